"""data/generate.py: continuously batched greedy answers equal ``generate``'s prompt by prompt
(through refills, compactions and the KV buffers' resizes); the one-token attention
(data/attention.py) equals SDPA."""

import itertools

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import specdraft.data.generate as generate
from specdraft.data.attention import SLOT_ATTENTION, grouped_query_attention, slot_attention
from specdraft.data.generate import greedy_generate
from specdraft.data.packed_linear import pack_linear_weights
from specdraft.data.tiny import tiny_random_target


def random_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts of different lengths (3..3+2·count tokens)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 100, (3 + 2 * i,), generator=generator).tolist() for i in range(count)]


def hf_greedy(model, input_ids, attention_mask, max_new_tokens, eos) -> list[list[int]]:
    """generate(do_sample=False), each row cut after its first end-of-sequence token."""
    output = model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=sorted(eos),
        pad_token_id=0,
    )[:, input_ids.shape[1] :]
    rows = []
    for row in output.tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
        rows.append(row[:end])
    return rows


@pytest.fixture(scope="module")
def model():
    return tiny_random_target(seed=0, initializer_range=0.5).model


def reference(model, prompts, max_new_tokens, eos) -> list[list[int]]:
    """generate(do_sample=False) on each prompt alone."""
    return [
        hf_greedy(model, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long), max_new_tokens, eos)[0]
        for p in prompts
    ]


@pytest.mark.parametrize("batch_size", [1, 4, 32])
def test_equals_generate_prompt_by_prompt(model, batch_size):
    """Rows end at different steps and take the next prompt (several refills and compactions);
    every answer equals the prompt's own greedy continuation."""
    prompts = random_prompts(9)
    # End-of-sequence tokens picked from the free-running continuations, so answers end at
    # different steps.
    free = reference(model, prompts, 30, set())
    eos = {free[row][2 + 3 * row] for row in range(0, 9, 2)}
    expected = reference(model, prompts, 30, eos)
    assert sorted({len(row) for row in expected})[0] < 30 < max(len(row) for row in expected) + 1
    assert greedy_generate(model, prompts, 30, eos, batch_size=batch_size) == expected


def test_buffers_grow_and_shrink_without_changing_answers(model, monkeypatch):
    """With a grain of 4 columns the KV buffers are resized many times, both ways (a long row
    leaves, short ones take its place): the answers stay each prompt's own."""
    prompts = [p * 3 for p in random_prompts(9, seed=3)]  # 9..57 tokens, shortest first
    eos = {reference(model, prompts[-1:], 1, set())[0][0]}  # the longest ends at once
    expected = reference(model, prompts, 12, eos)
    sizes = []
    fit = generate.Slots.fit

    def recording_fit(self, needed):
        fit(self, needed)
        assert self.columns % 4 == 0 and needed <= self.columns < needed + 4
        assert self.cache.capacity == self.columns
        sizes.append(self.columns)

    monkeypatch.setattr(generate.Slots, "fit", recording_fit)
    assert greedy_generate(model, prompts, 12, eos, batch_size=3, window_grain=4) == expected
    steps = list(itertools.pairwise(sizes))
    assert any(b > a for a, b in steps) and any(b < a for a, b in steps)


def test_prefills_of_a_few_rows_each_answer_as_the_model_does(model, monkeypatch):
    """A batch's first prefill split into groups of PREFILL_ROWS prompts (each padded to its
    own longest): the answers stay each prompt's own."""
    prompts = random_prompts(7, seed=4)
    expected = reference(model, prompts, 6, set())
    widths = []
    prefill = generate._prefill

    def recording_prefill(model, input_ids, attention_mask):
        widths.append(tuple(input_ids.shape))
        return prefill(model, input_ids, attention_mask)

    monkeypatch.setattr(generate, "PREFILL_ROWS", 2)
    monkeypatch.setattr(generate, "_prefill", recording_prefill)
    assert greedy_generate(model, prompts, 6, set(), batch_size=7) == expected
    # shortest first, two at a time: each group as wide as its own longer prompt
    assert widths == [(2, 5), (2, 9), (2, 13), (1, 15)]


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "none"])
def test_one_token_attention_equals_sdpa(mask_kind):
    """Query heads on their key/value heads (3 per head), 2 rows, 37 columns, some masked."""
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    query, key, value = torch.randn(2, 6, 1, 8), torch.randn(2, 2, 37, 8), torch.randn(2, 2, 37, 8)
    visible = torch.rand(2, 1, 1, 37) > 0.4
    mask = {
        "bool": visible,
        "additive": torch.zeros(2, 1, 1, 37).masked_fill(~visible, torch.finfo(torch.float32).min),
        "none": None,
    }[mask_kind]
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    output, _ = grouped_query_attention(module, query, key, value, mask, scaling=0.3, one_token_products=True)
    assert output.shape == (2, 1, 6, 8)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)


def test_slot_attention_is_restored(model):
    assert model.config._attn_implementation == "sdpa"
    with slot_attention(model):
        assert model.config._attn_implementation.startswith(SLOT_ATTENTION)
    assert model.config._attn_implementation == "sdpa"
    eager = tiny_random_target(seed=0, attn_implementation="eager").model
    with slot_attention(eager):  # its masks are not SDPA's: left as it is
        assert eager.config._attn_implementation == "eager"


def test_one_new_token_and_no_end_of_sequence(model):
    prompts = random_prompts(3, seed=1)
    assert greedy_generate(model, prompts, 1, set(), batch_size=2) == reference(model, prompts, 1, set())
    assert greedy_generate(model, [], 5, set()) == []
    with pytest.raises(ValueError, match="max_new_tokens"):
        greedy_generate(model, prompts, 0, set())


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_packed_weights_answer_as_the_model_does(model):
    """specdraft-regen packs the target's linears (packed_weights: true): in fp32 the answers are
    the unpacked model's, through refills and compactions."""
    prompts = random_prompts(9, seed=2)
    expected = greedy_generate(model, prompts, 20, set(), batch_size=4)
    packed = tiny_random_target(seed=0, initializer_range=0.5).model
    assert pack_linear_weights(packed) > 0
    assert greedy_generate(packed, prompts, 20, set(), batch_size=4) == expected
