"""Training callbacks: throughput and peak memory, a whole-run progress bar."""

from __future__ import annotations

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
            self._bar.update(trainer.global_step - self._bar.n)

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        tau = trainer.callback_metrics.get("val/sim_tau")
        if self._bar is not None and tau is not None:
            self._bar.set_postfix(sim_tau=f"{float(tau):.3f}")

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
