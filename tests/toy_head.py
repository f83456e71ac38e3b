"""A head kind that specdraft does not ship, written as a new kind's module would be: only the
DraftHead interface (specdraft.heads.interface), nothing else of specdraft touched.

ToyHead is an autoregressive feature head unlike EAGLE's: the draft layer reads
``f_t + g ⊙ emb(x_{t+1})`` (a learned gate g per channel instead of EAGLE's 2H → H fc) and drafts
through the target's frozen lm_head (FeatureHead's default).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

from specdraft.heads.eagle import FeatureHead
from specdraft.heads.frozen import TargetWeights
from specdraft.heads.spec import TargetSpec


@dataclass(frozen=True)
class ToyConfig:
    gate_init: float = 1.0
    kind: str = "toy"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ToyHead(FeatureHead):
    kind = "toy"
    config_class = ToyConfig

    def __init__(self, spec: TargetSpec, weights: TargetWeights, config: ToyConfig | None = None) -> None:
        super().__init__(spec, weights, attention_input_size=spec.hidden_size)
        self.config = config or ToyConfig()
        self.gate = nn.Parameter(torch.full((spec.hidden_size,), self.config.gate_init))

    @property
    def target_taps(self) -> tuple[int, ...]:
        return ()

    def initial_features(self, hidden: Tensor, aux: Tensor | None = None) -> Tensor:
        return hidden

    def attention_inputs(self, features: Tensor, token_ids: Tensor) -> tuple[Tensor, Tensor]:
        h = features + self.gate.to(features.dtype) * self.embed(token_ids).to(features.dtype)
        return h, h
