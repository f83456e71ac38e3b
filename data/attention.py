"""The frozen target's attention: ONE grouped-query attention function, registered with
transformers under our names, for the decoder's steps (:func:`use_grouped_query_attention`:
the target runner, batches, the training budget's probe) and regeneration's one-token steps
(:func:`slot_attention`).

transformers' SDPA path is slow on the key/value heads in two places, and both fixes stack the
query heads that share a key/value head as rows of that head (what transformers' ``pack_gqa``
does for one token), so nothing past-sized is copied per query head:

* a multi-token query under an explicit mask (a tree verification; a batch's ragged rows):
  transformers copies every key and value head ``groups`` times (``repeat_kv``) over the WHOLE
  past, in every layer, each step — it uses SDPA's own grouped-query path only without a mask;
* a one-token query: on a CPU, SDPA's ``enable_gqa`` kernel takes ~5× as long in bf16 as the
  same query heads stacked as rows (:data:`~specdraft.heads.layers.SLOW_GROUPED_QUERY_KERNEL`),
  and on contiguous keys and values (regeneration's buffers, data/generate.py) two batched
  products on the key/value heads are ~2× CPU SDPA's one-token kernel (64 rows × 600 columns,
  bf16).

The one-token products run where they were measured: regeneration's steps, whose caches are
contiguous (``one_token_products=True``); the runner's one-token step reads a strided prefix view
of its cache and keeps the stacked SDPA rows (bf16 on a CPU) or SDPA itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from specdraft.heads.layers import SLOW_GROUPED_QUERY_KERNEL, stacked_query_attention

# The attention implementation our targets run under: transformers' SDPA, with masked
# multi-token queries (and one-token bf16 ones on a CPU) on the key/value heads.
GROUPED_QUERY_ATTENTION = "specdraft_grouped_sdpa"
SLOT_ATTENTION = "specdraft_slot_attention"  # regeneration's one-token steps (slot_attention)


def grouped_query_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    one_token_products: bool = False,
    fallback: Callable = sdpa_attention_forward,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention (``fallback``: SDPA), except where it is slow on the key/value
    heads (see the module docstring):

    * ``one_token_products`` (regeneration): a one-token query on contiguous keys and values
      runs as two batched products (:func:`_one_token_products`); everything else (prefills,
      dropout, strided caches) goes to ``fallback``;
    * otherwise (the decoder): a masked multi-token query, and a one-token unmasked query where
      SDPA's grouped-query kernel is slow, run with the query heads stacked as rows of their
      key/value head (:func:`~specdraft.heads.layers.stacked_query_attention`).

    query B×H×n×d, key and value B×Hkv×L×d (query head h reads key/value head h // groups, as
    ``repeat_kv`` pairs them), attention_mask B'×1×n×L (additive or bool) or None. Returns
    B×n×H×d."""
    n = query.shape[2]
    if dropout:
        return fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if one_token_products:
        if n == 1 and key.is_contiguous() and value.is_contiguous():
            return _one_token_products(query, key, value, attention_mask, scaling), None
        return fallback(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    slow_kernel = (query.device.type, query.dtype) in SLOW_GROUPED_QUERY_KERNEL
    one_token = n == 1 and attention_mask is None and slow_kernel
    masked = n > 1 and attention_mask is not None and attention_mask.shape[1] == 1
    if groups == 1 or not (one_token or masked):
        return fallback(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    output = stacked_query_attention(query, key, value, attention_mask if masked else None, scaling)
    return output.transpose(1, 2).contiguous(), None


def _one_token_products(
    query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, scaling: float | None
) -> Tensor:
    """A one-token query's attention as two batched products on the key/value heads, the query
    heads that share one stacked as its rows. The scores are rounded to the keys' dtype before
    the fp32 softmax (a CPU has no bf16 product with fp32 output); the weights are, as in SDPA's
    CPU kernel. query B×H×1×d, key and value B×Hkv×L×d (contiguous), attention_mask B×1×1×L
    (bool: True where visible, or additive) or None. Returns B×1×H×d."""
    batch, heads, _, dim = query.shape
    rows = query.reshape(batch, key.shape[1], heads // key.shape[1], dim)
    scores = torch.matmul(rows, key.transpose(-1, -2)).float() * (dim**-0.5 if scaling is None else scaling)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    elif attention_mask is not None:
        scores = scores + attention_mask.float()
    output = torch.matmul(scores.softmax(-1).to(value.dtype), value)
    return output.reshape(batch, heads, 1, dim).transpose(1, 2)


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


@contextmanager
def slot_attention(model: nn.Module) -> Iterator[None]:
    """Run ``model``'s one-token steps on contiguous caches with :func:`grouped_query_attention`'s
    one-token products inside the block, its other forwards with the attention it ran before
    (restored after). Only on a CPU (where it was measured) and for attentions that take SDPA's
    masks; others are left as they are."""
    previous = model.config._attn_implementation
    sdpa_masks = ALL_MASK_ATTENTION_FUNCTIONS.get(previous) is sdpa_mask
    sdpa_like = previous in ALL_ATTENTION_FUNCTIONS and sdpa_masks
    if not sdpa_like or next(model.parameters()).device.type != "cpu":
        yield
        return
    name = f"{SLOT_ATTENTION}:{previous}"
    attention = partial(
        grouped_query_attention, one_token_products=True, fallback=ALL_ATTENTION_FUNCTIONS[previous]
    )
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


# -- sliding windows ------------------------------------------------------------------------------
SLIDING_ATTENTION = "sliding_attention"  # transformers' layer type of a windowed layer


def attention_windows(config) -> dict[str | None, int | None]:
    """How many keys each kind of layer of the decoder sees, by the name transformers keys its
    per-kind masks with: ``{layer type: window or None (all)}`` for a model whose config lists
    ``layer_types`` (Gemma 2/3, Qwen2/3: windowed and global layers), ``{None: window}`` for one
    whose every layer shares one mask (Mistral). A window of W keys: a query at position p sees
    the keys at positions p − W + 1 .. p. Every window None: no layer is windowed."""
    window = getattr(config, "sliding_window", None)
    if not getattr(config, "use_sliding_window", True):  # Qwen2/3 carry a window they do not use
        window = None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return {kind: window if kind == SLIDING_ATTENTION else None for kind in sorted(set(layer_types))}
    return {None: window}


def windowed_masks(
    mask: Tensor, windows: dict[str | None, int | None], query_positions: Tensor, key_positions: Tensor
) -> Tensor | dict[str, Tensor]:
    """``mask`` (B×1×n×keys, additive or bool: True visible) with each window of
    :func:`attention_windows` applied: the mask itself where no layer is windowed, the windowed
    mask for a model whose layers share one, else a mask per layer type (transformers takes the
    dict as it is). query_positions B×n, key_positions B×keys: the rotary positions of the
    queries and of the keys in the cache's columns (a tree's nodes sit at their depth, not their
    column)."""
    if all(window is None for window in windows.values()):
        return mask
    distance = query_positions[:, None, :, None] - key_positions[:, None, None, :]  # B×1×n×keys
    hidden = mask.new_zeros(()) if mask.dtype == torch.bool else torch.finfo(mask.dtype).min

    def windowed(window: int | None) -> Tensor:
        return mask if window is None else mask.masked_fill(distance >= window, hidden)

    if None in windows:  # one mask for every layer
        return windowed(windows[None])
    return {kind: windowed(window) for kind, window in windows.items()}


def column_positions(keys: int, written: Tensor, positions: Tensor) -> Tensor:
    """B×keys rotary positions of a cache's columns: column c holds position c (a committed
    past), except the columns ``written`` this step (n or B×n), which hold ``positions`` (B×n)."""
    columns = torch.arange(keys, device=positions.device).expand(len(positions), keys).clone()
    return columns.scatter_(1, written.expand_as(positions), positions)
