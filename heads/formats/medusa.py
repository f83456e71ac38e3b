"""Medusa heads in vLLM's layout: ``blocks.{i}.layers.{j}.{weight,bias}``, ``lm_heads.{i}.weight``.

vLLM builds its residual blocks WITHOUT a bias unless the config says ``medusa_fc_bias: true``
and then skips the file's biases silently; specdraft's blocks always have one, so it is written.
A head that drafts through the target's own lm_head is written with ``original_lm_head: true``
and the target's real lm_head as ``lm_heads.0.weight`` (vLLM shares it across heads).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from specdraft.heads.formats.record import FormatError, HeadRecord
from specdraft.heads.medusa import MedusaConfig
from specdraft.heads.spec import TargetSpec

# Residual-block weight names: specdraft's (head i, block j) and vLLM's.
_BLOCK = (re.compile(r"^blocks\.(\d+)\.(\d+)\.linear\.(weight|bias)$"), "blocks.{}.{}.linear.{}")
_VLLM_BLOCK = (re.compile(r"^blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)$"), "blocks.{}.layers.{}.{}")


def _rename_blocks(
    tensors: dict[str, Tensor], source: tuple, destination: tuple, where: str
) -> dict[str, Tensor]:
    """Block weights renamed from one naming to the other; ``lm_heads.*`` kept; anything else refused."""
    renamed = {}
    for name, tensor in tensors.items():
        if match := source[0].match(name):
            renamed[destination[1].format(*match.groups())] = tensor
        elif name.startswith("lm_heads."):
            renamed[name] = tensor
        else:
            raise FormatError(f"{where}: unexpected weight {name!r}")
    return renamed


def medusa_shapes(
    spec: TargetSpec, num_heads: int, num_layers: int, shared_lm_head: bool
) -> dict[str, tuple[int, ...]]:
    hidden = spec.hidden_size
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(num_heads):
        for j in range(num_layers):
            shapes[f"blocks.{i}.layers.{j}.weight"] = (hidden, hidden)
            shapes[f"blocks.{i}.layers.{j}.bias"] = (hidden,)
    for i in range(1 if shared_lm_head else num_heads):
        shapes[f"lm_heads.{i}.weight"] = (spec.vocab_size, hidden)
    return shapes


def medusa_files(
    record: HeadRecord, dtype: str, target_lm_head: Tensor | None
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    head_config = MedusaConfig(**{k: v for k, v in record.config.items() if k != "kind"})
    own = head_config.own_lm_head
    tensors = _rename_blocks(record.state, _BLOCK, _VLLM_BLOCK, "format medusa")
    if not own:
        if target_lm_head is None:
            raise FormatError(
                "format medusa: this head drafts through the target's lm_head; the export needs the "
                "target's weights to write it (vLLM has no other way to get it)"
            )
        tensors["lm_heads.0.weight"] = target_lm_head.detach()
    spec = record.spec
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": spec.hidden_size,
        "vocab_size": spec.vocab_size,
        "num_heads": head_config.num_heads,
        "num_hidden_layers": head_config.num_layers,
        "medusa_fc_bias": True,
        "original_lm_head": not own,
        "truncated_vocab_size": spec.vocab_size,
        "torch_dtype": dtype,
    }
    return config, tensors


def medusa_record(
    config: dict[str, Any], tensors: dict[str, Tensor], spec: TargetSpec, target_lm_head: Tensor | None
) -> HeadRecord:
    if not config.get("medusa_fc_bias", False):
        raise FormatError(
            "medusa config: medusa_fc_bias is not true; specdraft's residual blocks have a bias"
        )
    shared = bool(config.get("original_lm_head", False))
    state = _rename_blocks(tensors, _VLLM_BLOCK, _BLOCK, "medusa export")
    if shared:
        lm_head = state.pop("lm_heads.0.weight", None)
        if (
            lm_head is not None
            and target_lm_head is not None
            and not torch.equal(lm_head, target_lm_head.to(lm_head.dtype))
        ):
            raise FormatError(
                "medusa export: original_lm_head is true but lm_heads.0 is not this target's lm_head"
            )
    head_config = {
        "num_heads": int(config["num_heads"]),
        "num_layers": int(config["num_hidden_layers"]),
        "own_lm_head": not shared,
        "kind": "medusa",
    }
    return HeadRecord("medusa", head_config, spec, state)
