"""Where stored features first hold a NaN or an Inf: the check :mod:`specdraft.data.cache` runs on
each shard before it is written and when it is read (docs/architecture.md §2), cheap enough to
run on every shard once per process.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

# Rows per block of the check: memory stays one block of one field (16k rows of EAGLE-3 aux
# features, 3 × 576 wide in bf16: 57 MB), however large the shard.
FINITE_CHECK_ROWS = 16384


def first_nonfinite_row(rows: Callable[[int, int], Tensor], num_rows: int) -> int | None:
    """The first row (of ``num_rows``; ``rows(start, end)`` reads a block of them) that holds a
    NaN or an Inf, or None. Each block is summed in fp32 first, one pass that allocates nothing
    of its size (a NaN or an Inf anywhere makes the sum non-finite), and only a block whose sum
    is not finite is searched element by element (finite values whose sum overflows are then
    found finite: no false alarm). Measured on a full 262,144-token shard of SmolLM2 features
    (hidden 576 + EAGLE-3 aux 3 × 576, bf16, 1.2 GB), one thread of a 2-core EPYC, read from
    its file: 1.1 s (`torch.isfinite(x).all()` per block: 1.6 s; the shard's SHA-256: 0.8 s)."""
    for start in range(0, num_rows, FINITE_CHECK_ROWS):
        block = rows(start, min(start + FINITE_CHECK_ROWS, num_rows))
        if torch.isfinite(block.sum(dtype=torch.float32)):
            continue
        bad = (~torch.isfinite(block)).reshape(len(block), -1).any(dim=1).nonzero()
        if len(bad):
            return start + int(bad[0])
    return None


def nonfinite_feature(
    read: Callable[[str, int, int], Tensor],
    num_rows: dict[str, int],
    offsets: Sequence[int],
    sample_ids: Sequence[str],
) -> str | None:
    """Where a shard's features first hold a NaN or an Inf ("hidden, token 3 of sample 1
    ('s1')"), or None when they are all finite. ``read(field, start, end)``: rows of a stored
    field; ``num_rows``: the float fields to check and their row counts."""
    for name, count in num_rows.items():
        row = first_nonfinite_row(lambda start, end, name=name: read(name, start, end), count)
        if row is not None:
            sample = bisect.bisect_right(offsets, row) - 1
            if not 0 <= sample < len(sample_ids):  # offsets that do not cover the rows
                return f"{name}, row {row}"
            return f"{name}, token {row - offsets[sample]} of sample {sample} ({sample_ids[sample]!r})"
    return None
