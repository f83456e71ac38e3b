"""eval/shortlist.py: the decoder's shortlist ranked by a feature cache's own assistant tokens."""

import torch

from specdraft.data.cache import StoredFields, write_cache
from specdraft.data.chat import assistant_token_counts, tokenize_conversations
from specdraft.data.tiny import tiny_conversations
from specdraft.eval.cli import vocab_shortlist
from specdraft.eval.shortlist import cached_assistant_counts


def test_a_caches_counts_are_the_assistant_tokens_it_was_made_of(tmp_path, tiny_target):
    samples, _ = tokenize_conversations(
        tiny_target.tokenizer, tiny_conversations(12, seed=0).conversations, 256
    )
    write_cache(
        tiny_target, samples, tmp_path / "train", StoredFields(), {"d": 1}, shard_tokens=300, progress=False
    )
    vocab_size = tiny_target.spec.vocab_size
    counts = cached_assistant_counts(tmp_path / "train", vocab_size)
    assert torch.equal(counts, assistant_token_counts(samples, vocab_size))
    assert counts.sum() == sum(sum(sample.loss_mask) for sample in samples)
    # the shortlist: the most frequent of those tokens, as for a counted source
    shortlist = vocab_shortlist(lambda: counts, 5)
    others = torch.ones(vocab_size, dtype=torch.bool)
    others[shortlist] = False
    assert len(shortlist) == 5 and counts[shortlist].min() >= counts[others].max()
