"""Learning-rate schedules (per optimiser step), as partials Hydra completes with the optimiser."""

from __future__ import annotations

import math

import torch


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio``·lr at
    ``total_steps`` (constant after). ``total_steps`` <= 0 means no decay (e.g. max_steps = -1)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if total_steps <= warmup_steps:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
