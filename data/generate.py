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
step's attention is two batched products on the key/value heads (:mod:`specdraft.data.attention`).
The cache is the decoder's own :class:`~specdraft.data.kv_cache.PositionalKVCache`, resized to the
columns in use and written at one column per row (``write_index``).

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

from collections.abc import Callable, Collection, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from specdraft.data.attention import attention_windows, slot_attention, windowed_masks
from specdraft.data.kv_cache import PositionalKVCache, kv_shape

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


class Slots:
    """The per-row state of a continuous batch: the column each row writes next (``write``), its
    next rotary position (``position``), which cache columns it may attend (``visible``), how
    many columns the cache holds (``columns``: a multiple of ``grain``, at least the furthest
    row's next column + 1), and the cache itself (B rows, exactly ``columns`` positions, so that
    attention reads contiguous memory: see the module docstring)."""

    def __init__(
        self, model: torch.nn.Module, batch: int, capacity: int, device: torch.device, grain: int
    ) -> None:
        self.capacity, self.grain = capacity, grain
        self.write = torch.zeros(batch, dtype=torch.long, device=device)
        self.position = torch.zeros(batch, dtype=torch.long, device=device)
        # as many columns as the buffers may grow to (capacity rounded up to the grain)
        self.visible = torch.zeros(batch, -(-capacity // grain) * grain, dtype=torch.long, device=device)
        self.cache = PositionalKVCache(*kv_shape(model.config), model.dtype, device, batch)
        self.windows = attention_windows(model.config)
        self.columns = grain
        self.cache.resize(grain)

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
        self.cache.resize(columns)

    def load(self, slots: Tensor, prefill: PositionalKVCache, attention_mask: Tensor) -> None:
        """Copy a left-padded prefill (row i of ``prefill``, W columns) into rows ``slots``."""
        width = attention_mask.shape[1]
        if width + 1 > self.columns:  # grow only: other rows may write further
            self.fit(width + 1)
        self.cache.load_rows(slots, prefill)
        self.visible[slots] = 0
        self.visible[slots, :width] = attention_mask
        self.write[slots] = width
        self.position[slots] = attention_mask.sum(-1)

    def select(self, keep: Tensor) -> None:
        """Keep only the rows ``keep`` (ended rows leave the batch)."""
        self.write, self.position, self.visible = self.write[keep], self.position[keep], self.visible[keep]
        self.cache.select_rows(keep)

    def _mask(self, dtype: torch.dtype) -> Tensor | dict[str, Tensor]:
        """The step's attention mask: the visible columns (B×columns: transformers expands it),
        or for a windowed target the 4D masks of each layer kind, windowed here: transformers
        would window every row from the LAST column, and a row writes at its own. A row's columns
        hold consecutive positions (its left padding is never visible), so column distance is
        position distance."""
        visible = self.visible[:, : self.columns]
        if all(window is None for window in self.windows.values()):
            return visible
        additive = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
        additive.masked_fill_(visible == 0, torch.finfo(dtype).min)
        columns = torch.arange(self.columns, device=visible.device).expand_as(visible)
        return windowed_masks(additive[:, None, None, :], self.windows, self.write[:, None], columns)

    def step_logits(self, model: torch.nn.Module, tokens: Tensor) -> Tensor:
        """One decoding step of every row: ``tokens`` B (each row's newest token) written at its
        own column, attending its visible columns; returns the last logits B×V. The columns and
        positions do not advance here (an ended row rewrites its column)."""
        device = self.write.device
        self.fit(int(self.write.max()) + 1)
        self.visible[torch.arange(len(self.write), device=device), self.write] = 1
        # one column per row, read over the whole (contiguous) capacity; the mask covers it all
        self.cache.write_index, self.cache.read_length = self.write[:, None], None
        self.cache.write_at = self.columns - 1  # what precedes the one new column of a step
        try:
            return model(
                input_ids=tokens.to(device).unsqueeze(-1),
                attention_mask=self._mask(model.dtype),
                position_ids=self.position.unsqueeze(-1),
                past_key_values=self.cache,
                cache_position=torch.tensor([self.columns - 1], device=device),
                use_cache=True,
            ).logits[:, -1]
        finally:
            self.cache.write_index = None


class _ContinuousBatch:
    """:func:`greedy_generate`'s state: the prompts' queue (shortest first), the prompt each row
    answers (``owner``, −1: free), each row's newest token, and the answers so far."""

    def __init__(
        self,
        model: torch.nn.Module,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        eos_token_ids: Collection[int],
        batch_size: int,
        pad_token_id: int,
        window_grain: int,
        capture: FeatureCapture | None,
    ) -> None:
        self.model, self.prompts, self.max_new_tokens = model, prompts, max_new_tokens
        self.eos, self.pad_token_id, self.capture = set(eos_token_ids), pad_token_id, capture
        self.device = next(model.parameters()).device
        self.outputs: list[list[int]] = [[] for _ in prompts]
        # Shortest first: every row attends the columns up to the furthest row's, so rows of
        # similar length together keep that window small (longest first measured 25 % slower on a CPU).
        self.queue = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
        batch = min(batch_size, len(self.queue))
        # A capture feeds each answer's last token once more: one column past the answer, which
        # an ended row keeps until it leaves the batch, while rows that started later still run.
        capacity = max(len(p) for p in prompts) + max_new_tokens + (capture is not None)
        self.slots = Slots(model, batch, capacity, self.device, window_grain)
        self.owner = [-1] * batch
        self.tokens = torch.full((batch,), pad_token_id, dtype=torch.long)
        self.finishing: set[int] = set()  # rows whose answer ended, fed its last token once more (capture)

    def emit(self, rows: list[int], new: list[int]) -> None:
        """Append each row's new token to its answer; a row whose answer ended is freed (or,
        with a capture, fed its last token once more first)."""
        for row, token in zip(rows, new, strict=True):
            index = self.owner[row]
            self.outputs[index].append(token)
            if token in self.eos or len(self.outputs[index]) == self.max_new_tokens:
                if self.capture is None:
                    self.owner[row] = -1
                else:
                    self.finishing.add(row)
            self.tokens[row] = token

    def refill(self) -> None:
        """Give the free rows the next prompts of the queue, prefilled."""
        while self.queue and -1 in self.owner:
            # At most PREFILL_ROWS prompts a forward: consecutive in the (sorted) queue, so each
            # group pads to about its own length, not the longest of the whole batch.
            free = [row for row, index in enumerate(self.owner) if index == -1]
            free = free[: min(len(self.queue), PREFILL_ROWS)]
            chosen = [self.queue.pop(0) for _ in free]
            input_ids, attention_mask = left_pad(
                [self.prompts[i] for i in chosen], self.pad_token_id, self.device
            )
            logits, prefill = _prefill(self.model, input_ids, attention_mask)
            if self.capture is not None:
                self.capture.prefill(chosen, attention_mask, logits)
            self.slots.load(torch.tensor(free, device=self.device), prefill, attention_mask)
            for row, index in zip(free, chosen, strict=True):
                self.owner[row] = index
            self.emit(free, greedy_tokens(logits).tolist())

    def compact(self) -> None:
        """Drop the ended rows once they are COMPACT_FRACTION of the batch (a copy of the cache)."""
        ended = [row for row, index in enumerate(self.owner) if index == -1]
        if not ended or len(ended) < COMPACT_FRACTION * len(self.owner):
            return
        keep = [row for row, index in enumerate(self.owner) if index >= 0]
        self.slots.select(torch.tensor(keep, device=self.device))
        self.owner, self.tokens = [self.owner[row] for row in keep], self.tokens[keep]
        self.finishing = {keep.index(row) for row in self.finishing}

    def step(self) -> int:
        """One decoding step of every row; returns the number of answer tokens it produced."""
        active = [row for row, index in enumerate(self.owner) if index >= 0]
        # An ended row waiting to leave the batch rewrites the same column with a pad token.
        advance = torch.tensor([index >= 0 for index in self.owner], dtype=torch.long, device=self.device)
        logits = self.slots.step_logits(self.model, self.tokens)
        self.slots.write += advance
        self.slots.position += advance
        if self.capture is not None:
            self.capture.step([self.owner[row] for row in active], active, logits)
        fed_last = [row for row in active if row in self.finishing]
        for row in fed_last:
            self.owner[row] = -1
        self.finishing.difference_update(fed_last)
        active = [row for row in active if self.owner[row] >= 0]
        self.emit(active, greedy_tokens(logits[active]).tolist())
        return len(active)


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
    if not prompts:
        return []
    batch = _ContinuousBatch(
        model, prompts, max_new_tokens, eos_token_ids, batch_size, pad_token_id, window_grain, capture
    )
    with slot_attention(model), capture or nullcontext():
        batch.refill()
        while any(index >= 0 for index in batch.owner):
            batch.compact()
            produced = batch.step()
            if on_step is not None:
                on_step(produced)
            batch.refill()
    return batch.outputs


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


def _prefill(
    model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor
) -> tuple[Tensor, PositionalKVCache]:
    """The last column's logits B×V of a left-padded batch, and its KV cache (exactly its W
    columns)."""
    cache = PositionalKVCache(*kv_shape(model.config), model.dtype, input_ids.device, batch=len(input_ids))
    cache.resize(input_ids.shape[1])
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=(attention_mask.long().cumsum(-1) - 1).clamp(min=0),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    ).logits[:, -1]
    return logits, cache
