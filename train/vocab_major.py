"""The vocabulary-major pieces of the fused losses (:mod:`specdraft.train.fused`).

Everything vocabulary-sized there is a V×c matrix, c positions of a chunk per column: the work
buffers reused by every chunk and step, the projection into them, a softmax and a first-maximum
argmax over dim 0, the trainable projection's gradient gathered over chunks in reduced precision,
and the frozen target rows prepared once in the layout the gradient matmul reads.
"""

from __future__ import annotations

import torch
from torch import Tensor

# A trainable projection's gradient in reduced precision: the logit gradients of this many
# positions (of any chunks and steps sharing the projection) are gathered before ONE matmul, whose
# V×H product is cast and added to the fp32 gradient once per gathering instead of once per chunk
# and step (~0.4 GB of memory traffic each at 32k × 576).
WEIGHT_GRAD_POSITIONS = 1024


class GatheredWeightGradient:
    """A trainable projection's fp32 gradient ``into`` (V×H, or S×V×H: one per step) accumulated
    from reduced-precision logit gradients V×c and the hidden states c×H they multiply, gathered
    ``WEIGHT_GRAD_POSITIONS`` positions at a time (split between per-step projections) and added
    with one matmul per gathering. A bf16 product is rounded once per gathering, not per chunk."""

    def __init__(self, into: Tensor, per_step: bool, chunk: int, dtype: torch.dtype) -> None:
        self.into, self.per_step = into, per_step
        projections = into.shape[0] if per_step else 1
        vocab, width = into.shape[-2:]
        self.capacity = max(chunk, WEIGHT_GRAD_POSITIONS // projections)
        # Zeros, not empty: oneDNN's bf16 matmul reads the gathered columns past a K that is not a
        # multiple of its tile (80 of them: up to 96) and multiplies them by zeros, which turns a
        # NaN bit pattern of fresh memory into NaN gradients; stale gradients there stay finite.
        self.grads = [
            torch.zeros(vocab, self.capacity, dtype=dtype, device=into.device) for _ in range(projections)
        ]
        self.hidden = [
            torch.zeros(self.capacity, width, dtype=dtype, device=into.device) for _ in range(projections)
        ]
        self.filled = [0] * projections

    def slot(self, step: int, hidden: Tensor) -> Tensor:
        """Takes ``hidden`` (c×H) of ``step``; returns the V×c columns its logit gradients go to."""
        k, c = (step if self.per_step else 0), hidden.shape[0]
        if self.filled[k] + c > self.capacity:
            self._flush(k)
        start = self.filled[k]
        self.hidden[k][start : start + c].copy_(hidden)
        self.filled[k] += c
        return self.grads[k][:, start : start + c]

    def flush(self) -> None:
        for k in range(len(self.filled)):
            self._flush(k)

    def _flush(self, k: int) -> None:
        if self.filled[k]:
            into = self.into[k] if self.per_step else self.into
            into += (self.grads[k][:, : self.filled[k]] @ self.hidden[k][: self.filled[k]]).to(into.dtype)
            self.filled[k] = 0


def gradient_layout(weight: Tensor, wants_grad: bool) -> Tensor:
    """``weight`` (V×H, or S×V×H) transposed, as the gradient matmul reads it. In bf16 / fp16
    oneDNN multiplies a contiguous copy of Wᵀ ~2.6× faster than the transposed view (0.82
    against 2.15 ms for 576 × 8k @ 8k × 128 on an AMX Xeon); in fp32 the view is as fast."""
    transposed = weight.transpose(-1, -2)
    return transposed.contiguous() if wants_grad and weight.element_size() < 4 else transposed


class FrozenRows:
    """A frozen draft projection that is the target's lm_head (EAGLE-1/2 heads), over the
    training vocabulary, in the dtype the losses compute in and transposed for the gradient
    matmul: the same every step, so a caller prepares it once. Selecting 8k of the 49k rows,
    casting and transposing them cost ~20 ms a step on an AMX Xeon (~4 %).

    rows        V'×H ``lm_head[vocab]`` (all of it without a vocab): the draft's projection
                and the target's at once; transposed: their gradient layout."""

    def __init__(self, lm_head: Tensor, vocab: Tensor | None, dtype: torch.dtype) -> None:
        self.source = (_identity(lm_head), None if vocab is None else _identity(vocab), dtype)
        rows = lm_head.detach() if vocab is None else lm_head.detach()[vocab.to(lm_head.device)]
        self.rows = rows.to(dtype)
        self.transposed = gradient_layout(self.rows, wants_grad=True)

    def prepared_from(self, lm_head: Tensor, vocab: Tensor | None, dtype: torch.dtype) -> bool:
        """Whether these rows are ``lm_head``'s as it is now (same storage, no in-place change
        since), over ``vocab``, in ``dtype``."""
        return self.source == (_identity(lm_head), None if vocab is None else _identity(vocab), dtype)

    def serves(self, draft_weight: Tensor, compute: torch.dtype, target_dtype: torch.dtype) -> bool:
        """Whether the losses may read these rows as ``draft_weight`` and as the target's rows:
        they are ``draft_weight``, in the dtype of both hidden states."""
        return draft_weight is self.rows and self.rows.dtype == compute == target_dtype


def _identity(tensor: Tensor) -> tuple:
    """What a tensor's values depend on: its storage, its in-place version and its layout."""
    return (tensor.data_ptr(), tensor._version, tuple(tensor.shape), tensor.dtype, tensor.device)


class VocabBuffers:
    """``count`` work buffers of V×c values, allocated once per call and reused by every chunk
    and step. Everything vocabulary-sized is laid out vocabulary-major (V×c): BLAS computes
    ``W @ xᵀ`` faster than ``x @ Wᵀ`` (87 → 52 ms for 128 × 49k × 576 fp32 on the 2-core AVX2
    EPYC), and the reductions over V vectorise across the c positions. Reusing the buffers
    spares a fresh allocation (and, above glibc's mmap threshold, its page faults) per operation.
    """

    def __init__(self, vocab: int, chunk: int, dtype: torch.dtype, device: torch.device, count: int) -> None:
        self.vocab = vocab
        self.flat = [torch.empty(vocab * chunk, dtype=dtype, device=device) for _ in range(count)]

    def views(self, rows: int) -> list[Tensor]:
        """The buffers as contiguous V×rows matrices (rows ≤ chunk: the last chunk is shorter)."""
        return [flat[: self.vocab * rows].view(self.vocab, rows) for flat in self.flat]


def project(weight: Tensor, rows: Tensor, out: Tensor) -> Tensor:
    """weight V×H times rowsᵀ (rows c×H) into ``out`` V×c, which may have a wider dtype."""
    rows = rows.to(weight.dtype)
    if weight.dtype == out.dtype:
        return torch.mm(weight, rows.T, out=out)
    return out.copy_(weight @ rows.T)


def acceptance_(
    p: Tensor, probs: Tensor, total: Tensor, short: Tensor, below: Tensor, scratch: Tensor
) -> tuple[Tensor, Tensor]:
    """The acceptance rate α = Σ_v min(p_v, q_v) (c) of the draft q = ``probs`` / ``total`` (V×c
    and 1×c, as ``softmax_`` leaves them) against the target's p (V×c). Leaves in ``short`` (V×c)
    q·[q < p], the draft's mass where it falls short of the target's: α's gradient reads it,
    ∂α/∂logit_u = short_u − q_u·Σ_v short_v. Returns α and ``short``; ``below`` (V×c bool) and
    ``scratch`` (V×c) are work buffers."""
    q = torch.div(probs, total, out=short)
    alpha = torch.minimum(p, q, out=scratch).sum(0)
    return alpha, q.mul_(torch.lt(q, p, out=below))


def softmax_(
    logits: Tensor, probs: Tensor, argmax_with: tuple[Tensor, Tensor] | None = None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``probs`` (V×c) ← exp(logit − max) over dim 0 of V×c ``logits`` (left as they are): the
    softmax once divided by the returned sum. Returns the max and that sum (each 1×c) and, with
    ``argmax_with`` = (a V×c scratch buffer, V − arange(V) as a V×1 column), the argmax (c)."""
    top = logits.amax(0, keepdim=True)
    shifted = torch.sub(logits, top, out=probs)
    argmax = first_argmax(shifted, *argmax_with) if argmax_with is not None else None
    total = shifted.exp_().sum(0, keepdim=True)
    return top, total, argmax


# Logits below the max are scaled by this in the argmax: any difference above V / 2^100 (~1e-26
# for 49k rows) then sinks a logit below every maximal one.
_ARGMAX_SCALE = 2.0**100


def first_argmax(shifted: Tensor, scratch: Tensor, last_first: Tensor) -> Tensor:
    """The argmax over dim 0 of V×c logits given as ``shifted`` = logits − their max (0 at the
    maxima, < 0 elsewhere): the first maximal index, as ``argmax`` gives. ``scratch`` is a V×c
    buffer of their dtype; ``last_first`` is V − arange(V) as a V×1 column of it.

    torch's max / argmax over a non-last dim do not vectorise (5.6 ms for 8k × 256 on an AMX
    Xeon against 0.3 ms for amax), so the argmax is read off a maximum: the largest V − v among
    the v at the max, as the max over v of (V − v) + 2^100 · shifted_v, one fused add (0.85 ms
    where comparing, multiplying by the column and taking the max took 2.3 ms)."""
    scores = torch.add(last_first, shifted, alpha=_ARGMAX_SCALE, out=scratch)
    return last_first.shape[0] - scores.amax(0).long()
