import pytest
import torch

from specdraft.data.generate import greedy_generate
from specdraft.data.tiny import tiny_random_target


def left_padded_batch(rows: int, width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, 100, (rows, width), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row in range(rows):  # prompts of different lengths, all ending at the last column
        attention_mask[row, : 2 * row] = 0
        input_ids[row, : 2 * row] = 0
    return input_ids, attention_mask


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


def test_equals_generate_when_rows_end_at_different_steps(model):
    input_ids, attention_mask = left_padded_batch(9, 20)
    # End-of-sequence tokens picked from the free-running continuations, so rows end at
    # different steps and ended rows are dropped from the batch (several compactions).
    free = hf_greedy(model, input_ids, attention_mask, 30, set())
    eos = {free[row][2 + 3 * row] for row in range(0, 9, 2)}
    expected = hf_greedy(model, input_ids, attention_mask, 30, eos)
    assert sorted({len(row) for row in expected})[0] < 30 < max(len(row) for row in expected) + 1
    assert greedy_generate(model, input_ids, attention_mask, 30, eos) == expected


def test_one_new_token_and_no_end_of_sequence(model):
    input_ids, attention_mask = left_padded_batch(3, 8, seed=1)
    assert greedy_generate(model, input_ids, attention_mask, 1, set()) == hf_greedy(
        model, input_ids, attention_mask, 1, set()
    )
    with pytest.raises(ValueError, match="max_new_tokens"):
        greedy_generate(model, input_ids, attention_mask, 0, set())
