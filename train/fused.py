"""The vocabulary-sized loss terms of all draft steps, fused and chunked over positions.

With a 49k vocabulary, N×V logits, their softmax, the target's distribution and the gradients
are each ~0.6 GB per 3k supervised positions and step; allocating them dominated training time
on CPU. This function walks the positions ``chunk_size`` at a time: per chunk it computes the
target's distribution ONCE (shared by every draft step), each step's draft log-probabilities,
the loss terms of :mod:`specdraft.train.losses`, and their gradient with respect to the draft
hidden states and the draft vocabulary projection in closed form,

    d loss / d logits = (Σ_v w_v) · softmax(logits) − w,
    w = c_soft·p + c_kl·p + c_topk·(p on the target's top-K) + c_ce·onehot(label)
        + (c_α/α + c_λ·(1 − λ))·q·[q < p] + c_λ·λ·p,

the last line the LK terms' (α = Σ_v min(p_v, q_v): ∂α/∂logits = q·[q < p] − q·Σ_v q_v·[q_v < p_v]),

so nothing vocabulary-sized outlives the call: it lives in a few V×c buffers reused by every
chunk and step (vocabulary-major for speed: :mod:`specdraft.train.vocab_major`). When no gradient
is wanted (validation under ``no_grad``) the gradient matmuls are skipped: they are half the work;
when the target's argmax is known (its cached top-1) only its softmax is computed, not its
argmax, and when no term reads its whole distribution either (top-K and label terms only: they
come sparse, K entries a position) the target's vocabulary projection is not computed at all — a
third of the matmuls and half the elementwise passes. The values and gradients equal those of the reference
terms in ``losses.py`` (tested); ``feature`` (SmoothL1) is small and stays outside.

Here: the interface and the driver (the autograd Function); the per-call plan and the per-chunk,
per-step mechanics, with ``TERMS`` (re-exported here), are in :mod:`specdraft.train.fused_chunks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specdraft.train.fused_chunks import TERMS, draft_step, plan_call, prepare_chunk, zero_sums
from specdraft.train.losses import LossWeights
from specdraft.train.vocab_major import FrozenRows, VocabBuffers


@dataclass
class FusedOutput:
    """loss: Σ_j step_weight_j · Σ_term c_term · mean_j(term) (differentiable);
    terms: S×len(TERMS) per-step means of TERMS (detached); matches / counts: S, top-1 matches with the
    target's argmax over each step's valid positions."""

    loss: Tensor
    terms: Tensor
    matches: Tensor
    counts: Tensor

    def followed_by(self, later: FusedOutput) -> FusedOutput:
        """These steps and then ``later``'s, as one output (their losses summed)."""
        return FusedOutput(
            self.loss + later.loss,
            torch.cat([self.terms, later.terms]),
            torch.cat([self.matches, later.matches]),
            torch.cat([self.counts, later.counts]),
        )


@dataclass(frozen=True, eq=False)
class DraftSide:
    """The draft's S steps at N positions, over a draft vocabulary of V' tokens (V' = V, the
    target's, unless ``vocab`` reduces it).

    hidden           S×N×H   what the draft's vocabulary projection reads (grad)
    weight           V'×H    that projection (a trainable lm_head, or the frozen target one), or
                     S×V'×H  one per step (Medusa heads with their own lm_heads)
    valid            S×N     bool: the positions each step is evaluated at
    step_weights     S       each step's weight in the loss (0: measured, not trained)
    vocab            V'      target id of each draft id (None: the draft vocab is the target's).
                             With a reduced vocab the target's distribution is renormalised over
                             it and positions whose target argmax lies outside it are not
                             trained on (EAGLE-3)
    target_to_draft  V       draft id of each target id, −1 outside (with ``vocab``)
    frozen           ``weight`` is these prepared rows of the target's lm_head (``FrozenRows``)
    """

    hidden: Tensor
    weight: Tensor
    valid: Tensor
    step_weights: Sequence[float]
    vocab: Tensor | None = None
    target_to_draft: Tensor | None = None
    frozen: FrozenRows | None = None


@dataclass(frozen=True, eq=False)
class TargetSide:
    """The frozen target at the same N positions, over its V-token vocabulary.

    hidden      N×H  its last hidden state, whose next-token distribution p = softmax(hidden @
                     lm_headᵀ) is computed only when a term or the argmax needs it
    lm_head     V×H  its vocabulary projection
    topk_ids    N×K  its top-K (target ids) and topk_probs N×K their probabilities, for ``topk``
    labels      N    the next token (target ids, −1: none), for ``ce``
    argmax      N    its argmax when known (its cached top-1): with a reduced vocab the full
                     target logits are then never computed
    logit_softcap    the cap of its logits (Gemma 2: p = softmax(cap · tanh(hidden @ lm_headᵀ /
                     cap))), None: uncapped
    """

    hidden: Tensor
    lm_head: Tensor
    topk_ids: Tensor | None = None
    topk_probs: Tensor | None = None
    labels: Tensor | None = None
    argmax: Tensor | None = None
    logit_softcap: float | None = None


def fused_vocab_losses(
    draft: DraftSide, target: TargetSide, weights: LossWeights, chunk_size: int
) -> FusedOutput:
    """The vocabulary-sized terms of ``weights`` over ``draft``'s S steps against ``target`` at N
    positions, ``chunk_size`` positions at a time; differentiable with respect to
    ``draft.hidden`` and a trainable ``draft.weight``."""
    _refuse_inconsistent(draft, target, weights)
    wants_grad = torch.is_grad_enabled() and (draft.hidden.requires_grad or draft.weight.requires_grad)
    call = Call(draft, target, weights, chunk_size, wants_grad, tuple(float(w) for w in draft.step_weights))
    # The draft's hidden states and weight go to apply on their own too: autograd tracks the
    # tensors it is given, not those inside an object.
    return FusedOutput(*_FusedVocabLosses.apply(draft.hidden, draft.weight, call))


def _refuse_inconsistent(draft: DraftSide, target: TargetSide, weights: LossWeights) -> None:
    if (draft.vocab is None) != (draft.target_to_draft is None):
        raise ValueError("a draft vocab and its target_to_draft go together")
    steps = draft.hidden.shape[0]
    if draft.weight.dim() == 3 and draft.weight.shape[0] != steps:
        raise ValueError(f"{draft.weight.shape[0]} per-step draft weights for {steps} steps")
    for name, inputs in (("topk", (target.topk_ids, target.topk_probs)), ("ce", (target.labels,))):
        weight = float(getattr(weights, name))
        if weight > 0 and any(x is None for x in inputs):
            raise ValueError(f"loss term {name!r} has weight {weight} but no inputs")
    frozen = draft.frozen
    if frozen is not None and not frozen.serves(draft.weight, draft.hidden.dtype, target.hidden.dtype):
        raise ValueError("frozen rows given for another projection, or for other dtypes")


@dataclass(frozen=True, eq=False)
class Call:
    """One call's inputs, as the autograd Function receives them (step weights as floats)."""

    draft: DraftSide
    target: TargetSide
    weights: LossWeights
    chunk_size: int
    wants_grad: bool
    step_weights: tuple[float, ...]


class _FusedVocabLosses(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, call: Call):
        # ``hidden`` and ``weight`` are ``call.draft``'s, read from there.
        plan = plan_call(call)
        steps, n, _ = hidden.shape
        chunk_size = call.chunk_size
        count = 4 if plan.needs_distribution else 3
        vocab, width = plan.w_target.shape[0], min(chunk_size, n)
        buffers = VocabBuffers(vocab, width, plan.acc, hidden.device, count)
        below = torch.empty(vocab * width, dtype=torch.bool, device=hidden.device) if plan.lk else None
        sums = zero_sums(call, plan)
        for start in range(0, n, chunk_size):
            columns = min(chunk_size, n - start)
            views = buffers.views(columns)
            below_view = below[: vocab * columns].view(vocab, columns) if below is not None else None
            chunk = prepare_chunk(call, plan, slice(start, start + chunk_size), views, below_view)
            for j in range(steps):
                draft_step(call, plan, chunk, sums, j)
        if sums.gathered is not None:
            sums.gathered.flush()
        coefficients = torch.tensor(
            [plan.coef[name] for name in TERMS], dtype=torch.float64, device=hidden.device
        )
        step_scale = torch.tensor(call.step_weights, dtype=torch.float64, device=hidden.device)
        loss = (sums.terms @ coefficients * step_scale).sum().float()
        if call.wants_grad:
            kept_weight = sums.grad_weight if sums.grad_weight is not None else torch.empty(0)
            ctx.save_for_backward(sums.grad_hidden, kept_weight)
        ctx.hidden_dtype, ctx.has_weight_grad = hidden.dtype, sums.grad_weight is not None
        ctx.weight_dtype = weight.dtype
        counts = call.draft.valid.sum(-1)
        ctx.mark_non_differentiable(sums.terms, sums.matches, counts)
        return loss, sums.terms.float(), sums.matches, counts

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden = (grad_hidden * grad_loss).to(ctx.hidden_dtype)
        weight = (grad_weight * grad_loss).to(ctx.weight_dtype) if ctx.has_weight_grad else None
        return hidden, weight, None
