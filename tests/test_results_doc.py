"""scripts/results.py's doc stage: runs → committed snapshots → docs/results.md, and nothing measured
is lost when the runs' outputs are gone."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "results.py"


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location("results_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    log_dir = tmp_path / "outputs"
    monkeypatch.setattr(module, "LOG_DIR", log_dir)
    monkeypatch.setattr(module, "RESULTS", log_dir / "results")
    monkeypatch.setattr(module, "DOCS", tmp_path / "docs")
    monkeypatch.setattr(module, "SNAPSHOTS", tmp_path / "docs" / "results")
    return module


def write(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def fake_ablation_outputs(log_dir: Path) -> None:
    overall = {"tau": 2.345, "acceptance_per_depth": [0.61, 0.4, None], "speedup": 1.234}
    report = {
        "machine": {
            "time": "2026-11-22T23:00:00",
            "processor": "x86_64",
            "cpu_count": 2,
            "threads": 2,
            "torch": "2.13.0+cpu",
            "platform": "Linux",
        },
        "config": {
            "prompts": {"per_category": 1, "max_turns": 1, "path": "/somewhere"},
            "max_new_tokens": 128,
        },
        "results": {
            "T=0": {
                "plain": {"overall": {"tau": 1.0, "speedup": 1.0}, "per_category": {}},
                "eagle_tree": {
                    "overall": overall,
                    "lossless": {"exact_turns": 3, "turns_compared": 8},
                    "per_category": {"writing": {}},
                },
                "hf_prompt_lookup": {"overall": {"speedup": 0.617}},
            },
            "T=1": {"eagle_tree": {"overall": {"tau": 1.9, "speedup": 1.05}}},
        },
    }
    write(log_dir / "results" / "bench" / "ablation" / "report.json", report)
    summary = {"global_step": 120, "tokens_seen": 491520, "fit_seconds": 600.0, "best_sim_tau": 1.61}
    write(log_dir / "results" / "train" / "eagle" / "summary.json", {**summary, "best_checkpoint": "/x.ckpt"})
    features = log_dir / "quickstart" / "features" / "regen-768"  # named by the planned conversations
    write(features / "train" / "manifest.json", {"num_samples": 639, "num_tokens": 188364})
    run_config = log_dir / "train" / "quickstart" / "run_config.yaml"  # the quickstart training's
    run_config.parent.mkdir(parents=True)
    run_config.write_text(f"datamodule:\n  train_cache: {features / 'train'}\n")


def test_doc_renders_from_snapshots_and_keeps_what_it_cannot_reread(results, tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    measured_earlier = "a quickstart table measured on a machine that is gone"
    (docs / "results.md").write_text(f"# Results\n\n{results.QUICKSTART_TITLE}\n\n{measured_earlier}\n\n")
    fake_ablation_outputs(results.LOG_DIR)

    results.doc()
    text = (docs / "results.md").read_text()
    snapshot = json.loads((docs / "results" / "ablation.json").read_text())
    assert snapshot["data"] == {"num_samples": 639, "num_tokens": 188364}
    assert "per_category" not in snapshot["report"]["results"]["T=0"]["eagle_tree"]  # compact
    assert "path" not in snapshot["report"]["config"]["prompts"]  # no local paths committed
    assert snapshot["training"]["medusa"] is None
    # τ, α (None depths skipped), speedup, agreement, T=1, and the ratio to prompt lookup (1.234 / 0.617)
    assert "| eagle_tree | 2.35 | 0.61 / 0.40 | 1.23× | 3/8 | 1.90 | 1.05× | 2.00× |" in text
    assert "| eagle | 120 steps, 491,520 tokens seen, 10.0 min, best simulated τ 1.610 |" in text
    assert "| medusa | – |" in text
    assert "| hf_prompt_lookup | – | – | 0.62× | – | – | – | 1.00× |" in text  # τ not observable in HF
    assert "(639 conversations, 188,364 tokens)" in text
    assert measured_earlier in text  # no snapshot for the quickstart: its section is kept as it was
    assert "_Not run yet: `python scripts/results.py --stages curve doc`._" in text

    # The machine's outputs are gone: the committed snapshots alone give the same document.
    shutil.rmtree(results.LOG_DIR)
    results.doc()
    assert (docs / "results.md").read_text() == text


def test_decoder_section_reports_overheads_against_the_plain_step_and_the_auto_choice(results, tmp_path):
    step = {"draft_ms": 15.0, "verify_ms": 120.0, "bookkeeping_ms": 5.0, "plain_step_ms": 80.0}
    report = {
        "machine": {
            "time": "2026-11-23T19:00:00",
            "processor": "x86_64",
            "hardware": {"name": "AMD EPYC", "cpu_flags": ["avx2"]},
            "cpu_count": 2,
            "threads": 2,
            "torch": "2.13.0+cpu",
            "platform": "Linux",
        },
        "config": {
            "prompts": {"per_category": 2, "max_turns": 1, "path": "/somewhere"},
            "max_new_tokens": 128,
            "checkpoint": "/tmp/heads/eagle-step300.ckpt",
        },
        "methods": {
            "plain": {"type": "plain", "lossless": True},
            "head_auto": {
                "type": "head",
                "lossless": True,
                "auto_shape": {
                    "chosen": {"kind": "chain", "depth": 1},
                    "predicted_tokens_per_s": 14.4,
                    "measured_tokens_per_s": 12.5,
                    "latency": {"plain_ms": 78.0, "verify_ms": {"12": 117.0, "2": 81.0}},
                    "predictions": [
                        {
                            "shape": {"kind": "chain", "depth": 1},
                            "predicted_tokens_per_s": 14.4,
                            "measured_tokens_per_s": 12.5,
                            "tokens_per_step": 1.25,
                        },
                        {"shape": {"kind": "plain"}, "predicted_tokens_per_s": 12.8, "tokens_per_step": 1.0},
                    ],
                },
            },
        },
        "results": {
            "T=0": {
                "plain": {"overall": {"tokens_per_s": 12.0, "verify_ms": 80.0}},
                "head_dynamic": {
                    "overall": {"tokens_per_s": 9.0, "speedup": 0.75, "tau": 1.5, "mean_nodes": 12.0, **step},
                    "lossless": {"exact_turns": 16, "turns_compared": 16},
                },
                "head_auto": {
                    "overall": {"tokens_per_s": 12.3, "speedup": 1.025, "tau": 1.2, "mean_nodes": 2.0, **step}
                },
            }
        },
    }
    write(results.RESULTS / "bench" / "decoder" / "report.json", report)
    docs = tmp_path / "docs"
    results.doc("300 EAGLE steps on ShareGPT")
    text = (docs / "results.md").read_text()
    assert "| head_dynamic | 9.00 | 0.750× | 1.50 | 12.0 | 15.0 | 120.0 | 5.0 | 0.25 | 16/16 |" in text
    assert "| plain | 12.00 | 1× | – | – | – | 80.0 | – | – | – |" in text
    assert "`head_auto` (`shape: auto`) chose `{kind: chain, depth: 1}`: predicted 14.40 tok/s" in text
    assert "12.50 tok/s decoding the calibration prompts, 12.30 tok/s in this benchmark. " in text
    assert "2 nodes 81.0, 12 nodes 117.0 ms" in text  # sorted by node count
    assert "`eagle-step300.ckpt` — 300 EAGLE steps on ShareGPT" in text
    snapshot = json.loads((docs / "results" / "decoder.json").read_text())
    assert (
        snapshot["head"]["checkpoint"] == "eagle-step300.ckpt" and "path" not in snapshot["config"]["prompts"]
    )

    shutil.rmtree(results.LOG_DIR)  # the outputs are gone; the snapshot keeps the provenance too
    results.doc()
    assert (docs / "results.md").read_text() == text


def test_quickstart_runs_without_a_snapshot_keep_their_text_and_get_their_machine(results) -> None:
    previous = [
        "Machine: 2026-11-22, x86_64 × 2 cores.",
        "",
        "### `make run` (run `quickstart`)",
        "",
        "- data: 639 conversations",
        "",
        "### `another` (run `fresh`)",
        "",
        "- data: 1 conversation",
        "",
    ]
    kept = results.kept_runs(previous, snapshotted={"fresh"})  # `fresh` is re-rendered from its snapshot
    assert kept == [
        "### `make run` (run `quickstart`)",
        "",
        "- machine: 2026-11-22, x86_64 × 2 cores",
        "- data: 639 conversations",
        "",
    ]
    assert results.kept_runs(["", *kept], snapshotted=set()) == kept  # idempotent on the next render
