"""Turning target (or draft) logits into the distribution a decoder samples from.

The SAME :class:`Sampling` is applied to the target's logits in plain decoding and in
verification, which is what makes speculative sampling reproduce plain sampling: both draw from
``Sampling.probs(logits)``. Temperature 0 means greedy (argmax).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specdraft.data.generate import greedy_tokens


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy; top_k 0 and top_p 1 switch those filters off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: Tensor) -> Tensor:
        """...×V logits -> ...×V fp32 probabilities after temperature, top-k and top-p (for
        greedy: one-hot at the argmax, so the lossless rules degrade to exact matching)."""
        logits = logits.float()
        if self.greedy:
            return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        logits = logits / self.temperature
        if self.top_k > 0 and self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(-1)
            # Drop a token when the mass strictly before it already reaches top_p (the top-1 stays).
            drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p
            logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
        return logits.softmax(-1)

    def choose(self, logits: Tensor, generator: torch.Generator | None = None) -> int:
        """One token from a V logits vector: the argmax, or a sample from :meth:`probs`."""
        if self.greedy:
            return int(greedy_tokens(logits))
        return int(torch.multinomial(self.probs(logits), 1, generator=generator))
