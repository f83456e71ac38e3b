"""Sweeps: Hydra multirun → report PNGs; the W&B sweep matches the Hydra one; W&B never blocks."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import assert_validated

from specdraft.recipes.sweep_report import write_report
from specdraft.train.loggers import has_wandb_credentials, wandb_mode

ROOT = Path(__file__).resolve().parents[1]


def test_wandb_sweep_matches_the_hydra_search():
    hydra_search = yaml.safe_load((ROOT / "conf/hparams_search/hass_loss_weights.yaml").read_text())
    grid = {
        key: [yaml.safe_load(v) for v in str(values).split(",")]
        for key, values in hydra_search["hydra"]["sweeper"]["params"].items()
    }
    wandb_sweep = yaml.safe_load((ROOT / "scripts/sweeps/hass_loss_weights.yaml").read_text())
    assert {k: v["values"] for k, v in wandb_sweep["parameters"].items()} == grid
    assert wandb_sweep["metric"] == {"name": "val/sim_tau", "goal": "maximize"}
    assert "${args_no_hyphens}" in wandb_sweep["command"]  # Hydra overrides, not --flags
    assert "hparams_search=wandb_point" in wandb_sweep["command"]


def test_wandb_mode_is_offline_without_credentials(tmp_path, monkeypatch):
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert not has_wandb_credentials()
    assert wandb_mode("auto") == "offline"
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password secret\n")
    assert has_wandb_credentials() and wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode("auto") == "disabled"
    with pytest.raises(ValueError, match="auto, online or offline"):
        wandb_mode("sometimes")


def test_multirun_over_two_loss_weights_gives_a_report(tmp_path):
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "WANDB_MODE": "offline",
        "WANDB_API_KEY": "",
        "NETRC": str(tmp_path / "no-netrc"),
        "WANDB_SILENT": "true",
    }
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdraft.train.cli",
            "-m",
            "experiment=hass",
            "debug=smoke",
            "logger=wandb",
            "trainer.max_steps=3",
            "loss.weights.topk=0.0,1.0",
            "loss.rollout.step_weight_base=0.5,1.0",
            f"paths.log_dir={tmp_path}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    sweep = tmp_path / "sweeps" / "sweep"
    runs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert runs == [  # one deterministic dir per point, named by its overrides
        f"loss.rollout.step_weight_base={b},loss.weights.topk={w},trainer.max_steps=3"
        for b in ("0.5", "1.0")
        for w in ("0.0", "1.0")
    ]
    # W&B ran offline inside each run dir (no network, no key).
    assert list(sweep.glob("*/wandb/offline-run-*"))
    report = write_report([sweep], tmp_path / "report")
    assert report["swept"] == ["loss.rollout.step_weight_base", "loss.weights.topk"]
    assert len(report["runs"]) == 4
    for row in report["runs"]:  # each run's best τ, as its own validation accuracies make it
        summary = json.loads((Path(row["run"]) / "summary.json").read_text())
        assert_validated(summary)
        assert row["val/sim_tau"] == summary["best_sim_tau"]
    taus = [row["val/sim_tau"] for row in report["runs"]]
    assert taus == sorted(taus, reverse=True)  # best first
    for plot in report["plots"]:
        assert Path(plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "report" / "runs.json").read_text())["metric"] == "val/sim_tau"
    # runs.csv reads back: the run dir names hold commas, so they are quoted
    with (tmp_path / "report" / "runs.csv").open(newline="") as handle:
        table = list(csv.DictReader(handle))
    assert sorted(row["run"] for row in table) == sorted(str(sweep / run) for run in runs)
    assert {row["loss.weights.topk"] for row in table} == {"0.0", "1.0"}
    # Without summary.json (a killed run), the metric comes from the CSV logs.
    for run in (p for p in sweep.iterdir() if p.is_dir()):
        (run / "summary.json").unlink()
    from_csv = write_report([sweep], tmp_path / "report-csv")
    assert sorted(r["val/sim_tau"] for r in from_csv["runs"]) == sorted(
        r["val/sim_tau"] for r in report["runs"]
    )


def test_report_reads_synced_wandb_run_dirs(tmp_path):
    """W&B run dirs as synced / downloaded (files/config.yaml with {value: …}, wandb-summary.json)."""
    for index, topk in enumerate([0.0, 1.0]):
        files = tmp_path / f"run-{index}" / "files"
        files.mkdir(parents=True)
        config = {
            "_wandb": {"value": {"cli_version": "0.31.0"}},
            "loss": {"value": {"weights": {"topk": topk}}},
        }
        (files / "config.yaml").write_text(yaml.safe_dump(config))
        (files / "wandb-summary.json").write_text(json.dumps({"val/sim_tau": 1.5 + topk}))
    report = write_report([tmp_path], tmp_path / "report")
    assert report["swept"] == ["loss.weights.topk"]
    assert [row["val/sim_tau"] for row in report["runs"]] == [2.5, 1.5]


def test_a_metric_no_run_records_and_an_unreadable_run_config_are_refused_naming_them(tmp_path):
    run = tmp_path / "sweep" / "lr=0.1"
    run.mkdir(parents=True)
    (run / "run_config.yaml").write_text("optim:\n  lr: 0.1\n")
    (run / "summary.json").write_text(json.dumps({"best_sim_tau": 2.0, "last_val": {"val/loss": 1.0}}))
    with pytest.raises(ValueError, match=r"--metric val/nope: none of the 1 runs .* records it"):
        write_report([tmp_path / "sweep"], tmp_path / "report", "val/nope")
    (run / "run_config.yaml").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match=r"run_config.yaml: not a readable run config"):
        write_report([tmp_path / "sweep"], tmp_path / "report")
    assert not (tmp_path / "report").exists()
