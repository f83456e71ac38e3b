"""The decoder families specdraft decodes losslessly, and what each needs from the code that
runs a target outside transformers' own forward.

specdraft runs the target through transformers' modules, but builds some of what the model's
``forward`` would build itself: the attention masks of a tree verification (windowed per layer
where the family has sliding windows: :func:`specdraft.data.attention.windowed_masks`) and the
logits of the final hidden states (:func:`output_logits`: the lm_head, then the family's final
logit soft-capping). A family that transforms its logits or attention some other way would decode
something else without an error, so a target must belong to a family listed here; every family is
proven by the invariant tests on a tiny random model of it (``data/tiny.py``,
``tests/test_families.py``).
"""

from __future__ import annotations

from torch import Tensor, nn

from specdraft.heads.frozen import soft_cap

# transformers' model_type of each family, and what it needs beyond the Llama decoder.
FAMILIES = frozenset(
    {
        "llama",  # Llama 2/3, SmolLM2
        "qwen2",  # Qwen2 / Qwen2.5: q/k/v biases; its window where use_sliding_window sets it
        "qwen3",  # q/k norms per head; its window where use_sliding_window sets it
        "mistral",  # a sliding window on every layer (masked; every key is kept)
        "gemma2",  # alternating windows, attention and final soft-capping (eager attention), √H
        # embedding scale, (1 + w) norms
        "gemma3_text",  # windowed and global layers with their own rotary bases, q/k norms, √H
        # embedding scale, (1 + w) norms
        "phi3",  # fused q/k/v and gate/up projections
    }
)


class UnsupportedTarget(ValueError):
    """A target whose family specdraft does not decode (one line: the family and what is supported)."""


def check_family(config) -> None:
    """Refuse a target (a transformers ``config``) of a family not in :data:`FAMILIES`."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        architecture = (getattr(config, "architectures", None) or ["?"])[0]
        raise UnsupportedTarget(
            f"target family {model_type!r} ({architecture}) is not supported: specdraft decodes "
            f"{', '.join(sorted(FAMILIES))} (docs/architecture.md §3, Target families, says what each needs)"
        )


def output_logits(config, lm_head: nn.Module, hidden: Tensor) -> Tensor:
    """The target's logits of its final hidden states ``hidden`` (...×H → ...×V): the lm_head, then
    the final logit soft-capping of a family that has one (Gemma 2: cap · tanh(logits / cap)),
    as the model's own ``forward`` computes them."""
    return soft_cap(lm_head(hidden), final_logit_softcap(config))


def final_logit_softcap(config) -> float | None:
    """The cap of a family's final logits (Gemma 2's ``final_logit_softcapping``), None: uncapped."""
    return getattr(config, "final_logit_softcapping", None) or None
