"""The per-call preparation and the per-chunk, per-step mechanics of
:func:`specdraft.train.fused.fused_vocab_losses`, which drives them: the plan every chunk and step
of a call reads (prepared once), the sums they add up, a chunk's target side (shared by every draft
step) and one draft step on a chunk: its top-1 matches, its terms and, when wanted, its gradients
in closed form (the formulas: :mod:`specdraft.train.fused`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from specdraft.heads.frozen import soft_cap
from specdraft.train.losses import ALPHA_FLOOR
from specdraft.train.vocab_major import (
    GatheredWeightGradient,
    acceptance_,
    gradient_layout,
    project,
    softmax_,
)

if TYPE_CHECKING:  # fused.py calls this one
    from specdraft.train.fused import Call, DraftSide, TargetSide

TERMS = ("soft_ce", "forward_kl", "topk", "ce", "lk_alpha", "lk_lambda")
# LK^λ's blend weight λ = exp(−η·ᾱ) is one detached number per chunk and step, ᾱ the chunk's mean
# acceptance over the positions the step trains on: the reference's per-batch λ (losses.lk_lambda)
# at the size of a chunk, known before the chunk's gradient is (a batch-wide ᾱ would need a second
# pass over the vocabulary, or the gradients of KL and TV kept apart until the end).


@dataclass(frozen=True, eq=False)
class Plan:
    """What every chunk and step of one call reads, prepared once.

    coef                each term's weight (TERMS); dense = c_soft + c_kl, the weight of the
                        target's whole distribution p in the soft targets
    acc                 the dtype of the softmaxes and gradients: fp32 (fp64 when the inputs are
                        fp64, as in the tests)
    w_draft             V'×H (or S×V'×H) the draft projection, detached, in the hidden states'
                        dtype; w_draft_t its transpose as the gradient matmul reads it
    w_target            V'×H the target lm_head's rows over the draft vocabulary
    target_argmax       N the target's argmax (filled chunk by chunk when ``wants_argmax``)
    wants_argmax        it is read off p: neither given nor found over a reduced vocabulary
    needs_distribution  p is computed: a dense term, an LK term or the argmax needs it
    lk                  an LK term is trained (``_lk_step``)
    trained             S×N the positions each step trains on; denominators S their counts
                        (at least 1, fp64): the per-step means' divisors
    last_first          V'×1 V' − arange(V'), for the argmax read off a maximum (``softmax_``)
    """

    coef: dict[str, float]
    dense: float
    acc: torch.dtype
    w_draft: Tensor
    w_draft_t: Tensor
    w_target: Tensor
    target_argmax: Tensor
    wants_argmax: bool
    needs_distribution: bool
    lk: bool
    trained: Tensor
    denominators: Tensor
    last_first: Tensor

    @property
    def per_step(self) -> bool:
        return self.w_draft.dim() == 3


def plan_call(call: Call) -> Plan:
    draft, target = call.draft, call.target
    compute = draft.hidden.dtype
    acc = torch.float64 if compute == torch.float64 else torch.float32
    coef = {name: float(getattr(call.weights, name)) for name in TERMS}
    frozen = draft.frozen
    w_draft = frozen.rows if frozen is not None else draft.weight.detach().to(compute)
    w_draft_t = frozen.transposed if frozen is not None else gradient_layout(w_draft, call.wants_grad)
    w_target = _target_rows(draft, target)
    vocab = w_target.shape[0]
    if w_draft.shape[-2] != vocab:
        raise ValueError(f"a draft projection of {w_draft.shape[-2]} rows for a {vocab}-token vocabulary")
    target_argmax, keep = _target_argmax(draft, target, call.chunk_size)
    trained = draft.valid & keep
    # The soft targets w = c_dense·p + (c_topk·(p on the top-K) + c_ce·onehot): the dense part
    # reads the target's whole distribution p (soft CE, forward KL), the sparse part K' entries a
    # position, kept as (ids, weights) and never spread over V×c. p itself is only computed when
    # the dense part, an LK term (α reads the whole p) or the target's argmax (unknown: no cached
    # top-1, full vocab) needs it: else the target's vocabulary projection is skipped altogether.
    dense = coef["soft_ce"] + coef["forward_kl"]
    wants_argmax = target.argmax is None and draft.vocab is None
    lk = coef["lk_alpha"] > 0 or coef["lk_lambda"] > 0
    return Plan(
        coef=coef,
        dense=dense,
        acc=acc,
        w_draft=w_draft,
        w_draft_t=w_draft_t,
        w_target=w_target,
        target_argmax=target_argmax,
        wants_argmax=wants_argmax,
        needs_distribution=dense > 0 or wants_argmax or lk,
        lk=lk,
        trained=trained,
        denominators=trained.sum(-1).clamp(min=1).double(),
        last_first=torch.arange(vocab, 0, -1, dtype=acc, device=draft.hidden.device).unsqueeze(-1),
    )


def _target_rows(draft: DraftSide, target: TargetSide) -> Tensor:
    """V'×H: the target lm_head's rows over the draft vocabulary, in its hidden states' dtype."""
    if draft.frozen is not None:
        return draft.frozen.rows  # the same rows, in the same dtype
    rows = target.lm_head.detach()
    if draft.vocab is not None:
        # Selected before the cast, which then touches V' rows, not V (49k: ~10 ms a call).
        rows = rows[draft.vocab]
    return rows.to(target.hidden.dtype)


def _target_argmax(draft: DraftSide, target: TargetSide, chunk_size: int) -> tuple[Tensor, Tensor]:
    """The target's argmax N (given, or over a reduced vocabulary found here; else left to be
    read off its distribution chunk by chunk) and the positions N whose argmax lies in the draft
    vocabulary (all of them over the target's)."""
    n, device = draft.hidden.shape[1], draft.hidden.device
    keep = torch.ones(n, dtype=torch.bool, device=device)
    target_argmax = (
        target.argmax if target.argmax is not None else torch.empty(n, dtype=torch.long, device=device)
    )
    if draft.vocab is None:
        return target_argmax, keep
    # The positions each step trains on (target argmax inside the draft vocab) set the per-step
    # means before any gradient is computed. The argmax is the cached top-1 when there is one;
    # else it costs one extra pass over the full target logits.
    if target.argmax is None:
        w_full = target.lm_head.detach().to(target.hidden.dtype)
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            target_argmax[rows] = (target.hidden[rows] @ w_full.T).argmax(-1)
    return target_argmax, draft.target_to_draft[target_argmax] >= 0


@dataclass(frozen=True, eq=False)
class Sums:
    """What the chunks and steps add up. terms S×len(TERMS) (fp64: the per-step means of TERMS), matches S;
    when a gradient is wanted grad_hidden S×N×H and, for a trainable projection, grad_weight (its
    shape), in fp32 (fp64), the latter gathered first in reduced precision (``gathered``)."""

    terms: Tensor
    matches: Tensor
    grad_hidden: Tensor | None
    grad_weight: Tensor | None
    gathered: GatheredWeightGradient | None


def zero_sums(call: Call, plan: Plan) -> Sums:
    hidden, weight = call.draft.hidden, call.draft.weight
    steps, n, _ = hidden.shape
    device, acc = hidden.device, plan.acc
    grad_hidden = torch.zeros(hidden.shape, dtype=acc, device=device) if call.wants_grad else None
    grad_weight = None
    if call.wants_grad and weight.requires_grad:
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=device)
    gathered = None  # in fp32 (or fp64) each chunk adds its product in place instead
    if grad_weight is not None and hidden.dtype != acc:
        gathered = GatheredWeightGradient(grad_weight, plan.per_step, min(call.chunk_size, n), hidden.dtype)
    return Sums(
        terms=torch.zeros(steps, len(TERMS), dtype=torch.float64, device=device),
        matches=torch.zeros(steps, dtype=torch.long, device=device),
        grad_hidden=grad_hidden,
        grad_weight=grad_weight,
        gathered=gathered,
    )


@dataclass(frozen=True, eq=False)
class Chunk:
    """One chunk of c positions: its work buffers and the target's side, shared by every step.
    Everything vocabulary-sized is V'×c (vocabulary-major), see ``VocabBuffers``.

    rows            the chunk's slice of the N positions
    logits, probs, product  V'×c work buffers: a step's logits, exp(logit − max), a scratch
                         (with an LK term: the step's q·[q < p] after its terms)
    below           V'×c bool work buffer of the LK terms (None without)
    p               V'×c the target's distribution (None when nothing reads it)
    neg_entropy     c    Σ_v p log p (forward KL and LK^λ only)
    topk_ids        c×K  the target's top-K as draft ids (0 outside the draft vocab);
                         topk_probs c×K their probabilities (0 there)
    label_ids       c    the label as a draft id (0: none); has_label c, 1 or 0
    sparse_ids      K'×c the sparse targets (K' = K + 1 with both terms) and sparse_weights K'×c
                         their weights in w (c_topk·p, c_ce)
    w_total         c    Σ_v w_v per position (p sums to 1)
    """

    rows: slice
    logits: Tensor
    probs: Tensor
    product: Tensor
    below: Tensor | None
    p: Tensor | None
    neg_entropy: Tensor | None
    topk_ids: Tensor | None
    topk_probs: Tensor | None
    label_ids: Tensor | None
    has_label: Tensor | None
    sparse_ids: Tensor | None
    sparse_weights: Tensor | None
    w_total: Tensor | float


def prepare_chunk(call: Call, plan: Plan, rows: slice, views: list[Tensor], below: Tensor | None) -> Chunk:
    logits, probs, product, *target_buffer = views
    p = neg_entropy = None
    if plan.needs_distribution:
        p = target_buffer[0]
        neg_entropy = _target_distribution(call, plan, rows, logits, p, product)
    topk_ids = topk_probs = label_ids = has_label = None
    id_columns, weight_columns = [], []  # c×K (top-K), c×1 (label)
    if plan.coef["topk"] > 0:
        topk_ids, topk_probs = _topk_in_draft_vocab(call, plan, rows)
        id_columns.append(topk_ids)
        weight_columns.append(plan.coef["topk"] * topk_probs)
    if plan.coef["ce"] > 0:
        label_ids, has_label = _labels_in_draft_vocab(call, plan, rows)
        id_columns.append(label_ids.unsqueeze(1))
        weight_columns.append(plan.coef["ce"] * has_label.unsqueeze(1))
    sparse_ids = torch.cat(id_columns, 1).T if id_columns else None
    sparse_weights = torch.cat(weight_columns, 1).T if weight_columns else None
    w_total = plan.dense + (sparse_weights.sum(0) if sparse_weights is not None else 0.0)
    return Chunk(
        rows, logits, probs, product, below, p, neg_entropy, topk_ids, topk_probs, label_ids,
        has_label, sparse_ids, sparse_weights, w_total,
    )  # fmt: skip


def _target_distribution(
    call: Call, plan: Plan, rows: slice, logits: Tensor, p: Tensor, scratch: Tensor
) -> Tensor | None:
    """Writes the target's distribution at ``rows`` into ``p`` (V'×c, through ``logits``) and, when
    not known, its argmax into ``plan.target_argmax`` (the cached top-1 gives it; with a reduced
    vocab it was found before: two passes over V×c saved). Returns Σ_v p log p (c) when forward
    KL reads it."""
    target_logits = project(plan.w_target, call.target.hidden[rows], logits)
    target_logits = soft_cap(target_logits, call.target.logit_softcap)
    argmax_with = (scratch, plan.last_first) if plan.wants_argmax else None
    _, total, target_top = softmax_(target_logits, p, argmax_with)
    p.div_(total)
    if plan.wants_argmax:
        plan.target_argmax[rows] = target_top
    reads_entropy = plan.coef["forward_kl"] > 0 or plan.coef["lk_lambda"] > 0
    return torch.special.xlogy(p, p).sum(0) if reads_entropy else None


def _topk_in_draft_vocab(call: Call, plan: Plan, rows: slice) -> tuple[Tensor, Tensor]:
    """The target's top-K at ``rows`` as draft ids c×K (0 outside the draft vocab) and their
    probabilities c×K (0 there)."""
    ids = call.target.topk_ids[rows]
    if call.draft.vocab is not None:
        ids = call.draft.target_to_draft[ids]
    probs = call.target.topk_probs[rows].to(plan.acc) * (ids >= 0)
    return ids.clamp(min=0), probs


def _labels_in_draft_vocab(call: Call, plan: Plan, rows: slice) -> tuple[Tensor, Tensor]:
    """The labels at ``rows`` as draft ids c (0 where none or outside the draft vocab) and
    whether each is one (c, 1 or 0)."""
    ids = call.target.labels[rows]
    if call.draft.vocab is not None:
        ids = torch.where(ids >= 0, call.draft.target_to_draft[ids.clamp(min=0)], -1)
    return ids.clamp(min=0), (ids >= 0).to(plan.acc)


def draft_step(call: Call, plan: Plan, chunk: Chunk, sums: Sums, j: int) -> None:
    """Step ``j`` on ``chunk``: its top-1 matches, its terms and, when wanted, its gradients."""
    rows = chunk.rows
    hidden = call.draft.hidden[j, rows].detach()
    # The draft's logits; probs: exp(logit − max), normalised into the gradient's scale below.
    # Its log-probabilities are logits − lse, read where needed only.
    draft_logits = project(plan.w_draft[j] if plan.per_step else plan.w_draft, hidden, chunk.logits)
    top, total, drafted = softmax_(draft_logits, chunk.probs, (chunk.product, plan.last_first))
    lse = top + total.log()  # 1×c
    if call.draft.vocab is not None:
        drafted = call.draft.vocab[drafted]
    valid = call.draft.valid[j, rows]
    sums.matches[j] += ((drafted == plan.target_argmax[rows]) & valid).sum()
    values = _step_terms(chunk, draft_logits, lse)
    lk = _lk_step(call, plan, chunk, total, values, j) if plan.lk else None
    row_mask = plan.trained[j, rows].double()
    sums.terms[j] += torch.stack([(v * row_mask).sum() for v in values]) / plan.denominators[j]
    if call.wants_grad:
        _step_gradients(call, plan, chunk, sums, j, hidden, total, lk)


def _step_terms(chunk: Chunk, draft_logits: Tensor, lse: Tensor) -> list[Tensor]:
    """The TERMS of one step at each of the chunk's c positions (fp64; zeros for a term whose
    weight is 0, and for the LK terms, which ``_lk_step`` fills), from its logits V'×c and their
    log-sum-exp 1×c."""
    zeros = torch.zeros(lse.shape[-1], dtype=torch.float64, device=lse.device)
    values = [zeros] * len(TERMS)
    p = chunk.p
    if p is not None:  # −Σ_v p_v log q_v = lse − Σ_v p_v logit_v, as p sums to 1
        soft = (lse.squeeze(0) - torch.mul(p, draft_logits, out=chunk.product).sum(0)).double()
        values[0] = values[1] = soft
        if chunk.neg_entropy is not None:
            values[1] = soft + chunk.neg_entropy.double()
    if chunk.topk_ids is not None:
        log_q = draft_logits.gather(0, chunk.topk_ids.T).T - lse.T  # c×K
        values[2] = -(chunk.topk_probs * log_q).sum(-1).double()
    if chunk.label_ids is not None:
        log_q = draft_logits.gather(0, chunk.label_ids.unsqueeze(0)).squeeze(0) - lse.squeeze(0)
        values[3] = -(log_q * chunk.has_label).double()
    return values


@dataclass(frozen=True, eq=False)
class _LKStep:
    """The LK terms' part of one step's soft targets w on a chunk (see :mod:`specdraft.train.fused`):
    ``short`` (V'×c, in ``chunk.product``) q·[q < p] weighted by ``short_weight`` (c), p by
    ``dense`` (c), and their sum over V, ``w_total`` (c)."""

    short: Tensor
    short_weight: Tensor
    dense: Tensor
    w_total: Tensor


def _lk_step(call: Call, plan: Plan, chunk: Chunk, total: Tensor, values: list[Tensor], j: int) -> _LKStep:
    """Step ``j``'s LK terms on the chunk into ``values`` (per position) and their soft targets;
    ``total`` (1×c) the sum of exp(logit − max) in ``chunk.probs``."""
    c_alpha, c_lambda = plan.coef["lk_alpha"], plan.coef["lk_lambda"]
    # chunk.logits is free once the step's other terms are read: α's scratch.
    alpha, short = acceptance_(chunk.p, chunk.probs, total, chunk.product, chunk.below, chunk.logits)
    short_weight = torch.zeros_like(alpha)
    dense = torch.zeros_like(alpha)
    if c_alpha > 0:  # −log α: w = q·[q < p] / α
        floored = alpha.clamp(min=ALPHA_FLOOR)
        values[TERMS.index("lk_alpha")] = -floored.log().double()
        short_weight += c_alpha * (alpha >= ALPHA_FLOOR) / floored
    if c_lambda > 0:  # λ·KL + (1 − λ)·(1 − α): w = λ·p + (1 − λ)·q·[q < p]
        trained = plan.trained[j, chunk.rows].to(alpha.dtype)
        blend = torch.exp(-call.weights.lk_eta * (alpha * trained).sum() / trained.sum().clamp(min=1))
        kl = values[TERMS.index("soft_ce")] + chunk.neg_entropy.double()  # −Σ p log q + Σ p log p
        values[TERMS.index("lk_lambda")] = blend * kl + (1 - blend) * (1 - alpha.double())
        short_weight += c_lambda * (1 - blend)
        dense += c_lambda * blend
    return _LKStep(short, short_weight, dense, short_weight * short.sum(0) + dense)  # Σ_v p_v = 1


def _step_gradients(
    call: Call,
    plan: Plan,
    chunk: Chunk,
    sums: Sums,
    j: int,
    hidden: Tensor,
    total: Tensor,
    lk: _LKStep | None,
) -> None:
    """Adds step ``j``'s gradients at the chunk's positions (``hidden`` c×H, the sum ``total``
    1×c of exp(logit − max) in ``chunk.probs``, the LK terms' soft targets ``lk``) to ``sums``."""
    acc, rows = plan.acc, chunk.rows
    # Gradient of step_weight_j · Σ_t c_t · mean_j(term_t) with respect to the logits,
    # (Σ_v w_v)·q − w per position scaled, written over exp(logit − max) in place
    # (q = that / total): the dense part of w subtracted over V×c, the sparse part
    # at its K' entries, the LK terms' q·[q < p] over V×c.
    scale = (call.step_weights[j] / plan.denominators[j]).to(acc) * plan.trained[j, rows].to(acc)  # c
    w_total = chunk.w_total if lk is None else chunk.w_total + lk.w_total
    grad_logits = chunk.probs.mul_(w_total * scale / total)
    if chunk.p is not None and plan.dense > 0:
        grad_logits.addcmul_(chunk.p, scale, value=-plan.dense)
    if chunk.sparse_ids is not None:
        grad_logits.scatter_add_(0, chunk.sparse_ids, chunk.sparse_weights * -scale)
    if lk is not None:
        grad_logits.addcmul_(chunk.p, lk.dense * scale, value=-1)
        grad_logits.addcmul_(lk.short, lk.short_weight * scale, value=-1)
    if sums.gathered is not None:
        grad_logits = sums.gathered.slot(j, hidden).copy_(grad_logits)
    else:
        grad_logits = grad_logits.to(call.draft.hidden.dtype)
    transposed = plan.w_draft_t[j] if plan.per_step else plan.w_draft_t
    sums.grad_hidden[j, rows] = (transposed @ grad_logits).T.to(acc)
    if sums.grad_weight is not None and sums.gathered is None:
        (sums.grad_weight[j] if plan.per_step else sums.grad_weight).addmm_(grad_logits, hidden)
