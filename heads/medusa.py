"""Medusa heads (Cai et al., 2024): K parallel heads over the target's last hidden state.

Head k (0-based) reads the post-norm last hidden state at position t and predicts token t+2+k
(the target itself predicts t+1). Each head is ``num_layers`` residual blocks ``x + SiLU(Wx + b)``
with W zero-initialised (so an untrained head starts near the target's own lm_head), then a
vocabulary projection: either the head's own Linear initialised from the target lm_head, or the
shared frozen target lm_head.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdraft.heads.frozen import TargetWeights
from specdraft.heads.interface import DraftHead, TrainingBatch, TrainingPredictions, supervised_positions
from specdraft.heads.spec import TargetSpec
from specdraft.heads.vocab import VocabProjection


@dataclass(frozen=True)
class MedusaConfig:
    """Medusa. ``num_heads`` K (head k predicts the token k+2 ahead), ``num_layers`` residual
    blocks per head, ``own_lm_head``: Medusa-1's per-head projection (V×H trainable params per
    head) instead of the frozen target lm_head. No defaults here: conf/head/medusa.yaml sets them."""

    num_heads: int
    num_layers: int
    own_lm_head: bool
    kind: str = "medusa"

    def __post_init__(self) -> None:
        if self.kind != "medusa":
            raise ValueError(f"MedusaConfig.kind must be 'medusa', got {self.kind!r}")
        if self.num_heads < 1 or self.num_layers < 0:
            raise ValueError(f"Medusa needs num_heads >= 1 and num_layers >= 0, got {self}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)  # starts as x + SiLU(b): close to the target's own lm_head

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


class MedusaHead(DraftHead):
    """``forward(hidden ...×H) -> logits K×...×V``; head k predicts the token k+2 positions ahead.
    Drafts with ``specdraft.eval.medusa_drafter.MedusaDrafter``."""

    kind = "medusa"
    config_class = MedusaConfig

    def __init__(self, spec: TargetSpec, weights: TargetWeights, config: MedusaConfig) -> None:
        super().__init__(spec, weights)
        self.config = config
        # One ModuleList per head, a fresh ResBlock per layer: Medusa's reference code builds
        # ``[ResBlock(H)] * L``, which shares ONE block L times.
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(spec.hidden_size) for _ in range(self.config.num_layers)))
            for _ in range(self.config.num_heads)
        )
        if self.config.own_lm_head:
            self.lm_heads = nn.ModuleList(
                nn.Linear(spec.hidden_size, spec.vocab_size, bias=False) for _ in range(self.config.num_heads)
            )
            for lm_head in self.lm_heads:
                lm_head.weight.data.copy_(weights.lm_head.float())

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def parallel_steps(self) -> int:
        return self.num_heads

    @property
    def target_taps(self) -> tuple[int, ...]:
        """No aux layers: every head reads the target's last hidden state."""
        return ()

    def head_logits(self, hidden: Tensor, k: int) -> Tensor:
        """Logits ...×V of head k for last hidden states ...×H."""
        features = self.blocks[k](hidden)
        if self.config.own_lm_head:
            return self.lm_heads[k](features)
        return self.target_logits(features)

    def vocab_projection(self, hidden: Tensor) -> VocabProjection:
        """Head k's logits for the rows of ``hidden[k]`` (K×N×H, post-norm last hidden states, one
        row of N per head) as the training objective computes them: inputs @ weight.T, with
        weight V×H (the shared target lm_head) or K×V×H (each head's own)."""
        features = torch.stack([self.blocks[k](hidden[k]) for k in range(self.num_heads)])
        if self.config.own_lm_head:
            return VocabProjection(features, torch.stack([lm_head.weight for lm_head in self.lm_heads]))
        return VocabProjection(features, self.target_lm_head)

    def training_predictions(self, batch: TrainingBatch, steps: int, detach: bool) -> TrainingPredictions:
        """Head k reading position q−1−k predicts x_{q+1}, whose target distribution is the
        target's at q: indexed by q, the heads share that distribution (computed once per chunk)
        and its label. q is supervised when x_{q+1} is an assistant token; head k needs a position
        q−1−k ≥ 0 to read. ``steps`` and ``detach`` do not apply: the K heads are independent."""
        b, q = supervised_positions(batch)
        ahead = torch.arange(1, self.num_heads + 1, device=q.device).unsqueeze(-1)  # K×1: 1 + k
        hidden = batch.hidden[b, (q - ahead).clamp(min=0)]  # K×N×H
        return TrainingPredictions(b, q, hidden, q >= ahead, predicts_features=False)

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden ...×H (post-norm last hidden states) -> logits K×...×V."""
        return torch.stack([self.head_logits(hidden, k) for k in range(self.num_heads)])
