"""The LightningModule: a plain draft-head nn.Module, its objective, its optimiser.

The frozen target is not a sub-module: the DataModule runs it (online) or reads its cached
features, and the head holds only non-persistent views of its embedding / lm_head. So a
checkpoint holds the head's trained weights (+ the optimiser), the head's kind and config, and
the TargetSpec it was trained for, never the target.

Numbers that cannot be trusted stop the run (docs/architecture.md §2): a training step whose loss
terms are not finite ends training before its backward, a validation whose loss is not finite
ends it before anything records it, and weights that are not finite are never checkpointed — so
the run directory keeps its last good checkpoint to resume from.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor, nn
from torch.distributed.fsdp import FullyShardedDataParallel

from specdraft.data.features import FeatureBatch
from specdraft.heads.registry import CHECKPOINT_KEY
from specdraft.train.objective import DraftObjective, ObjectiveOutput, simulated_tau

SIM_TAU = "val/sim_tau"  # the validation metric the best checkpoint is chosen by
NONFINITE_HINT = (
    "the features hold NaN/Inf values (a feature cache: specdraft-cache mode=validate names the "
    "shard) or training diverged (lower optim.lr); nothing from this step was saved, the "
    "checkpoints written before it are kept"
)


class NonFiniteLoss(ValueError):
    """A loss, a validation loss or weights that are a NaN or an Inf: the run stops (one line)."""


def term_description(name: str) -> str:
    """An objective's term key said for a user: ``step2/topk`` → ``topk (rollout step 2)``."""
    step, _, term = name.partition("/")
    return f"{term} (rollout {step.replace('step', 'step ')})"


class DraftHeadModule(L.LightningModule):
    """Trains ``head`` on FeatureBatches with ``objective``.

    optimizer: partial taking the parameters; scheduler: partial taking the optimiser (or None),
    stepped every optimiser step. head_record: what a checkpoint needs to rebuild the head
    (``{"kind", "config", "target_spec"}``), stored under ``checkpoint["specdraft"]``.

    Logged: ``train/loss``, ``train/step{j}/{term}``, ``train/acc_{j}`` (for j >= 2 over
    ``loss.rollout_vocab_size``'s tokens when it is set); ``val/loss``, ``val/acc_{j}`` and
    ``val/sim_tau`` = 1 + Σ_k Π_{i≤k} acc_i over the whole validation set and the training
    vocabulary, ``train/tokens`` (real tokens seen).
    """

    def __init__(
        self,
        head: nn.Module,
        objective: DraftObjective,
        optimizer: Callable[..., torch.optim.Optimizer],
        scheduler: Callable[..., Any] | None = None,
        head_record: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head, self.objective = head, objective
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.head_record = head_record or {}
        self._val: dict[str, Any] = {}
        self.tokens_seen = 0

    def _check_device(self, batch: FeatureBatch) -> None:
        """One clear error instead of a matmul's "Expected all tensors to be on the same device"."""
        for name, value in vars(batch).items():
            if isinstance(value, Tensor) and value.device != self.device:
                raise RuntimeError(
                    f"training batch field {name!r} is on {value.device} but the head is on {self.device}:"
                    " the datamodule must deliver features on the training device"
                )

    def _compute_dtype_batch(self, batch: FeatureBatch) -> FeatureBatch:
        self._check_device(batch)
        # Under bf16-mixed autocast takes bf16 features as they are; full-precision training
        # needs the target's (possibly bf16) features in the head's parameter dtype.
        if torch.is_autocast_enabled(batch.hidden.device.type):
            return batch
        dtype = next(self.head.parameters()).dtype
        for name in ("hidden", "aux", "input_hidden"):
            value = getattr(batch, name)
            if value is not None and value.dtype != dtype:
                setattr(batch, name, value.to(dtype))
        return batch

    def training_step(self, batch: FeatureBatch, batch_index: int) -> Tensor:
        out = self.objective(self.head, self._compute_dtype_batch(batch), train=True)
        self._stop_if_nonfinite(out)
        size = batch.input_ids.shape[0]
        self.tokens_seen += int(batch.attention_mask.sum())
        self.log("train/loss", out.loss, prog_bar=True, batch_size=size)
        self.log_dict({f"train/{name}": value for name, value in out.terms.items()}, batch_size=size)
        for j, acc in enumerate(out.accuracy, start=1):
            self.log(f"train/acc_{j}", acc, batch_size=size)
        self.log("train/tokens", float(self.tokens_seen), batch_size=size, reduce_fx="max")
        return out.loss

    def _stop_if_nonfinite(self, out: ObjectiveOutput) -> None:
        """End training at the first step whose loss terms are not finite, before its backward
        and optimizer step: no NaN reaches the weights or a checkpoint. The objective already
        copies every term to the host once a step (to log them), so reading them costs no device
        sync; with several ranks one all-reduce of a flag stops them all at the same step (a rank
        stopping alone would leave the others waiting in the gradient all-reduce)."""
        found = next(iter(out.nonfinite.items()), None)
        stop = found is not None
        if self._trainer is not None:  # a no-op on one device
            stop = self.trainer.strategy.reduce_boolean_decision(stop, all=False)
        if not stop:
            return
        step = self.global_step + 1
        if found is None:
            raise NonFiniteLoss(f"step {step}: another rank's loss is not finite: {NONFINITE_HINT}")
        raise NonFiniteLoss(
            f"step {step}: loss term {term_description(found[0])} is {found[1]}: {NONFINITE_HINT}"
        )

    def on_validation_epoch_start(self) -> None:
        self._val = {"loss": 0.0, "batches": 0, "matches": None, "counts": None}

    def validation_step(self, batch: FeatureBatch, batch_index: int) -> None:
        out: ObjectiveOutput = self.objective(self.head, self._compute_dtype_batch(batch), train=False)
        state = self._val
        state["loss"] += float(out.loss)
        state["batches"] += 1
        if out.nonfinite and "nonfinite" not in state:  # named if the reduced val/loss is not finite
            state["nonfinite"] = next(iter(out.nonfinite.items()))
        matches, counts = (
            torch.tensor(out.matches, dtype=torch.float64),
            torch.tensor(out.counts, dtype=torch.float64),
        )
        state["matches"] = matches if state["matches"] is None else state["matches"] + matches
        state["counts"] = counts if state["counts"] is None else state["counts"] + counts

    def on_validation_epoch_end(self) -> None:
        state = self._val
        if not state.get("batches"):
            return
        # Sum over every rank's validation batches before dividing.
        totals = torch.cat(
            [
                torch.tensor([state["loss"], state["batches"]], dtype=torch.float64),
                state["matches"],
                state["counts"],
            ]
        ).to(self.device)
        totals = self.trainer.strategy.reduce(totals, reduce_op="sum").cpu()
        steps = len(state["matches"])
        loss, batches = float(totals[0]), float(totals[1])
        matches, counts = totals[2 : 2 + steps], totals[2 + steps :]
        accuracy = [float(m / c) if c else 0.0 for m, c in zip(matches, counts, strict=True)]
        self._stop_if_nonfinite_validation(loss / batches)
        metrics = {"val/loss": loss / batches}
        metrics.update({f"val/acc_{j}": acc for j, acc in enumerate(accuracy, start=1)})
        self.log_dict(metrics)
        self.log(SIM_TAU, simulated_tau(accuracy), prog_bar=True)

    def _stop_if_nonfinite_validation(self, val_loss: float) -> None:
        """A validation loss that is not finite ends the run before it is logged, compared for the
        best checkpoint or written to summary.json (every rank reduced the same value, so every
        rank stops)."""
        if math.isfinite(val_loss):
            return
        found = self._val.get("nonfinite")
        term = f" (loss term {term_description(found[0])} is {found[1]})" if found else ""
        raise NonFiniteLoss(
            f"validation after step {self.global_step}: val/loss is {val_loss}{term}: {NONFINITE_HINT}"
        )

    def _refuse_nonfinite_weights(self) -> None:
        """Never checkpoint weights that are not finite (a step with finite losses can still have
        non-finite gradients): the head's parameters are counted once per checkpoint (one host
        transfer), the decision shared by the ranks, before anything is written."""
        named = [(name, p) for name, p in self.head.named_parameters() if p.is_floating_point()]
        counts = (
            torch.stack([(~torch.isfinite(p.detach())).sum() for _, p in named]).tolist() if named else []
        )
        bad = {name: count for (name, _), count in zip(named, counts, strict=True) if count}
        stop = bool(bad)
        if self._trainer is not None:
            stop = self.trainer.strategy.reduce_boolean_decision(stop, all=False)
        if stop:
            shown = ", ".join(f"{name}: {count}" for name, count in bad.items()) or "on another rank"
            raise NonFiniteLoss(
                f"step {self.global_step}: the head's weights are not finite (NaN/Inf values in {shown}); "
                f"the checkpoint was not written: {NONFINITE_HINT}"
            )

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(params=[p for p in self.head.parameters() if p.requires_grad])
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer=optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Under FSDP each rank holds shards of the gradients, so their norm is a collective that
        only the FSDP module computes; Lightning clips FSDP gradients by value only (and raises
        for the trainer's default, by norm), so clip by norm through the wrapped module.

        Under bf16-mixed Lightning refuses to clip for a fused optimizer (``optim.fused``), which
        could unscale a GradScaler's fp16 gradients inside its step; bf16 has no scaler, the
        gradients are as they are, so they are clipped as in full precision."""
        wrapped = self._trainer.model if self._trainer is not None else None
        by_norm = gradient_clip_algorithm in (None, "norm")
        if gradient_clip_val and by_norm and isinstance(wrapped, FullyShardedDataParallel):
            wrapped.clip_grad_norm_(gradient_clip_val)
            return
        plugin = self._trainer.precision_plugin if self._trainer is not None else None
        if gradient_clip_val and isinstance(plugin, MixedPrecision) and plugin.scaler is None:
            algorithm = GradClipAlgorithmType(gradient_clip_algorithm or "norm")
            Precision.clip_gradients(plugin, optimizer, gradient_clip_val, algorithm)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._refuse_nonfinite_weights()
        checkpoint[CHECKPOINT_KEY] = {**self.head_record, "tokens_seen": self.tokens_seen}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.tokens_seen = int(checkpoint.get(CHECKPOINT_KEY, {}).get("tokens_seen", 0))
