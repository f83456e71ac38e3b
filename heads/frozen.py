"""The frozen pieces of the target a head computes with, handed over at build time.

They are registered as NON-persistent buffers: they move with the head (``.to``), but never
enter its ``state_dict``, so no checkpoint or export ever carries (or invents) target weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdraft.heads.spec import TargetSpec


@dataclass(frozen=True)
class TargetWeights:
    """embedding V×H, lm_head V×H (the same tensor for tied targets), final_norm H."""

    embedding: Tensor
    lm_head: Tensor
    final_norm: Tensor

    def check(self, spec: TargetSpec) -> None:
        expected = {
            "embedding": (spec.vocab_size, spec.hidden_size),
            "lm_head": (spec.vocab_size, spec.hidden_size),
            "final_norm": (spec.hidden_size,),
        }
        for name, shape in expected.items():
            actual = tuple(getattr(self, name).shape)
            if actual != shape:
                raise ValueError(f"target weights: {name} has shape {actual}, spec {spec.name} needs {shape}")

    def to(self, dtype: torch.dtype) -> TargetWeights:
        return TargetWeights(*(t.detach().to(dtype) for t in (self.embedding, self.lm_head, self.final_norm)))


def random_target_weights(spec: TargetSpec, seed: int = 0, std: float = 0.02) -> TargetWeights:
    """Stand-in weights with the right shapes, for tests and for loading a checkpoint's trained
    weights before the real target is at hand. Never exported: the buffers are not persistent."""
    generator = torch.Generator().manual_seed(seed)
    embedding = torch.randn(spec.vocab_size, spec.hidden_size, generator=generator) * std
    lm_head = (
        embedding if spec.tie_word_embeddings else torch.randn(embedding.shape, generator=generator) * std
    )
    return TargetWeights(embedding, lm_head, torch.ones(spec.hidden_size))
