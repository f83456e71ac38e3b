"""Files that survive a kill -9, and the rule for resuming what wrote them.

* atomic writes: a reader sees the old file or the new one, never half of one;
* durable appends: a line (or chunk) is on disk once the call returns; a kill mid-append leaves a
  torn last line, which :func:`cut_torn_tail` removes on the next start;
* stored settings: a job writes the settings it runs with next to its outputs; a re-run resumes
  only when they match, else it refuses naming every differing key. ONE rule decides what may
  differ: the keys a job lists as ``may_change`` — how long or where it runs, never what it
  computes (a time box, a logger, a progress bar) — each as a dotted key that covers its subkeys.
  Used by training runs, the benchmark, the feature cache and regeneration.
* file checksums.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
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
        with open(staging, "rb") as file:
            os.fsync(file.fileno())
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)


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
