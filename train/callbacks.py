"""Training callbacks: throughput and peak memory, a whole-run progress bar, a deadline."""

from __future__ import annotations

import math
import resource
import sys
import time
from typing import Any

import lightning as L
import torch
from tqdm.auto import tqdm


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: allocated CUDA memory on GPUs, peak RSS (with the target) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


class ThroughputMonitor(L.Callback):
    """Logs ``train/tokens_per_s`` (real tokens per second of wall time between training batches,
    data loading and online feature extraction included, validation excluded) and
    ``train/peak_memory_gb``. Totals are in ``tokens`` / ``seconds`` for the run summary."""

    def __init__(self) -> None:
        self.tokens, self.seconds = 0, 0.0
        self._last: float | None = None

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._last is not None:  # the first batch of a segment includes start-up costs
            self.tokens += int(batch.attention_mask.sum())
            self.seconds += now - self._last
        self._last = now
        if self.seconds > 0:
            module.log("train/tokens_per_s", self.tokens / self.seconds)
        module.log("train/peak_memory_gb", peak_memory_bytes(module.device) / 2**30)

    def on_validation_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._last = None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


class RunProgressBar(L.Callback):
    """One progress bar over the whole run (``trainer.max_steps``) with an ETA and the latest
    simulated τ — Lightning's own bar restarts every epoch, which says little on a short run of
    many small epochs. Resumed runs start the bar at the restored step. ``refresh_rate``: steps
    between updates (0: no bar, e.g. in CI logs), as for Lightning's bar."""

    def __init__(self, refresh_rate: int = 1) -> None:
        self.refresh_rate = refresh_rate
        self._bar: tqdm | None = None

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self.refresh_rate > 0 and trainer.is_global_zero and trainer.max_steps > 0:
            self._bar = tqdm(total=trainer.max_steps, initial=trainer.global_step, desc="train", unit="step")

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._bar is not None and trainer.global_step % self.refresh_rate == 0:
            if self._bar.total != trainer.max_steps:  # a deadline resized the run
                self._bar.total = trainer.max_steps
            self._bar.update(trainer.global_step - self._bar.n)

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        tau = trainer.callback_metrics.get("val/sim_tau")
        if self._bar is not None and tau is not None:
            self._bar.set_postfix(sim_tau=f"{float(tau):.3f}")

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class TrainingDeadline(L.Callback):
    """Training that ends after ``minutes`` of its own wall time (its validations included; a
    resumed run adds to what its checkpoint recorded), its optimizer steps sized to fill them.

    ``trainer.max_steps`` is the first guess (the quickstart sizes it from its probe). Every
    ``every_n_steps`` steps, the steps left become what the time left holds at the rate this
    process has trained at so far: ``max_steps`` moves there, and so does the end of the decay of
    a schedule that offers ``retarget(total_steps)`` (:mod:`specdraft.train.schedules`). A machine
    slower or faster than its probe said still ends training on time, its learning rate decayed
    (a ``max_time`` stop would leave it mid-decay). On a 2-core AMX Xeon the quickstart's probe
    timed 0.38 s per step where its training then drifted from 0.39 to 0.53 s and took 1.24× its
    ETA (run qs-evalbox-amx); another run's probe read 0.51 s for ~0.48."""

    def __init__(self, minutes: float, every_n_steps: int = 50) -> None:
        if minutes <= 0 or every_n_steps < 1:
            raise ValueError(
                f"TrainingDeadline needs minutes > 0 and every_n_steps >= 1, got {minutes}, {every_n_steps}"
            )
        self.seconds, self.every_n_steps = minutes * 60, every_n_steps
        self.spent_before = 0.0  # seconds this run spent in earlier processes (checkpointed)
        self.max_steps: int | None = None  # the steps as last sized (checkpointed)
        self._started: float | None = None  # this process's training start
        self._first_step = 0
        self._trainer: L.Trainer | None = None

    def now(self) -> float:
        return time.perf_counter()

    def spent(self) -> float:
        """Seconds of training so far, earlier processes of this run included."""
        return self.spent_before + (0.0 if self._started is None else self.now() - self._started)

    def setup(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer  # a resumed run's sized steps must reach the loop as they load

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._started, self._first_step = self.now(), trainer.global_step
        if self.spent() >= self.seconds:  # resumed after its time was up
            self._resize(trainer, trainer.global_step)
        elif self.max_steps is not None:  # resumed: the schedule's end too (it exists by now)
            self._resize(trainer, self.max_steps)

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        done = trainer.global_step - self._first_step
        if done == 0 or trainer.global_step % self.every_n_steps:
            return
        elapsed = self.now() - self._started
        left = self.seconds - self.spent_before - elapsed
        more = max(1, math.floor(left * done / elapsed)) if left > 0 else 0
        more = trainer.strategy.broadcast(more)  # every rank stops at rank 0's step (DDP)
        self._resize(trainer, trainer.global_step + more)

    def _resize(self, trainer: L.Trainer, steps: int) -> None:
        self.max_steps = steps
        trainer.fit_loop.epoch_loop.max_steps = steps  # what Lightning's loops stop at
        for config in trainer.lr_scheduler_configs:
            retarget = getattr(config.scheduler, "retarget", None)
            if retarget is not None:
                retarget(steps)

    def record(self) -> dict[str, Any]:
        """What the run summary keeps: the deadline, the seconds spent, the steps as last sized."""
        return {"minutes": self.seconds / 60, "spent_s": round(self.spent(), 1), "max_steps": self.max_steps}

    def state_dict(self) -> dict[str, Any]:
        return {"spent_s": self.spent(), "max_steps": self.max_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.spent_before, self.max_steps = state_dict["spent_s"], state_dict["max_steps"]
        if self.max_steps is not None and self._trainer is not None:
            # Before the loop decides whether it is done: at the config's max_steps, a run that
            # its deadline had lengthened would stop as it resumes.
            self._trainer.fit_loop.epoch_loop.max_steps = self.max_steps
