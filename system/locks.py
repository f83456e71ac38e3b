"""One process at a time per output: a lock file beside each output a command writes.

Two commands writing the same run directory, benchmark run, cache, regeneration output or export
would mix their files silently (two trainings in one run dir, a benchmark recording every question
twice). So every command that writes an output holds :func:`output_lock` on it from before it
reads or writes anything there until it ends, exceptions included.

* The lock is the file ``<parent>/.<name>.lock`` (``.<name>.<part>.lock`` for a part of an output
  written by several processes at once, e.g. a cache's ranks): a sibling, so it survives the
  output being replaced by a rename (an export). It holds JSON: pid, host, start time, command.
* It is created atomically with its content (written to a private file, then hard-linked to the
  lock's name, which fails if the name exists): a second process finds a complete record and is
  refused with :class:`OutputLocked`, naming the holder and the locked path.
* A lock whose holder is dead (same host, pid gone: a kill -9) is stale: the next start takes it
  over, with a log line. Takers serialise on an ``flock`` of the parent directory, re-read the lock
  under it and remove it only if it is still the stale one; then the atomic create decides: exactly
  one wins, the other is refused naming the winner.
* A lock from another host is never taken over (its pid means nothing here): the refusal names it
  and says how to remove it once that process is known to be gone.

Stdlib only (``system`` imports no other specdraft package).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from specdraft.system.files import process_alive

log = logging.getLogger(__name__)

LOCK_SUFFIX = ".lock"
# A holder record without these keys is not one of ours (a damaged or foreign file).
HOLDER_KEYS = ("pid", "host", "started", "command")
# Attempts at the atomic create: one, plus one after each stale lock removed (a racing taker
# may win in between, and is then the holder named).
CREATE_ATTEMPTS = 3


class OutputLocked(ValueError):
    """Another process holds the lock of an output this command would write."""


def lock_path(output: str | os.PathLike, part: str = "") -> Path:
    """The lock file of ``output`` (of its ``part``): a hidden sibling (of the normalised path:
    ``.`` or ``a/..`` name a directory too)."""
    output = Path(os.path.abspath(output))
    name = f".{output.name}.{part}" if part else f".{output.name}"
    return output.parent / f"{name}{LOCK_SUFFIX}"


@contextlib.contextmanager
def output_lock(output: str | os.PathLike, command: str, part: str = "") -> Iterator[Path]:
    """Hold the lock of ``output`` (its ``part``) while the block runs; the lock file's path.
    Raises :class:`OutputLocked` (a ``ValueError``: one line, exit 2) if a live process holds it."""
    path = lock_path(output, part)
    record = _acquire(path, Path(output), command)
    try:
        yield path
    finally:
        _release(path, record)


def live_holders(output: str | os.PathLike) -> list[dict[str, Any]]:
    """The holders of every lock on ``output`` (all its parts) held by another live process,
    or by one on another host: who may be writing it beside this process."""
    output = Path(os.path.abspath(output))
    found = []
    name = _glob_escape(output.name)
    paths = [*output.parent.glob(f".{name}{LOCK_SUFFIX}"), *output.parent.glob(f".{name}.*{LOCK_SUFFIX}")]
    for path in sorted(paths):
        holder = _read_holder(path)
        if holder is None or (holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()):
            continue
        if holder["host"] != socket.gethostname() or process_alive(holder["pid"]):
            found.append(holder)
    return found


def _acquire(path: Path, output: Path, command: str) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    record = _record(command)
    for _ in range(CREATE_ATTEMPTS):
        if _create(path, record):
            return record
        holder = _read_holder(path)
        if holder is None:
            continue  # released between the create and the read: try again
        _refuse_unless_stale(path, output, holder)
        _remove_if_stale(path)
    raise OutputLocked(f"{output}: could not take its lock {path}; another process keeps taking it")


def _record(command: str) -> bytes:
    holder = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "token": uuid.uuid4().hex,  # tells this holding from an earlier one of the same pid
    }
    return (json.dumps(holder, sort_keys=True) + "\n").encode()


def _create(path: Path, record: bytes) -> bool:
    """Create ``path`` holding ``record``, atomically: False if it exists."""
    private = path.with_name(f"{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}")
    private.write_bytes(record)
    try:
        os.link(private, path)
        return True
    except FileExistsError:
        return False
    finally:
        private.unlink(missing_ok=True)


def _read_holder(path: Path) -> dict[str, Any] | None:
    """The holder record at ``path``; None if there is no such file; raises if it is not a record."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(raw)
        if not isinstance(holder, dict) or any(key not in holder for key in HOLDER_KEYS):
            raise ValueError("keys missing")
        holder["pid"] = int(holder["pid"])
    except (ValueError, TypeError):
        raise OutputLocked(
            f"{path} is not a lock record of ours (expected JSON with {', '.join(HOLDER_KEYS)}): "
            "remove it once no process writes that output"
        ) from None
    return holder


def _refuse_unless_stale(path: Path, output: Path, holder: dict[str, Any]) -> None:
    who = f"{holder['command']} (pid {holder['pid']} on {holder['host']}, started {holder['started']})"
    if holder["host"] != socket.gethostname():
        raise OutputLocked(
            f"{output} is locked by {who}, another machine: if that process is gone, remove {path}"
        )
    if process_alive(holder["pid"]):
        raise OutputLocked(f"{output} is in use by {who}; lock file {path}")


def _remove_if_stale(path: Path) -> None:
    """Remove the lock at ``path`` if, read again under the parent directory's flock, its holder
    is (still) a dead process of this host; only a taker serialised this way removes a lock."""
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(directory, fcntl.LOCK_EX)
        holder = _read_holder(path)
        if holder is None or holder["host"] != socket.gethostname() or process_alive(holder["pid"]):
            return  # taken over (or released) by another taker meanwhile: the create decides
        log.warning(
            "taking over the stale lock %s of %s (pid %d, started %s), which is no longer running",
            path, holder["command"], holder["pid"], holder["started"],
        )  # fmt: skip
        path.unlink()
    finally:
        os.close(directory)  # releases the flock


def _release(path: Path, record: bytes) -> None:
    """Remove the lock if it is still this holding's (never one taken over from it)."""
    try:
        if path.read_bytes() == record:
            path.unlink()
    except FileNotFoundError:
        pass


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)
