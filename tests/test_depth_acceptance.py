"""Chain acceptance per depth with the head's own features vs the target's: the counting rule by
hand, and the whole measurement against a per-anchor loop of KV-cached draft steps as the decoder
runs them (tests/test_rollout.py's ``decode_steps``)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import compose_train
from hydra.utils import instantiate
from omegaconf import OmegaConf

from specdraft.data.cache import StoredFields, write_cache
from specdraft.data.chat import tokenize_conversations
from specdraft.data.conversations import select_conversations
from specdraft.data.datamodule import FeatureDataModule
from specdraft.data.features import FeatureBatch
from specdraft.data.target import target_weights
from specdraft.eval.cli import assistant_counts
from specdraft.heads import Eagle3Config, Eagle3Head, EagleConfig, EagleHead
from specdraft.heads.rollout import rollout
from specdraft.recipes import depth_acceptance
from specdraft.recipes.depth_acceptance import batch_counts, chain_counts, paired_chain_bootstrap, summarise
from specdraft.train.cli import train
from specdraft.train.objective import simulated_tau
from tests.test_rollout import decode_steps


def test_chain_counts_by_hand():
    # One sequence, T=6, depth 3. Step j is right at the positions marked 1.
    right = torch.tensor(
        [
            [1, 1, 0, 1, 1, 0],  # step 1
            [0, 1, 1, 0, 1, 0],  # step 2
            [0, 0, 1, 0, 0, 0],  # step 3
        ],
        dtype=torch.bool,
    ).unsqueeze(1)
    valid = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.bool)  # the last position is not supervised
    fed_ok = torch.tensor([[1, 1, 1, 0, 1, 1]], dtype=torch.bool)  # position 3's successor is off-greedy
    # A second sequence, the same but never right: its chains stop at depth 1, and stay its own.
    both = chain_counts(
        torch.cat([right, torch.zeros_like(right)], dim=1), valid.repeat(2, 1), fed_ok.repeat(2, 1)
    )
    assert both.attempts.tolist() == [[5, 2, 2], [5, 0, 0]]
    assert both.accepted.tolist() == [[4, 2, 1], [0, 0, 0]]
    assert both.acceptance() == [0.4, 1.0, 0.5]
    counts = chain_counts(right, valid, fed_ok)
    # depth 1: anchors 0..4 valid; right at 0, 1, 3, 4.
    # depth 2 (step 2 at a+1): reachable a ∈ {0, 1, 2} (a+1 valid, fed_ok at a; a=3: fed_ok false,
    #   a=4: a+1 invalid); of those right at depth 1: 0, 1; step 2 right at 1 (a=0), 2 (a=1).
    # depth 3 (step 3 at a+2): reachable a ∈ {0, 1} (fed_ok at a+1 ∈ {1, 2}; a=2 needs fed_ok at 3);
    #   through depth 2: 0, 1; step 3 right at a+2 = 2 (a=0) only.
    assert counts.attempts.tolist() == [[5, 2, 2]]
    assert counts.accepted.tolist() == [[4, 2, 1]]
    assert counts.acceptance() == [0.8, 1.0, 0.5]
    summary = summarise(counts, chain_counts(right[:1].expand(3, -1, -1), valid, fed_ok))
    # Target features: step 1 at a+j−1. depth 2: a ∈ {0, 1, 2}, right at a: 0, 1 -> right at a+1: 1, 2
    # -> {0}; depth 3: a ∈ {0, 1} through 2 -> {0}: needs step 1 right at 2: no.
    assert summary["target_features"]["accepted"] == [4, 1, 0]
    assert summary["gap_per_depth"][1] == pytest.approx(0.5 - 1.0)
    assert summary["own_features"]["chain_tau"] == pytest.approx(1 + 0.8 + 0.8 + 0.4)


def _draft_ids(head, outputs, vocab=None):
    """The decoder's drafted token: its argmax over the head's vocabulary, or over ``vocab`` (a
    shortlist of target ids) for a head over the whole target vocabulary."""
    logits = head.logits(outputs)
    if vocab is not None:
        return vocab[logits[..., vocab].argmax(-1)]
    return head.draft_to_target(logits.argmax(-1))


def _reference_counts(head, batch, depth, wanted, valid, fed_ok, vocab):
    """Per anchor, a chain through the decoder's draft steps (KV cache, own features)."""
    features = head.initial_features(batch.hidden, batch.aux)
    length = batch.input_ids.shape[1]
    own = torch.zeros(2, depth, dtype=torch.long)
    target = torch.zeros(2, depth, dtype=torch.long)
    for a in range(length - 1):
        steps = min(depth, length - 1 - a)
        drafted = decode_steps(head, features, batch.input_ids, a, steps)
        own_guesses = [_draft_ids(head, out, vocab)[0] for out in drafted]
        target_guesses = [
            _draft_ids(head, decode_steps(head, features, batch.input_ids, a + j, 1)[0], vocab)[0]
            for j in range(steps)
        ]
        for counts, guesses in ((own, own_guesses), (target, target_guesses)):
            for j in range(1, depth + 1):
                p = a + j - 1
                if p >= length - 1 or not valid[p] or (j > 1 and not fed_ok[p - 1]):
                    break
                counts[0, j - 1] += 1
                if guesses[j - 1] != wanted[p]:
                    break
                counts[1, j - 1] += 1
    return own, target


@pytest.mark.parametrize("kind", ["eagle", "eagle_shortlist", "eagle3_reduced"])
def test_batch_counts_equal_a_chain_decoded_per_anchor(tiny_target, kind):
    depth, length = 3, 14
    torch.manual_seed(0)
    weights = target_weights(tiny_target)
    vocab_size = tiny_target.spec.vocab_size
    vocab = None
    if kind in ("eagle", "eagle_shortlist"):
        head = EagleHead(tiny_target.spec, weights, EagleConfig(fc_bias=False))
        if kind == "eagle_shortlist":  # a reduced training vocabulary: every third target id
            vocab = torch.arange(0, vocab_size, 3)
    else:
        head = Eagle3Head(tiny_target.spec, weights, Eagle3Config(draft_vocab_size=vocab_size // 2))
        head.choose_vocabulary(lambda: torch.arange(vocab_size).flip(0))
    head = head.double().eval()
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, length, tiny_target.spec.hidden_size, generator=generator, dtype=torch.float64)
    aux = (
        torch.randn(1, length, 3 * tiny_target.spec.hidden_size, generator=generator, dtype=torch.float64)
        if kind == "eagle3_reduced"
        else None
    )
    input_ids = torch.randint(3, vocab_size, (1, length), generator=generator)
    # Make chains happen: position p's wanted token (the target's argmax for p+2) is what step
    # j*(p) = 1 + p mod depth drafts there, so the diagonal from anchors ≡ 0 (mod depth) is right:
    # the chain from 6 goes all the way; position 4 gets a random token (the chain from 3 ends
    # there); at p = 9 the draft is right but the data goes on with another token, which greedy
    # decoding would not have fed (the chain from 9 cannot be followed past depth 1).
    wanted = torch.zeros(length, dtype=torch.long)
    for p in range(length - 2):
        features = head.initial_features(hidden, aux)
        outputs = rollout(head, features, input_ids, depth, detach=True)
        token = _draft_ids(head, outputs[p % depth][0, p], vocab)
        if p == 4:
            token = torch.randint(3, vocab_size, (), generator=generator)
        wanted[p] = token
        input_ids[0, p + 2] = token if p != 9 else 3 + (token - 2) % (vocab_size - 3)
    topk_ids = torch.zeros(1, length, 1, dtype=torch.long)
    topk_ids[0, 1:, 0] = wanted[:-1]  # the argmax after p+1 is stored at p+1
    loss_mask = torch.ones(1, length, dtype=torch.long)
    loss_mask[0, :2] = 0  # the first two tokens are the prompt
    batch = FeatureBatch(input_ids, torch.ones_like(loss_mask), loss_mask, hidden, aux=aux, topk_ids=topk_ids)
    own, target = batch_counts(head, batch, depth, vocab)

    valid = torch.cat([loss_mask[0, 1:], torch.zeros(1, dtype=torch.long)]).bool()
    fed = torch.cat([input_ids[0, 2:], torch.zeros(2, dtype=torch.long)])
    fed_ok = fed == wanted
    ref_own, ref_target = _reference_counts(head, batch, depth, wanted, valid, fed_ok, vocab)
    assert own.attempts.tolist() == [ref_own[0].tolist()]
    assert own.accepted.tolist() == [ref_own[1].tolist()]
    assert target.attempts.tolist() == [ref_target[0].tolist()]
    assert target.accepted.tolist() == [ref_target[1].tolist()]
    assert own.accepted[0, -1] >= 1  # some chain went all the way: the test exercised every depth


def test_a_batch_without_supervised_positions_counts_nothing(tiny_target):
    head = EagleHead(tiny_target.spec, target_weights(tiny_target), EagleConfig(fc_bias=False)).eval()
    ids = torch.randint(3, tiny_target.spec.vocab_size, (1, 6))
    hidden = torch.randn(1, 6, tiny_target.spec.hidden_size)
    batch = FeatureBatch(ids, torch.ones_like(ids), torch.zeros_like(ids), hidden)  # a prompt only
    own, target = batch_counts(head, batch, depth=3)
    assert own.attempts.tolist() == [[0, 0, 0]] and target.accepted.tolist() == [[0, 0, 0]]
    assert own.acceptance() == [None, None, None]


def _measured(name, conversations, attempts, accepted):
    """A measure_run result with own-feature counts per conversation (C×D)."""
    return {
        "run": name,
        "conversations": conversations,
        "own_features": {"attempts_per_conversation": attempts, "accepted_per_conversation": accepted},
    }


def test_paired_chain_bootstrap_pairs_by_conversation_and_recomputes_tau_from_the_sums():
    reference = _measured("eagle", ["a", "b", "c"], [[10, 4], [8, 2], [6, 3]], [[4, 2], [2, 1], [3, 0]])
    # The same head measured in another row order, plus a conversation the reference lacks.
    same = _measured(
        "again", ["c", "x", "a", "b"], [[6, 3], [9, 9], [10, 4], [8, 2]], [[3, 0], [9, 9], [4, 2], [2, 1]]
    )
    result = paired_chain_bootstrap(same, reference, samples=500)
    assert result["conversations"] == 3
    # Whole sample: α1 = 9/24, α2 = 3/9 -> τ = 1 + 9/24 + 9/24 · 3/9 (not a mean of per-conversation τ).
    assert result["chain_tau"] == pytest.approx(simulated_tau([9 / 24, 3 / 9]))
    assert result["chain_tau"] == pytest.approx(result["chain_tau_reference"])
    assert result["difference"] == {"estimate": 0.0, "low": 0.0, "high": 0.0}  # every resample pairs
    assert result["ratio"]["low"] == pytest.approx(1.0) and result["ratio"]["high"] == pytest.approx(1.0)

    # A head that accepts one more depth-1 draft in every conversation: its interval excludes 0.
    better = _measured("better", ["a", "b", "c"], [[10, 5], [8, 3], [6, 4]], [[5, 2], [3, 1], [4, 0]])
    versus = paired_chain_bootstrap(better, reference, samples=500)
    assert versus["difference"]["estimate"] == pytest.approx(
        simulated_tau([12 / 24, 3 / 12]) - simulated_tau([9 / 24, 3 / 9])
    )
    assert 0 < versus["difference"]["low"] <= versus["difference"]["estimate"] <= versus["difference"]["high"]
    assert versus == paired_chain_bootstrap(better, reference, samples=500)  # seeded

    with pytest.raises(ValueError, match="share no held-out conversation"):
        paired_chain_bootstrap(_measured("other", ["z"], [[1, 0]], [[1, 0]]), reference)
    with pytest.raises(ValueError, match="no per-conversation counts"):
        paired_chain_bootstrap({"run": "old", "own_features": {}}, reference)


def test_the_cli_keeps_counts_per_heldout_conversation(tmp_path, caplog):
    runs = []
    for name, steps in (("first", 1), ("second", 2)):
        cfg = compose_train(tmp_path / name, "experiment=eagle", "debug=smoke", f"trainer.max_steps={steps}")
        train(cfg)
        runs.append(tmp_path / name)
    out = tmp_path / "depth.json"
    with caplog.at_level("INFO"):
        depth_acceptance.main([*map(str, runs), "--depth=2", f"--out={out}"])
    measured = json.loads(out.read_text())["runs"]
    first, second = measured["first"], measured["second"]
    # Every held-out conversation once, the same ones for both runs (one split).
    assert len(set(first["conversations"])) == len(first["conversations"]) > 1
    assert sorted(first["conversations"]) == sorted(second["conversations"])
    for run in (first, second):
        for source in ("own_features", "target_features"):
            counts = run[source]
            assert len(counts["attempts_per_conversation"]) == len(run["conversations"])
            assert torch.tensor(counts["attempts_per_conversation"]).sum(0).tolist() == counts["attempts"]
            assert torch.tensor(counts["accepted_per_conversation"]).sum(0).tolist() == counts["accepted"]
        assert run["own_features"]["attempts"][0] > 0
    assert "second: own-feature chain τ ÷ first's" in caplog.text


def test_a_cache_whose_shards_stayed_elsewhere_recounts_its_training_vocabulary_from_its_plan(
    tmp_path, tiny_target
):
    """A head trained on another machine (a GPU) comes back without its training features: the
    reduced training vocabulary is recounted from the conversations the cache's plan names (checked
    against its token hash), and the bench's shortlist with ``split_limit`` counts the same tokens."""
    source = {"_target_": "specdraft.data.tiny.tiny_conversations", "count": 40, "seed": 0}
    data = {"source": source, "max_length": 256, "heldout_fraction": 0.2, "split_seed": 0}
    train, description = select_conversations(instantiate(source).conversations, data, "train", 20)
    samples, _ = tokenize_conversations(tiny_target.tokenizer, train, 256, progress=False)
    cache = tmp_path / "train"
    write_cache(tiny_target, samples, cache, StoredFields(), description, progress=False)
    module = FeatureDataModule("cached", tiny_target, train_cache=str(cache), val_cache=str(cache))
    counted = module.assistant_token_counts()
    shortlist_cfg = OmegaConf.create({**data, "split_limit": 20})
    assert torch.equal(assistant_counts(shortlist_cfg, tiny_target), counted)
    assert not torch.equal(
        assistant_counts(OmegaConf.create({**data, "split_limit": None}), tiny_target), counted
    )

    assert depth_acceptance.has_shards(cache)
    for shard in cache.glob("shard-*.safetensors"):
        shard.unlink()
    assert not depth_acceptance.has_shards(cache)
    assert torch.equal(depth_acceptance.planned_assistant_counts(cache, tiny_target), counted)

    plan = json.loads((cache / "plan.json").read_text())
    plan["source"]["limit"] = 19  # a source that no longer gives the cached tokens
    (cache / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(SystemExit, match="token_hash"):
        depth_acceptance.planned_assistant_counts(cache, tiny_target)
