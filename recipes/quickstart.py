"""``specdraft-quickstart``: a trained draft head for the bundled SmolLM2, end to end, in a time
budget (Hydra).

    specdraft-quickstart                      # 45 minutes on this machine; `make run` runs it
    specdraft-quickstart budget_minutes=120   # more answers, more steps
    specdraft-quickstart self_distill=false   # the original ShareGPT answers instead of the target's

First a probe times a few seconds of each stage's own work on this machine (recipes/probe.py), and
the plan sizes the stages to fit ``budget_minutes`` (recipes/budget.py); it is printed with an ETA
per stage and written to ``<dir>/plan-<run>.json``, which a re-run reuses (recipes/plan.py). Then
the stages (recipes/stages.py: regenerate with feature capture → train → export → eval), each one
of the specdraft commands run as a subprocess (so each is exactly what a user would type, and each
resumes on its own: re-running the quickstart skips finished work). When training starts, what the
stages before it saved or overran against their ETAs resizes it, once.

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
from pathlib import Path

from omegaconf import DictConfig

from specdraft.data.settings import THREADS
from specdraft.recipes.budget import Plan, clock, describe, retime_training
from specdraft.recipes.plan import load_or_make_plan, record_retimed_plan
from specdraft.recipes.probe import Throughput
from specdraft.recipes.stages import MT_BENCH_CATEGORIES, Stage, run_name, stages
from specdraft.system.checks import (
    at_least,
    check_settings,
    each,
    either,
    greater_than,
    in_range,
    one_of,
    optional,
)
from specdraft.system.errors import hydra_command
from specdraft.system.files import write_json_atomic
from specdraft.system.hardware import start
from specdraft.system.names import check_path_component

# specdraft-quickstart settings (conf/quickstart.yaml), checked before the probe; each stage's own
# command checks the settings it is given again.
QUICKSTART_SETTINGS = {
    "budget_minutes": greater_than(0),
    "conversations": optional(at_least(1)),
    "train_steps": optional(at_least(1)),
    "budget.margin": in_range(0, 1, closed=(True, False)),
    "budget.eval_share": in_range(0, 1, closed=(True, False)),
    "budget.eval_tau": at_least(1, integer=False),
    "budget.eval_draft_per_depth": at_least(0, integer=False),
    "budget.eval_safety": at_least(1, integer=False),
    "budget.eval_min_minutes": greater_than(0),
    "budget.data_share": in_range(0, 1, closed=(False, False)),
    "budget.answer_tokens": greater_than(0),
    "budget.min_conversations": at_least(1),
    "budget.min_train_steps": at_least(1),
    "budget.validations": at_least(0),
    "budget.probe.regen_new_tokens": at_least(2),  # the first step is not timed
    "budget.probe.cache_tokens": at_least(1),
    "budget.probe.train_steps": at_least(3),  # timed start to start, the first is not timed
    "heldout_fraction": in_range(0, 1, closed=(False, False)),
    "regen.max_new_tokens": at_least(1),
    "regen.max_prompt_tokens": at_least(1),
    "regen.batch_size": either(one_of("auto"), at_least(1)),
    "top_k": at_least(0),
    "eval.per_category": at_least(1),
    "eval.max_turns": optional(at_least(1)),
    "eval.max_new_tokens": at_least(1),
    "eval.temperatures": each(at_least(0, integer=False)),
    "eval.max_minutes": optional(greater_than(0)),
    "threads": THREADS,
}


@hydra_command("specdraft-quickstart", "quickstart")
def main(cfg: DictConfig) -> None:
    check_path_component(cfg.name, "name")  # the stages' run names, before anything is written
    check_settings(cfg, QUICKSTART_SETTINGS)
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


def console_script(name: str) -> str:
    """The specdraft command installed next to this Python (the same venv), else on PATH."""
    sibling = Path(sys.executable).parent / name
    if sibling.is_file():
        return str(sibling)
    found = shutil.which(name)
    if found is None:
        raise SystemExit(f"quickstart: {name} is not installed next to {sys.executable} nor on PATH")
    return found


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
