"""The frozen target's KV cache, as transformers sees it: ONE preallocated tensor for every
layer's keys and values, written by position (docs/architecture.md §3, "The target runner")."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

# The cache grows in steps of this many positions when a sequence outgrows it (a reallocation and
# one copy; a bench run sizes it once for its longest prompt).
CAPACITY_STEP = 256


def grow_positions(storage: Tensor, length: int, keep: int) -> Tensor:
    """``storage`` (positions on dim −2) with room for ``length`` positions: itself when it has
    it, else a zeroed copy rounded up to CAPACITY_STEP holding its first ``keep`` positions."""
    if length <= storage.shape[-2]:
        return storage
    capacity = -(-length // CAPACITY_STEP) * CAPACITY_STEP
    grown = storage.new_zeros(*storage.shape[:-2], capacity, storage.shape[-1])
    grown[..., :keep, :] = storage[..., :keep, :]
    return grown


class _PositionalLayer(CacheLayerMixin):
    """One layer's view of a :class:`PositionalKVCache`: writes at the cache's cursor."""

    is_compileable = False
    is_sliding = False

    def __init__(self, cache: PositionalKVCache, index: int) -> None:
        super().__init__()
        self.cache, self.index = cache, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        pass  # the storage is preallocated by the cache

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        cache = self.cache
        keys, values = cache.rows(cache.storage[0, self.index]), cache.rows(cache.storage[1, self.index])
        index = cache.write_index
        if index is not None:  # written by position, read up to read_length (a static step: whole)
            if index.dim() == 1:  # the same positions in every row
                keys.index_copy_(2, index, key_states)
                values.index_copy_(2, index, value_states)
            else:  # B×n: each row its own positions (a batch of ragged sequences)
                where = index[:, None, :, None].expand_as(key_states)
                keys.scatter_(2, where, key_states)
                values.scatter_(2, where, value_states)
            end = cache.read_length
            return keys[:, :, :end], values[:, :, :end]
        start = self.cache.write_at
        end = start + key_states.shape[-2]
        keys[:, :, start:end].copy_(key_states)
        values[:, :, start:end].copy_(value_states)
        return keys[:, :, :end], values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.write_at + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.write_at

    def get_max_length(self) -> int:
        return self.cache.capacity


class PositionalKVCache(Cache):
    """Keys and values of every layer in one preallocated tensor, written by position.

    ``storage``: 2 × layers × B × kv_heads × capacity × head_dim (keys, then values; B = 1 for
    one sequence). A forward writes its entries at ``write_at``; positions at or after
    ``write_at`` hold nothing that will be read (attention only sees ``:write_at + n``), so
    dropping entries is moving the cursor. A static step sets ``write_index`` instead — n int64
    (the same positions in every row) or B×n (each row its own: ragged sequences) — and
    attention reads the first ``read_length`` positions (None: the whole capacity), masked.
    ``batch`` (≤ B): the forward runs the first ``batch`` rows.

    Its users: the target runner (B = 1, :mod:`specdraft.eval.runner`), batches of ragged rows
    (:mod:`specdraft.eval.batch`), a draft LM (:mod:`specdraft.eval.draft_model`), and
    regeneration (:mod:`specdraft.data.generate`: a left-padded prefill, then one column per row
    and step at ``write_index`` B×1 over a capacity resized to the columns in use)."""

    def __init__(
        self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device, batch: int = 1
    ) -> None:
        self.shape = (num_layers, kv_heads, head_dim)
        self.storage = torch.zeros(2, num_layers, batch, kv_heads, 0, head_dim, dtype=dtype, device=device)
        self.batch = batch
        self.write_at = 0
        self.write_index: Tensor | None = None
        self.read_length: int | None = None
        super().__init__(layers=[_PositionalLayer(self, i) for i in range(num_layers)])

    def rows(self, storage: Tensor) -> Tensor:
        """The first ``batch`` rows of one layer's keys or values (a view)."""
        return storage if storage.shape[0] == self.batch else storage[: self.batch]

    @classmethod
    def for_model(cls, model, dtype: torch.dtype, device, batch: int = 1) -> PositionalKVCache:
        """A cache for ``model``'s decoder. Windowed layers keep every key too: their masks hide
        the keys outside the window (data/attention.py ``windowed_masks``), so a tree's nodes and
        a moved path need nothing a ring buffer would."""
        return cls(*kv_shape(model.config), dtype, device, batch)

    @property
    def capacity(self) -> int:
        return self.storage.shape[-2]

    def reserve(self, length: int) -> None:
        """Make room for ``length`` positions (the entries before ``write_at`` are kept)."""
        self.storage = grow_positions(self.storage, length, keep=self.write_at)

    def reserve_rows(self, rows: int) -> None:
        """Run the next forwards on ``rows`` sequences (the rows grow, never shrink; a grown
        cache holds nothing)."""
        if rows > self.storage.shape[2]:
            self.storage = self.storage.new_zeros(*self.storage.shape[:2], rows, *self.storage.shape[3:])
        self.batch = rows

    def resize(self, capacity: int) -> None:
        """Hold exactly ``capacity`` positions, the first ones kept (zeros past the old ones):
        attention over the whole capacity then reads contiguous memory (regeneration's buffers,
        data/generate.py)."""
        kept = min(capacity, self.capacity)
        resized = self.storage.new_zeros(*self.storage.shape[:-2], capacity, self.storage.shape[-1])
        resized[..., :kept, :] = self.storage[..., :kept, :]
        self.storage = resized

    def select_rows(self, keep: Tensor) -> None:
        """Keep only the rows ``keep`` (int64), in that order."""
        self.storage = self.storage[:, :, keep]
        self.batch = len(keep)

    def load_rows(self, rows: Tensor, source: PositionalKVCache) -> None:
        """Copy every row of ``source`` (its whole capacity W) into rows ``rows`` (int64), at
        positions 0 .. W, every layer's keys and values in one copy."""
        self.storage[:, :, rows, :, : source.capacity] = source.storage

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions."""
        self.write_at = min(self.write_at, length)

    def move(self, source: Tensor, destination: int | Tensor, row: int | None = None) -> None:
        """Copy the entries at positions ``source`` (k int64) to ``destination .. destination+k``
        (an int, or a 0-dim tensor on the device: no host sync), every layer's keys and values in
        one gather/copy; in one ``row`` of a batch, or in every row (None)."""
        storage = self.storage if row is None else self.storage[:, :, row : row + 1]
        to = destination + torch.arange(len(source), device=storage.device)
        storage.index_copy_(-2, to, storage.index_select(-2, source))


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, key/value heads, head dim) of a transformers model's ``config``."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return config.num_hidden_layers, kv_heads, head_dim
