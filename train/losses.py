"""Draft-head losses: pure functions over the N supervised positions of one draft step.

Shapes: N supervised positions, V' the draft vocabulary (= V for EAGLE-1/2 and Medusa), H the
hidden size, K the Top-K size. Every term is a mean over the N positions (0 when N = 0), so
terms of different steps and batches are comparable. ``step_loss`` combines them with
:class:`LossWeights` and returns a dict of named terms plus ``loss``.

The terms, by head (docs/architecture.md §3):
* Medusa: ``ce`` against the data's next tokens, step k weighted γ^k (the rollout step weight).
* EAGLE-1/2: ``feature`` SmoothL1(ĥ, f) + 0.1 ``soft_ce``(softmax(lm_head f) ‖ lm_head ĥ).
* EAGLE-3: ``soft_ce`` against the target distribution restricted to the draft vocabulary.
* HASS Top-K distillation ``topk`` (any head) and ``forward_kl`` (any head).
* LK losses (arXiv 2602.23881; any head), which train the acceptance rate itself, α = Σ_v
  min(p_v, q_v) (the chance that speculative sampling accepts a token drafted from q against the
  target's p): ``lk_alpha`` = −log α, and ``lk_lambda`` = λ·KL(p ‖ q) + (1 − λ)·(1 − α)
  with λ = exp(−η·ᾱ), ᾱ the positions' mean α, detached: KL while the draft accepts little
  (TV's gradient vanishes there), the acceptance rate itself as it learns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# −log α is floored here: a position where draft and target share (almost) no mass costs
# −log(1e-6) ≈ 13.8, not ∞, and passes no gradient.
ALPHA_FLOOR = 1e-6


@dataclass(frozen=True)
class LossWeights:
    """Weights of the loss terms (0 disables a term; ``topk_k`` is HASS's K, ``lk_eta`` LK^λ's η)."""

    feature: float = 0.0
    soft_ce: float = 0.0
    forward_kl: float = 0.0
    topk: float = 0.0
    topk_k: int = 10
    ce: float = 0.0
    lk_alpha: float = 0.0
    lk_lambda: float = 0.0
    lk_eta: float = 3.0

    def __post_init__(self) -> None:
        for name in ("feature", "soft_ce", "forward_kl", "topk", "ce", "lk_alpha", "lk_lambda", "lk_eta"):
            if getattr(self, name) < 0:
                raise ValueError(f"loss.weights.{name} must be >= 0, got {getattr(self, name)}")
        if self.topk > 0 and self.topk_k < 1:
            raise ValueError(f"loss topk_k must be >= 1 when topk > 0, got {self.topk_k}")


def _mean(per_position: Tensor) -> Tensor:
    return per_position.mean() if per_position.numel() else per_position.sum()


def feature_regression(predicted: Tensor, target: Tensor) -> Tensor:
    """EAGLE's SmoothL1 (β = 1) between predicted and target features N×H, averaged over H."""
    return _mean(F.smooth_l1_loss(predicted.float(), target.float(), reduction="none").mean(-1))


def soft_cross_entropy(draft_logits: Tensor, target_probs: Tensor) -> Tensor:
    """−Σ_v p(v) log q(v) for draft logits N×V' and target probabilities N×V'."""
    return _mean(-(target_probs * F.log_softmax(draft_logits.float(), dim=-1)).sum(-1))


def forward_kl(draft_logits: Tensor, target_probs: Tensor) -> Tensor:
    """KL(p ‖ q) = Σ_v p(v) (log p(v) − log q(v)); same gradient as the soft CE, 0 at p = q."""
    log_q = F.log_softmax(draft_logits.float(), dim=-1)
    return _mean(torch.special.xlogy(target_probs, target_probs).sum(-1) - (target_probs * log_q).sum(-1))


def topk_distillation(draft_logits: Tensor, topk_ids: Tensor, topk_probs: Tensor) -> Tensor:
    """HASS Top-K distillation: −Σ_{v ∈ topK(p)} p(v) log q(v).

    draft_logits N×V'; topk_ids N×K draft-vocabulary ids of the target's K most likely tokens
    (−1 for a token outside the draft vocabulary: it contributes nothing); topk_probs N×K their
    probabilities under the full target distribution.
    """
    log_q = F.log_softmax(draft_logits.float(), dim=-1)
    present = topk_ids >= 0
    picked = log_q.gather(-1, topk_ids.clamp(min=0))
    return _mean(-(topk_probs * picked * present).sum(-1))


def acceptance_rate(draft_logits: Tensor, target_probs: Tensor) -> Tensor:
    """α = Σ_v min(p(v), q(v)) per position (N) for draft logits N×V' and target probabilities N×V'."""
    return torch.minimum(target_probs, F.softmax(draft_logits.float(), dim=-1)).sum(-1)


def lk_alpha(draft_logits: Tensor, target_probs: Tensor) -> Tensor:
    """LK^α: −log α, α floored at :data:`ALPHA_FLOOR`; TV's target with its gradient scaled by 1/α."""
    return _mean(-acceptance_rate(draft_logits, target_probs).clamp(min=ALPHA_FLOOR).log())


def lk_lambda(draft_logits: Tensor, target_probs: Tensor, eta: float) -> Tensor:
    """LK^λ: λ·KL(p ‖ q) + (1 − λ)·(1 − α) per position, λ = exp(−η·ᾱ) with ᾱ the mean α over the
    N positions given, detached (the fused losses take ᾱ over each chunk of positions)."""
    alpha = acceptance_rate(draft_logits, target_probs)
    if not alpha.numel():
        return alpha.sum()
    blend = torch.exp(-eta * alpha.mean()).detach()
    log_q = F.log_softmax(draft_logits.float(), dim=-1)
    kl = torch.special.xlogy(target_probs, target_probs).sum(-1) - (target_probs * log_q).sum(-1)
    return _mean(blend * kl + (1 - blend) * (1 - alpha))


def cross_entropy(draft_logits: Tensor, labels: Tensor) -> Tensor:
    """CE against hard labels N (draft-vocabulary ids, −1 = outside the draft vocabulary, ignored)."""
    if not labels.numel():
        return draft_logits.sum() * 0
    return F.cross_entropy(draft_logits.float(), labels, ignore_index=-1, reduction="sum") / labels.numel()


def step_loss(
    weights: LossWeights,
    draft_logits: Tensor,
    target_probs: Tensor | None = None,
    topk_ids: Tensor | None = None,
    topk_probs: Tensor | None = None,
    labels: Tensor | None = None,
    predicted_features: Tensor | None = None,
    target_features: Tensor | None = None,
) -> dict[str, Tensor]:
    """The weighted loss of one draft step. Only the terms with a weight > 0 are computed; each
    needs its inputs (shapes as in the functions above). Returns {term: value, ..., "loss"}."""
    terms: dict[str, Tensor] = {}
    needs = {
        "feature": (predicted_features, target_features),
        "soft_ce": (target_probs,),
        "forward_kl": (target_probs,),
        "topk": (topk_ids, topk_probs),
        "ce": (labels,),
        "lk_alpha": (target_probs,),
        "lk_lambda": (target_probs,),
    }
    for name, inputs in needs.items():
        if getattr(weights, name) > 0 and any(x is None for x in inputs):
            raise ValueError(f"loss term {name!r} has weight {getattr(weights, name)} but no inputs")
    if weights.feature > 0:
        terms["feature"] = feature_regression(predicted_features, target_features)
    if weights.soft_ce > 0:
        terms["soft_ce"] = soft_cross_entropy(draft_logits, target_probs)
    if weights.forward_kl > 0:
        terms["forward_kl"] = forward_kl(draft_logits, target_probs)
    if weights.topk > 0:
        terms["topk"] = topk_distillation(draft_logits, topk_ids, topk_probs)
    if weights.ce > 0:
        terms["ce"] = cross_entropy(draft_logits, labels)
    if weights.lk_alpha > 0:
        terms["lk_alpha"] = lk_alpha(draft_logits, target_probs)
    if weights.lk_lambda > 0:
        terms["lk_lambda"] = lk_lambda(draft_logits, target_probs, weights.lk_eta)
    total = torch.zeros((), device=draft_logits.device)
    for name, value in terms.items():
        total = total + getattr(weights, name) * value
    terms["loss"] = total
    return terms
