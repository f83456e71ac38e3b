"""One process at a time per output (system/locks.py): the lock primitive between real processes
(a second start refused naming the holder, a kill -9 leaving a stale lock the next start takes
over, racing takers of a stale lock with exactly one winner), two real trainings on one run dir,
and every other writing command refusing a held output before writing anything."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hydra.core.global_hydra import GlobalHydra

from specdraft.data import cache_cli, regen_cli
from specdraft.eval import cli as eval_cli
from specdraft.system.locks import OutputLocked, live_holders, lock_path, output_lock
from specdraft.train import export
from tests.test_bench import save_tiny_checkpoint
from tests.test_cli_errors import run_command

ROOT = Path(__file__).resolve().parents[1]
# A child that holds the lock of argv[1] (as command argv[2]) until its stdin closes; "held" once
# it does, or its refusal.
HOLDER = """
import sys
from specdraft.system.locks import OutputLocked, output_lock
try:
    with output_lock(sys.argv[1], sys.argv[2]):
        print("held", flush=True)
        sys.stdin.read()
except OutputLocked as error:
    print(f"refused: {error}", flush=True)
"""
# Racing takers: each waits for argv[3] to exist, then takes the lock as HOLDER does, pausing
# between finding the lock stale and removing it (so that every racer finds it stale first).
RACER = (
    """
import os, sys, time
import specdraft.system.locks as locks
def found_stale(*args, check=locks._refuse_unless_stale):
    check(*args)
    time.sleep(0.3)
locks._refuse_unless_stale = found_stale
while not os.path.exists(sys.argv[3]):
    pass
"""
    + HOLDER
)
RACERS = 6


def start_holder(output: Path, command: str = "holder", script: str = HOLDER, *extra: str):
    return subprocess.Popen(
        [sys.executable, "-c", script, str(output), command, *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def first_line(process: subprocess.Popen) -> str:
    return process.stdout.readline().strip()


def finish(process: subprocess.Popen) -> None:
    process.stdin.close()
    process.wait()


def stale_lock(output: Path) -> int:
    """A lock on ``output`` left by a process killed with SIGKILL; its pid."""
    holder = start_holder(output, "killed")
    assert first_line(holder) == "held"
    holder.send_signal(signal.SIGKILL)
    holder.wait()  # reaped: its pid names no process now
    assert lock_path(output).is_file()
    return holder.pid


def test_a_second_process_is_refused_naming_the_holder_and_the_lock_goes_with_the_holder(tmp_path):
    output = tmp_path / "run"
    holder = start_holder(output, "specdraft-train")
    assert first_line(holder) == "held"
    record = json.loads(lock_path(output).read_text())
    assert record["pid"] == holder.pid and record["command"] == "specdraft-train"
    second = start_holder(output, "second")
    refusal = first_line(second)
    finish(second)
    assert refusal.startswith("refused: ")
    assert str(output) in refusal and f"pid {holder.pid}" in refusal and socket.gethostname() in refusal
    assert record["started"] in refusal
    finish(holder)
    assert not lock_path(output).exists()
    with output_lock(output, "third"):  # released: free again
        pass


def test_a_killed_holders_lock_is_taken_over_with_a_log_line(tmp_path, caplog):
    output = tmp_path / "run"
    pid = stale_lock(output)
    with caplog.at_level("WARNING"), output_lock(output, "next") as path:
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert f"pid {pid}" in caplog.text and "stale" in caplog.text
    assert not path.exists()


def test_racing_takers_of_a_stale_lock_have_exactly_one_winner(tmp_path):
    output, go = tmp_path / "run", tmp_path / "go"
    stale_lock(output)
    racers = [start_holder(output, f"racer{i}", RACER, str(go)) for i in range(RACERS)]
    go.touch()
    outcomes = [first_line(racer) for racer in racers]
    for racer in racers:
        finish(racer)
    assert sorted(outcome.split(":")[0] for outcome in outcomes) == ["held"] + ["refused"] * (RACERS - 1)
    winner = racers[outcomes.index("held")].pid
    assert all(f"pid {winner}" in outcome for outcome in outcomes if outcome != "held")


def test_a_lock_of_another_host_is_refused_with_how_to_remove_it_and_a_release_on_error(tmp_path):
    output = tmp_path / "run"
    with pytest.raises(RuntimeError), output_lock(output, "failing"):
        raise RuntimeError("a crash inside the command")
    assert not lock_path(output).exists()  # released on the exception
    record = {"pid": os.getpid(), "host": "elsewhere", "started": "2026-01-01T00:00:00+00:00", "command": "x"}
    lock_path(output).write_text(json.dumps(record))
    refusal = f"elsewhere.*another machine.*remove {lock_path(output)}"
    with pytest.raises(OutputLocked, match=refusal), output_lock(output, "here"):
        pass
    assert json.loads(lock_path(output).read_text()) == record  # never taken over
    assert live_holders(output) == [record]


def test_two_trainings_started_together_on_one_run_dir_one_runs_the_other_is_refused(tmp_path):
    """Together, with different learning rates: one trains, the other is refused naming it; the
    run's config is the trained one's (without the lock both exit 0, config and weights mixed)."""
    run_dir = tmp_path / "train" / "together"
    script = ROOT / ".venv" / "bin" / "specdraft-train"
    command = [str(script), "experiment=eagle", "debug=smoke", "target=tiny_random", "data=tiny"]
    command += [f"hydra.run.dir={run_dir}", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    errors = {lr: tmp_path / f"stderr-{lr}" for lr in (1e-3, 1e-2)}
    runs = {
        lr: subprocess.Popen([*command, f"optim.lr={lr}"], stderr=path.open("w"), env=env)
        for lr, path in errors.items()
    }
    results = {lr: (run.wait(), errors[lr].read_text()) for lr, run in runs.items()}
    assert sorted(code for code, _ in results.values()) == [0, 2], results
    winner = next(lr for lr, (code, _) in results.items() if code == 0)
    refusal = [line for line in results[next(lr for lr in results if lr != winner)][1].splitlines() if line]
    assert len(refusal) == 1 and refusal[0].startswith("specdraft-train: error: "), refusal
    assert f"pid {runs[winner].pid}" in refusal[0] and str(run_dir) in refusal[0]
    assert yaml.safe_load((run_dir / "run_config.yaml").read_text())["optim"]["lr"] == winner
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert [group["initial_lr"] for group in state["optimizer_states"][0]["param_groups"]] == [winner]
    assert not list((run_dir / "checkpoints").glob("*-v1.ckpt"))


def hold_by_this_process(output: Path, part: str = "") -> Path:
    """A lock on ``output`` naming this (live) process, as another command's would."""
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": "now", "command": "other"}
    output.parent.mkdir(parents=True, exist_ok=True)
    lock_path(output, part).write_text(json.dumps(record))
    return lock_path(output, part)


def test_eval_cache_regen_and_export_refuse_a_held_output_before_writing(tmp_path, monkeypatch, capsys):
    """Each writing command, its output locked by a live process: exit 2, one line naming the
    holder and the output, nothing written there (Hydra's own .hydra/ in a bench run dir aside)."""
    quiet = ["hydra/job_logging=none", "hydra/hydra_logging=none", f"hydra.run.dir={tmp_path / 'hydra'}"]
    bench, cache, regen = tmp_path / "bench" / "run", tmp_path / "cache", tmp_path / "regen.jsonl"
    exported, features, other = tmp_path / "export", tmp_path / "features", tmp_path / "other.jsonl"
    checkpoint = save_tiny_checkpoint(tmp_path / "head.ckpt")
    tiny = ["target=tiny_random", "data=tiny", "progress=false"]
    commands = [  # entry, command, the locked output (its part), arguments, what must not exist after
        (eval_cli.eval_main, "specdraft-eval", bench, "", [f"checkpoint={checkpoint}", "prompts=tiny",
         "target=tiny_random", f"hydra.run.dir={bench}"], [bench / "run_config.json"]),
        (cache_cli.main, "specdraft-cache", cache, "rank-0", [*tiny, f"out_dir={cache}"], [cache]),
        (regen_cli.main, "specdraft-regen", regen, "", [*tiny, f"out_path={regen}"],
         [regen, regen.with_name(regen.name + ".meta.json")]),
        (regen_cli.main, "specdraft-regen", features, "", [*tiny, f"out_path={other}",
         f"features.dir={features}", "max_turns=1"], [other, features]),
        (export.main, "specdraft-export", exported, "", [f"checkpoint={checkpoint}", "target=tiny_random",
         "format=native", f"out={exported}"], [exported]),
    ]  # fmt: skip
    for entry, command, output, part, args, absent in commands:
        lock = hold_by_this_process(output, part)
        line = run_command(entry, command, *quiet, *args, monkeypatch=monkeypatch, capsys=capsys)
        assert f"is in use by other (pid {os.getpid()}" in line and str(output) in line, line
        assert not [path for path in absent if path.exists()], command
        lock.unlink()
    assert sorted(os.listdir(bench)) == [".hydra"]


def test_cache_ranks_lock_apart_and_a_live_rank_keeps_the_plan_binding(tmp_path, monkeypatch, capsys):
    """Rank 1 runs while another process holds rank 0's lock; while that rank lives, a plan
    without shards yet is not taken over by other settings (it may be writing them)."""
    other_rank = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        cache = tmp_path / "cache"
        record = {"pid": other_rank.pid, "host": socket.gethostname(), "started": "now", "command": "rank 0"}
        cache.mkdir()
        lock_path(cache, "rank-0").write_text(json.dumps(record))
        args = ["target=tiny_random", "data=tiny", "progress=false", f"out_dir={cache}", "world_size=2"]
        args += ["shard_tokens=200"]  # several shards: some are rank 1's
        args += [f"hydra.run.dir={tmp_path / 'hydra'}", "hydra/job_logging=none", "hydra/hydra_logging=none"]
        (cache / "plan.json").write_text(json.dumps({"num_samples": 1, "shards": []}))  # rank 0's
        line = run_command(
            cache_cli.main, "specdraft-cache", *args, "rank=1", monkeypatch=monkeypatch, capsys=capsys
        )
        assert "other settings" in line and not list(cache.glob("shard-*"))
        (cache / "plan.json").unlink()
        GlobalHydra.instance().clear()
        monkeypatch.setattr(sys, "argv", ["specdraft-cache", *args, "rank=1"])
        cache_cli.main()
        written = [int(p.stem.removeprefix("shard-")) for p in cache.glob("shard-*.json")]
        assert written and all(index % 2 == 1 for index in written)  # rank 1's shards
    finally:
        finish(other_rank)
