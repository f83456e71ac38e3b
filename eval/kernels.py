"""Compiled decoder and drafter steps (optional). The rest of what makes the target's steps fast
lives with the target, since regeneration runs it too: its attention on the key/value heads
(:mod:`specdraft.data.attention`) and its linear weights pre-packed for oneDNN
(:mod:`specdraft.data.packed_linear`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

Step = TypeVar("Step", bound=Callable)


def compiled_step(step: Step) -> Step:
    """``step`` (the target's decoder, a head's draft step) through ``torch.compile`` (inductor)
    with dynamic shapes: the past grows every step and trees differ in size, so static shapes
    would recompile per step. CUDA graphs come from the runner's own static steps instead
    (``graphs``, :mod:`specdraft.eval.graphs`), without a compiler.

    Packed linears (:class:`~specdraft.data.packed_linear.PackedLinear`) run as plain linears
    inside a compiled step. Measured on a 2-core AVX2 EPYC (SmolLM2 fp32, 2 threads): compiling
    the target took ~8 min and its plain step went from 83 ms (eager, packed weights) to 143 ms,
    which is why ``compile`` is off by default (conf/bench.yaml)."""
    return torch.compile(step, dynamic=True)
