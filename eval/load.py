"""Rebuilding a trained head for decoding: from a training checkpoint or from an export.

``path`` is a training checkpoint (``.ckpt``: the head's weights under ``state_dict``, its record
under ``checkpoint["specdraft"]``, read with ``weights_only=True``) or an export directory written
by ``specdraft-export`` in any format (the native one carries the full record; the engines'
layouts take the target's spec and their own aux layer ids). The frozen target weights the head
shares (embedding, lm_head, final norm) come from the target being decoded, which must have the
shape the head was trained on.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specdraft.data.target import Target, target_weights
from specdraft.heads.formats import read_head
from specdraft.heads.registry import head_from_state


def load_head(path: str | Path, target: Target, dtype: torch.dtype | None = None) -> nn.Module:
    """The head at ``path``, in eval mode, on the target's device, in ``dtype`` (default: the
    target's). Its ``spec`` is the spec it was trained with (aux layer ids included)."""
    weights = target_weights(target)
    record = read_head(path, target.spec, target_lm_head=weights.lm_head)
    head = head_from_state(record.kind, record.config, record.spec, weights, record.state)
    return head.to(device=target.device, dtype=dtype or target.dtype).eval().requires_grad_(False)
