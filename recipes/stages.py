"""The quickstart's stages: each one a specdraft command with the overrides that size it by the plan
and chain it to the stage before (what one writes, the next reads).

1. ``specdraft-regen``  — the target's own greedy answers to the first user turn of the planned
   number of ShareGPT prompts (self-distillation; skipped with ``self_distill=false``), and the
   target features (+ top-k) of prompt and answer captured as it answers, train and held-out;
2. ``specdraft-cache``  — the features computed afresh (``capture_features=false`` or
   ``self_distill=false``), train and held-out;
3. ``specdraft-train experiment=quickstart`` — the head, on the cached features, the planned steps
   (sized ones end at the plan's deadline: resized as training measures its own pace);
4. ``specdraft-export format=native`` — the head as ``<dir>/head``;
5. ``specdraft-eval``   — τ, acceptance per depth and speedup on MT-bench questions, time-boxed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from specdraft.recipes.budget import SECONDS_PER_MINUTE, Plan
from specdraft.train.callbacks import TrainingDeadline

TRAIN_TIME_GUARD = 1.25  # training's max_time, × its ETA
# MT-bench's categories: the fallback prompts (without Spec-Bench) take as many questions as
# per_category × this, so the eval's size does not depend on which prompts are at hand.
MT_BENCH_CATEGORIES = 8


@dataclass(frozen=True)
class Stage:
    name: str
    command: str  # a specdraft console script, e.g. "specdraft-regen"
    overrides: list[str]


@dataclass(frozen=True)
class StagePaths:
    """Where the stages write what the next ones read: the regenerated ``answers`` (JSONL), the
    ``features`` caches (``<features>/train`` and ``<features>/heldout``), the exported ``head``."""

    answers: Path
    features: Path
    head: Path

    @classmethod
    def of(cls, cfg: DictConfig, conversations: int) -> StagePaths:
        out = Path(cfg.dir)
        captured = captures_features(cfg)
        # Answers alone are shared by quickstarts (regen.dir); answers with their features belong
        # to this one.
        answers = Path(cfg.regen.dir) / f"quickstart-train-{conversations}.jsonl"
        if captured:
            answers = out / f"regen-{conversations}.jsonl"
        source = f"{'regen' if cfg.self_distill else 'sharegpt'}-{conversations}"
        features = out / "features" / (source + ("-captured" if captured else ""))
        return cls(answers, features, out / ("head" if cfg.self_distill else "head-sharegpt"))


def stages(cfg: DictConfig, plan: Plan) -> list[Stage]:
    """The quickstart's commands, in order, with the plan's sizes."""
    paths = StagePaths.of(cfg, plan.conversations)
    plan_stages = []
    if cfg.self_distill:
        plan_stages.append(regen_stage(cfg, plan, paths))
    if not captures_features(cfg):
        plan_stages += [cache_stage(cfg, plan, paths, split) for split in ("train", "heldout")]
    plan_stages += [train_stage(cfg, plan, paths), export_stage(cfg, paths), eval_stage(cfg, plan, paths)]
    return plan_stages


def regen_stage(cfg: DictConfig, plan: Plan, paths: StagePaths) -> Stage:
    features_dir = paths.features if captures_features(cfg) else None
    return Stage(
        "regen",
        "specdraft-regen",
        [
            f"limit={plan.conversations}",
            *regen_overrides(cfg, paths.answers, features_dir),
            *common_overrides(cfg),
        ],
    )


def cache_stage(cfg: DictConfig, plan: Plan, paths: StagePaths, split: str) -> Stage:
    """specdraft-cache over ``split`` of the regenerated answers (or of ShareGPT's own)."""
    if cfg.self_distill:
        data = [
            "data=jsonl",
            f"data.source.path={paths.answers}",
            f"data.heldout_fraction={cfg.heldout_fraction}",
            f"data.split_seed={cfg.split_seed}",
        ]
    else:
        data = [f"data.source.limit={plan.conversations}", f"data.heldout_fraction={cfg.heldout_fraction}"]
    return Stage(
        f"cache {split}",
        "specdraft-cache",
        [
            *data,
            f"split={split}",
            f"top_k={cfg.top_k}",
            f"aux_layers={cfg.aux_layers}",
            f"out_dir={paths.features / split}",
            *common_overrides(cfg),
            *cfg.overrides.cache,
        ],
    )


def train_stage(cfg: DictConfig, plan: Plan, paths: StagePaths) -> Stage:
    # Sized steps end at the plan's deadline: the run resizes them (and the lr decay) by the pace
    # it measures, which drifts from the probe's. Beyond that a guard: should a step hang or the
    # machine slow down at the very end, training stops (with a checkpoint) near its ETA.
    max_time = TRAIN_TIME_GUARD * plan.eta_s["train"]
    deadline = []
    if cfg.train_steps is None and plan.train_fit_s is not None:
        minutes = plan.train_fit_s / SECONDS_PER_MINUTE
        target = f"{TrainingDeadline.__module__}.{TrainingDeadline.__qualname__}"
        deadline = [f"callbacks.deadline={{_target_:{target},minutes:{minutes:.3f}}}"]
    return Stage(
        "train",
        "specdraft-train",
        [
            f"experiment={cfg.experiment}",
            f"run_name={run_name(cfg)}",
            f"datamodule.train_cache={paths.features / 'train'}",
            f"datamodule.val_cache={paths.features / 'heldout'}",
            f"trainer.max_steps={plan.train_steps}",
            f"trainer.max_time={lightning_duration(max_time)}",
            f"trainer.val_check_interval={plan.val_check_interval}",
            *deadline,
            *common_overrides(cfg),
            *cfg.overrides.train,
        ],
    )


def export_stage(cfg: DictConfig, paths: StagePaths) -> Stage:
    return Stage(
        "export",
        "specdraft-export",
        [
            f"checkpoint={Path(cfg.paths.log_dir) / 'train' / run_name(cfg)}",
            "format=native",
            f"out={paths.head}",
            "overwrite=true",
            f"paths.log_dir={cfg.paths.log_dir}",
            *cfg.overrides.export,
        ],
    )


def eval_stage(cfg: DictConfig, plan: Plan, paths: StagePaths) -> Stage:
    return Stage(
        "eval",
        "specdraft-eval",
        [
            f"checkpoint={paths.head}",
            "methods=quickstart",
            f"run_name={run_name(cfg)}",
            *eval_prompts(cfg),
            f"max_new_tokens={cfg.eval.max_new_tokens}",
            f"temperatures=[{','.join(str(t) for t in cfg.eval.temperatures)}]",
            f"max_minutes={plan.eval_minutes:.2f}",
            *common_overrides(cfg),
            *cfg.overrides.eval,
        ],
    )


def eval_prompts(cfg: DictConfig) -> list[str]:
    """MT-bench's questions where its file is at hand, else as many held-out ShareGPT prompts."""
    if Path(cfg.eval.mt_bench).is_file():
        return [
            "prompts=mt_bench",
            f"prompts.path={cfg.eval.mt_bench}",
            f"prompts.per_category={cfg.eval.per_category}",
            f"prompts.max_turns={cfg.eval.max_turns}",
        ]
    return [
        f"prompts={cfg.eval.fallback_prompts}",
        f"prompts.limit={MT_BENCH_CATEGORIES * cfg.eval.per_category}",
        f"prompts.max_turns={cfg.eval.max_turns}",
    ]


def common_overrides(cfg: DictConfig) -> list[str]:
    """What every stage (and the probe of it) is given: the outputs' root and the threads."""
    return [f"paths.log_dir={cfg.paths.log_dir}"] + ([f"threads={cfg.threads}"] if cfg.threads else [])


def captures_features(cfg: DictConfig) -> bool:
    """Whether regeneration captures the features as it answers (no cache stages)."""
    return bool(cfg.self_distill and cfg.capture_features)


def regen_overrides(cfg: DictConfig, out_path: Path, features_dir: Path | None) -> list[str]:
    """specdraft-regen's settings for the quickstart (the probe composes the same): with
    ``features_dir``, it captures the features the cache stages would compute."""
    features = []
    if features_dir is not None:
        features = [
            f"features.dir={features_dir}",
            f"features.aux_layers={cfg.aux_layers}",
            f"features.top_k={cfg.top_k}",
            f"features.heldout_fraction={cfg.heldout_fraction}",
            f"features.split_seed={cfg.split_seed}",
        ]
    return [
        "max_turns=1",
        f"generation.max_new_tokens={cfg.regen.max_new_tokens}",
        f"max_prompt_tokens={cfg.regen.max_prompt_tokens}",
        f"batch_size={cfg.regen.batch_size}",
        f"out_path={out_path}",
        *features,
        *cfg.overrides.regen,
    ]


def lightning_duration(seconds: float) -> str:
    """Lightning's ``max_time`` as DD:HH:MM:SS."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    return f"{days:02d}:{hours:02d}:{minutes:02d}:{secs:02d}"


def run_name(cfg: DictConfig) -> str:
    """The training / benchmark run name: ``name``, suffixed when not self-distilled so the two
    data sources never resume each other's run."""
    return cfg.name if cfg.self_distill else f"{cfg.name}-sharegpt"
