"""Nothing of the user's is lost by a write: ``overwrite=true`` replaces only an export specdraft
wrote; the staging and retired siblings of a directory write are removed on success, on failure
and on SIGTERM, and what a killed writer left is removed (or, for the old directory, moved back)
by the next write; a training run resumes only with ``weights_only=True``, whatever the
environment says (issue #62, item 7)."""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import lightning as L
import pytest
import torch
from conftest import compose_train

from specdraft.heads.formats import FormatError, read_export, write_export
from specdraft.heads.formats.files import is_our_export_dir
from specdraft.system.files import remove_dead_leftovers, write_dir_atomic
from specdraft.train import cli as train_cli
from specdraft.train import export
from specdraft.train.cli import train
from specdraft.train.run_dir import RunDirError
from tests.test_cli_errors import hydra_args, run_command
from tests.test_export import trained_record

HOST = socket.gethostname()


# -- overwrite=true ------------------------------------------------------------------------------
def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def foreign_directories(tmp_path: Path, target) -> dict[str, Path]:
    """Directories named as an export destination that hold something specdraft did not write."""
    record = trained_record(target, "eagle", {"fc_bias": False})
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.tex").write_text("three years of work")
    beside = write_export(tmp_path / "beside", record, "native", target_spec=target.spec)
    (beside / "README.md").write_text("my notes on this head")
    other = write_export(tmp_path / "other", record, "vllm", target_spec=target.spec)
    config = json.loads((other / "config.json").read_text())
    del config["specdraft"]  # as another trainer writes the same layout
    (other / "config.json").write_text(json.dumps(config))
    lookalike = tmp_path / "lookalike"
    lookalike.mkdir()
    (lookalike / "config.json").write_text('{"format": "something-else"}')
    (lookalike / "model.safetensors").write_bytes(b"the user's weights")
    return {"notes": notes, "beside": beside, "other": other, "lookalike": lookalike}


def test_overwrite_replaces_only_an_export_we_wrote(tiny_target, tmp_path):
    record = trained_record(tiny_target, "eagle", {"fc_bias": False}, seed=1)
    for name, directory in foreign_directories(tmp_path, tiny_target).items():
        before = files_of(directory)
        assert not is_our_export_dir(directory), name
        with pytest.raises(FormatError, match="not an export written by specdraft"):
            write_export(directory, record, "native", target_spec=tiny_target.spec, overwrite=True)
        assert files_of(directory) == before, name
    # Ours, in a foreign layout (its provenance key) or the native one: replaced.
    for layout in ("vllm", "native"):
        ours = write_export(
            tmp_path / f"ours-{layout}",
            trained_record(tiny_target, "eagle", {"fc_bias": False}),
            layout,
            target_spec=tiny_target.spec,
        )
        assert is_our_export_dir(ours)
        write_export(ours, record, "native", target_spec=tiny_target.spec, overwrite=True)
        assert torch.equal(read_export(ours, tiny_target.spec).state["fc.weight"], record.state["fc.weight"])
    empty = tmp_path / "empty"
    empty.mkdir()
    write_export(empty, record, "native", target_spec=tiny_target.spec, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_specdraft_export_overwrite_into_a_users_directory_is_one_line_and_touches_nothing(
    tiny_target, tmp_path, monkeypatch, capsys
):
    head = write_export(
        tmp_path / "head",
        trained_record(tiny_target, "eagle", {"fc_bias": False}),
        "native",
        target_spec=tiny_target.spec,
    )
    users = tmp_path / "mine"
    users.mkdir()
    (users / "thesis.tex").write_text("three years of work")
    line = run_command(
        export.main,
        "specdraft-export",
        "target=tiny_random",
        f"checkpoint={head}",
        "format=vllm",
        f"out={users}",
        "overwrite=true",
        *hydra_args(tmp_path),
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    assert "not an export written by specdraft (thesis.tex)" in line
    assert files_of(users) == {"thesis.tex": b"three years of work"}


# -- staging and retired siblings ----------------------------------------------------------------
def siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def write_file(name: str, text: str):
    return lambda staging: (staging / name).write_text(text)


def test_a_failed_write_leaves_the_old_directory_and_no_staging(tmp_path):
    out = write_dir_atomic(tmp_path / "out", write_file("a.txt", "old"))

    def fail(staging: Path) -> None:
        (staging / "a.txt").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_dir_atomic(out, fail)
    assert files_of(out) == {"a.txt": b"old"} and siblings(out) == []
    # A failure between the two renames (the old one moved aside): moved back.
    real_replace = os.replace
    calls = []

    def replace_then_fail(source, destination):
        calls.append(destination)
        if len(calls) == 2:
            raise OSError("renaming the staging failed")
        return real_replace(source, destination)

    with (
        mock.patch("specdraft.system.files.os.replace", replace_then_fail),
        pytest.raises(OSError, match="renaming the staging"),
    ):
        write_dir_atomic(out, write_file("a.txt", "new"))
    assert files_of(out) == {"a.txt": b"old"} and siblings(out) == []


WRITER = """
import os, signal, sys, time
from pathlib import Path
from specdraft.system.files import write_dir_atomic
def fill(staging):
    (staging / "model.safetensors").write_bytes(b"x" * 1000)
    print(staging, flush=True)
    time.sleep(60)
write_dir_atomic(Path(sys.argv[1]), fill)
"""


def killed_writer(out: Path, signum: int) -> tuple[Path, int]:
    """A real ``write_dir_atomic`` in another process, stopped by ``signum`` mid-fill: (its
    staging directory, its exit code)."""
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(WRITER), str(out)], stdout=subprocess.PIPE, text=True
    )
    staging = Path(child.stdout.readline().strip())
    child.send_signal(signum)
    code = child.wait(timeout=30)
    child.stdout.close()
    return staging, code


def test_staging_is_removed_on_sigterm_and_after_a_kill_9_by_the_next_write(tmp_path):
    out = write_dir_atomic(tmp_path / "out", write_file("a.txt", "old"))
    staging, code = killed_writer(out, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM and not staging.exists() and siblings(out) == []

    staging, code = killed_writer(out, signal.SIGKILL)
    assert code == -signal.SIGKILL and staging.is_dir()  # nothing of it could run
    assert staging.name.startswith(".out.partial-")
    write_dir_atomic(out, write_file("a.txt", "new"))
    assert files_of(out) == {"a.txt": b"new"} and siblings(out) == []


def test_dead_writers_leftovers_are_removed_live_ones_kept_and_the_old_directory_moved_back(tmp_path):
    out, dead, live = tmp_path / "out", dead_pid(), os.getppid()
    leftovers = {
        f".out.partial-{HOST}-{dead}": True,
        f".out.partial-{dead}": True,  # as named before hosts were
        f".out.old-{HOST}-{dead}": True,  # an old directory, while the new one is in place
        f".out.partial-{HOST}-{live}": False,  # a live writer's
        f".out.partial-another-host-{dead}": False,  # a writer's on another machine (a shared disk)
        f".outer.partial-{HOST}-{dead}": False,  # another destination's
    }
    out.mkdir()
    (out / "a.txt").write_text("current")
    for name in leftovers:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"69 MB")
    removed = remove_dead_leftovers(out)
    assert sorted(p.name for p in removed) == sorted(name for name, dead in leftovers.items() if dead)
    assert siblings(out) == sorted(name for name, dead in leftovers.items() if not dead)
    assert files_of(out) == {"a.txt": b"current"}

    # Killed between its two renames: no `out`, the old directory aside. It comes back.
    gone = tmp_path / "gone"
    aside = tmp_path / f".gone.old-{HOST}-{dead}"
    aside.mkdir()
    (aside / "a.txt").write_text("the previous export")
    (tmp_path / f".gone.partial-{HOST}-{dead}").mkdir()  # the complete new one, never placed
    remove_dead_leftovers(gone)
    assert files_of(gone) == {"a.txt": b"the previous export"}
    assert not any(p.name.startswith(".gone.") for p in tmp_path.iterdir())


# -- weights_only on resume ----------------------------------------------------------------------
class LeavesAMark:
    """Unpickling this runs code: it creates the file ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_resume_refuses_a_malicious_last_ckpt_even_when_the_environment_allows_pickles(tmp_path, monkeypatch):
    """A ``last.ckpt`` dropped into a run dir whose run_config.yaml matches: with
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` torch would unpickle anything a caller left unpinned."""
    run_dir = tmp_path / "run"
    cfg = compose_train(run_dir, "experiment=eagle", "debug=smoke", "logger=none")
    with mock.patch.object(L.Trainer, "fit"):  # stores the run config, trains nothing
        train(cfg)
    assert (run_dir / "run_config.yaml").is_file()
    marker = tmp_path / "code-ran"
    (run_dir / "checkpoints").mkdir(exist_ok=True)
    torch.save({"state_dict": {}, "payload": LeavesAMark(marker)}, run_dir / "checkpoints" / "last.ckpt")
    torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)  # the payload is live:
    assert marker.exists()  # loaded unsafely, it runs
    marker.unlink()
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(ValueError, match=r"last\.ckpt: not a specdraft checkpoint"):
        train(cfg)  # refused by the check before Lightning reads it (read_checkpoint)
    assert not marker.exists()
    monkeypatch.setattr(train_cli, "read_checkpoint", lambda path: None)  # Lightning's own load alone
    with pytest.raises(RunDirError, match=r"last\.ckpt: not a specdraft checkpoint .*refused to resume"):
        train(cfg)
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError):  # and the guard is torch's weights-only unpickler
        torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
