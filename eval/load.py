"""Rebuilding a trained head for decoding from what training wrote.

A training checkpoint (``.ckpt``) holds the head's weights under ``state_dict`` (prefixed
``head.``) and its record under ``checkpoint["specdraft"]`` = {kind, config, target_spec}. It
is read with ``weights_only=True``: tensors and plain containers only, no arbitrary pickles.
The frozen target weights the head shares (embedding, lm_head, final norm) come from the target
being decoded, which must have the shape the head was trained on.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specdraft.data.target import Target, target_weights
from specdraft.heads.registry import CHECKPOINT_KEY, CHECKPOINT_STATE_PREFIX, head_from_state
from specdraft.heads.spec import TargetSpec

SHAPE_FIELDS = ("hidden_size", "num_layers", "num_kv_heads", "head_dim", "vocab_size", "intermediate_size")


def load_head(path: str | Path, target: Target, dtype: torch.dtype | None = None) -> nn.Module:
    """The head of a training checkpoint, in eval mode, on the target's device, in ``dtype``
    (default: the target's). Its ``spec`` is the spec it was trained with (aux layer ids included)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"head checkpoint {path} does not exist")
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    record = checkpoint.get(CHECKPOINT_KEY) if isinstance(checkpoint, dict) else None
    if not record or not {"kind", "config", "target_spec"} <= set(record):
        raise ValueError(f"{path}: not a specdraft training checkpoint (no {CHECKPOINT_KEY!r} record)")
    spec = TargetSpec.from_dict(record["target_spec"])
    mismatched = {
        name: (getattr(spec, name), getattr(target.spec, name))
        for name in SHAPE_FIELDS
        if getattr(spec, name) != getattr(target.spec, name)
    }
    if mismatched:
        raise ValueError(
            f"{path}: head trained for target {spec.name!r}, decoding with {target.spec.name!r}; "
            f"shapes differ (head, target): {mismatched}"
        )
    state = {
        key.removeprefix(CHECKPOINT_STATE_PREFIX): value
        for key, value in checkpoint["state_dict"].items()
        if key.startswith(CHECKPOINT_STATE_PREFIX)
    }
    head = head_from_state(record["kind"], record["config"], spec, target_weights(target), state)
    return head.to(device=target.device, dtype=dtype or target.dtype).eval().requires_grad_(False)
