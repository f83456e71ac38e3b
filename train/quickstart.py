"""``specdraft-quickstart``: a trained draft head for the bundled SmolLM2, end to end (Hydra).

    specdraft-quickstart                      # ~45 min on 2 CPU cores; `make run` runs it
    specdraft-quickstart self_distill=false   # the original ShareGPT answers instead of the target's

Stages, each one of the specdraft commands run as a subprocess (so each is exactly what a user
would type, and each resumes on its own: re-running the quickstart skips finished work):

1. ``specdraft-regen``  — the target's own greedy answers to the first user turn of
   ``conversations`` ShareGPT prompts (self-distillation; skipped with ``self_distill=false``);
2. ``specdraft-cache``  — target features (+ top-k) of those conversations, train and held-out;
3. ``specdraft-train experiment=quickstart`` — the head, on the cached features;
4. ``specdraft-export format=native`` — the head as ``<dir>/head``;
5. ``specdraft-eval``   — τ, acceptance per depth and speedup on MT-bench questions.

The stage timings of this invocation go to ``<dir>/timings-<run>.json``; the last lines printed say
where the head and the report are.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import hydra
from omegaconf import DictConfig

from specdraft.data.atomic import write_json_atomic
from specdraft.data.hardware import start


@dataclass(frozen=True)
class Stage:
    name: str
    command: str  # a specdraft console script, e.g. "specdraft-regen"
    overrides: list[str]


def stages(cfg: DictConfig) -> list[Stage]:
    """The quickstart's commands, in order."""
    out = Path(cfg.dir)
    common = [f"paths.log_dir={cfg.paths.log_dir}"] + ([f"threads={cfg.threads}"] if cfg.threads else [])
    if cfg.self_distill:
        regen_path = Path(cfg.regen.path)
        data = [
            "data=jsonl",
            f"data.source.path={regen_path}",
            f"data.heldout_fraction={cfg.heldout_fraction}",
            f"data.split_seed={cfg.split_seed}",
        ]
    else:
        data = [f"data.source.limit={cfg.conversations}", f"data.heldout_fraction={cfg.heldout_fraction}"]
    source = "regen" if cfg.self_distill else "sharegpt"
    features = {split: out / "features" / source / split for split in ("train", "heldout")}
    plan = []
    if cfg.self_distill:
        plan.append(
            Stage(
                "regen",
                "specdraft-regen",
                [
                    f"limit={cfg.conversations}",
                    "max_turns=1",
                    f"generation.max_new_tokens={cfg.regen.max_new_tokens}",
                    f"max_prompt_tokens={cfg.regen.max_prompt_tokens}",
                    f"batch_size={cfg.regen.batch_size}",
                    f"out_path={regen_path}",
                    *common,
                    *cfg.overrides.regen,
                ],
            )
        )
    for split in ("train", "heldout"):
        plan.append(
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
    plan.append(
        Stage(
            "train",
            "specdraft-train",
            [
                f"experiment={cfg.experiment}",
                f"run_name={run}",
                f"datamodule.train_cache={features['train']}",
                f"datamodule.val_cache={features['heldout']}",
                *common,
                *cfg.overrides.train,
            ],
        )
    )
    head_dir = out / ("head" if cfg.self_distill else "head-sharegpt")
    plan.append(
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
            f"prompts.limit={8 * cfg.eval.per_category}",
            f"prompts.max_turns={cfg.eval.max_turns}",
        ]
    plan.append(
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
                *common,
                *cfg.overrides.eval,
            ],
        )
    )
    return plan


@hydra.main(version_base="1.3", config_path="pkg://specdraft.conf", config_name="quickstart")
def main(cfg: DictConfig) -> None:
    hardware = start("specdraft-quickstart", cfg.threads).hardware
    # The expected minutes were measured on a 2-core CPU with native bf16; without it every stage
    # runs in fp32, several times slower (README, Set-up).
    where = "on this machine" if hardware.fast_bf16 else "on a 2-core AMX-bf16 CPU, longer here in fp32"
    plan = stages(cfg)
    if not Path(cfg.eval.mt_bench).is_file():
        print(
            f"quickstart: no MT-bench file at {cfg.eval.mt_bench} (set SPECDRAFT_SPEC_BENCH): "
            "evaluating on held-out ShareGPT prompts instead",
            flush=True,
        )
    timings: dict[str, float] = {}
    started = time.perf_counter()
    for number, stage in enumerate(plan, start=1):
        elapsed = time.perf_counter() - started
        print(
            f"\n=== quickstart [{number}/{len(plan)}] {stage.name}  (elapsed {clock(elapsed)}; "
            f"~{cfg.expected_minutes[stage.name.split()[0]]} min {where}) ===",
            flush=True,
        )
        argv = [console_script(stage.command), *stage.overrides]
        print("$ " + " ".join(argv), flush=True)
        stage_started = time.perf_counter()
        result = subprocess.run(argv, check=False)
        timings[stage.name] = round(time.perf_counter() - stage_started, 1)
        if result.returncode != 0:
            raise SystemExit(
                f"quickstart: stage {stage.name!r} failed (exit {result.returncode}); "
                "fix the cause and re-run: finished work is kept"
            )
    timings["total"] = round(time.perf_counter() - started, 1)
    out = Path(cfg.dir)
    timings_path = out / f"timings-{run_name(cfg)}.json"
    write_json_atomic(timings_path, timings)
    print_summary(plan[-1], timings_path, timings)


def console_script(name: str) -> str:
    """The specdraft command installed next to this Python (the same venv), else on PATH."""
    sibling = Path(sys.executable).parent / name
    if sibling.is_file():
        return str(sibling)
    found = shutil.which(name)
    if found is None:
        raise SystemExit(f"quickstart: {name} is not installed next to {sys.executable} nor on PATH")
    return found


def clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}:{seconds:02d}"


def run_name(cfg: DictConfig) -> str:
    """The training / benchmark run name: ``name``, suffixed when not self-distilled so the two
    data sources never resume each other's run."""
    return cfg.name if cfg.self_distill else f"{cfg.name}-sharegpt"


def print_summary(eval_stage: Stage, timings_path: Path, timings: dict[str, float]) -> None:
    """τ, acceptance per depth and speedup of the head at each temperature, and where things are."""
    overrides = dict(o.split("=", 1) for o in eval_stage.overrides if "=" in o)
    report_dir = Path(overrides["paths.log_dir"]) / "bench" / overrides["run_name"]
    report = json.loads((report_dir / "report.json").read_text())
    print(f"\n=== quickstart done in {clock(timings['total'])} ===")
    for temperature, methods in report["results"].items():
        for method, entry in methods.items():
            if method == "plain":
                continue
            overall = entry["overall"]
            plain_rate = methods["plain"]["overall"]["tokens_per_s"]
            alphas = ", ".join(f"{a:.2f}" for a in overall.get("acceptance_per_depth") or [] if a is not None)
            print(
                f"{temperature} {method}: tau {overall['tau']:.2f}, acceptance per depth [{alphas}], "
                f"speedup {overall['speedup']:.2f}x over plain decoding "
                f"({overall['tokens_per_s']:.1f} vs {plain_rate:.1f} tokens/s)"
            )
    print(f"head (native export): {overrides['checkpoint']}")
    print(
        f"report: {report_dir / 'report.json'}, {report_dir / 'acceptance_per_depth.png'}, "
        f"{report_dir / 'speedup.png'}"
    )
    print(f"stage timings: {timings_path}")


if __name__ == "__main__":
    main()
