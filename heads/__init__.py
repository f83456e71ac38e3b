"""Draft-head modules and what they know of the target. Imports torch and safetensors only."""

from specdraft.heads.dflash import DFlashConfig, DFlashHead
from specdraft.heads.eagle import Eagle3Config, Eagle3Head, EagleConfig, EagleHead, FeatureHead
from specdraft.heads.frozen import TargetWeights, random_target_weights
from specdraft.heads.interface import DraftHead
from specdraft.heads.medusa import MedusaConfig, MedusaHead
from specdraft.heads.spec import TargetSpec, default_aux_layer_ids
from specdraft.heads.vocab import draft_vocab_from_counts, full_vocab_maps

__all__ = [
    "DFlashConfig",
    "DFlashHead",
    "DraftHead",
    "Eagle3Config",
    "Eagle3Head",
    "EagleConfig",
    "EagleHead",
    "FeatureHead",
    "MedusaConfig",
    "MedusaHead",
    "TargetSpec",
    "TargetWeights",
    "default_aux_layer_ids",
    "draft_vocab_from_counts",
    "full_vocab_maps",
    "random_target_weights",
]
