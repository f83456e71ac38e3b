"""CUDA graphs for the decoder's fixed-shape steps.

A small model's decoding step on a GPU is launch-bound: measured on one H100 (SmolLM2-135M,
bf16, eager HF forward), 8 plain steps issued 9,760 kernel launches and spent 358 ms on the host
against 20 ms on the GPU. A CUDA graph replays a step's kernels with one launch, so the host
cost of a step no longer scales with its kernel count.

A graph replays the SAME kernels on the SAME memory: every input is copied into a static buffer
before a replay, outputs are the graph's own buffers (valid until the next replay of that graph),
and the step may touch no other tensor whose storage changes between replays (the KV caches are
allocated once; :meth:`GraphedStep.reset` drops the graphs when one is reallocated). Shapes are
static, so the callers run "static" steps: attention over the whole preallocated cache with a
mask, cache writes at positions given as tensors (:mod:`specdraft.eval.runner`).

One graph is captured per input signature (shapes and dtypes) on its first call; a decoder's
step sizes recur (one token, the tree's node count, a chain's depth), a prompt's length does
not, so callers run those through :meth:`GraphedStep.eager`.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch
from torch import Tensor

# Eager runs on a side stream before a capture (CUDA's lazy initialisation of cuBLAS handles,
# workspaces and autotuned kernels must happen outside the graph).
WARMUP_RUNS = 2
# Input signatures one step may capture before the rest run eagerly (each graph keeps its
# static buffers alive).
MAX_GRAPHS = 32

# Per argument: (shape, dtype) of a tensor, or the value of a constant (an int the step is
# specialised on, e.g. a tree's depth).
Signature = tuple[tuple[tuple[int, ...], torch.dtype] | int, ...]
# A captured graph, its static input buffers (one per tensor argument) and its outputs.
Captured = tuple[torch.cuda.CUDAGraph, tuple[Tensor, ...], tuple[Tensor, ...]]


class GraphedStep:
    """``step(*arguments) -> tuple of tensors`` replayed from CUDA graphs when ``enabled`` (and on
    CUDA); otherwise called as is. Arguments are tensors (copied into the graph's buffers) or
    ints (constants: part of the signature, baked into the graph). The outputs of a replay are
    the graph's buffers: copy what must outlive the next call."""

    def __init__(self, step: Callable[..., tuple[Tensor, ...]], enabled: bool) -> None:
        self.step, self.enabled = step, enabled
        self._graphs: dict[Signature, Captured] = {}
        self._pool = None

    def reset(self) -> None:
        """Forget every captured graph (a buffer the step reads or writes was reallocated), and
        their memory pool: a pool whose graphs are all gone cannot take a new capture."""
        self._graphs.clear()
        self._pool = None

    def eager(self, *inputs: Tensor | int) -> tuple[Tensor, ...]:
        return self.step(*inputs)

    def __call__(self, *inputs: Tensor | int) -> tuple[Tensor, ...]:
        if not self.enabled or inputs[0].device.type != "cuda":
            return self.step(*inputs)
        signature = tuple((tuple(x.shape), x.dtype) if isinstance(x, Tensor) else x for x in inputs)
        captured = self._graphs.get(signature)
        if captured is None:
            if len(self._graphs) >= MAX_GRAPHS:
                return self.step(*inputs)
            captured = self._graphs[signature] = self._capture(inputs)
        graph, static_inputs, outputs = captured
        for buffer, x in zip(static_inputs, (x for x in inputs if isinstance(x, Tensor)), strict=True):
            buffer.copy_(x)
        graph.replay()
        return outputs

    def _capture(self, inputs: tuple[Tensor | int, ...]) -> Captured:
        arguments = tuple(x.clone() if isinstance(x, Tensor) else x for x in inputs)
        static_inputs = tuple(x for x in arguments if isinstance(x, Tensor))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                self.step(*arguments)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # No garbage collection inside a capture: a collected CUDA graph (e.g. of a runner the
        # shape probe dropped) resets itself, which invalidates the capture under way (seen on an
        # H100). So collect first, then hold the collector off. "thread_local": CUDA calls of
        # other threads do not invalidate it either.
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                outputs = self.step(*arguments)
        finally:
            if collecting:
                gc.enable()
        return graph, static_inputs, tuple(outputs)


def resolve_graphs(setting: bool | str, device: torch.device | str) -> bool:
    """``graphs: auto`` (conf/bench.yaml) is on where the decoder runs on CUDA: there a small
    model's step is launch-bound; on a CPU the static steps only add masked attention."""
    if setting == "auto":
        return torch.device(device).type == "cuda"
    if isinstance(setting, bool):
        return setting
    raise ValueError(f"graphs must be true, false or auto, got {setting!r}")
