"""Build a head from its kind and config dict: the one place that maps kind names to classes, used
by training (from Hydra) and by whoever rebuilds a head from a checkpoint or an export. A new
head kind is its own module (a :class:`~specdraft.heads.interface.DraftHead`) plus one line in
:data:`HEAD_KINDS`."""

from __future__ import annotations

from typing import Any

import torch

from specdraft.heads.dflash import DFlashHead
from specdraft.heads.eagle import Eagle3Head, EagleHead
from specdraft.heads.frozen import TargetWeights
from specdraft.heads.interface import DraftHead
from specdraft.heads.medusa import MedusaHead
from specdraft.heads.spec import TargetSpec

# Where a specdraft training checkpoint keeps the head (train.module writes, eval.load reads):
# the record {kind, config, target_spec, …} under this key, weights under "state_dict" with this
# prefix (the LightningModule's ``head`` attribute).
CHECKPOINT_KEY = "specdraft"
CHECKPOINT_STATE_PREFIX = "head."

# Every head kind, by the name configs, checkpoints and exports use: one line per kind.
HEAD_KINDS: dict[str, type[DraftHead]] = {
    head.kind: head
    for head in (
        MedusaHead,
        EagleHead,
        Eagle3Head,
        DFlashHead,
    )
}


def head_class(kind: str) -> type[DraftHead]:
    """The DraftHead subclass of ``kind``; an unknown kind names the known ones."""
    if kind not in HEAD_KINDS:
        raise ValueError(f"unknown head kind {kind!r}; expected one of {sorted(HEAD_KINDS)}")
    return HEAD_KINDS[kind]


def head_config(kind: str, config: dict[str, Any]) -> Any:
    """``kind``'s config dataclass from a config dict (a "kind" entry in it is ignored)."""
    config_class = head_class(kind).config_class
    try:
        return config_class(**{k: v for k, v in dict(config).items() if k != "kind"})
    except TypeError as error:
        raise ValueError(f"head {kind}: bad config {dict(config)}: {error}") from None


def config_record(head: DraftHead) -> dict[str, Any]:
    """The config dict a checkpoint or export keeps to rebuild ``head`` (every field, as the head
    resolved it)."""
    return {k: v for k, v in head.config.to_dict().items() if k != "kind"}


def build_head(kind: str, config: dict[str, Any], spec: TargetSpec, weights: TargetWeights) -> DraftHead:
    """A fresh head of ``kind`` for the target of ``spec`` / ``weights``."""
    return head_class(kind)(spec, weights, head_config(kind, config))


def head_from_state(
    kind: str,
    config: dict[str, Any],
    spec: TargetSpec,
    weights: TargetWeights,
    state_dict: dict[str, torch.Tensor],
) -> DraftHead:
    """Rebuild a trained head from its kind, config and ``state_dict`` (strict: a missing or
    unexpected key is an error, never a silently random weight)."""
    head = build_head(kind, config, spec, weights)
    head.load_state_dict(state_dict, strict=True)
    return head
