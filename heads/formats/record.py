"""A trained head as plain data: what every format writes from and reads back into."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from specdraft.heads.spec import TargetSpec

# The target fields a head's weights depend on: a head built for another value of any of them
# loads with the wrong shapes, or (num_layers: aux taps) reads the wrong layers.
SHAPE_FIELDS = (
    "hidden_size",
    "num_layers",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
)


class FormatError(ValueError):
    """An export or a file that does not fit a format (names the file/field and what was expected)."""


@dataclass(frozen=True)
class HeadRecord:
    """kind (a key of ``heads.registry.HEAD_KINDS``), the head config dict, the TargetSpec it was trained
    for, its state_dict in specdraft names (``head.state_dict()``, d2t/t2d included), and
    provenance (checkpoint path, tokens seen; informational)."""

    kind: str
    config: dict[str, Any]
    spec: TargetSpec
    state: dict[str, Tensor]
    provenance: dict[str, Any] = field(default_factory=dict)


def check_target(head_spec: TargetSpec, target_spec: TargetSpec, what: str) -> None:
    """Refuse a head trained for another target: names both targets and every differing field."""
    differing = {
        name: (getattr(head_spec, name), getattr(target_spec, name))
        for name in SHAPE_FIELDS
        if getattr(head_spec, name) != getattr(target_spec, name)
    }
    if differing:
        shown = ", ".join(f"{name}: head {a} vs target {b}" for name, (a, b) in differing.items())
        raise FormatError(
            f"{what}: the head was trained for target {head_spec.name!r}, not for {target_spec.name!r} "
            f"({shown})"
        )
