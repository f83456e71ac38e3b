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
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from specdraft.data.regen import report_path
from specdraft.eval.bench import read_records
from specdraft.eval.report import compare_with_reference, summarize
from specdraft.system.files import write_bytes_atomic, write_json_atomic

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
        name: flow(config["shape"])
        for name, config in configs.items()
        if isinstance(config, dict) and isinstance(config.get("shape"), dict)
    }


def flow(shape: dict) -> str:
    """A tree shape as conf/methods writes it, its kind first: {kind: chain, depth: 3}."""
    items = sorted(shape.items(), key=lambda item: item[0] != "kind")
    return "{" + ", ".join(f"{key}: {value}" for key, value in items) + "}"


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


# --- rendering: from the snapshots only -------------------------------------------------------
def fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def alphas(values: list | None) -> str:
    return " / ".join(f"{a:.2f}" for a in values or [] if a is not None) or "–"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
    ]


def run_lines(run: dict) -> list[str]:
    """How an entry was measured: machine, command and commit, prompts, conditions."""
    commit = f" at commit {run['commit']}" if run.get("commit") else ""
    lines = [f"- {run['machine']}: `{run['command']}`{commit}"]
    if run.get("prompts"):
        lines.append(f"- prompts: {run['prompts']}")
    return [*lines, f"- conditions: {run['conditions']}", ""]


def quickstart_section(snapshot: dict) -> list[str]:
    lines = ["## Quickstart (`make run`)", "", snapshot["about"], ""]
    for entry in snapshot["entries"]:
        run = entry["run"]
        lines += [f"### {run['machine_class']}: run `{run['name']}`", "", *run_lines(run)]
        rows = [
            [
                m,
                fmt(r.get("tau")),
                alphas(r.get("acceptance_per_depth")),
                fmt(r.get("tokens_per_s"), ".1f"),
                fmt(r.get("speedup"), ".2f", "×"),
                r.get("identical", "–"),
            ]
            for m, r in entry["methods"].items()
            if m != "plain"  # the yardstick: its tok/s is each row's ÷ its × plain
        ]
        lines += table(["method", "τ", "α per depth", "tok/s", "× plain", "identical to plain"], rows)
    return lines


def decoder_section(snapshot: dict) -> list[str]:
    lines = ["## The decoder's own speed (`specdraft-bench methods=decoder`)", "", snapshot["about"], ""]
    for entry in snapshot["entries"]:
        lines += [f"### {entry['run']['machine_class']}", "", *run_lines(entry["run"])]
        rows = [
            [
                m,
                fmt(r.get("tokens_per_s")),
                fmt(r.get("speedup"), ".3f", "×"),
                fmt(r.get("tau")),
                fmt(r.get("mean_nodes"), ".0f"),
                fmt(r.get("draft_ms"), ".1f"),
                fmt(r.get("verify_ms"), ".1f"),
                fmt(r.get("bookkeeping_ms"), ".1f"),
                r.get("identical", "–"),
            ]
            for m, r in entry["methods"].items()
        ]
        header = ["method", "tok/s", "× plain", "τ", "nodes", "draft ms", "verify ms", "bookkeeping ms"]
        lines += table([*header, "identical to plain"], rows)
        trees = ", ".join(f"`{m}` {shape}" for m, shape in entry["shapes"].items())
        if auto := entry.get("auto"):
            lines += [
                f"`head_auto` (`shape: auto`) chose `{flow(auto['chosen'])}`: predicted "
                f"{auto['predicted_tokens_per_s']:.1f} tok/s, {auto['measured_tokens_per_s']:.1f} decoding "
                f"its calibration prompts. Trees: {trees}.",
                "",
            ]
    return lines


def interval(compared: dict | None, key: str, spec: str) -> str:
    if compared is None:
        return "1 (reference)" if key == "ratio" else "–"
    found = compared[key]
    return f"{found['estimate']:{spec}} [{found['low']:{spec}}, {found['high']:{spec}}]"


def ablation_section(snapshot: dict) -> list[str]:
    lines = [
        "## The equal-token ablation: the same data, the same training tokens",
        "",
        *run_lines(snapshot["run"]),
    ]
    rows = [
        [
            head,
            str(t["global_step"]),
            f"{t['tokens_seen']:,}",
            " / ".join(f"{a:.3f}" for a in t["acc"]),
            f"{t['sim_tau']:.3f}",
        ]
        for head, t in snapshot["training"].items()
    ]
    lines += table(["head", "steps", "tokens seen", "held-out acc_1..4 (final)", "simulated τ (final)"], rows)
    greedy, sampled = snapshot["results"]["T=0"], snapshot["results"].get("T=1", {})
    for name, methods in greedy.items():
        prompts = next(
            m["against_reference"]["prompts"] for m in methods.values() if "against_reference" in m
        )
        lines += [f"{name} ({prompts} prompts), T=0 and T=1:", ""]
        rows = []
        for method, r in methods.items():
            if method == "plain":
                continue
            t1 = sampled.get(name, {}).get(method, {})
            rows.append(
                [
                    method.removesuffix("_tree"),
                    fmt(r.get("tau"), ".3f"),
                    alphas(r.get("acceptance_per_depth")),
                    interval(r.get("against_reference"), "ratio", ".3f"),
                    interval(r.get("against_reference"), "difference", "+.3f"),
                    fmt(r.get("speedup"), ".2f", "×"),
                    r.get("identical", "–"),
                    fmt(t1.get("tau"), ".3f"),
                    interval(t1.get("against_reference"), "ratio", ".3f"),
                    fmt(t1.get("speedup"), ".2f", "×"),
                ]
            )
        header = [
            "head",
            "τ",
            "α per depth",
            "τ ÷ EAGLE-2 [95% CI]",
            "Δτ [95% CI]",
            "speedup",
            "identical to plain",
        ]
        lines += table([*header, "τ T=1", "τ ÷ EAGLE-2 T=1 [95% CI]", "speedup T=1"], rows)
    return [*lines, *depth_lines(snapshot["depth"], "EAGLE-2")]


def depth_lines(depth: dict, reference: str) -> list[str]:
    """The own- vs target-feature chain acceptance per depth (specdraft-depth-acceptance)."""
    rows = []
    for head, run in depth["runs"].items():
        own, target = run["own_features"], run["target_features"]
        rows.append(
            [
                head,
                " / ".join(f"{a:.3f}" for a in own["acceptance_per_depth"]),
                " / ".join(f"{a:.3f}" for a in target["acceptance_per_depth"]),
                f"{own['chain_tau']:.3f} / {target['chain_tau']:.3f}",
                interval(run.get("against_reference"), "ratio", ".3f"),
            ]
        )
    header = ["head", "α own features d1..d4", "α target features d1..d4", "chain τ own / target"]
    return [
        depth["about"],
        "",
        *table([*header, f"own chain τ ÷ {reference} [95% CI]"], rows),
    ]


def sweep_section(snapshot: dict) -> list[str]:
    lines = ["## HASS loss-weight sweep (Hydra multirun, W&B offline)", "", *run_lines(snapshot["run"])]
    swept = snapshot["swept"]
    rows = [
        [
            *(str(p["values"][key]) for key in swept),
            f"{p['best_sim_tau']:.3f}",
            f"{p['sim_tau']:.3f}",
            " / ".join(f"{a:.3f}" for a in p["acc"]),
        ]
        for p in snapshot["points"]
    ]
    lines += table([*swept, "best simulated τ", "final simulated τ", "final acc_1..4"], rows)
    return [*lines, *depth_lines(snapshot["depth"], "EAGLE")]


def lookahead_section(snapshot: dict) -> list[str]:
    title = "## Lookahead decoding, HF prompt lookup and a trained head (`methods=lookahead`)"
    lines = [title, "", *run_lines(snapshot["run"])]
    for name, methods in snapshot["results"].items():
        rows = [
            [
                m,
                fmt(r.get("tokens_per_s")),
                fmt(r.get("speedup"), ".3f", "×"),
                fmt(r.get("tau")),
                fmt(r.get("mean_nodes"), ".1f"),
                r.get("identical", "–"),
            ]
            for m, r in methods.items()
        ]
        lines += [
            f"{name}:",
            "",
            *table(
                ["method", "tok/s", "× plain", "tokens per step", "nodes per step", "identical to plain"],
                rows,
            ),
        ]
    return [*lines, snapshot["about"], ""]


def batch_section(snapshot: dict) -> list[str]:
    lines = ["## Throughput against batch size (`methods=batch`)", "", *run_lines(snapshot["run"])]
    rows = [
        [
            size,
            m,
            fmt(r["tokens_per_s"]),
            fmt(r["speedup"], ".3f", "×"),
            fmt(r["row_ms_per_token"], ".1f"),
            fmt(r["tau"]) if m != "plain" else "–",
            r.get("identical_to_plain", "–"),
        ]
        for size, methods in snapshot["batch"]["sizes"].items()
        for m, r in methods.items()
    ]
    lines += table(
        ["B", "method", "tok/s (all rows)", "× plain", "ms per token per row", "τ", "identical to plain"],
        rows,
    )
    crossover = ", ".join(
        f"`{m}` {snapshot['shapes'][m]}: {b}" for m, b in snapshot["batch"]["crossover"].items()
    )
    return [*lines, f"The batch size from which a tree is no faster than plain decoding: {crossover}.", ""]


def train_speed_section(snapshot: dict) -> list[str]:
    lines = ["## Training speed per head kind (`scripts/bench_train_step.py`)", "", snapshot["about"], ""]
    classes = [entry["run"]["machine_class"] for entry in snapshot["entries"]]
    variants = sorted({v for entry in snapshot["entries"] for v in entry["train_tokens_per_s"]})
    rows = [
        [f"`{v}`", *(fmt(e["train_tokens_per_s"].get(v), ".0f") for e in snapshot["entries"])]
        for v in variants
    ]
    lines += table(["variant", *(f"train tokens/s, {c}" for c in classes)], rows)
    for entry in snapshot["entries"]:
        run = entry["run"]
        lines.append(
            f"- {run['machine_class']}: {run['machine']}; `{run['command']}` at commit {run['commit']}. "
            + run["conditions"]
        )
    return [*lines, ""]


def recipe_section(snapshot: dict) -> list[str]:
    lines = ["## Recipe variants of the quickstart's head (one GPU)", "", *run_lines(snapshot["run"])]
    rows = [
        [
            r["run"],
            r["differs"],
            f"{r['steps']:,}",
            f"{r['tokens']:,}",
            f"{r['sim_tau']:.3f}",
            " / ".join(f"{a:.3f}" for a in r["acc"]),
        ]
        for r in snapshot["runs"]
    ]
    lines += table(["run", "differs by", "steps", "tokens", "simulated τ", "acc_1..4"], rows)
    return [*lines, snapshot["about"], ""]


def regen_section(snapshot: dict) -> list[str]:
    lines = ["## Regeneration on one GPU, plain and capturing the features", "", *run_lines(snapshot["run"])]
    runs = snapshot["runs"]
    base = runs[-1]  # the oldest code, listed last
    rows = [
        [
            r["label"],
            r["commit"],
            str(r["rows"] or "–"),
            f"{r['generated_tokens']:,}",
            f"{r['seconds']:.0f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}×",
        ]
        for r in runs
    ]
    lines += table(["run", "commit", "rows", "answer tokens", "s", "tokens/s", f"× {base['commit']}"], rows)
    return [*lines, snapshot["about"], ""]


def evidence_section(snapshot: dict) -> list[str]:
    rows = [[f"`{r['setting']}`", r["value"], r["evidence"]] for r in snapshot["rows"]]
    return [
        "## Evidence for today's defaults",
        "",
        snapshot["about"],
        "",
        *table(["setting", "value", "measured"], rows),
    ]


def reading_section(snapshot: dict) -> list[str]:
    return ["## Reading these numbers", "", *(f"- {item}" for item in snapshot["reading"]), ""]


# snapshot file (docs/results/<name>.json) -> its section's renderer, in the doc's order
SECTIONS: dict[str, Callable[[dict], list[str]]] = {
    "evidence": evidence_section,
    "quickstart": quickstart_section,
    "decoder": decoder_section,
    "ablation": ablation_section,
    "sweep": sweep_section,
    "recipe": recipe_section,
    "lookahead": lookahead_section,
    "batch": batch_section,
    "train_speed": train_speed_section,
    "regen": regen_section,
}


def render(snapshots: Path | None = None) -> str:
    """docs/results.md's text from the snapshots in ``snapshots`` (default SNAPSHOTS; a missing
    one: no section)."""
    snapshots = snapshots or SNAPSHOTS
    evidence = json.loads((snapshots / "evidence.json").read_text())
    lines = ["# Results", "", evidence["preamble"], ""]
    for name, section in SECTIONS.items():
        path = snapshots / f"{name}.json"
        if path.is_file():
            lines += section(json.loads(path.read_text()))
    lines += reading_section(evidence)
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
