"""Learning-rate schedules (per optimiser step), as partials Hydra completes with the optimiser.

A schedule that decays towards a last step offers ``retarget(total_steps)``: a run whose length
is decided as it goes (:class:`specdraft.train.callbacks.TrainingDeadline`) moves its decay's end
with it. The end is NOT kept in the scheduler's checkpointed state: a resumed run takes it from
its config (extending a run stretches the decay) or from whoever retargets it again.
"""

from __future__ import annotations

import math

import torch


class WarmupCosine(torch.optim.lr_scheduler.LambdaLR):
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio``·lr at
    ``total_steps`` (constant after). ``total_steps`` <= 0 means no decay (e.g. max_steps = -1)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_steps: int,
        total_steps: int,
        min_lr_ratio: float,
    ) -> None:
        self.warmup_steps, self.min_lr_ratio = warmup_steps, min_lr_ratio
        self._total_steps = total_steps

        def factor(step: int) -> float:  # a plain function: LambdaLR checkpoints none of its state
            return self.factor(step)

        super().__init__(optimizer, factor)

    def factor(self, step: int) -> float:
        """The lr at optimiser step ``step`` over the optimiser's base lr."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self._total_steps <= self.warmup_steps:
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / (self._total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def retarget(self, total_steps: int) -> None:
        """End the decay at ``total_steps`` instead; the lr follows from the next step on."""
        self._total_steps = total_steps

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.pop("_total_steps")  # the config's (or the retargeting's) end, not the checkpoint's
        return state


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> WarmupCosine:
    """:class:`WarmupCosine` (conf/scheduler/warmup_cosine.yaml)."""
    return WarmupCosine(optimizer, warmup_steps, total_steps, min_lr_ratio)
