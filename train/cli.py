"""``specdraft-train``: train a draft head on the frozen target's features (Hydra).

    specdraft-train experiment=hass                           # EAGLE head + HASS on SmolLM2
    specdraft-train experiment=eagle3 datamodule=cached \\
        datamodule.train_cache=outputs/features/smol-train datamodule.val_cache=outputs/features/smol-heldout
    specdraft-train experiment=medusa debug=smoke              # seconds, tiny target
    specdraft-train -m hparams_search=hass_loss_weights        # local sweep, one run dir per point
    specdraft-train experiment=hass init_from=outputs/train/hass-align/checkpoints/last.ckpt \\
        optim.lr=3.3e-4 trainer.max_steps=200 scheduler.warmup_steps=10 run_name=hass-topk  # fine-tune

Re-running a command resumes its run dir (``${paths.log_dir}/train/${run_name}``) from
``checkpoints/last.ckpt`` when the config matches (``train.run_dir``); a run that finished its
``max_steps`` is left as it is. The run ends with ``summary.json``: best simulated τ and its
checkpoint, the last validation metrics, throughput.
"""

from __future__ import annotations

import json
import logging
import pickle
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor
from omegaconf import DictConfig, OmegaConf, open_dict

from specdraft.data.cache import stored_top_k
from specdraft.data.datamodule import FeatureDataModule
from specdraft.data.settings import THREADS, data_rules
from specdraft.data.target import Target, check_target_family, target_weights
from specdraft.heads.formats import read_checkpoint, read_head
from specdraft.heads.interface import DraftHead
from specdraft.heads.registry import build_head, config_record
from specdraft.heads.vocab import draft_vocab_from_counts
from specdraft.system.checks import (
    at_least,
    check_settings,
    each,
    either,
    greater_than,
    in_range,
    integer,
    one_of,
    optional,
)
from specdraft.system.errors import hydra_command
from specdraft.system.files import write_json_atomic
from specdraft.system.hardware import start
from specdraft.system.locks import output_lock
from specdraft.train.callbacks import ThroughputMonitor, TrainingDeadline, peak_memory_bytes
from specdraft.train.loggers import finish_loggers
from specdraft.train.losses import LossWeights
from specdraft.train.module import SIM_TAU, DraftHeadModule
from specdraft.train.objective import DraftObjective, RolloutConfig
from specdraft.train.run_dir import FINAL_CHECKPOINT, RunDirError, lead_process, prepare_run_dir

log = logging.getLogger(__name__)

# specdraft-train settings (the train config and the groups it composes), checked before anything
# loads or is written. -1 is Lightning's "no limit" for max_steps / max_epochs (and no decay).
UNLIMITED = -1
TRAIN_SETTINGS = {
    "seed": integer(),
    "threads": THREADS,
    "resume": one_of("auto", True, False),
    **data_rules(),
    "datamodule.mode": one_of("online", "cached"),
    "datamodule.top_k": at_least(0),
    "datamodule.max_batch_tokens": at_least(1),
    "datamodule.num_workers": either(one_of("auto"), at_least(0)),
    "datamodule.noise.amplitude": optional(at_least(0, integer=False)),
    "datamodule.supervise": one_of("assistant", "all"),
    "datamodule.heldout_fraction": in_range(0, 1, closed=(True, False)),
    "datamodule.max_length": at_least(1),
    "datamodule.seed": integer(),
    "head.config.num_heads": at_least(1),
    "head.config.num_layers": at_least(1),
    "head.config.draft_vocab_size": at_least(1),
    "loss.weights.*": at_least(0, integer=False),
    "loss.weights.topk_k": at_least(1),
    "loss.rollout.steps": at_least(1),
    "loss.rollout.step_weight_base": greater_than(0),
    "loss.eval_steps": at_least(1),
    "loss.chunk_size": at_least(1),
    "loss.draft_vocab_size": optional(at_least(1)),
    "loss.rollout_vocab_size": optional(at_least(1)),
    "optim.lr": at_least(0, integer=False),  # 0: frozen weights (tests of init_from)
    "optim.weight_decay": at_least(0, integer=False),
    "optim.betas": each(in_range(0, 1, closed=(True, False))),
    "scheduler.warmup_steps": at_least(0),
    "scheduler.total_steps": either(one_of(UNLIMITED), at_least(1)),
    "scheduler.min_lr_ratio": in_range(0, 1),
    "trainer.max_steps": either(one_of(UNLIMITED), at_least(1)),
    "trainer.max_epochs": optional(either(one_of(UNLIMITED), at_least(1))),
    "trainer.val_check_interval": optional(either(at_least(1), in_range(0, 1, closed=(False, True)))),
    "trainer.limit_val_batches": either(at_least(0), in_range(0, 1)),
    "trainer.log_every_n_steps": at_least(1),
    "trainer.gradient_clip_val": optional(at_least(0, integer=False)),
    "trainer.accumulate_grad_batches": at_least(1),
    "trainer.num_nodes": at_least(1),
    "callbacks.deadline.minutes": greater_than(0),
    "callbacks.last_checkpoint.every_n_train_steps": at_least(1),
}


@hydra_command("specdraft-train", "train")
def main(cfg: DictConfig) -> None:
    train(cfg)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train (or resume) the run in ``cfg.paths.output_dir``, holding its lock (system/locks.py;
    a distributed launcher's other ranks run inside the lead's) once its settings are checked;
    the run's summary."""
    check_settings(cfg, TRAIN_SETTINGS)
    with output_lock(cfg.paths.output_dir, "specdraft-train") if lead_process() else nullcontext():
        return train_locked(cfg)


def train_locked(cfg: DictConfig) -> dict[str, Any]:
    run_dir = Path(cfg.paths.output_dir)
    check_target_family(cfg.target)  # before the run dir holds anything
    features_for_objective(cfg)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resume_from = prepare_run_dir(run_dir, resolved, cfg.resume, list(cfg.resume_ignore))
    if resume_from:  # a truncated or foreign last.ckpt: one line naming it, before Lightning reads it
        read_checkpoint(resume_from)
    finished = finished_summary(run_dir, cfg.trainer.max_steps) if resume_from else None
    if finished is not None:
        # Fitting again from the last checkpoint would rewrite the summary with a zero-second fit
        # and the checkpoint callback's stale best (seen re-running a finished sweep).
        log.info("%s finished its %d steps already: nothing to do", run_dir, finished["global_step"])
        return finished
    # The stored config keeps `auto`; the value it resolves to follows the machine this run is on.
    precision = start(
        "specdraft-train", cfg.threads, cfg.target, cfg.trainer.precision, str(cfg.trainer.accelerator)
    ).precision
    L.seed_everything(cfg.seed, workers=True)

    target: Target = instantiate(cfg.target)
    sources = {"conversations": instantiate(cfg.data.source)} if cfg.datamodule.mode == "online" else {}
    datamodule: FeatureDataModule = instantiate(cfg.datamodule)(target=target, **sources)
    head, record = build_training_head(cfg.head, target, datamodule)
    if cfg.init_from and not resume_from:  # a resumed run's checkpoint holds the weights already
        warm_start(head, record, cfg.init_from, target)
    check_features_for_head(head, datamodule)
    objective = build_objective(cfg.loss, target, datamodule)
    module = DraftHeadModule(
        head,
        objective,
        optimizer=instantiate(cfg.optim),
        scheduler=instantiate(cfg.scheduler) if cfg.scheduler else None,
        head_record=record,
    )
    callbacks = [instantiate(callback) for callback in cfg.callbacks.values() if callback]
    loggers = [instantiate(logger) for logger in cfg.logger.values() if logger] if cfg.logger else []
    for logger in loggers:
        logger.log_hyperparams(resolved)  # the resolved Hydra config is the run config
    if not loggers:  # nothing to log the lr to (Lightning refuses the monitor without a logger)
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    trainer: L.Trainer = instantiate(
        cfg.trainer, precision=precision, callbacks=callbacks, logger=loggers or False
    )
    log.info(
        "training %s (%s trainable parameters, precision %s) in %s",
        record["kind"], f"{count(head):,}", precision, run_dir,
    )  # fmt: skip
    if resume_from:
        log.info("resuming from %s", resume_from)

    started = time.perf_counter()
    fit_resuming_safely(trainer, module, datamodule, resume_from)
    summary = run_summary(trainer, module, time.perf_counter() - started, resume_from)
    if cfg.validate_at_end:
        # The final weights on the whole validation set (a time-limited run stops between checks).
        trainer.limit_val_batches = 1.0
        final = trainer.validate(module, datamodule=datamodule, verbose=False)
        summary["final_val"] = {k: float(v) for k, v in final[0].items()} if final else {}
        prefer_final_weights(summary, run_dir, lambda path: trainer.save_checkpoint(path, weights_only=True))
    finish_loggers(loggers)
    if trainer.is_global_zero:
        write_json_atomic(run_dir / "summary.json", summary)
        log.info("summary: %s", summary)
    return summary


def finished_summary(run_dir: Path, max_steps: int | None) -> dict[str, Any] | None:
    """The summary of a run that reached ``max_steps``, or the steps its deadline sized it to
    (callbacks.deadline), written when a run ends; or None: a run limited by ``max_time`` alone,
    or not finished, goes on."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    sized = (summary.get("deadline") or {}).get("max_steps")
    if sized is not None and summary.get("global_step", 0) >= sized:
        return summary
    if max_steps is None or max_steps < 0:
        return None
    return summary if summary.get("global_step", 0) >= max_steps else None


def build_training_head(head_cfg: DictConfig, target: Target, datamodule: FeatureDataModule):
    """A fresh head for ``target`` and the record a checkpoint keeps to rebuild it. A head that
    drafts over a vocabulary of its own (EAGLE-3's reduced one) chooses it from the training
    split's assistant tokens."""
    config = OmegaConf.to_container(head_cfg.config, resolve=True)
    head = build_head(head_cfg.kind, config, target.spec, target_weights(target))
    head.choose_vocabulary(datamodule.assistant_token_counts)
    record = {"kind": head.kind, "config": config_record(head), "target_spec": target.spec.to_dict()}
    return head, record


def warm_start(head: DraftHead, record: dict[str, Any], path: str, target: Target) -> None:
    """Start from the weights of the trained head at ``path`` (a training checkpoint or an export)
    instead of fresh ones; the optimizer and the schedule start anew. It must be the head this run
    builds: same kind, same config, same target shape and target layers (HASS's reference trains
    the alignment first, then adds Top-K distillation from those weights at a lower learning rate)."""
    weights = target_weights(target)
    trained = read_head(path, target.spec, target_lm_head=weights.lm_head)
    if trained.kind != head.kind:
        raise ValueError(f"init_from={path}: the trained head is {trained.kind}, this run trains {head.kind}")
    # Its config as that head resolves it, compared with this run's.
    built = build_head(trained.kind, trained.config, trained.spec, weights)
    resolved = config_record(built)
    differing = [
        f"{key}: {resolved.get(key)!r} there, {value!r} here"
        for key, value in record["config"].items()
        if resolved.get(key) != value
    ]
    if tuple(built.target_taps) != tuple(head.target_taps):
        differing.append(f"target layers: {list(built.target_taps)} there, {list(head.target_taps)} here")
    if differing:
        raise ValueError(
            f"init_from={path}: the trained {head.kind} head differs from this run's "
            f"({'; '.join(differing)}); set head.config (and target.aux_layer_ids) to its values"
        )
    head.load_state_dict(trained.state, strict=True)
    log.info("starting from the weights of %s", path)


def check_features_for_head(head: DraftHead, datamodule: FeatureDataModule) -> None:
    """Refuse, before training starts, features that lack the target layers the head reads (one
    clear error instead of one raised from inside the first training step)."""
    taps, delivered = tuple(head.target_taps), tuple(datamodule.fields.aux_layer_ids)
    if taps and taps != delivered:
        raise ValueError(
            f"head {head.kind} reads the target's layers {list(taps)} beside its last hidden state, "
            f"but the features carry {list(delivered)}: set datamodule.aux_layers=true (a feature "
            "cache must store them too: specdraft-cache aux_layers=true)"
        )


def features_for_objective(cfg: DictConfig) -> None:
    """Ask the datamodule for what the objective needs beyond the experiment's own settings: a
    reduced vocabulary (the training one, the rollout steps', or a head's own draft vocabulary)
    trains only where the target's argmax lies inside it, and its top-1 delivered with the
    features spares a pass over the full target logits per batch — when the feature caches
    store it (a cache written with top_k=0 does not: the argmax is then computed from the full
    logits)."""
    settings = ("loss.draft_vocab_size", "loss.rollout_vocab_size", "head.config.draft_vocab_size")
    reduced = [name for name in settings if OmegaConf.select(cfg, name, default=None)]
    if not reduced or cfg.datamodule.top_k:
        return
    setting = reduced[0]
    # A Top-K term reads K of them (without any it recomputes them from the full logits).
    weights = OmegaConf.select(cfg, "loss.weights", default=None) or {}
    wanted = weights.get("topk_k", 1) if weights.get("topk", 0) > 0 else 1
    if cfg.datamodule.mode == "cached":
        # A directory without a manifest (None) is not a finished cache: opening it says so, in one line.
        stored = {d: stored_top_k(d) for d in cache_directories(cfg.datamodule)}
        lacking = [d for d, k in stored.items() if k is not None and k < wanted]
        if lacking:
            log.info(
                "%s: %s stores fewer than the top-%d, so the target's argmax is computed from its"
                " full logits (slower: a cache written with top_k=%d spares it)",
                setting,
                lacking[0],
                wanted,
                wanted,
            )
            return
    log.info("%s: the features carry the target's top-%d (datamodule.top_k=%d)", setting, wanted, wanted)
    with open_dict(cfg):
        cfg.datamodule.top_k = wanted


def cache_directories(datamodule_cfg: DictConfig) -> list[str]:
    """Every feature cache a cached datamodule reads (train_cache / val_cache: a path or a list)."""
    directories = []
    for entry in (datamodule_cfg.train_cache, datamodule_cfg.val_cache):
        directories += [entry] if isinstance(entry, str) else list(entry)
    return directories


def build_objective(
    loss_cfg: DictConfig,
    target: Target,
    datamodule: FeatureDataModule,
    train_counts: torch.Tensor | None = None,
    rollout: bool = True,
) -> DraftObjective:
    """The objective of ``loss_cfg``; a reduced training vocabulary (``draft_vocab_size``) and
    the rollout steps' (``rollout_vocab_size``; none with ``rollout=False``, for an objective
    that only measures) are the most frequent assistant tokens of the training split
    (``train_counts``, V; default: counted from the datamodule's), chosen as EAGLE-3's is, so
    the smaller lies inside the larger; a rollout vocabulary no smaller than the training one
    changes nothing."""
    sizes = {name: loss_cfg.get(name) for name in ("draft_vocab_size", "rollout_vocab_size")}
    training_size = sizes["draft_vocab_size"] or target.spec.vocab_size
    if not rollout or (sizes["rollout_vocab_size"] or training_size) >= training_size:
        sizes["rollout_vocab_size"] = None
    reduced = {
        name: size for name, size in sizes.items() if size is not None and size < target.spec.vocab_size
    }
    if reduced and train_counts is None:
        train_counts = datamodule.assistant_token_counts()
    vocab = {name: most_frequent(train_counts, size) for name, size in reduced.items()}
    return DraftObjective(
        LossWeights(**loss_cfg.weights),
        RolloutConfig(**loss_cfg.rollout),
        eval_steps=loss_cfg.eval_steps,
        chunk_size=loss_cfg.chunk_size,
        draft_vocab=vocab.get("draft_vocab_size"),
        rollout_vocab=vocab.get("rollout_vocab_size"),
    )


def most_frequent(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The target ids of the ``size`` most frequent tokens by ``counts`` (V), in id order."""
    d2t, _ = draft_vocab_from_counts(counts, size)
    return d2t + torch.arange(size)


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def prefer_final_weights(summary: dict[str, Any], run_dir: Path, save: Callable[[Path], None]) -> None:
    """Make the final weights the run's best checkpoint (``save`` writes them to
    ``checkpoints/final-step=N.ckpt``) when their simulated τ on the whole validation set
    (``summary["final_val"]``) is at least the best periodic validation's. Else a run stopped by
    ``max_time``, or whose last steps came after its last validation, exports older weights:
    the export (and the bench) take ``best_checkpoint``."""
    final = summary.get("final_val", {}).get(SIM_TAU)
    best = summary.get("best_sim_tau")
    if final is None or (best is not None and final < best):
        return
    path = run_dir / FINAL_CHECKPOINT.format(step=summary["global_step"])
    save(path)
    log.info("final weights (simulated tau %.4f, best validation %s) are the best: %s", final, best, path)
    summary["best_sim_tau"], summary["best_checkpoint"] = final, str(path)


def fit_resuming_safely(
    trainer: L.Trainer, module: DraftHeadModule, datamodule: FeatureDataModule, resume_from: str | None
) -> None:
    """``trainer.fit``, resuming from ``resume_from`` with ``weights_only=True`` pinned: left
    unset, torch takes it from the environment (``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``), and a
    ``last.ckpt`` dropped into a run dir would run its code. One that holds anything but tensors
    and plain data is refused in one line, never with torch's advice to load it unsafely."""
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=resume_from, weights_only=True)
    except pickle.UnpicklingError:
        if resume_from is None:
            raise
        raise RunDirError(
            f"{resume_from}: not a specdraft checkpoint (it holds objects other than tensors and "
            "plain data); refused to resume from it, nothing of it was run"
        ) from None


def run_summary(trainer: L.Trainer, module: DraftHeadModule, seconds: float, resumed: str | None) -> dict:
    best = next((c for c in trainer.checkpoint_callbacks if c.monitor == SIM_TAU), None)
    throughput = next((c for c in trainer.callbacks if isinstance(c, ThroughputMonitor)), None)
    deadline = next((c for c in trainer.callbacks if isinstance(c, TrainingDeadline)), None)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    summary = {
        "kind": module.head_record.get("kind"),
        "global_step": trainer.global_step,
        "resumed_from": resumed,
        "best_sim_tau": float(best.best_model_score) if best and best.best_model_score is not None else None,
        "best_checkpoint": best.best_model_path if best else None,
        "last_val": metrics,
        "tokens_seen": module.tokens_seen,
        "fit_seconds": seconds,
        "train_tokens_per_s": throughput.tokens_per_second if throughput else None,
        "peak_memory_gb": peak_memory_bytes(module.device) / 2**30,
        "trainable_parameters": count(module.head),
        "precision": str(trainer.precision),
    }
    if deadline is not None:
        summary["deadline"] = deadline.record()
    return summary


if __name__ == "__main__":
    main()
