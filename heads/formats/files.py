"""An export directory on disk: ``config.json`` + ``model.safetensors``, written atomically.

The files are staged in a hidden sibling directory and moved into place by rename
(:func:`specdraft.system.files.write_dir_atomic`), so a reader (or a killed export) sees either no
export or a complete one. An existing export is replaced only when asked to, and then only after
the new one is complete, and ``overwrite=true`` replaces only an export that specdraft wrote.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from specdraft.heads.formats.native import is_native
from specdraft.heads.formats.record import FormatError
from specdraft.system.files import write_dir_atomic

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
GGUF_FILE = "model.gguf"  # a llama.cpp export's weights (written by llama.cpp's converter; train/llamacpp.py)
PROVENANCE_KEY = "specdraft"  # in foreign configs: which format/kind wrote them (engines ignore it)
SHOWN_ENTRIES = 5  # how many of a refused destination's files its message names


def check_destination(out_dir: Path, overwrite: bool) -> None:
    """Fail before any work when ``out_dir`` holds something we must not replace: anything, unless
    ``overwrite``; with it, anything but an export we wrote (:func:`is_our_export_dir`) — a user's
    directory that happens to be named ``out=…`` is never deleted."""
    if out_dir.is_symlink():
        raise FormatError(f"export destination {out_dir} is a symbolic link; give the directory itself")
    if out_dir.exists() and not out_dir.is_dir():
        raise FormatError(f"export destination {out_dir} exists and is not a directory")
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return
    if not overwrite:
        raise FormatError(
            f"export destination {out_dir} already holds files; choose another out=… or pass "
            "overwrite=true (the old export is replaced only once the new one is complete)"
        )
    if not is_our_export_dir(out_dir):
        shown = sorted(entry.name for entry in out_dir.iterdir())
        listed = ", ".join(shown[:SHOWN_ENTRIES]) + (", …" if len(shown) > SHOWN_ENTRIES else "")
        raise FormatError(
            f"export destination {out_dir} holds files that are not an export written by specdraft "
            f"({listed}); overwrite=true replaces only such an export: choose another out=… "
            "(nothing was touched)"
        )


def is_our_export_dir(path: Path) -> bool:
    """Exactly ``config.json`` and ``model.safetensors`` (or ``model.gguf``: a llama.cpp export),
    as regular files, and a config that specdraft wrote: the native format, or a foreign layout
    with our provenance key (engines ignore it). An export by another trainer, or one with a file
    of the user's beside it, is not."""
    entries = {entry.name: entry for entry in path.iterdir()}
    if set(entries) not in ({CONFIG_FILE, WEIGHTS_FILE}, {CONFIG_FILE, GGUF_FILE}):
        return False
    if any(entry.is_symlink() or not entry.is_file() for entry in entries.values()):
        return False
    try:
        config = json.loads(entries[CONFIG_FILE].read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    if not isinstance(config, dict):
        return False
    written_by = config.get(PROVENANCE_KEY)
    return is_native(config) or (isinstance(written_by, dict) and isinstance(written_by.get("format"), str))


def write_export_dir(
    out_dir: str | os.PathLike, config: dict[str, Any], tensors: dict[str, Tensor], overwrite: bool = False
) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into ``out_dir`` atomically."""
    out_dir = Path(out_dir)
    check_destination(out_dir, overwrite)

    def fill(staging: Path) -> None:
        # safetensors refuses shared or non-contiguous storage; exports own their tensors.
        save_file(
            {name: t.detach().cpu().contiguous().clone() for name, t in tensors.items()},
            staging / WEIGHTS_FILE,
            metadata={"format": "pt"},
        )
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            os.chmod(staging / name, 0o644)  # safetensors creates its file private; engines read it
        check_destination(out_dir, overwrite)  # again: something may have appeared meanwhile

    return write_dir_atomic(out_dir, fill)


def read_export_dir(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(config, tensors) of an export directory."""
    path = Path(path)
    config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    if (path / GGUF_FILE).is_file() and not weights_path.is_file():
        raise FormatError(
            f"{path}: a llama.cpp export ({GGUF_FILE}), which llama.cpp loads; specdraft reads the "
            "checkpoint it was exported from (its config.json names it)"
        )
    for file in (config_path, weights_path):
        if not file.is_file():
            raise FormatError(f"{path}: not an export directory (missing {file.name})")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise FormatError(f"{config_path}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise FormatError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    try:
        return config, load_file(weights_path)
    except SafetensorError as error:  # a truncated or foreign file
        raise FormatError(f"{weights_path}: not a readable safetensors file ({error})") from None


def check_tensors(tensors: dict[str, Tensor], expected: dict[str, tuple[int, ...]], where: str) -> None:
    """Exactly the ``expected`` names with these shapes (missing, unexpected and misshaped keys
    are listed together)."""
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    misshaped = {
        name: (tuple(tensors[name].shape), shape)
        for name, shape in expected.items()
        if name in tensors and tuple(tensors[name].shape) != tuple(shape)
    }
    if missing or unexpected or misshaped:
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if unexpected:
            parts.append(f"unexpected {unexpected}")
        if misshaped:
            parts.append("shape (found, expected) " + ", ".join(f"{k}: {v}" for k, v in misshaped.items()))
        raise FormatError(f"{where}: " + "; ".join(parts))


def check_finite(tensors: dict[str, Tensor], where: str) -> None:
    """Refuse weights holding a NaN or an Inf, naming each such tensor with its count: a head
    trained into NaN (or cast to a dtype its values overflow) drafts garbage, and said plainly
    here it is not mistaken for an export that "does not read back" (NaN ≠ NaN)."""
    floats = [(name, t) for name, t in tensors.items() if t.is_floating_point()]
    counts = torch.stack([(~torch.isfinite(t)).sum() for _, t in floats]).tolist() if floats else []
    bad = {name: (count, t.numel()) for (name, t), count in zip(floats, counts, strict=True) if count}
    if bad:
        shown = ", ".join(f"{name}: {count} of {size}" for name, (count, size) in sorted(bad.items()))
        raise FormatError(f"{where}: weights that are not finite (NaN/Inf values in {shown})")


def cast_floats(tensors: dict[str, Tensor], dtype: torch.dtype | None) -> dict[str, Tensor]:
    """Floating-point tensors in ``dtype`` (None: unchanged); integer/bool maps untouched."""
    if dtype is None:
        return dict(tensors)
    return {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}
