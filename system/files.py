"""Files that survive a kill -9, and the rule for resuming what wrote them. Imports the stdlib
only: ``specdraft.heads`` writes its exports with it.

* atomic writes: a reader sees the old file or the new one, never half of one; a directory of
  files (an export) is staged beside its destination and renamed into place whole, and what a
  writer killed mid-write left beside it is removed by the next write there (once its pid is dead);
* durable appends: a line (or chunk) is on disk once the call returns; a kill mid-append leaves a
  torn last line, which :func:`cut_torn_tail` removes on the next start;
* stored settings: a job writes the settings it runs with next to its outputs; a re-run resumes
  only when they match, else it refuses naming every differing key. ONE rule decides what may
  differ: :data:`OUTPUT_NEUTRAL` (how a job runs, never what it computes: a progress bar, threads,
  a time box, a logger), plus the keys a job lists as ``may_change`` (a training run's length),
  each a dotted key that covers its subkeys. Stored settings bind only once an output exists: a
  directory whose stored settings have no outputs yet (a run refused or killed before its first
  output) is taken over by the next run's settings, with a log line. Used by training runs, the
  benchmark, the feature cache and regeneration.
* file checksums;
* a user's text file read line by line, so that a non-UTF-8 byte names its file and line.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ABSENT = "<absent>"  # a key on one side only
# How much of a differing value a refusal message shows.
SHOWN_VALUE_CHARS = 300
# The settings that may change when a job resumes, in every job (dotted keys, each covering its
# subkeys; absent in a job's settings, a key is simply not there): how a job runs, not what it
# writes. Tokens, features and weights do not depend on them; the benchmark's timings do (threads,
# warm-up), as they do on the machine's load, which no setting controls.
OUTPUT_NEUTRAL = (
    "progress",  # a progress bar
    "threads",  # torch threads
    "resume",  # how a re-run treats the outputs, not what they are
    "warmup",  # the benchmark's untimed warm-up of this invocation
    "max_minutes",  # a time box limits one invocation
    "logger",  # where metrics are logged
    "datamodule.progress",
    "datamodule.num_workers",
)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over ``path``."""
    write_file_atomic(path, lambda staging: staging.write_bytes(data))


def write_file_atomic(path: str | os.PathLike, fill: Callable[[Path], object]) -> None:
    """``fill(staging)`` writes a temporary file in the same directory (by its path: a writer that
    streams to a file needs no copy of the whole in memory); it is fsynced, then renamed over
    ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(handle)
    try:
        fill(Path(staging))
        fsync_file(staging)
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)  # make the rename itself durable


def write_dir_atomic(path: str | os.PathLike, fill: Callable[[Path], object]) -> Path:
    """``fill(staging)`` writes the files of a directory into a hidden sibling of ``path``; each
    is fsynced, then the staging directory is renamed to ``path``. A directory already at ``path``
    is renamed aside just before and removed once the new one is in place, so a reader (or a
    kill) finds the old directory or the complete new one, never a part of either; ``fill`` may
    raise to leave ``path`` untouched. The staging is removed on every exit this process sees (an
    exception, Ctrl-C, SIGTERM); what a kill -9 leaves is removed by the next write to ``path``
    (:func:`remove_dead_leftovers`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_leftovers(path)
    staging = leftover_path(path, STAGING)
    shutil.rmtree(staging, ignore_errors=True)  # this pid's, from a killed run that had it before
    staging.mkdir()
    retired = None
    try:
        with terminate_as_exit():
            fill(staging)
            for file in staging.iterdir():
                fsync_file(file)
            if path.exists():
                retired = leftover_path(path, RETIRED)
                os.replace(path, retired)
            os.replace(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if retired is not None and retired.exists() and not path.exists():
            os.replace(retired, path)  # the old directory back where it was
        raise
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)  # one left (unremovable) is retried by the next write
    fsync_dir(path.parent)  # make the renames durable
    return path


# The hidden siblings a directory write leaves while it runs: ``.<name>.<role>-<host>-<pid>``.
STAGING, RETIRED = "partial", "old"


def leftover_path(path: Path, role: str) -> Path:
    """This process's staging (``STAGING``) or retired (``RETIRED``) sibling of ``path``."""
    return path.parent / f".{path.name}.{role}-{socket.gethostname()}-{os.getpid()}"


def leftover_owner(path: Path, role: str, sibling: str) -> tuple[str | None, int] | None:
    """(host, pid) of the process that named ``sibling`` a ``role`` sibling of ``path``; None:
    not one. A name without a host (``.<name>.partial-<pid>``, written before hosts were named)
    is this host's."""
    prefix = f".{path.name}.{role}-"
    if not sibling.startswith(prefix):
        return None
    host, _, pid = sibling[len(prefix) :].rpartition("-")
    return (host or None, int(pid)) if pid.isdigit() else None


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (one of another user's counts as alive; no pid
    ≤ 0 is a process: ``kill`` would signal a group)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead_leftovers(path: str | os.PathLike) -> list[Path]:
    """Remove the staging and retired siblings of ``path`` that processes of this host left when
    they died (a kill -9 mid-write: their pid is gone), and return them. A retired directory is
    the previous ``path``: a kill between the two renames left no ``path``, so it is moved back
    instead. Live processes' siblings, and other hosts', are left alone."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    host, dead = socket.gethostname(), {STAGING: [], RETIRED: []}
    for sibling in path.parent.iterdir():
        for role, found in dead.items():
            owner = leftover_owner(path, role, sibling.name)
            if owner is not None and owner[0] in (None, host) and not process_alive(owner[1]):
                found.append(sibling)
    retired = sorted(dead[RETIRED], key=lambda p: p.stat().st_mtime)
    if retired and not path.exists() and not path.is_symlink():
        os.replace(retired.pop(), path)
        log.warning("%s: a write killed mid-rename left it aside; moved back", path)
    for sibling in dead[STAGING] + retired:
        shutil.rmtree(sibling, ignore_errors=True)
        log.info("removed %s, left by a process that died while writing %s", sibling, path.name)
    return dead[STAGING] + retired


@contextlib.contextmanager
def terminate_as_exit() -> Iterator[None]:
    """SIGTERM (a scheduler's or ``timeout``'s stop) raises ``SystemExit(128 + 15)`` inside the
    block instead of ending the process at once, so its clean-up runs. Only in the main thread,
    and only where SIGTERM still has its default action (a handler someone installed stays)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def fsync_file(path: str | os.PathLike) -> None:
    """Flush ``path``'s contents to disk."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make the renames and creations inside ``directory`` durable."""
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def file_sha256(path: str | os.PathLike, chunk_bytes: int = 1 << 22) -> str:
    """SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def append_durably(path: str | os.PathLike, data: bytes) -> None:
    """Append ``data`` to ``path`` and fsync: on disk when this returns."""
    with open(path, "ab") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def cut_torn_tail(path: str | os.PathLike) -> int:
    """Cut ``path`` (a file of newline-terminated records) back to its last complete line; the
    bytes removed (a kill mid-append leaves a torn last line)."""
    path = Path(path)
    raw = path.read_bytes()
    keep = raw.rfind(b"\n") + 1
    if keep < len(raw):
        with path.open("r+b") as handle:
            handle.truncate(keep)
            os.fsync(handle.fileno())
    return len(raw) - keep


def setting_differences(
    stored: Any, current: Any, may_change: Sequence[str] = (), key: str = ""
) -> list[str]:
    """``"key.sub: stored X, now Y"`` for every leaf (mappings are walked, anything else is a
    leaf) that differs between two settings trees, except keys equal to or under an entry of
    ``may_change``. A subtree on one side only is walked too: its leaves are compared with
    ``<absent>``, so that ``may_change`` can cover some of them."""
    if any(key == allowed or key.startswith(allowed + ".") for allowed in may_change):
        return []
    if stored == ABSENT and isinstance(current, dict):
        stored = {}
    elif current == ABSENT and isinstance(stored, dict):
        current = {}
    if isinstance(stored, dict) and isinstance(current, dict):
        return [
            line
            for name in sorted(set(stored) | set(current), key=str)
            for line in setting_differences(
                stored.get(name, ABSENT),
                current.get(name, ABSENT),
                may_change,
                f"{key}.{name}".lstrip("."),
            )
        ]
    if stored == current:
        return []
    return [f"{key or '<root>'}: stored {_shown(stored)}, now {_shown(current)}"]


def _shown(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= SHOWN_VALUE_CHARS else text[:SHOWN_VALUE_CHARS] + "…"


class SettingsMismatch(ValueError):
    """A re-run whose settings differ from those its outputs were made with."""


def check_or_store_settings(
    path: str | os.PathLike,
    settings: dict[str, Any],
    may_change: Sequence[str] = (),
    outputs_exist: bool = True,
) -> bool:
    """The resume rule (module docstring): if ``path`` holds stored settings and ``outputs_exist``
    (the job's outputs made with them), raise :class:`SettingsMismatch` naming every key that
    differs outside :data:`OUTPUT_NEUTRAL` and ``may_change`` (nothing is touched); otherwise store
    ``settings`` atomically (stored ones without outputs are replaced, with a log line). Whether
    this is a resume (stored settings that match)."""
    path = Path(path)
    settings = json.loads(json.dumps(settings))  # as it will read back (tuples -> lists, keys -> str)
    if not path.is_file():
        write_json_atomic(path, settings)
        return False
    try:
        stored = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SettingsMismatch(f"{path}: stored settings that do not read as JSON ({error})") from None
    differences = setting_differences(stored, settings, [*OUTPUT_NEUTRAL, *may_change])
    if not differences:
        return True
    if outputs_exist:
        raise SettingsMismatch(
            f"{path.parent} holds outputs made with other settings (nothing was changed):\n  "
            + "\n  ".join(differences)
        )
    log.info("%s: no outputs made with these settings yet; this run's settings replace them", path)
    write_json_atomic(path, settings)
    return False


@contextlib.contextmanager
def open_utf8(path: str | os.PathLike) -> Iterator[Iterator[str]]:
    """The lines of a UTF-8 text file (``with open_utf8(p) as lines: for line in lines``), decoded
    one by one: a line that is not UTF-8 raises a ``ValueError`` naming the file and the line
    (Python's own error names neither)."""
    with open(path, "rb") as handle:

        def lines() -> Iterator[str]:
            for line_number, raw in enumerate(handle, start=1):
                try:
                    yield raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    raise ValueError(
                        f"{path}:{line_number}: not UTF-8 text (byte {raw[error.start]:#04x} at"
                        f" column {error.start + 1}; expected a UTF-8 encoded file)"
                    ) from None

        yield lines()
