"""Training callbacks: throughput and peak memory."""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

import lightning as L
import torch


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
