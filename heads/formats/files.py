"""An export directory on disk: ``config.json`` + ``model.safetensors``, written atomically.

The files are staged in a hidden sibling directory and moved into place by rename
(:func:`specdraft.system.files.write_dir_atomic`), so a reader (or a killed export) sees either no
export or a complete one. An existing export is replaced only when asked to, and then only after
the new one is complete.
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

from specdraft.heads.formats.record import FormatError
from specdraft.system.files import write_dir_atomic

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def check_destination(out_dir: Path, overwrite: bool) -> None:
    """Fail before any work when ``out_dir`` holds something we must not replace."""
    if out_dir.exists() and not out_dir.is_dir():
        raise FormatError(f"export destination {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise FormatError(
            f"export destination {out_dir} already holds files; choose another out=… or pass "
            "overwrite=true (the old export is replaced only once the new one is complete)"
        )


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


def cast_floats(tensors: dict[str, Tensor], dtype: torch.dtype | None) -> dict[str, Tensor]:
    """Floating-point tensors in ``dtype`` (None: unchanged); integer/bool maps untouched."""
    if dtype is None:
        return dict(tensors)
    return {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}
