"""``specdraft-sweep-report``: collect the runs of a sweep into a table and plots.

    specdraft-sweep-report outputs/sweeps/sweep             # a Hydra multirun (sweep_name=…)
    specdraft-sweep-report outputs/sweeps/wandb --out report # W&B agent runs (incl. offline dirs)

A run is found by its ``run_config.yaml`` (every specdraft-train run writes one; its metrics come
from ``summary.json`` or, for a run still going or killed, from its CSV logs) or by a W&B run
directory as online / synced runs leave it (``files/config.yaml`` + ``files/wandb-summary.json``).
An OFFLINE W&B run keeps its records in a binary ``.wandb`` file, which is not parsed: it is
collected through the specdraft run dir that holds it (the ``wandb`` logger preset keeps CSV). The swept
parameters are the config values that differ between runs. Writes ``runs.csv``, ``runs.json``
and one PNG per swept parameter (the metric against its values, every run a point, the mean
per value a line).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

from specdraft.system.errors import one_line, user_errors
from specdraft.system.files import write_bytes_atomic, write_json_atomic
from specdraft.train.run_dir import RUN_CONFIG, flatten_config

DEFAULT_METRIC = "val/sim_tau"
# Keys that differ between runs without being hyper-parameters.
NOT_SWEPT = (
    "paths.",
    "run_name",
    "sweep_name",
    "hydra",
    "resume",
    "callbacks.",
    "logger.",
    "trainer.max_time",
    "trainer.default_root_dir",
    "threads",
)


def read_csv_metric(run_dir: Path, metric: str) -> float | None:
    """The best (max) value of ``metric`` over every CSV log version of a run."""
    best = None
    for path in sorted(run_dir.glob("csv/version_*/metrics.csv")):
        with path.open(newline="") as file:
            for row in csv.DictReader(file):
                value = row.get(metric)
                if value not in (None, ""):
                    best = float(value) if best is None else max(best, float(value))
    return best


def read_yaml(path: Path) -> dict[str, Any]:
    """A run's YAML config; one that does not read as YAML is a ``ValueError`` naming it."""
    try:
        return yaml.safe_load(path.read_text()) or {}
    except (UnicodeDecodeError, yaml.YAMLError) as error:
        raise ValueError(f"{path}: not a readable run config ({one_line(str(error))})") from None


def specdraft_run(config_path: Path, metric: str) -> dict[str, Any]:
    run_dir = config_path.parent
    config = flatten_config(read_yaml(config_path))
    summary_path = run_dir / "summary.json"
    value = None
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        if metric == DEFAULT_METRIC and summary.get("best_sim_tau") is not None:
            value = summary["best_sim_tau"]
        else:
            value = {**summary.get("last_val", {}), **summary.get("final_val", {})}.get(metric)
    if value is None:
        value = read_csv_metric(run_dir, metric)
    return {"run": str(run_dir), "config": config, "metric": value}


def wandb_run(files_dir: Path, metric: str) -> dict[str, Any]:
    raw = read_yaml(files_dir / "config.yaml")
    # W&B stores each top-level key as {"value": ...}; "_wandb" is its own bookkeeping.
    config = flatten_config(
        {k: v.get("value") if isinstance(v, dict) else v for k, v in raw.items() if k != "_wandb"}
    )
    summary_path = files_dir / "wandb-summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    return {"run": str(files_dir.parent), "config": config, "metric": summary.get(metric)}


def collect_runs(roots: list[Path], metric: str) -> list[dict[str, Any]]:
    runs, seen = [], set()
    for root in roots:
        if not root.exists():
            raise FileNotFoundError(f"sweep dir {root} does not exist")
        for config_path in sorted(root.rglob(RUN_CONFIG)):
            runs.append(specdraft_run(config_path, metric))
            seen.add(config_path.parent.resolve())
        for files_dir in sorted(root.rglob("files")):
            is_wandb = (files_dir / "config.yaml").is_file() and (files_dir / "wandb-summary.json").is_file()
            # A W&B dir inside a specdraft run dir is the same run: keep the specdraft record.
            if is_wandb and not any(parent.resolve() in seen for parent in files_dir.parents):
                runs.append(wandb_run(files_dir, metric))
    return runs


def swept_parameters(runs: list[dict[str, Any]]) -> list[str]:
    keys = sorted({k for run in runs for k in run["config"]})
    swept = []
    for key in keys:
        if key.startswith(NOT_SWEPT) or key in NOT_SWEPT:
            continue
        values = {json.dumps(run["config"].get(key), sort_keys=True) for run in runs}
        if len(values) > 1:
            swept.append(key)
    return swept


def plot(runs: list[dict[str, Any]], parameter: str, metric: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(run["config"].get(parameter), run["metric"]) for run in runs if run["metric"] is not None]
    numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x, _ in points)
    labels = (
        sorted({x for x, _ in points}, key=lambda x: (str(type(x)), x))
        if numeric
        else sorted({str(x) for x, _ in points})
    )
    position = {label: (label if numeric else i) for i, label in enumerate(labels)}
    figure, axis = plt.subplots(figsize=(5, 3.5), dpi=120)
    xs = [position[x if numeric else str(x)] for x, _ in points]
    axis.scatter(xs, [y for _, y in points], alpha=0.6, label="runs")
    means = defaultdict(list)
    for x, y in zip(xs, (y for _, y in points), strict=True):
        means[x].append(y)
    order = sorted(means)
    axis.plot(order, [sum(means[x]) / len(means[x]) for x in order], color="C1", marker="o", label="mean")
    if not numeric:
        axis.set_xticks(range(len(labels)), labels)
    axis.set_xlabel(parameter)
    axis.set_ylabel(metric)
    axis.set_title(f"{metric} vs {parameter} ({len(points)} runs)")
    axis.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    figure.savefig(tmp)
    plt.close(figure)
    tmp.replace(path)


def write_report(roots: list[Path], out_dir: Path, metric: str = DEFAULT_METRIC) -> dict[str, Any]:
    runs = collect_runs(roots, metric)
    if not runs:
        raise SystemExit(
            f"no runs found under {', '.join(map(str, roots))} (looked for {RUN_CONFIG} and W&B dirs)"
        )
    if all(run["metric"] is None for run in runs):
        raise ValueError(
            f"--metric {metric}: none of the {len(runs)} runs under {', '.join(map(str, roots))} "
            f"records it (the default is {DEFAULT_METRIC})"
        )
    swept = swept_parameters(runs)
    rows = [
        {"run": run["run"], **{key: run["config"].get(key) for key in swept}, metric: run["metric"]}
        for run in sorted(runs, key=lambda r: -math.inf if r["metric"] is None else -r["metric"])
    ]
    table = io.StringIO()
    writer = csv.writer(table, lineterminator="\n")  # quotes Hydra's comma-joined run dir names
    writer.writerow(["run", *swept, metric])
    for row in rows:
        writer.writerow(
            [json.dumps(row[k]) if not isinstance(row[k], str) else row[k] for k in ["run", *swept, metric]]
        )
    write_bytes_atomic(out_dir / "runs.csv", table.getvalue().encode())
    plots = []
    for parameter in swept:
        path = out_dir / f"{metric.replace('/', '_')}_vs_{parameter}.png"
        plot(runs, parameter, metric, path)
        plots.append(str(path))
    report = {"metric": metric, "swept": swept, "runs": rows, "plots": plots}
    write_json_atomic(out_dir / "runs.json", report)
    return report


@user_errors("specdraft-sweep-report")
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("roots", nargs="+", type=Path, help="sweep / run directories to search")
    parser.add_argument("--out", type=Path, default=None, help="report dir (default: <first root>/report)")
    parser.add_argument("--metric", default=DEFAULT_METRIC)
    args = parser.parse_args(argv)
    report = write_report(args.roots, args.out or args.roots[0] / "report", args.metric)
    width = max(len(p) for p in report["swept"]) if report["swept"] else 0
    print(f"{len(report['runs'])} runs; swept: {', '.join(report['swept']) or '(nothing differs)'}")
    for row in report["runs"]:
        settings = "  ".join(f"{k}={row[k]}".ljust(width) for k in report["swept"])
        print(f"  {report['metric']}={row[report['metric']]}  {settings}")
    for path in report["plots"]:
        print(f"  plot: {path}")


if __name__ == "__main__":
    main()
