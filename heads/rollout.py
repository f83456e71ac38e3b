"""Multi-step training of autoregressive feature heads: HASS harmonized context alignment and
EAGLE-3's training-time test, as ONE parametrised mechanism.

At decode time, after the target accepted position t, draft step j (j = 1..n) runs at position
t+j−1: its query reads the head's own step-(j−1) feature, and it attends the KV cache of target
features up to t plus the head's own features at t+1..t+j−1 from the earlier steps. Training
reproduces exactly that context for every position at once. At step j the query at position p
(so t = p−(j−1)) attends

* level-1 keys (computed from target features at step 1) at positions q ≤ p−(j−1), and
* the level-l key (computed at step l, 2 ≤ l ≤ j) at position q = p−(j−l) only,

where the level-l input at q is the head's step-(l−1) output at q−1 with the true token x_{q+1}
(teacher forcing). The step-j output at p therefore predicts the target's feature / next-token
distribution at p+1 for every j, and positions p < j−1 (no target context left) are not
supervised. The pattern is :class:`specdraft.heads.layers.AlignedMask`, with ADDITIVE (0 / −inf)
semantics: a masked key takes no part in the softmax. (HASS's
reference code multiplies the scores by its mask instead, so masked keys still enter the
softmax denominator.) Rotary positions are the true positions at every level, as at decode time.

``detach=True`` (HASS) stops the gradient through earlier-step features; ``detach=False`` with
weights 0.8^(j−1) is EAGLE-3's training-time test.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from specdraft.heads.interface import shift_left
from specdraft.heads.layers import AlignedMask

if TYPE_CHECKING:  # the head module calls this one
    from specdraft.heads.eagle import FeatureHead


def shift_right(x: Tensor) -> Tensor:
    """x[:, p] <- x[:, p−1] along dim 1; position 0 gets zeros."""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)


def rollout(
    head: FeatureHead, features: Tensor, input_ids: Tensor, steps: int, detach: bool, pad_token_id: int = 0
) -> list[Tensor]:
    """Run ``steps`` aligned draft steps over whole sequences (``detach``: see above).

    features   B×T×H  level-1 features (``head.initial_features``)
    input_ids  B×T    the tokens; position p reads x_{p+1}
    Returns one B×T×H output per step: step j's output at p predicts position p+1's target
    feature (EAGLE-1) / the next-token distribution there. Supervise step j only at p ≥ j−1.
    """
    batch, length, _ = features.shape
    next_tokens = shift_left(input_ids, pad_token_id)
    positions = torch.arange(length, device=features.device).expand(batch, length)
    past_keys: list[Tensor] = []
    past_values: list[Tensor] = []
    outputs: list[Tensor] = []
    for step in range(1, steps + 1):
        # Step 1 is plain causal attention (the fused kernel); later steps add one key per level.
        mask = AlignedMask(step)
        past_key = torch.cat(past_keys, dim=2) if past_keys else None
        past_value = torch.cat(past_values, dim=2) if past_values else None
        output, key, value = head.step(features, next_tokens, positions, mask, past_key, past_value)
        outputs.append(output)
        past_keys.append(key)
        past_values.append(value)
        features = shift_right(output.detach() if detach else output)
    return outputs
