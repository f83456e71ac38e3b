#!/usr/bin/env python
"""docs/results.md, regenerated from measured runs: ``python scripts/results.py`` (after
``make quickstart``; every stage resumes, so re-running only redoes what is missing).

Stages (``--stages`` picks some):

* ``ablation``  — Medusa, EAGLE, HASS (Top-K only / alignment only / both), EAGLE-3 and HASS on
  EAGLE-3 trained one after the other on the quickstart's cached features (its self-distilled
  SmolLM2 answers), each for the same wall-clock budget (``--budget``);
* ``bench``     — ONE ``specdraft-bench`` run over every trained head (EAGLE-1 as a chain and as
  an EAGLE-2 dynamic tree), HF prompt lookup and plain decoding, interleaved per question, at
  T=0 and T=1 on MT-bench;
* ``curve``     — the quickstart's checkpoints (``checkpoints/curve``) benched together at T=0:
  τ against training time; and heads trained on the first N regenerated conversations for the
  quickstart's number of steps: τ against data;
* ``doc``       — docs/results.md and docs/results_curve.png from the JSON the stages wrote.

The numbers in the doc are read from those JSON files only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOG_DIR = Path(os.environ.get("SPECDRAFT_LOG_DIR", ROOT / "outputs"))
QUICKSTART = LOG_DIR / "quickstart"
FEATURES = QUICKSTART / "features" / "regen"
RESULTS = LOG_DIR / "results"
DOCS = ROOT / "docs"
MT_BENCH = os.environ.get("SPECDRAFT_SPEC_BENCH", str(ROOT.parent / "shared" / "bench" / "spec_bench.jsonl"))

# name -> specdraft-train overrides (on top of the shared ones below)
ABLATION = {
    "medusa": ["experiment=medusa"],
    "eagle": ["experiment=eagle"],
    "hass_topk": ["experiment=hass", "loss.rollout.steps=1"],
    "hass_align": ["experiment=hass", "loss.weights.topk=0"],
    "hass": ["experiment=hass"],
    "eagle3": ["experiment=eagle3"],
    "hass_eagle3": ["experiment=hass_eagle3"],
}
TREE = "{kind: dynamic, depth: 5, top_k: 6, total_tokens: 24}"  # the quickstart's head_tree
CHAIN = "{kind: chain, depth: 4}"
MEDUSA_TREE = (  # conf/methods/medusa.yaml's static tree
    "{kind: static, rank_accept: [[0.6, 0.15, 0.08, 0.05], [0.4, 0.12, 0.06], [0.3, 0.1], [0.25]], "
    "num_nodes: 16}"
)
DATA_SIZES = (64, 128)  # conversations for the τ-vs-data points (plus the quickstart's own run)


def command(name: str, *overrides: str) -> None:
    """Run a specdraft console script of this venv; stop on failure."""
    argv = [str(Path(sys.executable).parent / name), *overrides]
    print("$ " + " ".join(argv), flush=True)
    subprocess.run(argv, check=True)


def best_checkpoint(run_dir: Path) -> Path:
    summary = json.loads((run_dir / "summary.json").read_text())
    return Path(summary["best_checkpoint"])


def head_method(name: str, checkpoint: Path, shape: str) -> str:
    return f"+methods.{name}={{type: head, checkpoint: '{checkpoint}', shape: {shape}, shortlist: true}}"


def ablation(budget: str) -> None:
    for name, overrides in ABLATION.items():
        run_dir = RESULTS / "train" / name
        if (run_dir / "summary.json").is_file():
            continue
        command(
            "specdraft-train",
            *overrides,
            f"run_name={name}",
            f"paths.log_dir={RESULTS}",
            "datamodule=cached",
            f"datamodule.train_cache={FEATURES / 'train'}",
            f"datamodule.val_cache={FEATURES / 'heldout'}",
            "datamodule.max_batch_tokens=4096",
            f"trainer.max_time={budget}",
            "trainer.max_steps=1000000",
            "trainer.val_check_interval=25",
            "trainer.limit_val_batches=8",
            "scheduler.warmup_steps=20",
            "scheduler.total_steps=-1",  # the budget is wall-clock: no decay to a step count
            "validate_at_end=true",
            "callbacks.progress.refresh_rate=0",
        )


def bench(per_category: int) -> None:
    runs = {name: best_checkpoint(RESULTS / "train" / name) for name in ABLATION}
    methods = [
        head_method("medusa_tree", runs["medusa"], MEDUSA_TREE),
        head_method("eagle_chain", runs["eagle"], CHAIN),
    ]
    methods += [head_method(f"{name}_tree", runs[name], TREE) for name in ABLATION if name != "medusa"]
    command(
        "specdraft-bench",
        "methods=none",
        *methods,
        "+methods.hf_prompt_lookup={type: hf, prompt_lookup_tokens: 10}",
        "checkpoint=unused",
        "run_name=ablation",
        f"paths.log_dir={RESULTS}",
        f"prompts.path={MT_BENCH}",
        f"prompts.per_category={per_category}",
        "temperatures=[0.0,1.0]",
    )


def curve(per_category: int) -> None:
    quickstart_run = LOG_DIR / "train" / "quickstart"
    steps = json.loads((quickstart_run / "summary.json").read_text())["global_step"]
    for size in DATA_SIZES:
        run_name = f"data-{size}"
        if (RESULTS / "train" / run_name / "summary.json").is_file():
            continue
        features = RESULTS / "features" / run_name
        for split in ("train", "heldout"):
            command(
                "specdraft-cache",
                "data=jsonl",
                f"data.source.path={next((QUICKSTART / 'regen').glob('train-*.jsonl'))}",
                "data.heldout_fraction=0.05",
                "data.split_seed=1",
                f"data.source.limit={size}",
                f"split={split}",
                "top_k=10",
                f"out_dir={features / split}",
            )
        command(
            "specdraft-train",
            "experiment=quickstart",
            f"run_name={run_name}",
            f"paths.log_dir={RESULTS}",
            f"datamodule.train_cache={features / 'train'}",
            f"datamodule.val_cache={FEATURES / 'heldout'}",  # one validation set for every size
            f"trainer.max_steps={steps}",
            "callbacks.progress.refresh_rate=0",
        )
    methods = [
        head_method(f"step_{path.stem.split('=')[1]}", path, TREE)
        for path in sorted((quickstart_run / "checkpoints" / "curve").glob("step=*.ckpt"))
    ]
    methods += [
        head_method(f"data_{size}", best_checkpoint(RESULTS / "train" / f"data-{size}"), TREE)
        for size in DATA_SIZES
    ]
    command(
        "specdraft-bench",
        "methods=none",
        *methods,
        "checkpoint=unused",
        "run_name=curve",
        f"paths.log_dir={RESULTS}",
        f"prompts.path={MT_BENCH}",
        f"prompts.per_category={per_category}",
        "temperatures=[0.0]",
    )


def doc() -> None:
    """docs/results.md (+ results_curve.png) from the JSON files the other stages wrote."""
    DOCS.mkdir(exist_ok=True)
    lines = [
        "# Results",
        "",
        "Generated by `python scripts/results.py` from the runs it names; every number below is read",
        "from their JSON outputs. Do not edit by hand.",
        "",
    ]
    lines += quickstart_section() + ablation_section() + curve_section()
    (DOCS / "results.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {DOCS / 'results.md'}")


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def machine_line(report: dict) -> str:
    machine = report["machine"]
    return (
        f"{machine['time'][:10]}, {machine['processor']} × {machine['cpu_count']} cores "
        f"({machine['threads']} torch threads), torch {machine['torch']}, {machine['platform']}"
    )


def head_rows(results: dict, methods: list[str], reference: str | None = None) -> list[str]:
    """One table row per method: τ, α per depth, tokens/s, speedups, T=0 agreement."""
    rows = []
    for method in methods:
        cells = [method]
        for temperature in ("T=0", "T=1"):
            entry = results.get(temperature, {}).get(method)
            if entry is None:
                cells += ["–"] * (4 if temperature == "T=0" else 2)
                continue
            overall = entry["overall"]
            cells.append(f"{overall.get('tau', 1.0):.2f}")
            if temperature == "T=0":
                alphas = overall.get("acceptance_per_depth") or []
                cells.append(" / ".join(f"{a:.2f}" for a in alphas if a is not None) or "–")
            cells.append(f"{overall['speedup']:.2f}×")
            if temperature == "T=0":
                lossless = entry.get("lossless") or {}
                cells.append(
                    f"{lossless.get('exact_turns', '–')}/{lossless.get('turns_compared', '–')}"
                    if lossless
                    else "–"
                )
        if reference and reference in results.get("T=0", {}):
            ours = results["T=0"].get(method, {}).get("overall", {}).get("speedup")
            theirs = results["T=0"][reference]["overall"]["speedup"]
            cells.append(f"{ours / theirs:.2f}×" if ours else "–")
        rows.append("| " + " | ".join(cells) + " |")
    return rows


HEADER = "| method | τ T=0 | α per depth T=0 | speedup T=0 | identical to plain T=0 | τ T=1 | speedup T=1 |"
SEPARATOR = "|---|---|---|---|---|---|---|"


def training_line(summary: dict) -> str:
    return (
        f"{summary['global_step']} steps, {summary['tokens_seen']:,} tokens seen, "
        f"{summary['fit_seconds'] / 60:.1f} min, best simulated τ {summary['best_sim_tau']:.3f}"
    )


def manifest_tokens(cache_dir: Path) -> str:
    manifest = read_json(cache_dir / "manifest.json")
    return f"{manifest['num_samples']} conversations, {manifest['num_tokens']:,} tokens" if manifest else "–"


def quickstart_section() -> list[str]:
    report = read_json(LOG_DIR / "bench" / "quickstart" / "report.json")
    if report is None:
        return ["## Quickstart", "", "_Not run yet: `make quickstart`._", ""]
    timings = read_json(QUICKSTART / "timings.json") or {}
    summary = read_json(LOG_DIR / "train" / "quickstart" / "summary.json")
    lines = [
        "## Quickstart (`make quickstart`)",
        "",
        f"Machine: {machine_line(report)}.",
        "",
        "- data: SmolLM2's own greedy answers (first turns), train cache "
        + manifest_tokens(FEATURES / "train"),
        f"- training: {training_line(summary)}",
        "- stage wall times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()),
        f"- prompts: MT-bench, {report['config']['prompts'].get('per_category')} per category, "
        f"{report['config']['max_new_tokens']} new tokens per turn",
        "",
        HEADER,
        SEPARATOR,
        *head_rows(report["results"], [m for m in report["results"]["T=0"] if m != "plain"]),
        "",
    ]
    original = read_json(LOG_DIR / "bench" / "quickstart-sharegpt" / "report.json")
    if original is not None:
        original_summary = read_json(LOG_DIR / "train" / "quickstart-sharegpt" / "summary.json")
        lines += [
            "### Self-distillation vs the original ShareGPT answers",
            "",
            "`specdraft-quickstart self_distill=false`: the same steps on ShareGPT's original answers "
            f"({manifest_tokens(QUICKSTART / 'features' / 'sharegpt' / 'train')}); "
            f"training: {training_line(original_summary)}.",
            "",
            HEADER,
            SEPARATOR,
            *head_rows(original["results"], [m for m in original["results"]["T=0"] if m != "plain"]),
            "",
        ]
    return lines


def ablation_section() -> list[str]:
    report = read_json(RESULTS / "bench" / "ablation" / "report.json")
    if report is None:
        return [
            "## Ablation",
            "",
            "_Not run yet: `python scripts/results.py --stages ablation bench doc`._",
            "",
        ]
    lines = [
        "## Ablation: the same data, the same training budget",
        "",
        f"Machine: {machine_line(report)}. Data: the quickstart's features "
        f"({manifest_tokens(FEATURES / 'train')}). Each head trained alone on the machine.",
        "",
        "| run | training |",
        "|---|---|",
    ]
    for name in ABLATION:
        summary = read_json(RESULTS / "train" / name / "summary.json")
        lines.append(f"| {name} | {training_line(summary) if summary else '–'} |")
    methods = [m for m in report["results"]["T=0"] if m not in ("plain", "hf_prompt_lookup")]
    lines += [
        "",
        HEADER[:-1] + " vs HF prompt lookup T=0 |",
        SEPARATOR + "---|",
        *head_rows(report["results"], methods, reference="hf_prompt_lookup"),
        *head_rows(report["results"], ["hf_prompt_lookup"]),
        "",
    ]
    return lines


def curve_section() -> list[str]:
    report = read_json(RESULTS / "bench" / "curve" / "report.json")
    summary = read_json(LOG_DIR / "train" / "quickstart" / "summary.json")
    if report is None or summary is None:
        return [
            "## τ vs training time and data",
            "",
            "_Not run yet: `python scripts/results.py --stages curve doc`._",
            "",
        ]
    seconds_per_step = summary["fit_seconds"] / summary["global_step"]
    results = report["results"]["T=0"]
    time_points = sorted((int(m.split("_")[1]), m) for m in results if m.startswith("step_"))
    lines = [
        "## τ vs training time and data",
        "",
        f"The quickstart's checkpoints (every {time_points[0][0]} steps) and heads trained for the same "
        f"steps on fewer conversations, benched together at T=0 ({machine_line(report)}). Training time "
        f"= step × the run's mean {seconds_per_step:.1f} s/step.",
        "",
        "| head | training | τ T=0 | speedup T=0 |",
        "|---|---|---|---|",
    ]
    for step, method in time_points:
        overall = results[method]["overall"]
        lines.append(
            f"| step {step} | {step * seconds_per_step / 60:.1f} min | {overall['tau']:.2f} "
            f"| {overall['speedup']:.2f}× |"
        )
    for size in DATA_SIZES:
        method = f"data_{size}"
        if method in results:
            overall = results[method]["overall"]
            lines.append(
                f"| {size} conversations "
                f"({manifest_tokens(RESULTS / 'features' / f'data-{size}' / 'train')}) "
                f"| {summary['global_step']} steps | {overall['tau']:.2f} | {overall['speedup']:.2f}× |"
            )
    plot_curve(time_points, results, seconds_per_step)
    lines += ["", "![τ vs training time](results_curve.png)", ""]
    return lines


def plot_curve(time_points: list[tuple[int, str]], results: dict, seconds_per_step: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(5, 3.2))
    minutes = [step * seconds_per_step / 60 for step, _ in time_points]
    axes.plot(minutes, [results[m]["overall"]["tau"] for _, m in time_points], marker="o")
    axes.set(xlabel="training time (min, 2 CPU cores)", ylabel="τ (MT-bench, T=0)", title="Quickstart head")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(DOCS / "results_curve.png", dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stages", nargs="+", default=["ablation", "bench", "curve", "doc"])
    parser.add_argument("--budget", default="00:00:10:00", help="training wall-clock per ablation run")
    parser.add_argument("--per-category", type=int, default=2, help="MT-bench questions per category")
    args = parser.parse_args()
    started = time.perf_counter()
    for stage in args.stages:
        if stage == "ablation":
            ablation(args.budget)
        elif stage == "bench":
            bench(args.per_category)
        elif stage == "curve":
            curve(args.per_category)
        elif stage == "doc":
            doc()
        else:
            parser.error(f"unknown stage {stage!r}")
    print(f"done in {(time.perf_counter() - started) / 60:.1f} min on {platform.node() or 'this machine'}")


if __name__ == "__main__":
    main()
