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
    """embedding V×H, lm_head V×H (the same tensor for tied targets), final_norm H: the scale the
    target's final RMS norm applies after normalising (its weight; Gemma's 1 + weight),
    ``embedding_scale``: what the target multiplies a token's embedding row by before its first
    layer (Gemma: √H; heads that read embeddings scale them alike), ``logit_softcap``: the cap of
    the target's final logits (Gemma 2: :func:`soft_cap`), None: uncapped."""

    embedding: Tensor
    lm_head: Tensor
    final_norm: Tensor
    embedding_scale: float = 1.0
    logit_softcap: float | None = None

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
        tensors = (t.detach().to(dtype) for t in (self.embedding, self.lm_head, self.final_norm))
        return TargetWeights(*tensors, embedding_scale=self.embedding_scale, logit_softcap=self.logit_softcap)


def soft_cap(logits: Tensor, cap: float | None) -> Tensor:
    """``cap · tanh(logits / cap)`` (Gemma 2's final logits), in place when ``logits`` allows it
    (a fresh product); ``logits`` itself when ``cap`` is None."""
    if not cap:
        return logits
    if logits.requires_grad:
        return torch.tanh(logits / cap) * cap
    return logits.div_(cap).tanh_().mul_(cap)


def random_target_weights(spec: TargetSpec, seed: int = 0, std: float = 0.02) -> TargetWeights:
    """Stand-in weights with the right shapes, for tests and for loading a checkpoint's trained
    weights before the real target is at hand. Never exported: the buffers are not persistent."""
    generator = torch.Generator().manual_seed(seed)
    embedding = torch.randn(spec.vocab_size, spec.hidden_size, generator=generator) * std
    lm_head = (
        embedding if spec.tie_word_embeddings else torch.randn(embedding.shape, generator=generator) * std
    )
    return TargetWeights(embedding, lm_head, torch.ones(spec.hidden_size))
