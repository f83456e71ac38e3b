"""The vocabulary-sized loss terms of all draft steps, fused and chunked over positions.

With a 49k vocabulary, N×V logits, their softmax, the target's distribution and the gradients
are each ~0.6 GB per 3k supervised positions and step; allocating them dominated training time
on CPU. This function walks the positions ``chunk_size`` at a time: per chunk it computes the
target's distribution ONCE (shared by every draft step), each step's draft log-probabilities,
the loss terms of :mod:`specdraft.train.losses`, and their gradient with respect to the draft
hidden states and the draft vocabulary projection in closed form,

    d loss / d logits = (Σ_v w_v) · softmax(logits) − w,
    w = c_soft·p + c_kl·p + c_topk·(p on the target's top-K) + c_ce·onehot(label),

so nothing vocabulary-sized outlives a chunk. When no gradient is wanted (validation under
``no_grad``) the gradient matmuls are skipped: they are half the work. The values and gradients
equal those of the reference terms in ``losses.py`` (tested); ``feature`` (SmoothL1) is small and
stays outside.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from specdraft.train.losses import LossWeights

TERMS = ("soft_ce", "forward_kl", "topk", "ce")
DEFAULT_CHUNK_SIZE = 128  # 128 × 49k fp32 = 25 MB: below glibc's mmap threshold, so buffers are reused


@dataclass
class FusedOutput:
    """loss: Σ_j step_weight_j · Σ_term c_term · mean_j(term) (differentiable);
    terms: S×4 per-step means of TERMS (detached); matches / counts: S, top-1 matches with the
    target's argmax over each step's valid positions."""

    loss: Tensor
    terms: Tensor
    matches: Tensor
    counts: Tensor


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
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    target_argmax: Tensor | None = None,
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
    target_argmax   N      the target's argmax when known (its cached top-1): with a reduced
                           vocab the full target logits are then never computed
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
    ):
        steps, n, _ = draft_hidden.shape
        device, compute = draft_hidden.device, draft_hidden.dtype
        coef = {name: float(getattr(weights, name)) for name in TERMS}
        for name, inputs in (("topk", (topk_ids, topk_probs)), ("ce", (labels,))):
            if coef[name] > 0 and any(x is None for x in inputs):
                raise ValueError(f"loss term {name!r} has weight {coef[name]} but no inputs")
        w_draft = draft_weight.detach().to(compute)
        per_step_weight = w_draft.dim() == 3
        w_target = target_weight.detach().to(target_hidden.dtype)
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
                for start in range(0, n, chunk_size):
                    rows = slice(start, start + chunk_size)
                    target_argmax[rows] = (target_hidden[rows] @ w_target.T).argmax(-1)
            keep = target_to_draft[target_argmax] >= 0
            # From here on only the draft vocabulary's rows of the target lm_head are needed.
            w_target = w_target[draft_vocab]
        trained = step_valid & keep  # S×N
        denominators = trained.sum(-1).clamp(min=1).double()

        terms = torch.zeros(steps, len(TERMS), dtype=torch.float64, device=device)
        matches = torch.zeros(steps, dtype=torch.long, device=device)
        grad_hidden = torch.zeros(draft_hidden.shape, dtype=acc, device=device) if wants_grad else None
        grad_weight = (
            torch.zeros(draft_weight.shape, dtype=acc, device=device)
            if wants_grad and draft_weight.requires_grad
            else None
        )
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            target_logits = (target_hidden[rows] @ w_target.T).to(acc)  # c×V'
            if not reduced:
                target_argmax[rows] = target_logits.argmax(-1)
            p = target_logits.softmax(-1)  # c×V'
            # w without the per-step scaling: the target side is the same for every step.
            w = (coef["soft_ce"] + coef["forward_kl"]) * p
            sparse_ids = sparse_probs = None
            if coef["topk"] > 0:
                sparse_ids = topk_ids[rows]
                if reduced:
                    sparse_ids = target_to_draft[sparse_ids]
                sparse_probs = topk_probs[rows].to(acc) * (sparse_ids >= 0)
                sparse_ids = sparse_ids.clamp(min=0)
                w = w.scatter_add(-1, sparse_ids, coef["topk"] * sparse_probs)
            label_ids = None
            if coef["ce"] > 0:
                label_ids = labels[rows]
                if reduced:
                    label_ids = torch.where(label_ids >= 0, target_to_draft[label_ids.clamp(min=0)], -1)
                has_label = label_ids >= 0
                label_ids = label_ids.clamp(min=0)
                w = w.scatter_add(-1, label_ids.unsqueeze(-1), coef["ce"] * has_label.unsqueeze(-1).to(acc))
            w_total = w.sum(-1, keepdim=True)
            neg_entropy = torch.special.xlogy(p, p).sum(-1) if coef["forward_kl"] > 0 else None
            for j in range(steps):
                hidden = draft_hidden[j, rows].detach()
                step_weight = w_draft[j] if per_step_weight else w_draft
                logits = (hidden @ step_weight.T).to(acc)
                log_q = logits.log_softmax(-1)
                drafted = logits.argmax(-1)
                if reduced:
                    drafted = draft_vocab[drafted]
                valid = step_valid[j, rows]
                matches[j] += ((drafted == target_argmax[rows]) & valid).sum()
                row_mask = trained[j, rows].double()
                soft = -(p * log_q).sum(-1).double()
                values = [soft, soft, torch.zeros_like(soft), torch.zeros_like(soft)]
                if neg_entropy is not None:
                    values[1] = soft + neg_entropy.double()
                if sparse_ids is not None:
                    values[2] = -(sparse_probs * log_q.gather(-1, sparse_ids)).sum(-1).double()
                if label_ids is not None:
                    values[3] = -(log_q.gather(-1, label_ids.unsqueeze(-1)).squeeze(-1) * has_label).double()
                terms[j] += torch.stack([(v * row_mask).sum() for v in values]) / denominators[j]
                if not wants_grad:
                    continue
                # Gradient of step_weight_j · Σ_t c_t · mean_j(term_t) with respect to the logits.
                scale = (step_weights[j] / denominators[j]).to(acc) * trained[j, rows].to(acc)
                grad_logits = (w_total * log_q.exp() - w) * scale.unsqueeze(-1)
                grad_logits = grad_logits.to(compute)
                grad_hidden[j, rows] = (grad_logits @ step_weight).to(acc)
                if grad_weight is not None:
                    grad = (grad_logits.T @ hidden).to(acc)
                    if per_step_weight:
                        grad_weight[j] += grad
                    else:
                        grad_weight += grad
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
        return hidden, weight, *([None] * 13)


@torch.no_grad()
def target_topk(target_hidden: Tensor, target_weight: Tensor, k: int, chunk_size: int = DEFAULT_CHUNK_SIZE):
    """The target's top-k (ids, probs) N×k for its hidden states N×H, ``chunk_size`` rows at a time."""
    weight = target_weight.to(target_hidden.dtype)
    ids = torch.empty(target_hidden.shape[0], k, dtype=torch.long, device=target_hidden.device)
    probs = torch.empty(target_hidden.shape[0], k, dtype=torch.float32, device=target_hidden.device)
    for start in range(0, target_hidden.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        probs[rows], ids[rows] = (target_hidden[rows] @ weight.T).float().softmax(-1).topk(k, dim=-1)
    return ids, probs
