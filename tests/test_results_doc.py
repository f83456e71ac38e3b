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
    monkeypatch.setattr(module, "FEATURES", log_dir / "quickstart" / "features" / "regen")
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
    write(
        log_dir / "quickstart" / "features" / "regen" / "train" / "manifest.json",
        {"num_samples": 639, "num_tokens": 188364},
    )


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
