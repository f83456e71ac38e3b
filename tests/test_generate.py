import pytest
import torch

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
