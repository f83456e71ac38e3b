"""How the decoder's steps run fast: pre-packed linear weights on CPU, attention on the key/value
heads for masked multi-token queries, and (optionally) compiled steps.

Measured on a 2-core AMD EPYC with AVX2 only (fp32, 2 threads, SmolLM2-135M's 211 linear layers
with distinct weights, median of 7): the default path (MKL sgemm) costs 59 ms for 1 token, 114 ms
for 4 and 104–117 ms for 12–24 — every multi-token forward re-packs each weight, so a 4-node
verification cost ~2× a plain step. The same weights pre-packed once for oneDNN cost 44 / 51 /
64 / 79 ms. Verification is where speculative decoding spends its time, so the decoder runs the
target with packed weights wherever oneDNN can pack them (fp32 on any x86 CPU; bf16 where
oneDNN has native bf16 instructions).

The weights are packed IN PLACE of the target's nn.Linear modules (their class is switched to
:class:`PackedLinear`, a subclass): the original ``weight`` stays where it was (tied embeddings,
the heads' shared lm_head and state dicts are untouched), and every caller of the model — our
runner and the HF ``generate`` baselines alike — runs the same kernels, so the comparison stays
about decoding.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

log = logging.getLogger(__name__)
Step = TypeVar("Step", bound=Callable)

# oneDNN picks a weight layout for an expected number of rows; a verification tree's node count
# is of this order, and one token runs as fast with it (measured above).
PACKING_ROWS_HINT = 16


class PackedLinear(nn.Linear):
    """An nn.Linear that also holds its weight pre-packed for oneDNN and uses it when no gradient
    is needed (the frozen target in decoding); otherwise it is a plain nn.Linear."""

    packed_weight: Tensor

    def forward(self, x: Tensor) -> Tensor:
        # Under torch.compile inductor lowers the linear itself (it cannot lower the packed op).
        if (
            x.device.type != "cpu"
            or x.dtype != self.packed_weight.dtype
            or torch.is_grad_enabled()
            or torch.compiler.is_compiling()
        ):
            return super().forward(x)
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], out.shape[-1])


def pack_linear_weights(model: nn.Module) -> int:
    """Pack every CPU nn.Linear of ``model`` for oneDNN, in place; the number packed. Where this
    CPU cannot pack the dtype (bf16 without AVX-512 / avx_ne_convert) the first weight fails and
    nothing is packed."""
    if not torch.backends.mkldnn.is_available():
        return 0
    packed = 0
    for module in model.modules():
        if type(module) is not nn.Linear or module.weight.device.type != "cpu":
            continue
        try:
            weight = torch.ops.mkldnn._reorder_linear_weight(
                module.weight.detach(), batch_size=PACKING_ROWS_HINT
            )
        except RuntimeError as error:  # e.g. bf16 without AVX-512 / avx_ne_convert
            log.info("linear weights not packed (%s): %s", module.weight.dtype, str(error).splitlines()[0])
            return packed
        # Switching the class keeps the module object, its weight and every reference to it.
        module.__class__ = PackedLinear
        module.packed_weight = weight
        packed += 1
    return packed


# The attention implementation our targets run under: transformers' SDPA, with masked
# multi-token queries on the key/value heads (:func:`grouped_query_attention`).
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
    """transformers' SDPA attention, except for a multi-token query under an explicit mask (a tree
    verification; a batch's ragged rows): transformers then copies every key and value head
    ``groups`` times (``repeat_kv``) over the WHOLE past, in every layer, each step — it uses
    SDPA's own grouped-query path only without a mask. Here the query heads that share a key/value
    head are stacked as rows of that head instead (``groups·n`` rows against the past, the n×L
    mask tiled ``groups`` times), so nothing past-sized is copied: what the one-token step
    (transformers' ``pack_gqa``) already does, for n tokens.

    query B×H×n×d, key and value B×Hkv×L×d (query head h reads key/value head h // groups, as
    ``repeat_kv`` pairs them), attention_mask B'×1×n×L (additive or bool). Returns B×n×H×d."""
    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, n, dim = query.shape
    if groups == 1 or n == 1 or attention_mask is None or attention_mask.shape[1] != 1 or dropout:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    rows = query.reshape(batch, heads // groups, groups * n, dim)  # row g·n + i: head's group g, token i
    mask = torch.cat([attention_mask] * groups, dim=2)  # the same rows (3× faster than .repeat here)
    output = torch.nn.functional.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scaling)
    return output.reshape(batch, heads, n, dim).transpose(1, 2).contiguous(), None


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

    Packed linears (:class:`PackedLinear`) run as plain linears inside a compiled step. Measured
    on a 2-core AVX2 EPYC (SmolLM2 fp32, 2 threads): compiling the target took ~8 min and its
    plain step went from 83 ms (eager, packed weights) to 143 ms, which is why ``compile`` is off
    by default (conf/bench.yaml)."""
    return torch.compile(step, dynamic=True)
