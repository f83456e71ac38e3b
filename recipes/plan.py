"""The quickstart's plan, made once and kept: ``<dir>/plan-<run>.json``.

A fresh quickstart probes this machine (:mod:`specdraft.recipes.probe`, each stage's config
composed as the stage composes it), sizes its stages to the budget (:mod:`specdraft.recipes.budget`)
and stores the plan with the request it was made for. A re-run with the same request resumes that
plan, so its data, features and training run keep the sizes they were started with; a re-run with
another request is refused, naming what differs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from hydra import compose
from omegaconf import DictConfig, OmegaConf

from specdraft.data.cache import StoredFields
from specdraft.eval.bench import WARMUP_QUESTIONS
from specdraft.recipes.budget import (
    SECONDS_PER_MINUTE,
    BudgetError,
    BudgetRules,
    Plan,
    TrainShape,
    clock,
    eval_seconds,
    make_plan,
)
from specdraft.recipes.probe import ProbeSettings, Throughput, probe
from specdraft.recipes.stages import (
    MT_BENCH_CATEGORIES,
    captures_features,
    common_overrides,
    regen_overrides,
    run_name,
)
from specdraft.system.files import write_json_atomic

# What a stored plan was made for: a re-run with any of these changed would need other sizes.
PLAN_KEYS = ("budget_minutes", "conversations", "train_steps", "self_distill", "capture_features",
             "experiment", "budget", "heldout_fraction", "regen", "top_k", "aux_layers")  # fmt: skip
# overrides.train may not set them
PLANNED_TRAIN_KEYS = (
    "trainer.max_steps", "trainer.max_time", "trainer.val_check_interval", "callbacks.deadline"
)  # fmt: skip


def load_or_make_plan(cfg: DictConfig) -> tuple[Plan, Throughput, bool]:
    """The plan stored for this quickstart (a re-run resumes it), else a fresh probe and plan;
    and whether the plan was made now."""
    refuse_planned_train_keys(cfg)
    path, request = plan_path(cfg), plan_request(cfg)
    if path.is_file():
        return (*resume_plan(path, request), False)

    print("quickstart: probing this machine (a few seconds of each stage's work)…", flush=True)
    train_cfg = compose(
        "train",
        [
            f"experiment={cfg.experiment}",
            "datamodule.train_cache=probe",
            "datamodule.val_cache=probe",
            *common_overrides(cfg),
            *cfg.overrides.train,
        ],
    )
    trees = eval_trees(cfg) if cfg.eval.max_minutes is None else []
    throughput = probe_stages(cfg, train_cfg, trees)
    plan = size_stages(cfg, throughput, trees, train_cfg.trainer.limit_val_batches)
    record: dict[str, Any] = {
        "request": request,
        "made": time.strftime("%Y-%m-%d %H:%M:%S"),
        "plan": plan.record(),
        "throughput": throughput.record(),
    }
    write_json_atomic(path, record)
    return plan, throughput, True


def refuse_planned_train_keys(cfg: DictConfig) -> None:
    """The plan sets training's length and validations: ``overrides.train`` may not."""
    for key in PLANNED_TRAIN_KEYS:
        if any(o.split("=", 1)[0].lstrip("+~") == key for o in cfg.overrides.train):
            raise SystemExit(
                f"quickstart: overrides.train sets {key}, which the plan sets (with a max_time guard "
                "from its ETA, and budget.validations spaced over the run): pass train_steps=N or "
                "budget.validations=N instead"
            )


def plan_request(cfg: DictConfig) -> dict[str, Any]:
    """What the plan is made for (:data:`PLAN_KEYS`, the eval's box, the stages' overrides), as
    it reads back from JSON."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    request = {key: resolved[key] for key in PLAN_KEYS if key != "regen" or cfg.self_distill}
    request["eval_max_minutes"] = resolved["eval"]["max_minutes"]
    request["overrides"] = {k: resolved["overrides"][k] for k in ("regen", "cache", "train")}
    return json.loads(json.dumps(request))


def resume_plan(path: Path, request: dict[str, Any]) -> tuple[Plan, Throughput]:
    """The plan and throughput stored at ``path``, if they were made for ``request``."""
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
    return Plan(**{k: v for k, v in plan.items() if k != "total_s"}), Throughput(**stored["throughput"])


def probe_stages(cfg: DictConfig, train_cfg: DictConfig, trees: list[tuple[int, int]]) -> Throughput:
    """Probe this machine on the stages' own configs: regeneration's (self-distilled) or the
    cache's conversation source, the cache's, ``train_cfg``, and the eval's ``trees``."""
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
    settings = ProbeSettings(**cfg.budget.probe)
    fields = StoredFields(tuple(cache_cfg.target.aux_layer_ids or ()) if cfg.aux_layers else (), cfg.top_k)
    answer_tokens = int(cfg.budget.answer_tokens) if cfg.self_distill else None
    return probe(
        data_cfg, train_cfg, fields, cache_cfg.batch_tokens, settings, regen_cfg, answer_tokens,
        sorted({nodes for _, nodes in trees}),
    )  # fmt: skip


def size_stages(
    cfg: DictConfig, throughput: Throughput, trees: list[tuple[int, int]], limit_val_batches: int | float
) -> Plan:
    """The plan for ``cfg``'s budget at the probed rates (a budget too small: one clear message)."""
    rules = BudgetRules(**{k: v for k, v in cfg.budget.items() if k not in ("probe", "validations")})
    eval_minutes = eval_box_minutes(cfg, throughput, rules, trees)
    try:
        shape = TrainShape(cfg.heldout_fraction, cfg.budget.validations, limit_val_batches)
        return make_plan(
            cfg.budget_minutes, throughput, rules, shape, cfg.self_distill,
            cfg.conversations, cfg.train_steps, eval_minutes, captures_features(cfg),
        )  # fmt: skip
    except (BudgetError, ValueError) as error:
        raise SystemExit(f"quickstart: {error}") from None


def eval_box_minutes(
    cfg: DictConfig, throughput: Throughput, rules: BudgetRules, trees: list[tuple[int, int]]
) -> float | None:
    """The eval's time box in minutes: the quickstart's ``max_minutes`` for its eval when set, else
    what this machine's decoding of ``trees`` needs, within [eval_min_minutes, eval_share × budget]
    (None when the eval was not probed)."""
    eval_minutes = cfg.eval.max_minutes
    # the bench's warm-up answers within its box too
    turns = MT_BENCH_CATEGORIES * cfg.eval.per_category * cfg.eval.max_turns + WARMUP_QUESTIONS
    estimate_s = eval_seconds(throughput, rules, trees, turns, cfg.eval.max_new_tokens)
    if eval_minutes is None and estimate_s is not None:
        needed = max(rules.eval_min_minutes, estimate_s / SECONDS_PER_MINUTE)
        eval_minutes = round(min(rules.eval_share * cfg.budget_minutes, needed), 2)
    return eval_minutes


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
