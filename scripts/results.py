#!/usr/bin/env python
"""docs/results.md: the latest measurement per question and per machine class, rendered from the
snapshots in docs/results/ (committed, so any clone re-renders it byte for byte).

  python scripts/results.py                  # render docs/results.md from the snapshots
  python scripts/results.py --check          # exit 1 where docs/results.md differs from a render
  python scripts/results.py record bench decoder outputs/bench/decoder --machine-class "…" \\
      --command "specdraft-bench methods=decoder …" --commit abc1234 --conditions "…"
  python scripts/results.py record regen "plain, rows auto:abc1234:outputs/regen/x.jsonl" … \\
      --machine-class "…" --command "specdraft-regen …" --conditions "…"

A snapshot holds the numbers its section shows AND how they were obtained, as data: ``run`` =
{machine, command, commit, prompts, conditions}. Sections with several machine classes
(quickstart, decoder, training speed) keep one entry per class: a new result REPLACES its
predecessor for that class (git keeps the history). ``record`` turns a command's outputs into an
entry — ``bench``: a ``specdraft-bench`` report.json (quickstart: its eval's; ablation: the
interleaved heads, each against EAGLE-2 by eval.report.compare_with_reference); ``regen``: the
reports ``specdraft-regen`` writes beside its outputs (data.regen.report_path);
``train_speed``: a scripts/bench_train_step.py output. The sweep, recipe and evidence snapshots
are written by hand from ``specdraft-sweep-report`` / training summaries / the other sections.
Each section's renderer: scripts/results_sections.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdraft.data.regen import report_path
from specdraft.eval.bench import read_records
from specdraft.eval.report import compare_with_reference, summarize
from specdraft.system.files import write_bytes_atomic, write_json_atomic

# The section renderers live beside this script; its directory is on sys.path when it runs as
# `python scripts/results.py`, not when it is loaded by path (the tests): put it there either way.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_sections as sections

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "results.md"
SNAPSHOTS = ROOT / "docs" / "results"
# The equal-token ablation's prompt sets (one interleaved bench) and the head each is paired with.
PROMPT_SETS = {"MT-bench": lambda category: category != "humaneval", "HumanEval": lambda c: c == "humaneval"}
ABLATION_REFERENCE = "eagle_tree"
ENTRIES = ("quickstart", "decoder", "train_speed")  # sections with one entry per machine class


# --- recording: a command's outputs → a snapshot entry ----------------------------------------
def measured(entry: dict) -> dict:
    """One method's numbers as the tables show them, from a bench report's {overall, lossless}."""
    overall, lossless = entry["overall"], entry.get("lossless")
    keys = ("tau", "acceptance_per_depth", "tokens_per_s", "speedup", "mean_nodes")
    row = {key: overall.get(key) for key in (*keys, "draft_ms", "verify_ms", "bookkeeping_ms")}
    if lossless:
        row["identical"] = f"{lossless['exact_turns']}/{lossless['turns_compared']}"
    return {key: value for key, value in row.items() if value is not None}


def bench_entry(out_dir: Path, section: str) -> dict:
    """What the ``section``'s tables need from a ``specdraft-bench`` run in ``out_dir``."""
    report = json.loads((out_dir / "report.json").read_text())
    if section == "ablation":
        compared = compare_with_reference(read_records(out_dir), ABLATION_REFERENCE, PROMPT_SETS)
        return {
            "results": {
                temperature: {
                    name: {
                        method: {
                            **measured(entry),
                            **{k: entry[k] for k in ("against_reference",) if k in entry},
                        }
                        for method, entry in methods.items()
                    }
                    for name, methods in sets.items()
                }
                for temperature, sets in compared.items()
            }
        }
    if section == "lookahead":  # per prompt set: MT-bench first turns alternate with HumanEval
        records = read_records(out_dir)
        return {
            "results": {
                name: {
                    m: measured(e)
                    for m, e in summarize([r for r in records if member(r["category"])])["T=0"].items()
                }
                for name, member in PROMPT_SETS.items()
            }
        }
    if section == "batch":
        return {"batch": report["batch"]["T=0"], "shapes": shapes(report)}
    entry: dict = {
        "methods": {method: measured(e) for method, e in report["results"]["T=0"].items()},
        "shapes": shapes(report),
    }
    auto = (report["methods"].get("head_auto") or {}).get("auto_shape")
    if auto:  # what shape: auto chose and predicted on this machine
        entry["auto"] = {k: auto[k] for k in ("chosen", "predicted_tokens_per_s", "measured_tokens_per_s")}
    return entry


def shapes(report: dict) -> dict[str, str]:
    """Each head method's tree, as the tables name it."""
    configs = report["config"].get("methods") or {}
    return {
        name: sections.flow(config["shape"])
        for name, config in configs.items()
        if isinstance(config, dict) and isinstance(config.get("shape"), dict)
    }


def regen_entry(runs: list[str]) -> dict:
    """``specdraft-regen`` runs, each ``LABEL:COMMIT:OUT_PATH``, from the reports they wrote."""
    measured_runs = []
    for run in runs:
        label, commit, out_path = run.split(":", 2)
        report = json.loads(report_path(out_path).read_text())
        numbers = {key: report[key] for key in ("rows", "generated_tokens", "seconds", "tokens_per_s")}
        measured_runs.append({"label": label, "commit": commit, **numbers})
    return {"runs": measured_runs}


def machine_line(machine: dict) -> str:
    """A bench report's machine record as one line: date, GPU, CPU model and flags, threads, torch."""
    hardware = machine.get("hardware")
    processor = (
        f"{hardware['name']} ({', '.join(hardware['cpu_flags'])})" if hardware else machine["processor"]
    )
    accelerator = machine.get("accelerator")  # GPU runs record the GPU beside its host
    on = f"{accelerator['name']} on a host of " if accelerator else ""
    return (
        f"{machine['time'][:10]}, {on}{processor} × {machine['cpu_count']} cores "
        f"({machine['threads']} torch threads), torch {machine['torch']}"
    )


def train_speed_entry(out: Path) -> dict:
    """Training tokens/s per variant from a scripts/bench_train_step.py output (``--out``)."""
    measured_run = json.loads(out.read_text())
    return {"train_tokens_per_s": {v: x["train_tokens_per_s"] for v, x in measured_run["variants"].items()}}


RECORDERS = {  # record KIND -> (its sources -> the entry's numbers)
    "regen": regen_entry,
    "train_speed": lambda sources: train_speed_entry(Path(sources[0])),
}


def record(args: argparse.Namespace) -> None:
    """Write one snapshot entry with its conditions: in a section per machine class (ENTRIES), in
    place of the entry of the same class; elsewhere in place of the section's numbers."""
    source = Path(args.source[0])
    entry = bench_entry(source, args.section) if args.kind == "bench" else RECORDERS[args.kind](args.source)
    machine = args.machine
    if machine is None and args.kind == "bench":
        machine = machine_line(json.loads((source / "report.json").read_text())["machine"])
    entry["run"] = {
        "machine_class": args.machine_class,
        "name": args.name,
        "machine": machine,
        "command": args.command,
        "commit": args.commit,
        "prompts": args.prompts,
        "conditions": args.conditions,
    }
    path = SNAPSHOTS / f"{args.section}.json"
    snapshot = json.loads(path.read_text()) if path.is_file() else {"about": "", "entries": []}
    if args.section in ENTRIES:
        kept = [e for e in snapshot["entries"] if e["run"]["machine_class"] != args.machine_class]
        snapshot["entries"] = [entry, *kept]
    else:
        snapshot.update(entry)
    write_json_atomic(path, snapshot)
    print(f"wrote {path}")


# --- rendering: from the snapshots only (each section: scripts/results_sections.py) -----------
def render(snapshots: Path | None = None) -> str:
    """docs/results.md's text from the snapshots in ``snapshots`` (default SNAPSHOTS; a missing
    one: no section)."""
    snapshots = snapshots or SNAPSHOTS
    evidence = json.loads((snapshots / "evidence.json").read_text())
    lines = ["# Results", "", evidence["preamble"], ""]
    for name, section in sections.SECTIONS.items():
        path = snapshots / f"{name}.json"
        if path.is_file():
            lines += section(json.loads(path.read_text()))
    lines += sections.reading_section(evidence)
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare docs/results.md with a render")
    commands = parser.add_subparsers(dest="action")
    recorder = commands.add_parser("record", help="a command's outputs → a snapshot entry")
    recorder.add_argument("kind", choices=("bench", *RECORDERS))
    recorder.add_argument("section", help="the snapshot: docs/results/<section>.json")
    sources = (
        "bench: its output dir; regen: LABEL:COMMIT:OUT_PATH …; train_speed: bench_train_step.py's --out"
    )
    recorder.add_argument("source", nargs="+", help=sources)
    for flag in ("--machine-class", "--command", "--conditions"):
        recorder.add_argument(flag, required=True)
    for flag in ("--commit", "--prompts", "--name", "--machine"):  # --machine: default the report's
        recorder.add_argument(flag)
    args = parser.parse_args()
    if args.action == "record":
        record(args)
    text = render()
    if args.check:
        sys.exit(0 if DOC.read_text() == text else f"{DOC} differs from a render of {SNAPSHOTS}")
    write_bytes_atomic(DOC, text.encode())
    print(f"wrote {DOC} ({text.count(chr(10))} lines)")


if __name__ == "__main__":
    main()
