"""The one resume rule every job follows (system/files.py), and the durable append under it:
training runs, the benchmark, the feature cache and regeneration all store their settings with
``check_or_store_settings`` and refuse a re-run naming every differing key."""

from __future__ import annotations

import json

import pytest

from specdraft.system.files import (
    SettingsMismatch,
    append_durably,
    check_or_store_settings,
    cut_torn_tail,
    setting_differences,
    write_file_atomic,
)


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
