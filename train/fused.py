"""The vocabulary-sized loss terms of all draft steps, fused and chunked over positions.

With a 49k vocabulary, N×V logits, their softmax, the target's distribution and the gradients
are each ~0.6 GB per 3k supervised positions and step; allocating them dominated training time
on CPU. This function walks the positions ``chunk_size`` at a time: per chunk it computes the
target's distribution ONCE (shared by every draft step), each step's draft log-probabilities,
the loss terms of :mod:`specdraft.train.losses`, and their gradient with respect to the draft
hidden states and the draft vocabulary projection in closed form,

    d loss / d logits = (Σ_v w_v) · softmax(logits) − w,
    w = c_soft·p + c_kl·p + c_topk·(p on the target's top-K) + c_ce·onehot(label),

so nothing vocabulary-sized outlives the call: it lives in a few V×c buffers reused by every
chunk and step (:class:`_VocabBuffers`, vocabulary-major for speed). When no gradient is wanted
(validation under ``no_grad``) the gradient matmuls are skipped: they are half the work; when the
target's argmax is known (its cached top-1) only its softmax is computed, not its argmax, and when
no term reads its whole distribution either (top-K and label terms only: they come sparse, K
entries a position) the target's vocabulary projection is not computed at all — a third of the
matmuls and half the elementwise passes. The values and gradients equal those of the reference
terms in ``losses.py`` (tested); ``feature`` (SmoothL1) is small and stays outside.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specdraft.train.losses import LossWeights

TERMS = ("soft_ce", "forward_kl", "topk", "ce")
# A trainable projection's gradient in reduced precision: the logit gradients of this many
# positions (of any chunks and steps sharing the projection) are gathered before ONE matmul, whose
# V×H product is cast and added to the fp32 gradient once per gathering instead of once per chunk
# and step (~0.4 GB of memory traffic each at 32k × 576).
WEIGHT_GRAD_POSITIONS = 1024


@dataclass
class FusedOutput:
    """loss: Σ_j step_weight_j · Σ_term c_term · mean_j(term) (differentiable);
    terms: S×4 per-step means of TERMS (detached); matches / counts: S, top-1 matches with the
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


def fused_vocab_losses(
    draft_hidden: Tensor,
    draft_weight: Tensor,
    target_hidden: Tensor,
    target_weight: Tensor,
    step_valid: Tensor,
    step_weights: Sequence[float],
    weights: LossWeights,
    draft_vocab: Tensor | None = None,
    target_to_draft: Tensor | None = None,
    topk_ids: Tensor | None = None,
    topk_probs: Tensor | None = None,
    labels: Tensor | None = None,
    *,
    chunk_size: int,
    target_argmax: Tensor | None = None,
    frozen: FrozenRows | None = None,
) -> FusedOutput:
    """Loss terms over S draft steps at N positions.

    draft_hidden    S×N×H  what the draft's vocabulary projection reads (grad)
    draft_weight    V'×H   that projection (a trainable lm_head, or the frozen target one), or
                    S×V'×H one per step (Medusa heads with their own lm_heads)
    target_hidden   N×H    the target's last hidden state whose next-token distribution p is the
                           target at each position; target_weight V×H its lm_head
    step_valid      S×N    positions each step is evaluated at
    draft_vocab     V'     target id of each draft id (None: the draft vocab is the target's).
                           With a reduced vocab, p is renormalised over it and positions whose
                           target argmax lies outside it are not trained on (EAGLE-3)
    target_to_draft V      draft id of each target id, −1 outside (with draft_vocab)
    topk_ids/probs  N×K    the target's top-K (target ids) for ``topk``; labels N target ids
                           (−1: none) for ``ce``
    chunk_size             positions per chunk (conf/train.yaml loss.chunk_size)
    target_argmax   N      the target's argmax when known (its cached top-1): with a reduced
                           vocab the full target logits are then never computed
    frozen          ``draft_weight`` is these prepared rows of ``target_weight`` (:class:`FrozenRows`)
    """
    if (draft_vocab is None) != (target_to_draft is None):
        raise ValueError("draft_vocab and target_to_draft go together")
    if draft_weight.dim() == 3 and draft_weight.shape[0] != draft_hidden.shape[0]:
        raise ValueError(f"{draft_weight.shape[0]} per-step draft weights for {draft_hidden.shape[0]} steps")
    wants_grad = torch.is_grad_enabled() and (draft_hidden.requires_grad or draft_weight.requires_grad)
    return FusedOutput(
        *_FusedVocabLosses.apply(
            draft_hidden,
            draft_weight,
            wants_grad,
            target_hidden,
            target_weight,
            step_valid,
            tuple(float(w) for w in step_weights),
            weights,
            draft_vocab,
            target_to_draft,
            topk_ids,
            topk_probs,
            labels,
            chunk_size,
            target_argmax,
            frozen,
        )
    )


class _FusedVocabLosses(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        draft_hidden,
        draft_weight,
        wants_grad,
        target_hidden,
        target_weight,
        step_valid,
        step_weights,
        weights: LossWeights,
        draft_vocab,
        target_to_draft,
        topk_ids,
        topk_probs,
        labels,
        chunk_size,
        target_argmax_given,
        frozen,
    ):
        steps, n, _ = draft_hidden.shape
        device, compute = draft_hidden.device, draft_hidden.dtype
        coef = {name: float(getattr(weights, name)) for name in TERMS}
        for name, inputs in (("topk", (topk_ids, topk_probs)), ("ce", (labels,))):
            if coef[name] > 0 and any(x is None for x in inputs):
                raise ValueError(f"loss term {name!r} has weight {coef[name]} but no inputs")
        target_dtype = target_hidden.dtype
        if frozen is not None and not frozen.serves(draft_weight, compute, target_dtype):
            raise ValueError("frozen rows given for another projection, or for other dtypes")
        w_draft = frozen.rows if frozen is not None else draft_weight.detach().to(compute)
        per_step_weight = w_draft.dim() == 3
        w_draft_t = frozen.transposed if frozen is not None else _gradient_layout(w_draft, wants_grad)
        reduced = draft_vocab is not None
        # Softmaxes and gradients in fp32 (fp64 when the inputs are fp64, as in the tests).
        acc = torch.float64 if compute == torch.float64 else torch.float32

        keep = torch.ones(n, dtype=torch.bool, device=device)
        target_argmax = torch.empty(n, dtype=torch.long, device=device)
        if reduced:
            # The positions each step trains on (target argmax inside the draft vocab) set the
            # per-step means before any gradient is computed. The argmax is the cached top-1
            # when there is one; else it costs one extra pass over the full target logits.
            if target_argmax_given is not None:
                target_argmax = target_argmax_given
            else:
                w_full = target_weight.detach().to(target_dtype)
                for start in range(0, n, chunk_size):
                    rows = slice(start, start + chunk_size)
                    target_argmax[rows] = (target_hidden[rows] @ w_full.T).argmax(-1)
            keep = target_to_draft[target_argmax] >= 0
            # From here on only the draft vocabulary's rows of the target lm_head are needed:
            # selected before the cast, which then touches V' rows, not V (49k: ~10 ms a call).
            if frozen is None:
                w_target = target_weight.detach()[draft_vocab].to(target_dtype)
        else:
            if frozen is None:
                w_target = target_weight.detach().to(target_dtype)
            if target_argmax_given is not None:
                target_argmax = target_argmax_given
        if frozen is not None:
            w_target = frozen.rows  # the same rows, in the same dtype
        trained = step_valid & keep  # S×N
        denominators = trained.sum(-1).clamp(min=1).double()

        # The soft targets w = c_dense·p + (c_topk·(p on the top-K) + c_ce·onehot): the dense
        # part reads the target's whole distribution p (soft CE, forward KL), the sparse part K'
        # entries a position, kept as (ids, weights) and never spread over V×c. p itself is only
        # computed when the dense part or the target's argmax (unknown: no cached top-1, full
        # vocab) needs it: else the target's vocabulary projection is skipped altogether.
        dense = coef["soft_ce"] + coef["forward_kl"]
        wants_argmax = target_argmax_given is None and not reduced
        needs_distribution = dense > 0 or wants_argmax
        vocab = w_target.shape[0]
        if w_draft.shape[-2] != vocab:
            raise ValueError(f"a draft projection of {w_draft.shape[-2]} rows for a {vocab}-token vocabulary")
        buffers = _VocabBuffers(vocab, min(chunk_size, n), acc, device, 4 if needs_distribution else 3)
        last_first = torch.arange(vocab, 0, -1, dtype=acc, device=device).unsqueeze(-1)  # V×1

        terms = torch.zeros(steps, len(TERMS), dtype=torch.float64, device=device)
        matches = torch.zeros(steps, dtype=torch.long, device=device)
        grad_hidden = torch.zeros(draft_hidden.shape, dtype=acc, device=device) if wants_grad else None
        grad_weight = (
            torch.zeros(draft_weight.shape, dtype=acc, device=device)
            if wants_grad and draft_weight.requires_grad
            else None
        )
        gathered = None  # in fp32 (or fp64) each chunk adds its product in place instead
        if grad_weight is not None and compute != acc:
            gathered = _GatheredWeightGradient(grad_weight, per_step_weight, min(chunk_size, n), compute)
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            logits, probs, product, *target_buffer = buffers.views(min(chunk_size, n - start))
            # Everything vocabulary-sized is V×c (vocabulary-major), see _VocabBuffers.
            p = neg_entropy = None
            if needs_distribution:
                # p: the target's distribution. Its argmax only when not known (the cached top-1
                # gives it; with a reduced vocab it was found above): two passes over V×c saved.
                p = target_buffer[0]
                target_logits = _project(w_target, target_hidden[rows], logits)
                _, total, target_top = _softmax_(
                    target_logits, p, (product, last_first) if wants_argmax else None
                )
                p.div_(total)
                if wants_argmax:
                    target_argmax[rows] = target_top
                if coef["forward_kl"] > 0:
                    neg_entropy = torch.special.xlogy(p, p).sum(0)
            id_columns, weight_columns = [], []  # c×K (top-K), c×1 (label)
            topk_rows = label_ids = None
            if coef["topk"] > 0:
                topk_rows = topk_ids[rows]
                if reduced:
                    topk_rows = target_to_draft[topk_rows]
                sparse_probs = topk_probs[rows].to(acc) * (topk_rows >= 0)
                topk_rows = topk_rows.clamp(min=0)
                id_columns.append(topk_rows)
                weight_columns.append(coef["topk"] * sparse_probs)
            if coef["ce"] > 0:
                label_ids = labels[rows]
                if reduced:
                    label_ids = torch.where(label_ids >= 0, target_to_draft[label_ids.clamp(min=0)], -1)
                has_label = (label_ids >= 0).to(acc)
                label_ids = label_ids.clamp(min=0)
                id_columns.append(label_ids.unsqueeze(1))
                weight_columns.append(coef["ce"] * has_label.unsqueeze(1))
            # The sparse targets K'×c (K' = K + 1 with both terms).
            sparse_ids = torch.cat(id_columns, 1).T if id_columns else None
            sparse_weights = torch.cat(weight_columns, 1).T if weight_columns else None
            # Σ_v w_v per position (p sums to 1)
            w_total = dense + (sparse_weights.sum(0) if sparse_weights is not None else 0.0)
            for j in range(steps):
                hidden = draft_hidden[j, rows].detach()
                step_weight = w_draft[j] if per_step_weight else w_draft
                # The draft's logits; probs: exp(logit − max), normalised into the gradient's
                # scale below. Its log-probabilities are logits − lse, read where needed only.
                draft_logits = _project(step_weight, hidden, logits)
                top, total, drafted = _softmax_(draft_logits, probs, (product, last_first))
                lse = top + total.log()  # 1×c
                if reduced:
                    drafted = draft_vocab[drafted]
                valid = step_valid[j, rows]
                matches[j] += ((drafted == target_argmax[rows]) & valid).sum()
                row_mask = trained[j, rows].double()
                zeros = torch.zeros(lse.shape[-1], dtype=torch.float64, device=device)
                values = [zeros, zeros, zeros, zeros]
                if p is not None:  # −Σ_v p_v log q_v = lse − Σ_v p_v logit_v, as p sums to 1
                    soft = (lse.squeeze(0) - torch.mul(p, draft_logits, out=product).sum(0)).double()
                    values[0] = values[1] = soft
                    if neg_entropy is not None:
                        values[1] = soft + neg_entropy.double()
                if topk_rows is not None:
                    log_q = draft_logits.gather(0, topk_rows.T).T - lse.T  # c×K
                    values[2] = -(sparse_probs * log_q).sum(-1).double()
                if label_ids is not None:
                    log_q = draft_logits.gather(0, label_ids.unsqueeze(0)).squeeze(0) - lse.squeeze(0)
                    values[3] = -(log_q * has_label).double()
                terms[j] += torch.stack([(v * row_mask).sum() for v in values]) / denominators[j]
                if not wants_grad:
                    continue
                # Gradient of step_weight_j · Σ_t c_t · mean_j(term_t) with respect to the logits,
                # (Σ_v w_v)·q − w per position scaled, written over exp(logit − max) in place
                # (q = that / total): the dense part of w subtracted over V×c, the sparse part
                # at its K' entries.
                scale = (step_weights[j] / denominators[j]).to(acc) * trained[j, rows].to(acc)  # c
                grad_logits = probs.mul_(w_total * scale / total)
                if p is not None and dense > 0:
                    grad_logits.addcmul_(p, scale, value=-dense)
                if sparse_ids is not None:
                    grad_logits.scatter_add_(0, sparse_ids, sparse_weights * -scale)
                if gathered is not None:
                    grad_logits = gathered.slot(j, hidden).copy_(grad_logits)
                else:
                    grad_logits = grad_logits.to(compute)
                transposed = w_draft_t[j] if per_step_weight else w_draft_t
                grad_hidden[j, rows] = (transposed @ grad_logits).T.to(acc)
                if grad_weight is not None and gathered is None:
                    (grad_weight[j] if per_step_weight else grad_weight).addmm_(grad_logits, hidden)
        if gathered is not None:
            gathered.flush()
        coefficients = torch.tensor([coef[name] for name in TERMS], dtype=torch.float64, device=device)
        step_scale = torch.tensor(step_weights, dtype=torch.float64, device=device)
        loss = (terms @ coefficients * step_scale).sum().float()
        if wants_grad:
            ctx.save_for_backward(grad_hidden, grad_weight if grad_weight is not None else torch.empty(0))
        ctx.hidden_dtype, ctx.has_weight_grad = draft_hidden.dtype, grad_weight is not None
        ctx.weight_dtype = draft_weight.dtype
        counts = step_valid.sum(-1)
        ctx.mark_non_differentiable(terms, matches, counts)
        return loss, terms.float(), matches, counts

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden = (grad_hidden * grad_loss).to(ctx.hidden_dtype)
        weight = (grad_weight * grad_loss).to(ctx.weight_dtype) if ctx.has_weight_grad else None
        return hidden, weight, *([None] * 14)


class _GatheredWeightGradient:
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


def _gradient_layout(weight: Tensor, wants_grad: bool) -> Tensor:
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
        self.transposed = _gradient_layout(self.rows, wants_grad=True)

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


class _VocabBuffers:
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


def _project(weight: Tensor, rows: Tensor, out: Tensor) -> Tensor:
    """weight V×H times rowsᵀ (rows c×H) into ``out`` V×c, which may have a wider dtype."""
    rows = rows.to(weight.dtype)
    if weight.dtype == out.dtype:
        return torch.mm(weight, rows.T, out=out)
    return out.copy_(weight @ rows.T)


def _softmax_(
    logits: Tensor, probs: Tensor, argmax_with: tuple[Tensor, Tensor] | None = None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``probs`` (V×c) ← exp(logit − max) over dim 0 of V×c ``logits`` (left as they are): the
    softmax once divided by the returned sum. Returns the max and that sum (each 1×c) and, with
    ``argmax_with`` = (a V×c scratch buffer, V − arange(V) as a V×1 column), the argmax (c)."""
    top = logits.amax(0, keepdim=True)
    shifted = torch.sub(logits, top, out=probs)
    argmax = _first_argmax(shifted, *argmax_with) if argmax_with is not None else None
    total = shifted.exp_().sum(0, keepdim=True)
    return top, total, argmax


# Logits below the max are scaled by this in the argmax: any difference above V / 2^100 (~1e-26
# for 49k rows) then sinks a logit below every maximal one.
_ARGMAX_SCALE = 2.0**100


def _first_argmax(shifted: Tensor, scratch: Tensor, last_first: Tensor) -> Tensor:
    """The argmax over dim 0 of V×c logits given as ``shifted`` = logits − their max (0 at the
    maxima, < 0 elsewhere): the first maximal index, as ``argmax`` gives. ``scratch`` is a V×c
    buffer of their dtype; ``last_first`` is V − arange(V) as a V×1 column of it.

    torch's max / argmax over a non-last dim do not vectorise (5.6 ms for 8k × 256 on an AMX
    Xeon against 0.3 ms for amax), so the argmax is read off a maximum: the largest V − v among
    the v at the max, as the max over v of (V − v) + 2^100 · shifted_v, one fused add (0.85 ms
    where comparing, multiplying by the column and taking the max took 2.3 ms)."""
    scores = torch.add(last_first, shifted, alpha=_ARGMAX_SCALE, out=scratch)
    return last_first.shape[0] - scores.amax(0).long()
