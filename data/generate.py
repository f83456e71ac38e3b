"""Batched greedy generation for the regeneration stage, faster than ``generate`` on a CPU.

Profiling ``model.generate`` on SmolLM2 (bf16, 48 rows, ~300-token prompts) put 35 % of a decode
step in ``torch.cat`` — the dynamic KV cache re-copies every layer's keys and values at every
token — and kept computing rows that had already ended. Here the KV cache is allocated once, one
row per slot, and written in place at each row's own column; a row whose answer ended takes the
next prompt of the queue at once (continuous batching: its prefill runs beside the batch and is
copied into the slot), and once the queue is empty ended rows leave the batch when they are a
quarter of it.

Attention was then the largest cost (43 % of a 64-row bf16 regeneration on a 2-core EPYC, more
than the linear layers): transformers' SDPA read the keys and values of every row through a slice
of the preallocated buffer, and on a CPU a product over that strided slice runs ~5× slower than
over contiguous memory. So the buffers hold only the columns in use (grown and shrunk by
``window_grain`` columns, each a copy of the cache), always contiguous, and on a CPU a one-token
step's attention is two batched products on the key/value heads (:func:`one_token_attention`).

What is left is near this design's floor on a CPU (128 rows, bf16, 2-core AVX-512-bf16 EPYC): of
a decode step 43 % is the linear layers (at about the machine's bf16 matmul rate) and 30-38 %
attention, which reads the whole KV cache from memory once per step. Every row reads the columns
up to the furthest row's, of which 41 % are masked for it; blocks of rows, each reading only its
own furthest column, would not win them back: on a traced run (512 first turns), fixed blocks of
16-64 rows read ≤ 3 % fewer columns (some long row sits in every block), and blocks re-sorted by
length at each resize 28 % fewer, for 4-8× the attention's operations per layer — and a block
reading a column slice of a shared buffer pays a copy (a bf16 ``bmm`` copies operands with
non-standard batch strides: 2.6-5.8× the time of contiguous ones).

Apart from that attention (the same sums in another order) the arithmetic is the model's own
forward; in fp32 the tokens equal ``generate(do_sample=False)``'s on each prompt alone (tested).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

if TYPE_CHECKING:
    from specdraft.data.capture import FeatureCapture

COMPACT_FRACTION = 0.25  # drop ended rows once they are this share of the batch (a copy of the cache)
# Columns the KV buffers grow and shrink by: each resize copies the cache (~0.1 s at 64 rows × 600
# columns), so it comes at most once per this many steps, and attention reads at most this many
# columns that no row uses.
WINDOW_GRAIN = 64
# Prompts prefilled in one forward at most. A batch's first prefill took all its rows at once,
# padded to the longest: the quickstart's probe (128 first turns, 92 tokens on average) padded ~5×
# the tokens it needed (probed in 0:34, was 1:24). A chunk's first 128 rows (its shortest prompts)
# prefill faster in groups too: 1.6-1.7 s against 1.9-2.2 s in one forward for the first chunk of
# 512 ShareGPT first turns, 3.0 s against 5.1-5.2 for the second (bf16, 2-core AVX-512-bf16 EPYC).
PREFILL_ROWS = 16
SLOT_ATTENTION = "specdraft_slot_attention"  # our name in transformers' AttentionInterface


def one_token_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    fallback: Callable = ALL_ATTENTION_FUNCTIONS["sdpa"],
    **kwargs,
) -> tuple[Tensor, None]:
    """A one-token decode step's attention as two batched products on the key/value heads, the
    query heads that share one stacked as its rows (as transformers' ``pack_gqa`` does for SDPA).
    On contiguous keys and values this is ~2× CPU SDPA's one-token kernel (64 rows × 600 columns,
    bf16). The scores are rounded to the keys' dtype before the fp32 softmax (a CPU has no bf16
    product with fp32 output); the weights are, as in SDPA's CPU kernel. Anything else
    (prefills, dropout, strided caches) goes to ``fallback``.

    query B×H×1×d, key and value B×Hkv×L×d (query head h reads key/value head h // (H/Hkv), as
    ``repeat_kv`` pairs them), attention_mask B×1×1×L (bool: True where visible, or additive) or
    None. Returns B×1×H×d."""
    batch, heads, length, dim = query.shape
    if length != 1 or dropout or not (key.is_contiguous() and value.is_contiguous()):
        return fallback(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    rows = query.reshape(batch, key.shape[1], heads // key.shape[1], dim)
    scores = torch.matmul(rows, key.transpose(-1, -2)).float() * (dim**-0.5 if scaling is None else scaling)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    elif attention_mask is not None:
        scores = scores + attention_mask.float()
    output = torch.matmul(scores.softmax(-1).to(value.dtype), value)
    return output.reshape(batch, heads, 1, dim).transpose(1, 2), None


@contextmanager
def slot_attention(model: nn.Module) -> Iterator[None]:
    """Run ``model``'s one-token steps with :func:`one_token_attention` inside the block, its other
    forwards with the attention it ran before (restored after). Only on a CPU (where it was
    measured) and for attentions that take SDPA's masks; others are left as they are."""
    previous = model.config._attn_implementation
    sdpa_masks = ALL_MASK_ATTENTION_FUNCTIONS.get(previous) is sdpa_mask
    sdpa_like = previous in ALL_ATTENTION_FUNCTIONS and sdpa_masks
    if not sdpa_like or next(model.parameters()).device.type != "cpu":
        yield
        return
    name = f"{SLOT_ATTENTION}:{previous}"
    # transformers' extension point: a named implementation, chosen per model.
    attention = partial(one_token_attention, fallback=ALL_ATTENTION_FUNCTIONS[previous])
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


class PreallocatedLayer(DynamicLayer):
    """One layer's KV cache for a prefill: B×h×capacity×d buffers written in place; ``keys`` /
    ``values`` are views of the filled B×h×length×d part (what attention and the mask sizes read)."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity, self.length = capacity, 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, dim = key_states.shape
        self.key_buffer = key_states.new_empty(batch, heads, self.capacity, dim)
        self.value_buffer = value_states.new_empty(batch, heads, self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache of {self.capacity} positions cannot hold {end}")
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a preallocated generation cache is never cropped")


class SlotLayer(DynamicLayer):
    """One layer's KV cache for continuous batching: B×h×columns×d buffers, one row per slot,
    each slot writing its next key at its own column (``slots.write``). Attention reads all
    ``slots.columns`` (contiguous: see the module docstring); which of them a row may see is the
    attention mask's business."""

    def __init__(self, slots: Slots) -> None:
        super().__init__()
        self.slots = slots

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        raise RuntimeError("a slot cache is filled by Slots.load, not by a forward")

    def allocate(self, batch: int, heads: int, key_dim: int, value_dim: int, dtype, device) -> None:
        self.dtype, self.device = dtype, device
        columns = self.slots.columns
        self.key_buffer = torch.zeros(batch, heads, columns, key_dim, dtype=dtype, device=device)
        self.value_buffer = torch.zeros(batch, heads, columns, value_dim, dtype=dtype, device=device)
        self.is_initialized = True

    def resize(self, columns: int) -> None:
        """Keep the first ``columns`` columns (zeros past the old ones)."""
        kept = min(columns, self.key_buffer.shape[2])
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], columns, old.shape[3])
            new[:, :, :kept] = old[:, :, :kept]
            setattr(self, name, new)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        rows = torch.arange(key_states.shape[0], device=key_states.device)
        self.key_buffer[rows, :, self.slots.write] = key_states[:, :, 0]
        self.value_buffer[rows, :, self.slots.write] = value_states[:, :, 0]
        return self.key_buffer, self.value_buffer

    def get_seq_length(self) -> int:
        return self.slots.columns - 1  # what precedes the one new column of a decode step

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.slots.columns, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a slot cache is never cropped")

    def batch_select_indices(self, indices: Tensor) -> None:
        self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]


class Slots:
    """The per-row state of a continuous batch: the column each row writes next (``write``), its
    next rotary position (``position``), which cache columns it may attend (``visible``), and how
    many columns the buffers hold (``columns``: a multiple of ``grain``, at least the furthest
    row's next column + 1)."""

    def __init__(self, batch: int, capacity: int, num_layers: int, device: torch.device, grain: int) -> None:
        self.capacity, self.grain = capacity, grain
        self.write = torch.zeros(batch, dtype=torch.long, device=device)
        self.position = torch.zeros(batch, dtype=torch.long, device=device)
        # as many columns as the buffers may grow to (capacity rounded up to the grain)
        self.visible = torch.zeros(batch, -(-capacity // grain) * grain, dtype=torch.long, device=device)
        self.cache = Cache(layers=[SlotLayer(self) for _ in range(num_layers)])
        self.columns = grain

    def fit(self, needed: int) -> None:
        """Hold ``needed`` columns: grow to the next multiple of ``grain``, or shrink to it when
        ``grain`` or more columns past ``needed`` are unused (nothing past a row's write column
        is visible to it, so columns at or past the furthest row's are free)."""
        if needed > self.capacity:
            raise RuntimeError(f"KV cache of {self.capacity} positions cannot hold {needed}")
        columns = -(-needed // self.grain) * self.grain
        if columns == self.columns:
            return
        self.columns = columns
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.resize(columns)

    def load(self, slots: Tensor, prefill: Cache, attention_mask: Tensor) -> None:
        """Copy a left-padded prefill (rows i of ``prefill``, W columns) into rows ``slots``."""
        width = attention_mask.shape[1]
        if width + 1 > self.columns:  # grow only: other rows may write further
            self.fit(width + 1)
        for layer, source in zip(self.cache.layers, prefill.layers, strict=True):
            if not layer.is_initialized:
                _, heads, _, key_dim = source.keys.shape
                value_dim, dtype, device = source.values.shape[-1], source.keys.dtype, source.keys.device
                layer.allocate(self.write.numel(), heads, key_dim, value_dim, dtype, device)
            layer.key_buffer[slots, :, :width] = source.keys
            layer.value_buffer[slots, :, :width] = source.values
        self.visible[slots] = 0
        self.visible[slots, :width] = attention_mask
        self.write[slots] = width
        self.position[slots] = attention_mask.sum(-1)

    def select(self, keep: Tensor) -> None:
        """Keep only the rows ``keep`` (ended rows leave the batch)."""
        self.write, self.position, self.visible = self.write[keep], self.position[keep], self.visible[keep]
        self.cache.batch_select_indices(keep)


@torch.no_grad()
def greedy_generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: Collection[int],
    batch_size: int = 32,
    pad_token_id: int = 0,
    on_step: Callable[[int], object] | None = None,
    window_grain: int = WINDOW_GRAIN,
    capture: FeatureCapture | None = None,
) -> list[list[int]]:
    """Greedy continuations of ``prompts``, ``batch_size`` at a time, continuously batched: a row
    whose answer ended takes the next prompt of the queue at once (its prefill runs beside the
    batch), so the batch stays full until the queue is empty; then ended rows leave it.

    prompts  token ids of each prompt (any lengths)
    on_step  called after each decoding step with the number of answer tokens it produced (a
             progress bar, a probe timing the steps)
    window_grain  columns the KV buffers grow and shrink by (:data:`WINDOW_GRAIN`)
    capture  keeps the target features of every prompt + answer token (data/capture.py); each
             answer's last token is then fed once more, for its own features
    returns  per prompt, its new token ids, ending at its first end-of-sequence token (kept) or
             after ``max_new_tokens`` tokens
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    outputs: list[list[int]] = [[] for _ in prompts]
    if not prompts:
        return outputs
    device = next(model.parameters()).device
    eos = set(eos_token_ids)
    # Shortest first: every row attends the columns up to the furthest row's, so rows of similar
    # length together keep that window small (longest first measured 25 % slower on a CPU).
    queue = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    batch = min(batch_size, len(queue))
    capacity = max(len(p) for p in prompts) + max_new_tokens
    slots = Slots(batch, capacity, model.config.num_hidden_layers, device, window_grain)
    owner = [-1] * batch  # the prompt each row answers (−1: free)
    tokens = torch.full((batch,), pad_token_id, dtype=torch.long)
    finishing: set[int] = set()  # rows whose answer ended, fed its last token once more (capture)

    def emit(rows: list[int], new: list[int]) -> None:
        for row, token in zip(rows, new, strict=True):
            index = owner[row]
            outputs[index].append(token)
            if token in eos or len(outputs[index]) == max_new_tokens:
                if capture is None:
                    owner[row] = -1
                else:
                    finishing.add(row)
            tokens[row] = token

    def refill() -> None:
        while queue and -1 in owner:
            # At most PREFILL_ROWS prompts a forward: consecutive in the (sorted) queue, so each
            # group pads to about its own length, not the longest of the whole batch.
            free = [row for row, index in enumerate(owner) if index == -1][: min(len(queue), PREFILL_ROWS)]
            chosen = [queue.pop(0) for _ in free]
            input_ids, attention_mask = left_pad([prompts[i] for i in chosen], pad_token_id, device)
            logits, prefill = _prefill(model, input_ids, attention_mask)
            if capture is not None:
                capture.prefill(chosen, attention_mask, logits)
            slots.load(torch.tensor(free, device=device), prefill, attention_mask)
            for row, index in zip(free, chosen, strict=True):
                owner[row] = index
            emit(free, greedy_tokens(logits).tolist())

    with slot_attention(model), capture or nullcontext():
        refill()
        while any(index >= 0 for index in owner):
            ended = [row for row, index in enumerate(owner) if index == -1]
            if ended and len(ended) >= COMPACT_FRACTION * len(owner):
                keep = [row for row, index in enumerate(owner) if index >= 0]
                slots.select(torch.tensor(keep, device=device))
                owner, tokens = [owner[row] for row in keep], tokens[keep]
                finishing = {keep.index(row) for row in finishing}
            rows = torch.arange(len(owner), device=device)
            active = [row for row, index in enumerate(owner) if index >= 0]
            # An ended row waiting to leave the batch rewrites the same column with a pad token.
            advance = torch.tensor([index >= 0 for index in owner], dtype=torch.long, device=device)
            slots.fit(int(slots.write.max()) + 1)
            slots.visible[rows, slots.write] = 1
            logits = model(
                input_ids=tokens.to(device).unsqueeze(-1),
                attention_mask=slots.visible[:, : slots.columns],
                position_ids=slots.position.unsqueeze(-1),
                past_key_values=slots.cache,
                cache_position=torch.tensor([slots.columns - 1], device=device),
                use_cache=True,
            ).logits[:, -1]
            slots.write += advance
            slots.position += advance
            if capture is not None:
                capture.step([owner[row] for row in active], active, logits)
            fed_last = [row for row in active if row in finishing]
            for row in fed_last:
                owner[row] = -1
            finishing.difference_update(fed_last)
            active = [row for row in active if owner[row] >= 0]
            emit(active, greedy_tokens(logits[active]).tolist())
            if on_step is not None:
                on_step(len(active))
            refill()
    return outputs


def greedy_tokens(logits: Tensor) -> Tensor:
    """...×V -> ... argmax (the first maximum on ties). Regeneration, plain and speculative
    decoding all call this, so a tie in bf16 logits is broken the same way. ``max`` is ~4× faster
    than ``argmax`` on bf16 rows on a CPU (64×49k: 1.2 against 5.3 ms, a 2-core AMX Xeon)."""
    return logits.max(dim=-1).indices


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int, device) -> tuple[Tensor, Tensor]:
    """B×W input ids and attention mask, every prompt ending at the last column."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def _prefill(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Cache]:
    """The last column's logits B×V of a left-padded batch, and its KV cache."""
    width = input_ids.shape[1]
    cache = Cache(layers=[PreallocatedLayer(width) for _ in range(model.config.num_hidden_layers)])
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=(attention_mask.long().cumsum(-1) - 1).clamp(min=0),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]
    return logits, cache
