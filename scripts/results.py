#!/usr/bin/env python
"""docs/results.md: the latest measurement per question and per machine class, rendered from the
snapshots in docs/results/ (committed, so any clone re-renders it byte for byte).

  python scripts/results.py                  # render docs/results.md from the snapshots
  python scripts/results.py --check          # exit 1 where docs/results.md differs from a render
  python scripts/results.py record bench decoder outputs/bench/decoder --machine-class "…" \\
      --command "specdraft-bench methods=decoder …" --commit abc1234 --conditions "…"
  python scripts/results.py record regen "plain, rows auto:abc1234:outputs/regen/x.jsonl" … \\
      --machine-class "…" --command "specdraft-regen …" --conditions "…"
  python scripts/results.py record bench ablation outputs/bench/ablation [outputs/bench/ablation_t1 …] \\
      --reference eagle2 --training eagle2=outputs/train/eagle2/summary.json … \\
      --settings eagle2="…" … --machine-class "…" --command "…" --commit abc1234 --conditions "…"
  python scripts/results.py record llamacpp llamacpp outputs/bench/llamacpp --machine-class "…" \\
      --command "python scripts/interop/bench_llamacpp.py …" --commit abc1234 --conditions "…"

A snapshot holds the numbers its section shows AND how they were obtained, as data: ``run`` =
{machine, command, commit, prompts, conditions}. Sections with several machine classes
(quickstart, decoder, training speed) keep one entry per class: a new result REPLACES its
predecessor for that class (git keeps the history). ``record`` turns a command's outputs into an
entry — ``bench``: a ``specdraft-bench`` report.json (quickstart: its eval's; the equal-token
comparisons, ablation and block: one or more interleaved runs, their records merged, every drafting
method against ``--reference`` by eval.report.paired_bootstrap per prompt set and temperature, and
each head's training run from its summary.json); ``regen``: the
reports ``specdraft-regen`` writes beside its outputs (data.regen.report_path);
``train_speed``: a scripts/bench_train_step.py output; ``llamacpp``: a
scripts/interop/bench_llamacpp.py output. The sweep, recipe and evidence snapshots
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
from specdraft.eval.report import paired_bootstrap, summarize
from specdraft.system.files import write_bytes_atomic, write_json_atomic

# The section renderers live beside this script; its directory is on sys.path when it runs as
# `python scripts/results.py`, not when it is loaded by path (the tests): put it there either way.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_sections as sections

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "results.md"
SNAPSHOTS = ROOT / "docs" / "results"
# The prompt sets of a bench over prompts=mt_bench_humaneval, by record. MT-bench's second turns ask
# to rework the method's own first answer: what prompt lookup copies, so they are a set of their own.
PROMPT_SETS = {
    "MT-bench turn 1": lambda r: r["category"] != "humaneval" and r["turn"] == 0,
    "MT-bench turn 2": lambda r: r["category"] != "humaneval" and r["turn"] > 0,
    "HumanEval": lambda r: r["category"] == "humaneval",
}
ENTRIES = ("quickstart", "decoder", "train_speed")  # sections with one entry per machine class
COMPARISONS = ("ablation", "block")  # equal-token comparisons of heads: comparison_entry


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
    if section == "lookahead":  # per prompt set: MT-bench first turns alternate with HumanEval
        records = read_records(out_dir)
        return {
            "results": {
                name: {m: measured(e) for m, e in summarize([r for r in records if member(r)])["T=0"].items()}
                for name, member in PROMPT_SETS.items()
                if any(member(r) for r in records)
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


def comparison_entry(
    out_dirs: list[Path], reference: str, training: dict[str, str], settings: dict[str, str]
) -> dict:
    """An equal-token comparison of heads: one or more interleaved ``specdraft-bench`` runs (their
    records merged per temperature), every method paired with ``reference`` per prompt set and
    temperature, and each head's training run (``training``: head -> its summary.json)."""
    records: list[dict] = []
    seen: set[tuple] = set()
    for out_dir in out_dirs:
        for r in read_records(out_dir):
            key = (r["method"], r["question_id"], r["turn"], r["temperature"])
            if key in seen:
                sys.exit(f"{out_dir}: {key} is in another source too: one run per method and temperature")
            seen.add(key)
            records.append(r)
    reports = [json.loads((out_dir / "report.json").read_text()) for out_dir in out_dirs]
    results: dict = {}
    prompts: dict = {}
    for temperature in sorted({r["temperature"] for r in records}):
        key = f"T={temperature:g}"
        for name, member in PROMPT_SETS.items():
            rows = [r for r in records if r["temperature"] == temperature and member(r)]
            if rows:
                prompts.setdefault(key, {})[name] = len({r["question_id"] for r in rows})
                results.setdefault(key, {})[name] = against(rows, reference)
    return {
        "reference": reference,
        # the tables' order (the snapshot's keys are written sorted): the bench's, then PROMPT_SETS'
        "methods": list(dict.fromkeys(r["method"] for r in records)),
        "prompt_sets": [name for name in PROMPT_SETS if any(name in sets for sets in results.values())],
        "shapes": {method: shape for report in reports for method, shape in shapes(report).items()},
        "training": [
            {"head": head, **trained(Path(path), settings.get(head))} for head, path in training.items()
        ],
        "prompts": prompts,
        "results": results,
    }


def against(rows: list[dict], reference: str) -> dict:
    """Each method's numbers on ``rows`` (one temperature, one prompt set) and, for a drafting
    method (its records have steps) where ``reference`` ran too, eval.report.paired_bootstrap
    against it (the step-less HF baselines are not paired: they have no τ)."""
    stepped = {r["method"] for r in rows if r.get("steps") is not None}
    compared = {}
    for method, entry in next(iter(summarize(rows).values())).items():
        compared[method] = measured(entry)
        if method not in ("plain", reference) and {method, reference} <= stepped:
            compared[method]["against_reference"] = paired_bootstrap(rows, method, reference)
    return compared


def trained(summary_path: Path, settings: str | None) -> dict:
    """One head's training run from its summary.json: the final weights' held-out accuracies per
    drafted step and simulated τ (``final_val``, else the last periodic validation's)."""
    summary = json.loads(summary_path.read_text())
    val = {**summary.get("last_val", {}), **summary.get("final_val", {})}
    acc = []
    while f"val/acc_{len(acc) + 1}" in val:
        acc.append(val[f"val/acc_{len(acc) + 1}"])
    keys = ("kind", "global_step", "tokens_seen", "train_tokens_per_s", "trainable_parameters")
    return {
        **{k: summary.get(k) for k in keys},
        "acc": acc,
        "sim_tau": val.get("val/sim_tau"),
        "settings": settings,
    }


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


def llamacpp_machine_line(machine: dict) -> str:
    """machine_line, and the ggml CPU features llama.cpp's build uses."""
    features = [part.split(" = ")[0].strip() for part in machine["llamacpp"].removeprefix("CPU :").split("|")]
    return f"{machine_line(machine)}; llama.cpp's kernels: {', '.join(f for f in features if f)}"


def train_speed_entry(out: Path) -> dict:
    """Training tokens/s per variant from a scripts/bench_train_step.py output (``--out``)."""
    measured_run = json.loads(out.read_text())
    return {"train_tokens_per_s": {v: x["train_tokens_per_s"] for v, x in measured_run["variants"].items()}}


def llamacpp_entry(out: Path) -> dict:
    """A scripts/interop/bench_llamacpp.py run (its --out): settings, forward costs, methods."""
    measured = json.loads((out / "llamacpp.json").read_text())
    return {key: measured[key] for key in ("settings", "forward_ms", "methods")}


RECORDERS = {  # record KIND -> (its sources -> the entry's numbers)
    "regen": regen_entry,
    "train_speed": lambda sources: train_speed_entry(Path(sources[0])),
    "llamacpp": lambda sources: llamacpp_entry(Path(sources[0])),
}


def named(pairs: list[str] | None) -> dict[str, str]:
    """``NAME=VALUE`` arguments (``--training``, ``--settings``) as {NAME: VALUE}, in their order."""
    if bad := [pair for pair in pairs or [] if "=" not in pair]:
        sys.exit(f"{bad[0]!r}: expected NAME=VALUE")
    return dict(pair.split("=", 1) for pair in pairs or [])


def record(args: argparse.Namespace) -> None:
    """Write one snapshot entry with its conditions: in a section per machine class (ENTRIES), in
    place of the entry of the same class; elsewhere in place of the section's numbers."""
    source = Path(args.source[0])
    if args.kind == "bench" and args.section in COMPARISONS:
        training, settings = named(args.training), named(args.settings)
        entry = comparison_entry([Path(s) for s in args.source], args.reference, training, settings)
    elif args.kind == "bench":
        entry = bench_entry(source, args.section)
    else:
        entry = RECORDERS[args.kind](args.source)
    machine = args.machine
    if machine is None and args.kind == "bench":
        machine = machine_line(json.loads((source / "report.json").read_text())["machine"])
    elif machine is None and args.kind == "llamacpp":
        machine = llamacpp_machine_line(json.loads((source / "llamacpp.json").read_text())["machine"])
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
    fresh = {"about": "", "entries": []} if args.section in ENTRIES else {"about": ""}
    snapshot = json.loads(path.read_text()) if path.is_file() else fresh
    if args.section in ENTRIES:
        kept = [e for e in snapshot["entries"] if e["run"]["machine_class"] != args.machine_class]
        snapshot["entries"] = [entry, *kept]
    elif args.section in COMPARISONS:  # a new comparison replaces the old one: only its about is kept
        snapshot = {"about": snapshot.get("about", ""), **entry}
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


def comparison_flags_error(args: argparse.Namespace) -> str | None:
    """What is wrong with ``record``'s flags for the equal-token comparisons, if anything."""
    is_comparison = args.kind == "bench" and args.section in COMPARISONS
    if is_comparison and args.reference is None:
        return f"record bench {args.section} needs --reference <the EAGLE-2 method>"
    if not is_comparison and (args.reference or args.training or args.settings):
        return f"--reference, --training and --settings are for record bench {'/'.join(COMPARISONS)} only"
    if not set(named(args.settings)) <= set(named(args.training)):
        return "--settings NAME=…: each NAME needs its --training NAME=…"
    return None


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
        f"bench: its output dir ({'/'.join(COMPARISONS)}: one or more); regen: LABEL:COMMIT:OUT_PATH …; "
        "train_speed: bench_train_step.py's --out; llamacpp: bench_llamacpp.py's --out"
    )
    recorder.add_argument("source", nargs="+", help=sources)
    for flag in ("--machine-class", "--command", "--conditions"):
        recorder.add_argument(flag, required=True)
    for flag in ("--commit", "--prompts", "--name", "--machine"):  # --machine: default the report's
        recorder.add_argument(flag)
    only = f"bench {'/'.join(COMPARISONS)} only: "
    recorder.add_argument("--reference", help=only + "the EAGLE-2 method every method is paired with")
    recorder.add_argument("--training", action="append", help=only + "NAME=<run dir>/summary.json (repeat)")
    recorder.add_argument("--settings", action="append", help=only + 'NAME="a head\'s settings" (repeat)')
    args = parser.parse_args()
    if args.action == "record" and (error := comparison_flags_error(args)):
        parser.error(error)
    if args.action == "record":
        record(args)
    text = render()
    if args.check:
        sys.exit(0 if DOC.read_text() == text else f"{DOC} differs from a render of {SNAPSHOTS}")
    write_bytes_atomic(DOC, text.encode())
    print(f"wrote {DOC} ({text.count(chr(10))} lines)")


if __name__ == "__main__":
    main()
