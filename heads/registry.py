"""Build a head from its kind and config dict: the one place that maps names to classes, used by
training (from Hydra) and by whoever rebuilds a head from a checkpoint or an export."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from specdraft.heads.eagle import Eagle3Config, Eagle3Head, EagleConfig, EagleHead
from specdraft.heads.frozen import TargetWeights
from specdraft.heads.medusa import MedusaConfig, MedusaHead
from specdraft.heads.spec import TargetSpec

# Where a specdraft training checkpoint keeps the head (train.module writes, eval.load reads):
# the record {kind, config, target_spec, …} under this key, weights under "state_dict" with this
# prefix (the LightningModule's ``head`` attribute).
CHECKPOINT_KEY = "specdraft"
CHECKPOINT_STATE_PREFIX = "head."

HEAD_KINDS = {
    "medusa": (MedusaHead, MedusaConfig),
    "eagle": (EagleHead, EagleConfig),
    "eagle3": (Eagle3Head, Eagle3Config),
}


def build_head(
    kind: str,
    config: dict[str, Any],
    spec: TargetSpec,
    weights: TargetWeights,
    d2t: torch.Tensor | None = None,
    t2d: torch.Tensor | None = None,
) -> nn.Module:
    """A fresh head of ``kind`` ("medusa", "eagle", "eagle3"); d2t/t2d only for EAGLE-3."""
    if kind not in HEAD_KINDS:
        raise ValueError(f"unknown head kind {kind!r}; expected one of {sorted(HEAD_KINDS)}")
    head_class, config_class = HEAD_KINDS[kind]
    config = {k: v for k, v in dict(config).items() if k != "kind"}
    try:
        head_config = config_class(**config)
    except TypeError as error:
        raise ValueError(f"head {kind}: bad config {config}: {error}") from None
    if kind == "eagle3":
        return head_class(spec, weights, head_config, d2t, t2d)
    if d2t is not None or t2d is not None:
        raise ValueError(f"head {kind} predicts over the full target vocabulary: d2t/t2d are EAGLE-3 only")
    return head_class(spec, weights, head_config)


def head_from_state(
    kind: str,
    config: dict[str, Any],
    spec: TargetSpec,
    weights: TargetWeights,
    state_dict: dict[str, torch.Tensor],
) -> nn.Module:
    """Rebuild a trained head from its kind, config and ``state_dict`` (strict: a missing or
    unexpected key is an error, never a silently random weight)."""
    d2t = t2d = None
    if kind == "eagle3" and dict(config).get("draft_vocab_size") is not None:
        if "d2t" not in state_dict or "t2d" not in state_dict:
            raise ValueError("an EAGLE-3 head with a reduced draft vocabulary needs d2t and t2d in its state")
        d2t, t2d = state_dict["d2t"], state_dict["t2d"]
    head = build_head(kind, config, spec, weights, d2t, t2d)
    head.load_state_dict(state_dict, strict=True)
    return head
