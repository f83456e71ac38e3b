"""How the decoder's steps run fast: attention on the key/value heads for masked multi-token
queries (and one-token bf16 queries on a CPU), and (optionally) compiled steps. The target's
linear weights are pre-packed for oneDNN by :mod:`specdraft.data.packed_linear` (regeneration uses
them too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specdraft.heads.layers import SLOW_GROUPED_QUERY_KERNEL, stacked_query_attention

Step = TypeVar("Step", bound=Callable)


# The attention implementation our targets run under: transformers' SDPA, with masked
# multi-token queries (and one-token bf16 ones on a CPU) on the key/value heads
# (:func:`grouped_query_attention`).
GROUPED_QUERY_ATTENTION = "specdraft_grouped_sdpa"


def grouped_query_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' SDPA attention, except where it is slow on the key/value heads:

    * a multi-token query under an explicit mask (a tree verification; a batch's ragged rows):
      transformers then copies every key and value head ``groups`` times (``repeat_kv``) over the
      WHOLE past, in every layer, each step — it uses SDPA's own grouped-query path only without
      a mask. Here the query heads that share a key/value head are stacked as rows of that head
      instead (``groups·n`` rows against the past, the n×L mask tiled ``groups`` times), so nothing
      past-sized is copied: what the one-token step (transformers' ``pack_gqa``) already does, for
      n tokens;
    * a one-token bf16 query without a mask (plain decoding's step) on a CPU: transformers passes
      it to SDPA's ``enable_gqa``, whose CPU kernel takes ~5× as long there as the same query
      heads stacked as rows (:data:`~specdraft.heads.layers.SLOW_GROUPED_QUERY_KERNEL`).

    query B×H×n×d, key and value B×Hkv×L×d (query head h reads key/value head h // groups, as
    ``repeat_kv`` pairs them), attention_mask B'×1×n×L (additive or bool). Returns B×n×H×d."""
    groups = getattr(module, "num_key_value_groups", 1)
    n = query.shape[2]
    slow_kernel = (query.device.type, query.dtype) in SLOW_GROUPED_QUERY_KERNEL
    one_token = n == 1 and attention_mask is None and slow_kernel
    masked = n > 1 and attention_mask is not None and attention_mask.shape[1] == 1
    if groups == 1 or dropout or not (one_token or masked):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    output = stacked_query_attention(query, key, value, attention_mask if masked else None, scaling)
    return output.transpose(1, 2).contiguous(), None


def use_grouped_query_attention(model: nn.Module) -> bool:
    """Run ``model`` (a transformers model on SDPA attention) with :func:`grouped_query_attention`;
    its masks stay SDPA's. False (nothing changed) when the model runs another attention."""
    if model.config._attn_implementation != "sdpa":
        return False
    # transformers' extension point: a named implementation, chosen per model.
    AttentionInterface.register(GROUPED_QUERY_ATTENTION, grouped_query_attention)
    AttentionMaskInterface.register(GROUPED_QUERY_ATTENTION, sdpa_mask)
    model.set_attn_implementation(GROUPED_QUERY_ATTENTION)
    return True


def compiled_step(step: Step) -> Step:
    """``step`` (the target's decoder, a head's draft step) through ``torch.compile`` (inductor)
    with dynamic shapes: the past grows every step and trees differ in size, so static shapes
    would recompile per step. CUDA graphs come from the runner's own static steps instead
    (``graphs``, :mod:`specdraft.eval.graphs`), without a compiler.

    Packed linears (:class:`~specdraft.data.packed_linear.PackedLinear`) run as plain linears
    inside a compiled step. Measured on a 2-core AVX2 EPYC (SmolLM2 fp32, 2 threads): compiling
    the target took ~8 min and its plain step went from 83 ms (eager, packed weights) to 143 ms,
    which is why ``compile`` is off by default (conf/bench.yaml)."""
    return torch.compile(step, dynamic=True)
