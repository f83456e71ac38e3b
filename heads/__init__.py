"""Draft-head modules and what they know of the target. Imports torch and safetensors only."""

from specdraft.heads.spec import TargetSpec, default_aux_layer_ids

__all__ = ["TargetSpec", "default_aux_layer_ids"]
