"""Files that survive a kill -9, and the rule for resuming what wrote them. Imports the stdlib
only: ``specdraft.heads`` writes its exports with it.

* atomic writes: a reader sees the old file or the new one, never half of one; a directory of
  files (an export) is staged beside its destination and renamed into place whole;
* durable appends: a line (or chunk) is on disk once the call returns; a kill mid-append leaves a
  torn last line, which :func:`cut_torn_tail` removes on the next start;
* stored settings: a job writes the settings it runs with next to its outputs; a re-run resumes
  only when they match, else it refuses naming every differing key. ONE rule decides what may
  differ: the keys a job lists as ``may_change`` — how long or where it runs, never what it
  computes (a time box, a logger, a progress bar) — each as a dotted key that covers its subkeys.
  Used by training runs, the benchmark, the feature cache and regeneration.
* file checksums;
* a user's text file read line by line, so that a non-UTF-8 byte names its file and line.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

# How much of a differing value a refusal message shows.
SHOWN_VALUE_CHARS = 300


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
    raise to leave ``path`` untouched (the staging is removed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f".{path.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)  # a killed run's leftovers
    staging.mkdir()
    try:
        fill(staging)
        for file in staging.iterdir():
            fsync_file(file)
        retired = None
        if path.exists():
            retired = path.parent / f".{path.name}.old-{os.getpid()}"
            os.replace(path, retired)
        os.replace(staging, path)
        if retired is not None:
            shutil.rmtree(retired)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_dir(path.parent)  # make the renames durable
    return path


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
    ``may_change``."""
    if any(key == allowed or key.startswith(allowed + ".") for allowed in may_change):
        return []
    if isinstance(stored, dict) and isinstance(current, dict):
        return [
            line
            for name in sorted(set(stored) | set(current), key=str)
            for line in setting_differences(
                stored.get(name, "<absent>"),
                current.get(name, "<absent>"),
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
    path: str | os.PathLike, settings: dict[str, Any], may_change: Sequence[str] = ()
) -> bool:
    """The resume rule (module docstring): if ``path`` holds stored settings, raise
    :class:`SettingsMismatch` naming every key that differs outside ``may_change`` (nothing is
    touched); if it holds none, store ``settings`` atomically. Whether they were stored before
    (True: this is a resume)."""
    path = Path(path)
    settings = json.loads(json.dumps(settings))  # as it will read back (tuples -> lists, keys -> str)
    if not path.is_file():
        write_json_atomic(path, settings)
        return False
    differences = setting_differences(json.loads(path.read_text()), settings, may_change)
    if differences:
        raise SettingsMismatch(
            f"{path.parent} holds outputs made with other settings (nothing was changed):\n  "
            + "\n  ".join(differences)
        )
    return True


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
