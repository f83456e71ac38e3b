"""``specdraft-quickstart``: a trained draft head for the bundled SmolLM2, end to end, in a time
budget (Hydra).

    specdraft-quickstart                      # 45 minutes on this machine; `make run` runs it
    specdraft-quickstart budget_minutes=120   # more answers, more steps
    specdraft-quickstart self_distill=false   # the original ShareGPT answers instead of the target's

First a probe times a few seconds of each stage's own work on this machine, and the plan sizes
the stages to fit ``budget_minutes`` (recipes/budget.py); it is printed with an ETA per stage and
written to ``<dir>/plan-<run>.json``, which a re-run reuses. Then the stages, each one of the
specdraft commands run as a subprocess (so each is exactly what a user would type, and each
resumes on its own: re-running the quickstart skips finished work):

1. ``specdraft-regen``  — the target's own greedy answers to the first user turn of the planned
   number of ShareGPT prompts (self-distillation; skipped with ``self_distill=false``), and the
   target features (+ top-k) of prompt and answer captured as it answers, train and held-out;
2. ``specdraft-cache``  — the features computed afresh (``capture_features=false`` or
   ``self_distill=false``), train and held-out;
3. ``specdraft-train experiment=quickstart`` — the head, on the cached features, the planned steps
   (sized ones end at the plan's deadline: resized as training measures its own pace);
4. ``specdraft-export format=native`` — the head as ``<dir>/head``;
5. ``specdraft-eval``   — τ, acceptance per depth and speedup on MT-bench questions, time-boxed.

The stage timings of this invocation go to ``<dir>/timings-<run>.json`` beside the plan's ETAs;
the last lines printed say where the head and the report are.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
from hydra import compose
from omegaconf import DictConfig, OmegaConf

from specdraft.data.cache import StoredFields
from specdraft.recipes.budget import (
    SECONDS_PER_MINUTE,
    BudgetError,
    BudgetRules,
    Plan,
    ProbeSettings,
    Throughput,
    TrainShape,
    clock,
    describe,
    eval_seconds,
    make_plan,
    probe,
    retime_training,
)
from specdraft.system.errors import user_errors
from specdraft.system.files import write_json_atomic
from specdraft.system.hardware import start
from specdraft.train.callbacks import TrainingDeadline

# What a stored plan was made for: a re-run with any of these changed would need other sizes.
PLAN_KEYS = ("budget_minutes", "conversations", "train_steps", "self_distill", "capture_features",
             "experiment", "budget", "heldout_fraction", "regen", "top_k", "aux_layers")  # fmt: skip


# overrides.train may not set them
PLANNED_TRAIN_KEYS = (
    "trainer.max_steps", "trainer.max_time", "trainer.val_check_interval", "callbacks.deadline"
)  # fmt: skip
TRAIN_TIME_GUARD = 1.25  # training's max_time, × its ETA
# MT-bench's categories: the fallback prompts (without Spec-Bench) take as many questions as
# per_category × this, so the eval's size does not depend on which prompts are at hand.
MT_BENCH_CATEGORIES = 8


@dataclass(frozen=True)
class Stage:
    name: str
    command: str  # a specdraft console script, e.g. "specdraft-regen"
    overrides: list[str]


def stages(cfg: DictConfig, plan: Plan) -> list[Stage]:
    """The quickstart's commands, in order, with the plan's sizes."""
    out = Path(cfg.dir)
    common = common_overrides(cfg)
    conversations = plan.conversations
    captured = captures_features(cfg)
    # Answers alone are shared by quickstarts (regen.dir); answers with their features belong to this one.
    regen_path = Path(cfg.regen.dir) / f"quickstart-train-{conversations}.jsonl"
    if captured:
        regen_path = out / f"regen-{conversations}.jsonl"
    if cfg.self_distill:
        data = [
            "data=jsonl",
            f"data.source.path={regen_path}",
            f"data.heldout_fraction={cfg.heldout_fraction}",
            f"data.split_seed={cfg.split_seed}",
        ]
    else:
        data = [f"data.source.limit={conversations}", f"data.heldout_fraction={cfg.heldout_fraction}"]
    source = f"{'regen' if cfg.self_distill else 'sharegpt'}-{conversations}{'-captured' if captured else ''}"
    features = {split: out / "features" / source / split for split in ("train", "heldout")}
    plan_stages = []
    if cfg.self_distill:
        features_dir = out / "features" / source if captured else None
        plan_stages.append(
            Stage(
                "regen",
                "specdraft-regen",
                [f"limit={conversations}", *regen_overrides(cfg, regen_path, features_dir), *common],
            )
        )
    for split in () if captured else ("train", "heldout"):
        plan_stages.append(
            Stage(
                f"cache {split}",
                "specdraft-cache",
                [
                    *data,
                    f"split={split}",
                    f"top_k={cfg.top_k}",
                    f"aux_layers={cfg.aux_layers}",
                    f"out_dir={features[split]}",
                    *common,
                    *cfg.overrides.cache,
                ],
            )
        )
    run = run_name(cfg)
    # Sized steps end at the plan's deadline: the run resizes them (and the lr decay) by the pace
    # it measures, which drifts from the probe's. Beyond that a guard: should a step hang or the
    # machine slow down at the very end, training stops (with a checkpoint) near its ETA.
    max_time = TRAIN_TIME_GUARD * plan.eta_s["train"]
    deadline = []
    if cfg.train_steps is None and plan.train_fit_s is not None:
        minutes = plan.train_fit_s / SECONDS_PER_MINUTE
        target = f"{TrainingDeadline.__module__}.{TrainingDeadline.__qualname__}"
        deadline = [f"callbacks.deadline={{_target_:{target},minutes:{minutes:.3f}}}"]
    plan_stages.append(
        Stage(
            "train",
            "specdraft-train",
            [
                f"experiment={cfg.experiment}",
                f"run_name={run}",
                f"datamodule.train_cache={features['train']}",
                f"datamodule.val_cache={features['heldout']}",
                f"trainer.max_steps={plan.train_steps}",
                f"trainer.max_time={lightning_duration(max_time)}",
                f"trainer.val_check_interval={plan.val_check_interval}",
                *deadline,
                *common,
                *cfg.overrides.train,
            ],
        )
    )
    head_dir = out / ("head" if cfg.self_distill else "head-sharegpt")
    plan_stages.append(
        Stage(
            "export",
            "specdraft-export",
            [
                f"checkpoint={Path(cfg.paths.log_dir) / 'train' / run}",
                "format=native",
                f"out={head_dir}",
                "overwrite=true",
                f"paths.log_dir={cfg.paths.log_dir}",
                *cfg.overrides.export,
            ],
        )
    )
    if Path(cfg.eval.mt_bench).is_file():
        prompts = ["prompts=mt_bench", f"prompts.path={cfg.eval.mt_bench}"]
        prompts += [
            f"prompts.per_category={cfg.eval.per_category}",
            f"prompts.max_turns={cfg.eval.max_turns}",
        ]
    else:
        prompts = [
            f"prompts={cfg.eval.fallback_prompts}",
            f"prompts.limit={MT_BENCH_CATEGORIES * cfg.eval.per_category}",
            f"prompts.max_turns={cfg.eval.max_turns}",
        ]
    plan_stages.append(
        Stage(
            "eval",
            "specdraft-eval",
            [
                f"checkpoint={head_dir}",
                "methods=quickstart",
                f"run_name={run}",
                *prompts,
                f"max_new_tokens={cfg.eval.max_new_tokens}",
                f"temperatures=[{','.join(str(t) for t in cfg.eval.temperatures)}]",
                f"max_minutes={plan.eval_minutes:.2f}",
                *common,
                *cfg.overrides.eval,
            ],
        )
    )
    return plan_stages


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


@hydra.main(version_base="1.3", config_path="pkg://specdraft.conf", config_name="quickstart")
@user_errors("specdraft-quickstart")
def main(cfg: DictConfig) -> None:
    hardware = start("specdraft-quickstart", cfg.threads).hardware
    if not Path(cfg.eval.mt_bench).is_file():
        print(
            f"quickstart: no MT-bench file at {cfg.eval.mt_bench} (set SPECDRAFT_SPEC_BENCH): "
            "evaluating on held-out ShareGPT prompts instead",
            flush=True,
        )
    started = time.perf_counter()
    plan, throughput, planned_now = load_or_make_plan(cfg)
    timings: dict[str, float] = {"probe": round(time.perf_counter() - started, 1)}
    eval_what = (
        f"{MT_BENCH_CATEGORIES * cfg.eval.per_category} first turns, {cfg.eval.max_new_tokens} new tokens, "
        "stops when the next question would not fit"
    )
    print(describe(plan, throughput, hardware.name, eval_what, cfg.self_distill), flush=True)
    if cfg.plan_only:
        return
    plan, plan_stages = run_stages(cfg, plan, throughput, planned_now, timings, started)
    timings["total"] = round(time.perf_counter() - started, 1)
    out = Path(cfg.dir)
    timings_path = out / f"timings-{run_name(cfg)}.json"
    write_json_atomic(timings_path, {**timings, "eta": plan.eta_s, "budget_minutes": plan.budget_minutes})
    print_summary(plan_stages[-1], timings_path, timings, plan)


def run_stages(
    cfg: DictConfig,
    plan: Plan,
    throughput: Throughput,
    planned_now: bool,
    timings: dict[str, float],
    started: float,
    run: Callable[..., subprocess.CompletedProcess] = subprocess.run,
) -> tuple[Plan, list[Stage]]:
    """Run the plan's stages in order (``run``: how a command is run), recording each one's
    seconds in ``timings``. Returns the plan as run and its stages: when the plan was made in
    this process and its steps were sized, the training is resized by what the stages before it
    saved or overran (:func:`retime_training`)."""
    plan_stages = stages(cfg, plan)
    for number, stage in enumerate(plan_stages, start=1):
        if stage.name == "train" and planned_now and cfg.train_steps is None:
            # Every stage before training ran in this process: what they saved (or overran)
            # against their ETAs resizes the training, once; the plan file keeps it for a resume.
            ahead_s = sum(plan.eta_s[name] - timings[name] for name in timings if name != "probe")
            plan = retime_training(
                plan, throughput, ahead_s, cfg.budget.validations, cfg.budget.min_train_steps
            )
            record_retimed_plan(cfg, plan, ahead_s)
            stage = next(s for s in stages(cfg, plan) if s.name == "train")
            plan_stages[number - 1] = stage
        elapsed = time.perf_counter() - started
        print(
            f"\n=== quickstart [{number}/{len(plan_stages)}] {stage.name}  (elapsed {clock(elapsed)}; "
            f"ETA ~{clock(plan.eta_s[stage.name])}) ===",
            flush=True,
        )
        argv = [console_script(stage.command), *stage.overrides]
        print("$ " + " ".join(argv), flush=True)
        stage_started = time.perf_counter()
        result = run(argv, check=False)
        timings[stage.name] = round(time.perf_counter() - stage_started, 1)
        if result.returncode != 0:
            raise SystemExit(
                f"quickstart: stage {stage.name!r} failed (exit {result.returncode}); "
                "fix the cause and re-run: finished work and the plan are kept"
            )
    return plan, plan_stages


def load_or_make_plan(cfg: DictConfig) -> tuple[Plan, Throughput, bool]:
    """The plan stored for this quickstart (a re-run resumes it), else a fresh probe and plan;
    and whether the plan was made now."""
    for key in PLANNED_TRAIN_KEYS:
        if any(o.split("=", 1)[0].lstrip("+~") == key for o in cfg.overrides.train):
            raise SystemExit(
                f"quickstart: overrides.train sets {key}, which the plan sets (with a max_time guard "
                "from its ETA, and budget.validations spaced over the run): pass train_steps=N or "
                "budget.validations=N instead"
            )
    path = plan_path(cfg)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    request = {key: resolved[key] for key in PLAN_KEYS if key != "regen" or cfg.self_distill}
    request["eval_max_minutes"] = resolved["eval"]["max_minutes"]
    request["overrides"] = {k: resolved["overrides"][k] for k in ("regen", "cache", "train")}
    request = json.loads(json.dumps(request))
    if path.is_file():
        stored = json.loads(path.read_text())
        if stored.get("request") != request:
            changed = sorted(k for k in request if stored.get("request", {}).get(k) != request[k])
            raise SystemExit(
                f"quickstart: {path} holds the plan this quickstart was started with, and {changed} "
                "differ now: its data, features and training run were sized by that plan. Re-run "
                "with the same settings to resume it, or pass name=<new name> to start another "
                f"quickstart (or, if no stage ran yet, as after plan_only=true, delete {path})"
            )
        plan = stored["plan"]
        print(f"quickstart: resuming the plan in {path} (probed {stored['made']})", flush=True)
        return (
            Plan(**{k: v for k, v in plan.items() if k != "total_s"}),
            Throughput(**stored["throughput"]),
            False,
        )

    print("quickstart: probing this machine (a few seconds of each stage's work)…", flush=True)
    overrides = common_overrides(cfg)
    regen_cfg = None
    if cfg.self_distill:
        # (the probe writes neither file: the paths only make the config the stage's)
        probe_features = Path(cfg.dir) / "features" / "probe" if captures_features(cfg) else None
        probe_overrides = regen_overrides(cfg, Path(cfg.regen.dir) / "probe.jsonl", probe_features)
        regen_cfg = compose("regen", [*probe_overrides, *overrides])
        data_cfg = regen_cfg
    else:
        data_cfg = compose(
            "cache", [f"data.heldout_fraction={cfg.heldout_fraction}", *overrides, *cfg.overrides.cache]
        )
    cache_cfg = compose("cache", [*overrides, *cfg.overrides.cache])
    train_cfg = compose(
        "train",
        [
            f"experiment={cfg.experiment}",
            "datamodule.train_cache=probe",
            "datamodule.val_cache=probe",
            *overrides,
            *cfg.overrides.train,
        ],
    )
    settings = ProbeSettings(**cfg.budget.probe)
    fields = StoredFields(tuple(cache_cfg.target.aux_layer_ids or ()) if cfg.aux_layers else (), cfg.top_k)
    answer_tokens = int(cfg.budget.answer_tokens) if cfg.self_distill else None
    trees = eval_trees(cfg) if cfg.eval.max_minutes is None else []
    throughput = probe(
        data_cfg, train_cfg, fields, cache_cfg.batch_tokens, settings, regen_cfg, answer_tokens,
        sorted({nodes for _, nodes in trees}),
    )  # fmt: skip
    rules = BudgetRules(**{k: v for k, v in cfg.budget.items() if k not in ("probe", "validations")})
    eval_minutes = cfg.eval.max_minutes
    turns = MT_BENCH_CATEGORIES * cfg.eval.per_category * cfg.eval.max_turns
    estimate_s = eval_seconds(throughput, rules, trees, turns, cfg.eval.max_new_tokens)
    if eval_minutes is None and estimate_s is not None:
        # The box this machine's decoding needs, within [eval_min_minutes, eval_share × budget].
        needed = max(rules.eval_min_minutes, estimate_s / SECONDS_PER_MINUTE)
        eval_minutes = round(min(rules.eval_share * cfg.budget_minutes, needed), 2)
    try:
        shape = TrainShape(cfg.heldout_fraction, cfg.budget.validations, train_cfg.trainer.limit_val_batches)
        plan = make_plan(
            cfg.budget_minutes, throughput, rules, shape, cfg.self_distill,
            cfg.conversations, cfg.train_steps, eval_minutes, captures_features(cfg),
        )  # fmt: skip
    except (BudgetError, ValueError) as error:
        raise SystemExit(f"quickstart: {error}") from None
    record: dict[str, Any] = {
        "request": request,
        "made": time.strftime("%Y-%m-%d %H:%M:%S"),
        "plan": plan.record(),
        "throughput": throughput.record(),
    }
    write_json_atomic(path, record)
    return plan, throughput, True


def plan_path(cfg: DictConfig) -> Path:
    return Path(cfg.dir) / f"plan-{run_name(cfg)}.json"


def record_retimed_plan(cfg: DictConfig, plan: Plan, ahead_s: float) -> None:
    """Store the plan as training was resized (a resumed quickstart trains the same run), with
    the seconds the stages before it finished ahead of their ETAs."""
    path = plan_path(cfg)
    record = json.loads(path.read_text())
    before = record["plan"]["train_steps"]
    record["retimed"] = {"ahead_s": round(ahead_s, 1), "planned_train_steps": before}
    record["plan"] = plan.record()
    write_json_atomic(path, record)
    print(
        f"quickstart: the stages before training finished {clock(abs(ahead_s))} "
        f"{'ahead of' if ahead_s >= 0 else 'behind'} their ETAs: training {before:,} → "
        f"{plan.train_steps:,} steps (ETA {clock(plan.eta_s['train'])})",
        flush=True,
    )


def eval_trees(cfg: DictConfig) -> list[tuple[int, int]]:
    """(depth, nodes) of every draft tree the eval stage decodes with (its methods composed as
    the stage composes them): what the probe times and the eval's box is sized by."""
    eval_cfg = compose("eval", ["methods=quickstart", "checkpoint=probe", *cfg.overrides.eval])
    trees = []
    for name, method in eval_cfg.methods.items():
        shape = method.get("shape")
        if shape is None:
            continue
        if shape.kind == "dynamic":
            trees.append((int(shape.depth), int(shape.total_tokens)))
        elif shape.kind == "chain":
            trees.append((int(shape.depth), int(shape.depth) + 1))
        else:
            raise SystemExit(
                f"quickstart: eval method {name!r} drafts a {shape.kind!r} shape, which the eval's "
                "time box cannot be sized for: set eval.max_minutes"
            )
    return trees


def console_script(name: str) -> str:
    """The specdraft command installed next to this Python (the same venv), else on PATH."""
    sibling = Path(sys.executable).parent / name
    if sibling.is_file():
        return str(sibling)
    found = shutil.which(name)
    if found is None:
        raise SystemExit(f"quickstart: {name} is not installed next to {sys.executable} nor on PATH")
    return found


def run_name(cfg: DictConfig) -> str:
    """The training / benchmark run name: ``name``, suffixed when not self-distilled so the two
    data sources never resume each other's run."""
    return cfg.name if cfg.self_distill else f"{cfg.name}-sharegpt"


def prompt_set(eval_overrides: dict[str, str]) -> str:
    """Which prompts the eval stage read, for the closing summary: τ on held-out ShareGPT (the
    self-distilled head's own distribution) is not comparable with τ on MT-bench."""
    turns = eval_overrides["prompts.max_turns"]
    turns = "their first turns" if turns == "1" else f"up to {turns} turns each"
    if eval_overrides["prompts"] == "mt_bench":
        return f"MT-bench ({eval_overrides['prompts.path']}), {turns}"
    return (
        f"{eval_overrides['prompts']} prompts, {turns}: no MT-bench file was found "
        "(set SPECDRAFT_SPEC_BENCH); τ there is not comparable with MT-bench's"
    )


def print_summary(eval_stage: Stage, timings_path: Path, timings: dict[str, float], plan: Plan) -> None:
    """The time each stage took against its ETA; τ, acceptance per depth and speedup of the head
    at each temperature; and where things are."""
    overrides = dict(o.split("=", 1) for o in eval_stage.overrides if "=" in o)
    report_dir = Path(overrides["paths.log_dir"]) / "bench" / overrides["run_name"]
    report = json.loads((report_dir / "report.json").read_text())
    print(
        f"\n=== quickstart done in {clock(timings['total'])} (budget {clock(60 * plan.budget_minutes)}) ==="
    )
    print(
        "  ".join(
            f"{name} {clock(seconds)} (ETA {clock(plan.eta_s[name])})"
            for name, seconds in timings.items()
            if name in plan.eta_s
        )
    )
    left = report.get("time_box", {}).get("units_left", 0)
    print(f"evaluated on {prompt_set(overrides)}")
    for temperature, methods in report["results"].items():
        for method, entry in methods.items():
            if method == "plain":
                continue
            overall = entry["overall"]
            plain_rate = methods["plain"]["overall"]["tokens_per_s"]
            alphas = ", ".join(f"{a:.2f}" for a in overall.get("acceptance_per_depth") or [] if a is not None)
            print(
                f"{temperature} {method} ({overall['turns']} turns): tau {overall['tau']:.2f}, "
                f"acceptance per depth [{alphas}], "
                f"speedup {overall['speedup']:.2f}x over plain decoding "
                f"({overall['tokens_per_s']:.1f} vs {plain_rate:.1f} tokens/s)"
            )
    if left:
        print(f"the eval's time box ({plan.eval_minutes:.1f} min) left {left} of its questions undone")
    print(f"head (native export): {overrides['checkpoint']}")
    print(
        f"report: {report_dir / 'report.json'}, {report_dir / 'acceptance_per_depth.png'}, "
        f"{report_dir / 'speedup.png'}"
    )
    print(f"stage timings: {timings_path}")


if __name__ == "__main__":
    main()
