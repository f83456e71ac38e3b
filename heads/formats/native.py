"""specdraft's own export: everything needed to rebuild the head exactly, and nothing of the target.

config.json: ``{format, format_version, kind, head_config, target_spec, target: {name, revision},
draft_vocab_size, provenance}``; model.safetensors: the head's state_dict in specdraft names
(EAGLE-3's ``d2t`` offsets and ``t2d`` mask included). The frozen target pieces (embedding,
lm_head, final norm) are never in it: they come from the target at load time.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from specdraft.heads.formats.record import FormatError, HeadRecord
from specdraft.heads.spec import TargetSpec

NATIVE_FORMAT = "specdraft-head"
NATIVE_FORMAT_VERSION = 1


def native_files(record: HeadRecord) -> tuple[dict[str, Any], dict[str, Tensor]]:
    config = {
        "format": NATIVE_FORMAT,
        "format_version": NATIVE_FORMAT_VERSION,
        "kind": record.kind,
        "head_config": dict(record.config),
        "target_spec": record.spec.to_dict(),
        "target": {"name": record.spec.name, "revision": record.spec.revision},
        "draft_vocab_size": int(record.state["d2t"].numel())
        if "d2t" in record.state
        else record.spec.vocab_size,
        "provenance": dict(record.provenance),
    }
    return config, dict(record.state)


def is_native(config: dict[str, Any]) -> bool:
    return config.get("format") == NATIVE_FORMAT


def native_record(config: dict[str, Any], tensors: dict[str, Tensor], where: str) -> HeadRecord:
    version = config.get("format_version")
    if version != NATIVE_FORMAT_VERSION:
        raise FormatError(
            f"{where}: format_version {version!r} is not supported (expected {NATIVE_FORMAT_VERSION})"
        )
    missing = [key for key in ("kind", "head_config", "target_spec") if key not in config]
    if missing:
        raise FormatError(f"{where}: missing fields {missing}")
    try:
        spec = TargetSpec.from_dict(config["target_spec"])
    except (TypeError, ValueError) as error:
        raise FormatError(f"{where}: field target_spec: {error}") from None
    return HeadRecord(
        config["kind"], dict(config["head_config"]), spec, dict(tensors), dict(config.get("provenance", {}))
    )
