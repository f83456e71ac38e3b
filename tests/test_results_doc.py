"""scripts/results.py: docs/results.md is the latest measurement per question and machine class,
rendered from committed snapshots that say how each number was obtained; a recorded run replaces
its machine class's predecessor, and nothing measured needs the runs' outputs once snapshotted."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from specdraft.eval.bench import RECORDS

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "results.py"
EVIDENCE_TITLE = "## Evidence for today's defaults"


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location("results_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_the_committed_doc_renders_byte_identical_from_the_snapshots_alone(results) -> None:
    assert results.render(ROOT / "docs" / "results") == (ROOT / "docs" / "results.md").read_text(), (
        "docs/results.md is out of date with docs/results/: run python scripts/results.py"
    )


def test_the_doc_keeps_to_the_current_state(results) -> None:
    text = (ROOT / "docs" / "results.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 350 and len(list((ROOT / "docs" / "results").iterdir())) <= 12
    assert "A new result replaces its predecessor for that machine class" in "\n".join(lines[:4])
    titles = [line for line in lines if line.startswith("#")]
    assert not [t for t in titles if re.search(r"\b[0-9a-f]{7,40}\b", t)], "no commit hash in a title"
    assert len(titles) == len(set(titles))
    evidence = text.split(EVIDENCE_TITLE + "\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in evidence.splitlines() if line.startswith("| `")]
    assert 0 < len(rows) <= 15
    assert all(line.count(" | ") == 2 for line in rows)  # setting → value → measurement, one line each


def every_run(snapshot: dict) -> list[dict]:
    return [entry["run"] for entry in snapshot["entries"]] if "entries" in snapshot else [snapshot["run"]]


@pytest.mark.parametrize("path", sorted((ROOT / "docs" / "results").glob("*.json")), ids=lambda p: p.name)
def test_every_snapshot_carries_how_it_was_measured(path: Path) -> None:
    snapshot = json.loads(path.read_text())
    if path.stem == "evidence":
        return
    classes = []
    for run in every_run(snapshot):
        assert run["machine"] and run["command"] and run["conditions"], run
        assert {"commit", "prompts"} <= set(run)
        classes.append(run["machine_class"])
    assert len(classes) == len(set(classes)), "one entry per machine class"


MACHINE = {
    "time": "2026-11-28T08:00:00",
    "processor": "x86_64",
    "hardware": {"name": "AMD EPYC", "cpu_flags": ["avx2"]},
    "cpu_count": 2,
    "threads": 2,
    "torch": "2.13.0+cpu",
}


def overall(tau: float, speedup: float, tokens_per_s: float, **more: float) -> dict:
    return {
        "tau": tau,
        "speedup": speedup,
        "tokens_per_s": tokens_per_s,
        "acceptance_per_depth": [0.5, None],
        **more,
    }


def decoder_report(out_dir: Path, plain_tokens_per_s: float) -> None:
    chain = {"kind": "chain", "depth": 3}
    auto = {"chosen": {"kind": "plain"}, "predicted_tokens_per_s": 20.0, "measured_tokens_per_s": 19.0}
    report = {
        "machine": MACHINE,
        "config": {"methods": {"head_chain": {"type": "head", "shape": chain}, "plain": {"type": "plain"}}},
        "methods": {"head_auto": {"type": "head", "auto_shape": {**auto, "latency": {}}}},
        "results": {
            "T=0": {
                "plain": {"overall": overall(1.0, 1.0, plain_tokens_per_s, verify_ms=50.0)},
                "head_chain": {
                    "overall": overall(1.5, 1.2, 1.2 * plain_tokens_per_s, mean_nodes=4.0, draft_ms=5.0),
                    "lossless": {"exact_turns": 15, "turns_compared": 16},
                },
            }
        },
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report))


def record(results, *args: str) -> None:
    sys.argv = ["results.py", "record", *args]
    results.main()


def empty_snapshots(results, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A snapshots dir holding only a minimal evidence.json, where ``results`` records and renders."""
    snapshots = tmp_path / "results"
    snapshots.mkdir()
    monkeypatch.setattr(results, "SNAPSHOTS", snapshots)
    monkeypatch.setattr(results, "DOC", tmp_path / "results.md")
    (snapshots / "evidence.json").write_text(
        json.dumps({"preamble": "p", "about": "a", "rows": [], "reading": []})
    )
    return snapshots


def test_a_recorded_bench_replaces_the_entry_of_its_machine_class_only(
    results, tmp_path, monkeypatch
) -> None:
    snapshots = empty_snapshots(results, tmp_path, monkeypatch)
    for machine_class, rate in (("AVX2 EPYC", 10.0), ("AMX Xeon", 30.0), ("AVX2 EPYC", 20.0)):
        decoder_report(tmp_path / "bench", rate)
        flags = [
            "--machine-class",
            machine_class,
            "--command",
            "specdraft-bench methods=decoder",
            "--conditions",
            "alone",
        ]
        record(results, "bench", "decoder", str(tmp_path / "bench"), *flags, "--commit", "abc1234")
    entries = json.loads((snapshots / "decoder.json").read_text())["entries"]
    assert [e["run"]["machine_class"] for e in entries] == ["AVX2 EPYC", "AMX Xeon"]  # the newest first
    assert entries[0]["methods"]["plain"]["tokens_per_s"] == 20.0  # the second AVX2 run replaced the first
    assert entries[0]["run"]["machine"].startswith("2026-11-28, AMD EPYC (avx2) × 2 cores")
    text = (tmp_path / "results.md").read_text()
    assert "| head_chain | 24.00 | 1.200× | 1.50 | 4 | 5.0 | – | – | 15/16 |" in text
    assert "`head_auto` (`shape: auto`) chose `{kind: plain}`: predicted 20.0 tok/s" in text
    assert "`head_chain` {kind: chain, depth: 3}" in text
    assert "`specdraft-bench methods=decoder` at commit abc1234" in text and "- conditions: alone" in text
    # The outputs are gone: the snapshots alone render the same document.
    (tmp_path / "bench" / "report.json").unlink()
    assert results.render(snapshots) == text


def test_regeneration_is_read_from_the_reports_specdraft_regen_writes(results, tmp_path, monkeypatch) -> None:
    from specdraft.data.regen import report_path

    monkeypatch.setattr(results, "SNAPSHOTS", tmp_path)
    runs = []
    for label, commit, rows, seconds in (
        ("rows auto", "new1234", 1024, 10.0),
        ("256 rows", "old1234", 256, 40.0),
    ):
        out = tmp_path / f"{commit}.jsonl"
        report = {
            "rows": rows,
            "generated_tokens": 100_000,
            "seconds": seconds,
            "tokens_per_s": 100_000 / seconds,
        }
        report_path(out).write_text(json.dumps({**report, "written": 9, "chunk_size": 4096}))
        runs.append(f"{label}:{commit}:{out}")
    entry = results.regen_entry(runs)
    assert entry["runs"][0] == {
        "label": "rows auto",
        "commit": "new1234",
        **{k: v for k, v in report.items()},
    } | {
        "rows": 1024,
        "seconds": 10.0,
        "tokens_per_s": 10_000.0,
    }
    entry |= {"run": {"machine": "H100", "command": "specdraft-regen", "conditions": "alone"}, "about": "."}
    lines = results.sections.regen_section(entry)
    assert (
        "| rows auto | new1234 | 1024 | 100,000 | 10 | 10,000 | 4.00× |" in lines
    )  # against the oldest, last


def turn(
    method: str,
    question: str,
    category: str,
    temperature: float,
    committed: int,
    forwards: int,
    turn_index: int = 0,
) -> dict:
    """One answer: ``forwards`` verify steps committing ``committed`` tokens after the first."""
    steps = [[4, 1, 1, 0.001, 0.01, 0.001]] * forwards
    return {
        "method": method,
        "question_id": question,
        "category": category,
        "turn": turn_index,
        "temperature": temperature,
        "tokens": [7] * (committed + 1),
        "total_s": 0.1 * forwards,
        "prefill_s": 0.01,
        "stop": "length",
        "steps": steps,
    }


def depth_run(own_tau: float, ratio: float | None = None) -> dict:
    features = {"acceptance_per_depth": [0.4, 0.3], "chain_tau": own_tau}
    run = {"own_features": features, "target_features": {**features, "chain_tau": 2.0}}
    found = {"estimate": ratio, "low": ratio, "high": ratio}
    return run if ratio is None else {**run, "against_reference": {"ratio": found}}


def test_the_sweep_shows_each_point_with_its_depth_run_in_one_table(results) -> None:
    """A depth run is keyed by its point's swept values (in any order, 1 = 1.0); the yardstick's run,
    named otherwise, pairs with the one point left; a run left beyond that keeps a row of its own."""
    points = [
        {"values": {"a": 0.5, "b": 2.0}, "best_sim_tau": 1.6, "sim_tau": 1.5, "acc": [0.4, 0.3]},
        {"values": {"a": 1.0, "b": 2.0}, "best_sim_tau": 1.4, "sim_tau": 1.3, "acc": [0.2, 0.1]},
        {"values": {"a": "EAGLE", "b": "–"}, "best_sim_tau": 1.2, "sim_tau": 1.1, "acc": [0.3, 0.2]},
    ]
    runs = {"eagle-run": depth_run(1.5), "b=2.0,a=1": depth_run(1.4, 0.9), "a=0.5,b=2.0": depth_run(1.6, 1.1)}
    snapshot = {
        "run": {"machine": "m", "command": "c", "conditions": "x"},
        "swept": ["a", "b"],
        "points": points,
        "depth": {"about": "depth", "runs": runs},
    }
    text = "\n".join(results.sections.sweep_section(snapshot))
    cells = "0.400 / 0.300 | 0.400 / 0.300"
    assert (
        f"| 0.5 | 2.0 | 1.600 | 1.500 | 0.400 / 0.300 | {cells} | 1.600 / 2.000 | 1.100 [1.100, 1.100] |"
        in text
    )
    assert (
        f"| 1.0 | 2.0 | 1.400 | 1.300 | 0.200 / 0.100 | {cells} | 1.400 / 2.000 | 0.900 [0.900, 0.900] |"
        in text
    )
    assert f"| EAGLE | – | 1.200 | 1.100 | 0.300 / 0.200 | {cells} | 1.500 / 2.000 | 1 (reference) |" in text
    # one table: its header and three rows
    assert text.count("| own chain τ ÷ EAGLE [95% CI] |") == 1 and text.count("\n| ") == 4
    runs["orphan"] = depth_run(1.0, 0.5)  # two left: neither pairs, and nothing drops out
    text = "\n".join(results.sections.sweep_section(snapshot))
    assert "| EAGLE | – | 1.200 | 1.100 | 0.300 / 0.200 | – | – | – | – |" in text
    assert "| eagle-run | – | – | – | – | 0.400 / 0.300 |" in text and "| orphan | – |" in text


def test_the_batch_table_has_one_row_per_batch_size(results) -> None:
    """τ, the same at every B, goes into the closing sentence; identical-to-plain, varying, a column."""

    def at(tokens_per_s: float, speedup: float, ms: float, **more: object) -> dict:
        return {"tokens_per_s": tokens_per_s, "speedup": speedup, "row_ms_per_token": ms, "tau": 1.0, **more}

    sizes = {
        "1": {"plain": at(10.0, 1.0, 70.0), "head": at(12.0, 1.2, 60.0, tau=1.55, identical_to_plain="2/2")},
        "4": {"plain": at(40.0, 1.0, 90.0), "head": at(20.0, 0.5, 150.0, tau=1.55, identical_to_plain="1/2")},
    }
    snapshot = {
        "run": {"machine": "m", "command": "c", "conditions": "x"},
        "batch": {"sizes": sizes, "crossover": {"head": 2}},
        "shapes": {"head": "{kind: chain, depth: 3}"},
    }
    lines = results.sections.batch_section(snapshot)
    header = "| B | plain tok/s | plain ms/token/row | head tok/s (× plain) | head ms/token/row |"
    assert f"{header} head identical to plain |" in lines
    assert "| 1 | 10.00 | 70.0 | 12.00 (1.200×) | 60.0 | 2/2 |" in lines
    assert "| 4 | 40.00 | 90.0 | 20.00 (0.500×) | 150.0 | 1/2 |" in lines
    assert (
        "The batch size from which a tree is no faster than plain decoding: `head` {kind: chain, "
        "depth: 3}: 2. At every B, τ: `head` 1.55." in lines
    )


def test_training_speed_is_read_from_a_bench_train_step_output(results, tmp_path) -> None:
    out = tmp_path / "bench.json"
    out.write_text(
        json.dumps({"variants": {"eagle": {"train_tokens_per_s": 2194.1, "val_tokens_per_s": 1.0}}})
    )
    entry = results.RECORDERS["train_speed"]([str(out)])
    assert entry == {"train_tokens_per_s": {"eagle": 2194.1}}
    run = {
        "machine_class": "AMX Xeon",
        "machine": "Xeon",
        "command": "bench_train_step.py",
        "commit": "abc1234",
    }
    snapshot = {"about": ".", "entries": [{**entry, "run": {**run, "conditions": "alone"}}]}
    assert "| `eagle` | 2194 |" in results.sections.train_speed_section(snapshot)


def bench_dir(out_dir: Path, records: list[dict], methods: dict) -> Path:
    """A ``specdraft-bench`` output dir as eval.bench.read_records reads it."""
    out_dir.mkdir()
    (out_dir / "report.json").write_text(json.dumps({"machine": MACHINE, "config": {"methods": methods}}))
    (out_dir / RECORDS).write_text(json.dumps({"records": records}) + "\n")
    return out_dir


def timed(record: dict, total_s: float, steps: bool = True) -> dict:
    return {**record, "total_s": total_s, **({} if steps else {"steps": None})}


@pytest.mark.parametrize("section", ["ablation", "block"])
def test_an_equal_token_comparison_pairs_every_method_with_eagle2_over_merged_runs(
    results, tmp_path, monkeypatch, section
) -> None:
    """record bench ablation / block: two bench runs (T=0, then T=1 for some methods) merged, every
    drafting method paired with the EAGLE-2 reference per prompt set (MT-bench's second turns a set
    of their own), the training runs from their summary.json."""
    snapshots = empty_snapshots(results, tmp_path, monkeypatch)
    greedy, sampled = [], []
    for question, category in (("q1", "writing"), ("q2", "humaneval")):
        greedy += [
            turn("plain", question, category, 0.0, 8, 8),  # τ 1, 9 tokens in 0.8 s
            timed(turn("hf_prompt_lookup", question, category, 0.0, 8, 0), 0.5, steps=False),  # 18 tok/s
            turn("eagle2_tree", question, category, 0.0, 8, 4),  # τ 2, 22.5 tok/s: the reference
            turn("eagle3_chain", question, category, 0.0, 8, 2),  # τ 4, 45 tok/s: a decoy reference
            timed(turn("dflash_chain", question, category, 0.0, 8, 2), 1.8),  # τ 4, 5 tok/s
        ]
        sampled += [
            turn("plain", question, category, 1.0, 8, 8),
            turn("eagle2_tree", question, category, 1.0, 8, 8),  # τ 1, 11.25 tok/s
            timed(turn("dflash_chain", question, category, 1.0, 8, 2), 3.6),  # τ 4, 2.5 tok/s
        ]
    # q1's second turn: EAGLE-2 (τ 4) doubles DFlash's τ there
    greedy += [
        turn("eagle2_tree", "q1", "writing", 0.0, 8, 2, turn_index=1),
        turn("dflash_chain", "q1", "writing", 0.0, 8, 4, turn_index=1),
    ]
    shapes = {
        "eagle2_tree": {"type": "head", "shape": {"depth": 5, "kind": "dynamic", "top_k": 6}},
        "dflash_chain": {"type": "head", "shape": {"kind": "chain", "depth": 7}},
    }
    first = bench_dir(tmp_path / "t0", greedy, shapes)
    second = bench_dir(tmp_path / "t1", sampled, {})
    summaries = {}
    for head, kind, acc in (("eagle2", "eagle", [0.5, 0.4]), ("dflash", "dflash", [0.6, 0.5, 0.4, 0.3, 0.2])):
        val = {f"val/acc_{j}": a for j, a in enumerate(acc, start=1)}
        summary = {
            "kind": kind,
            "global_step": 300,
            "tokens_seen": 5_928_308,
            "train_tokens_per_s": 12_345.6,
            "trainable_parameters": 29_000_000,
            "last_val": {"val/acc_1": 0.0, "val/sim_tau": 1.0},
            "final_val": {**val, "val/sim_tau": 1.0 + sum(acc)},
        }
        summaries[head] = tmp_path / f"{head}.json"
        summaries[head].write_text(json.dumps(summary))
    flags = ["--machine-class", "H200", "--command", "specdraft-bench …", "--conditions", "alone"]
    training = [f"--training=eagle2={summaries['eagle2']}", f"--training=dflash={summaries['dflash']}"]
    args = [*flags, "--reference", "eagle2_tree", *training, "--settings", "dflash=block 8, 2 layers"]
    record(results, "bench", section, str(first), str(second), *args, "--commit", "abc1234")
    snapshot = json.loads((snapshots / f"{section}.json").read_text())
    assert snapshot["run"]["command"] == "specdraft-bench …" and "entries" not in snapshot
    dflash = snapshot["results"]["T=0"]["HumanEval"]["dflash_chain"]["against_reference"]
    assert dflash["ratio"]["estimate"] == pytest.approx(2.0)  # τ 4 ÷ EAGLE-2's 2
    assert dflash["speed_ratio"]["estimate"] == pytest.approx(5.0 / 22.5)
    assert "against_reference" not in snapshot["results"]["T=0"]["MT-bench turn 1"]["hf_prompt_lookup"]
    second_turns = snapshot["results"]["T=0"]["MT-bench turn 2"]
    assert second_turns["dflash_chain"]["against_reference"]["ratio"]["estimate"] == pytest.approx(0.5)
    assert snapshot["prompt_sets"] == ["MT-bench turn 1", "MT-bench turn 2", "HumanEval"]
    text = (tmp_path / "results.md").read_text()
    # one table: every prompt set at T=0, the T=1 results in the last four columns
    assert text.count("every method paired with `eagle2_tree`:") == 1
    assert (
        "| HumanEval (1) | dflash_chain | 4.00 | 1.00 | 5.0 | 0.44× | 0.28× | 2.000 [2.000, 2.000] "
        "| 0.222 [0.222, 0.222] | 1.0 / 10.0 | 1/1 | 4.00 | 4.000 [4.000, 4.000] | 0.222 [0.222, 0.222] "
        "| 0.22× |" in text
    )
    assert (
        "| MT-bench turn 1 (1) | eagle2_tree | 2.00 | 1.00 | 22.5 | 2.00× | 1.25× | 1 (reference) | 1 "
        "| 1.0 / 10.0 | 1/1 | 1.00 | 1 (reference) | 1 | 1.00× |" in text
    )
    assert (
        "| MT-bench turn 1 (1) | hf_prompt_lookup | – | – | 18.0 | 1.60× | 1.00× | – | – | – / – | 1/1 "
        "| – | – | – | – |" in text
    )
    assert (
        "| MT-bench turn 1 (1) | eagle3_chain | 4.00 | 1.00 | 45.0 | 4.00× | 2.50× | 2.000 [2.000, 2.000] "
        "| 2.000 [2.000, 2.000] | 1.0 / 10.0 | 1/1 | – | – | – | – |" in text  # absent at T=1: "–"
    )
    assert (
        "Shapes: `eagle2_tree` {kind: dynamic, depth: 5, top_k: 6}; `dflash_chain` {kind: chain, depth: 7}."
        in text
    )
    assert text.index("| eagle2 | eagle |") < text.index("| dflash | dflash |")  # as --training named them
    assert (
        "| dflash | dflash | block 8, 2 layers | 300 | 5,928,308 | 12,346 | 29.0M "
        "| 0.600 / 0.500 / 0.400 / 0.300 | 3.000 |" in text
    )
    assert "| eagle2 | eagle | – | 300 | 5,928,308 | 12,346 | 29.0M | 0.500 / 0.400 | 1.900 |" in text
    assert list(results.sections.SECTIONS)[3:5] == ["ablation", "block"]
    (first / "report.json").unlink()  # the snapshot alone renders the same document
    assert results.render(snapshots) == text
    with pytest.raises(SystemExit, match="in another source too"):
        results.comparison_entry([second, second], "eagle2_tree", {}, {})
