"""The one resume rule every job follows (system/files.py), and the durable append under it:
training runs, the benchmark, the feature cache and regeneration all store their settings with
``check_or_store_settings`` and refuse a re-run naming every differing key — once an output
exists, and never for an output-neutral setting (progress, threads, …)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra

from specdraft.data import cache_cli
from specdraft.eval import cli as eval_cli
from specdraft.system.files import (
    OUTPUT_NEUTRAL,
    SettingsMismatch,
    append_durably,
    check_or_store_settings,
    cut_torn_tail,
    setting_differences,
    write_file_atomic,
)
from tests.test_bench import save_tiny_checkpoint
from tests.test_cli_errors import run_command


def test_differences_are_dotted_leaves_with_both_values_and_may_change_covers_subkeys():
    stored = {"a": 1, "b": {"c": [1, 2], "d": "x"}, "logger": {"wandb": {"mode": "online"}}, "gone": 3}
    current = {"a": 1, "b": {"c": [1, 3], "d": "x"}, "logger": {"wandb": {"mode": "offline"}}, "new": True}
    assert setting_differences(stored, current, ["logger"]) == [
        "b.c: stored [1, 2], now [1, 3]",
        'gone: stored 3, now "<absent>"',
        'new: stored "<absent>", now true',
    ]
    assert setting_differences(stored, stored) == []
    assert setting_differences({"x": {"y": 1}}, {"x": {"y": 2}}, ["x.y"]) == []
    assert setting_differences({"xy": 1}, {"xy": 2}, ["x"]) == [
        "xy: stored 1, now 2"
    ]  # a prefix is not a parent


def test_settings_are_stored_once_then_a_match_resumes_and_a_mismatch_refuses_untouched(tmp_path):
    path = tmp_path / "run" / "settings.json"
    assert check_or_store_settings(path, {"steps": 3, "shape": (1, 2)}) is False  # stored: a new run
    stored = path.read_bytes()
    assert check_or_store_settings(path, {"steps": 3, "shape": [1, 2]}) is True  # tuples read back as lists
    assert check_or_store_settings(path, {"steps": 3, "shape": [1, 2], "box": 5}, may_change=["box"]) is True
    with pytest.raises(
        SettingsMismatch, match=r"other settings \(nothing was changed\):\n  steps: stored 3, now 4"
    ):
        check_or_store_settings(path, {"steps": 4, "shape": [1, 2]})
    assert path.read_bytes() == stored


def test_a_torn_last_line_is_cut_and_complete_lines_are_kept(tmp_path):
    path = tmp_path / "records.jsonl"
    append_durably(path, b'{"unit": 1}\n')
    append_durably(path, b'{"unit": 2}\n')
    assert cut_torn_tail(path) == 0
    with path.open("ab") as handle:
        handle.write(b'{"unit": 3, "rec')  # killed mid-append
    assert cut_torn_tail(path) == len(b'{"unit": 3, "rec')
    assert [json.loads(line)["unit"] for line in path.read_text().splitlines()] == [1, 2]


def test_a_file_written_through_its_path_replaces_the_old_whole_or_not_at_all(tmp_path):
    """write_file_atomic (feature shards, which safetensors streams to a file): a writer that
    fails part-way leaves the old file and no temporary one."""
    path = tmp_path / "shard.bin"
    write_file_atomic(path, lambda staging: staging.write_bytes(b"old"))

    def torn(staging):
        staging.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_file_atomic(path, torn)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["shard.bin"]
    write_file_atomic(path, lambda staging: staging.write_bytes(b"new"))
    assert path.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["shard.bin"]


def test_stored_settings_bind_once_an_output_exists_and_output_neutral_keys_never_do(tmp_path):
    path = tmp_path / "run" / "settings.json"
    check_or_store_settings(path, {"steps": 3, "progress": True}, outputs_exist=False)
    # A run refused before its first output: the next one's settings replace its own.
    assert check_or_store_settings(path, {"steps": 4, "progress": True}, outputs_exist=False) is False
    assert json.loads(path.read_text())["steps"] == 4
    assert {"progress", "threads"} <= set(OUTPUT_NEUTRAL)
    changed = {"steps": 4, "progress": False, "threads": 2, "datamodule": {"num_workers": 3}}
    assert check_or_store_settings(path, changed, outputs_exist=True) is True
    with pytest.raises(SettingsMismatch, match="steps: stored 4, now 5"):
        check_or_store_settings(path, {"steps": 5, "progress": True}, outputs_exist=True)


def run_to_the_end(entry, command: str, *args: str, monkeypatch) -> None:
    """Run ``entry`` as the console script ``command``; it must not exit (a refusal would)."""
    GlobalHydra.instance().clear()
    monkeypatch.setattr(sys, "argv", [command, *args])
    threads = torch.get_num_threads()
    try:
        entry()
    finally:
        torch.set_num_threads(threads)  # `threads=` sets the process's


def test_a_refused_eval_leaves_nothing_that_blocks_its_corrected_rerun_nor_a_new_progress_or_threads(
    tmp_path, monkeypatch, capsys
):
    """specdraft-eval refused for a bad temperature, before anything is written; settings stored by
    a run refused later bind nothing while no record exists: the corrected command runs; re-runs
    changing only progress, or only threads, resume (no question twice)."""
    run_dir = tmp_path / "bench" / "eval-tiny"
    args = [
        f"checkpoint={save_tiny_checkpoint(tmp_path / 'head.ckpt')}",
        "target=tiny_random",
        "prompts=tiny",
        "shortlist.size=null",
        "max_new_tokens=3",
        "progress=false",
        f"paths.log_dir={tmp_path}",
        "hydra/job_logging=none",
        "hydra/hydra_logging=none",
    ]
    line = run_command(
        eval_cli.eval_main,
        "specdraft-eval",
        *args,
        "temperatures=[-1.0]",
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    # Refused before anything was written (Hydra's own .hydra/ aside).
    assert "temperature" in line and not (run_dir / "run_config.json").exists()
    # Settings stored by a run refused later, inside its work, bind nothing while no record exists:
    (run_dir / "run_config.json").write_text(json.dumps({"temperatures": [-1.0], "max_new_tokens": 3}))
    run_to_the_end(eval_cli.eval_main, "specdraft-eval", *args, "temperatures=[0.0]", monkeypatch=monkeypatch)
    records = (run_dir / "records.jsonl").read_bytes()
    for change in ("progress=true", "threads=1"):
        run_to_the_end(
            eval_cli.eval_main, "specdraft-eval", *args, "temperatures=[0.0]", change, monkeypatch=monkeypatch
        )
        assert (run_dir / "records.jsonl").read_bytes() == records  # resumed: nothing to do
    assert len(records.splitlines()) == 3  # the tiny prompts' 3 questions, once each


def test_a_cache_takes_over_settings_without_shards_and_resumes_with_a_new_progress_or_threads(
    tmp_path, monkeypatch
):
    """specdraft-cache: plan.json left by a run refused before its first shard does not block
    another command; once shards exist, re-runs changing only progress, or only threads, resume."""
    out_dir = tmp_path / "cache"
    out_dir.mkdir()
    (out_dir / "plan.json").write_text(json.dumps({"num_samples": 1, "shards": []}))  # no shard yet
    args = [
        "target=tiny_random",
        "data=tiny",
        "limit=4",
        f"out_dir={out_dir}",
        "progress=false",
        f"hydra.run.dir={tmp_path / 'hydra'}",
        "hydra/job_logging=none",
        "hydra/hydra_logging=none",
    ]
    run_to_the_end(cache_cli.main, "specdraft-cache", *args, monkeypatch=monkeypatch)
    manifest = (out_dir / "manifest.json").read_bytes()
    assert json.loads(manifest)["num_samples"] == 4
    for change in ("progress=true", "threads=1"):
        run_to_the_end(cache_cli.main, "specdraft-cache", *args, change, monkeypatch=monkeypatch)
        assert (out_dir / "manifest.json").read_bytes() == manifest
