"""EAGLE-3's reduced draft vocabulary.

The draft head predicts over the ``draft_vocab_size`` most frequent assistant tokens of the
training data. Draft id i maps to target id ``i + d2t[i]`` (d2t holds OFFSETS, the convention of
EAGLE-3, vLLM and SGLang); ``t2d`` is a bool mask over the target vocabulary marking the tokens
the draft can propose. Draft ids are ordered by target id, so d2t is non-decreasing.
"""

from __future__ import annotations

import torch
from torch import Tensor


def draft_vocab_from_counts(counts: Tensor, draft_vocab_size: int) -> tuple[Tensor, Tensor]:
    """counts V (token frequencies) -> (d2t draft_vocab_size int64, t2d V bool).

    The most frequent tokens win; ties go to the lower id, so the map is deterministic.
    """
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(
            f"draft_vocab_size must be in 1..{vocab_size} (the target vocab), got {draft_vocab_size}"
        )
    ids = torch.arange(vocab_size)
    # Stable sort by descending count keeps ascending ids among ties.
    order = torch.sort(-counts.to(torch.float64), stable=True).indices
    chosen = torch.sort(ids[order[:draft_vocab_size]]).values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return chosen - torch.arange(draft_vocab_size), t2d


def full_vocab_maps(vocab_size: int) -> tuple[Tensor, Tensor]:
    """The identity mapping: the draft predicts over the whole target vocabulary."""
    return torch.zeros(vocab_size, dtype=torch.long), torch.ones(vocab_size, dtype=torch.bool)


def target_to_draft_index(t2d: Tensor) -> Tensor:
    """V int64: the draft id of each target id, −1 for tokens outside the draft vocabulary."""
    index = torch.full(t2d.shape, -1, dtype=torch.long, device=t2d.device)
    index[t2d] = torch.arange(int(t2d.sum()), device=t2d.device)
    return index
