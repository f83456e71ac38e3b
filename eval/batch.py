"""Speculative decoding of B prompts at once: the target verifies every row's tree in ONE forward.

Each row keeps its own drafter, its own tree and its own accepted length; only the target is
batched, because the target's forward is what batching makes cheaper per token (its weights are
read once for all rows). The KV cache holds B ragged rows written by position:

* row b's committed entries are positions ``0 .. length_b``; a forward over n tokens per row
  (the trees padded to the widest one) writes row b's at ``length_b .. length_b + n`` — a
  scatter with per-row positions — and attends over the first ``max_b length_b + n`` positions
  under a B×1×n×keys additive mask: row b's committed past plus what its tree lets each node see;
  the keys between row b's end and the others' are masked, never read;
* acceptance moves each row's accepted entries next to its committed past (a gather/copy in that
  row), and the rejected ones are overwritten by the next forward, as in
  :class:`~specdraft.eval.runner.TargetRunner`.

A row that has finished (EOS or its token budget) rides along as a one-node tree whose output is
ignored until every row is done (static batching: the batch's time is its slowest row's). A row's
record carries its own steps; the phase times of a step are the whole batch's.

Plain decoding at batch B is the same forward with one node per row: the baseline every batch
size is compared with.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from functools import partial

import torch
from torch import Tensor

from specdraft.data.attention import attention_windows
from specdraft.data.families import output_logits
from specdraft.data.kv_cache import PositionalKVCache
from specdraft.data.target import Target
from specdraft.eval.decode import (
    Generation,
    StepRecord,
    Typical,
    accept_draft,
    check_budget,
    cut_at_stop,
    device_clock,
)
from specdraft.eval.drafters import Drafter
from specdraft.eval.runner import TargetOutput, decoder_features
from specdraft.eval.sampling import Sampling


def check_batch_sizes(batch_sizes: Sequence[int], where: str = "batch_sizes") -> list[int]:
    """``batch_sizes`` as a list of positive ints, or one clear error naming ``where``."""
    if isinstance(batch_sizes, str) or not isinstance(batch_sizes, Sequence):
        raise ValueError(f"{where}: expected a non-empty list of positive integers, got {batch_sizes!r}")
    sizes = list(batch_sizes)
    bad = [size for size in sizes if isinstance(size, bool) or not isinstance(size, int) or size < 1]
    if not sizes or bad:
        raise ValueError(f"{where}: expected a non-empty list of positive integers, got {sizes}")
    return sizes


class BatchRunner:
    """B sequences on the frozen target, each row with its own committed length.

    ``lengths[b]`` counts row b's committed tokens; as in the one-row runner, each row's newest
    token (its root) is outside the cache and is node 0 of its next tree. The cache keeps its
    rows and positions between batches (it grows, never shrinks)."""

    def __init__(self, target: Target, aux_layer_ids: Sequence[int] = ()) -> None:
        self.target, self.model = target, target.model
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.device, self.dtype = target.device, target.dtype
        self._decoder = self.model.get_decoder()
        self._logits = partial(output_logits, self.model.config, self.model.get_output_embeddings())
        self._windows = attention_windows(self.model.config)
        self.cache = PositionalKVCache.for_model(self.model, self.dtype, self.device)
        self._masked = torch.finfo(self.dtype).min
        self.lengths: list[int] = []

    def reserve(self, rows: int, length: int) -> None:
        """Room for ``rows`` sequences of ``length`` tokens (prompt + new tokens + tree depth)."""
        self.cache.reserve_rows(rows)
        self.cache.reserve(length)

    def _forward(self, tokens: Tensor, depths: Tensor, visible: Tensor) -> tuple[Tensor, Tensor | None]:
        """n tokens per row after each row's committed past: tokens, depths B×n (positions are
        length_b + depth), visible B×n×n bool (which of the row's n each one attends). Returns
        hidden B×n×H and aux B×n×k·H (or None); the entries stay uncommitted."""
        rows, n = tokens.shape
        lengths = torch.tensor(self.lengths, device=self.device)
        keys = max(self.lengths) + n
        self.cache.reserve(keys)
        written = lengths[:, None] + torch.arange(n, device=self.device)  # B×n
        mask = torch.full((rows, n, keys), self._masked, dtype=self.dtype, device=self.device)
        mask.masked_fill_(torch.arange(keys, device=self.device) < lengths[:, None, None], 0)
        block = torch.full((rows, n, n), self._masked, dtype=self.dtype, device=self.device)
        block.masked_fill_(visible.to(self.device), 0)
        mask.scatter_(2, written[:, None, :].expand(rows, n, n), block)
        cache = self.cache
        cache.write_index, cache.read_length, cache.write_at = written, keys, keys - n
        try:
            return decoder_features(
                self._decoder,
                cache,
                self.aux_layer_ids,
                tokens.to(self.device),
                (lengths[:, None] + depths.to(self.device)),
                mask[:, None],
                self._windows,
            )
        finally:
            cache.write_index, cache.read_length = None, None

    @torch.no_grad()
    def prefill(self, prompts: Sequence[Tensor]) -> list[TargetOutput]:
        """Start B sequences: run the prompts (right-padded to the longest, causal); they are
        committed at once. Returns per row the hidden states (and aux) of every prompt position
        and the logits of the LAST one only (1×V: the rest are never read, and at B prompts of a
        few hundred tokens they would cost more than the forward)."""
        rows, width = len(prompts), max(len(prompt) for prompt in prompts)
        self.reserve(rows, width)
        self.lengths = [0] * rows
        tokens = torch.zeros(rows, width, dtype=torch.long)
        for b, prompt in enumerate(prompts):
            tokens[b, : len(prompt)] = prompt
        causal = torch.ones(width, width, dtype=torch.bool).tril_()
        real = torch.arange(width) < torch.tensor([len(p) for p in prompts])[:, None]  # B×width
        positions = torch.arange(width).expand(rows, width)
        hidden, aux = self._forward(tokens, positions, causal & real[:, None, :])
        self.lengths = [len(prompt) for prompt in prompts]
        last = torch.tensor([len(prompt) - 1 for prompt in prompts], device=self.device)
        logits = self._logits(hidden[torch.arange(rows, device=self.device), last])  # B×V
        return [
            TargetOutput(logits[b : b + 1], hidden[b, :length], None if aux is None else aux[b, :length])
            for b, length in enumerate(self.lengths)
        ]

    @torch.no_grad()
    def verify(self, trees: Sequence[tuple[Tensor, Tensor, Tensor]]) -> list[TargetOutput]:
        """One forward over every row's tree: per row (tokens n_b, depths n_b, visible n_b×n_b
        bool; node 0 the root), padded to the widest. The nodes stay in the cache, uncommitted,
        until :meth:`commit`. Returns per row its n_b nodes' output."""
        rows, n = len(trees), max(len(tokens) for tokens, _, _ in trees)
        tokens = torch.zeros(rows, n, dtype=torch.long)
        depths = torch.ones(rows, n, dtype=torch.long)  # a padding node: a child of the root
        visible = torch.eye(n, dtype=torch.bool).repeat(rows, 1, 1)
        visible[:, :, 0] = True
        for b, (row_tokens, row_depths, row_visible) in enumerate(trees):
            size = len(row_tokens)
            tokens[b, :size], depths[b, :size] = row_tokens, row_depths
            visible[b, :size, :size] = row_visible
        hidden, aux = self._forward(tokens, depths, visible)
        logits = self._logits(hidden)  # target dtype: B×n×V
        return [
            TargetOutput(logits[b, :size], hidden[b, :size], None if aux is None else aux[b, :size])
            for b, size in enumerate(len(row_tokens) for row_tokens, _, _ in trees)
        ]

    def commit(self, row: int, nodes: Sequence[int]) -> None:
        """Keep row ``row``'s committed past plus ``nodes`` of its last verified tree (root
        first, in path order)."""
        nodes = torch.as_tensor(nodes, dtype=torch.long)
        length, count = self.lengths[row], len(nodes)
        if not torch.equal(nodes, torch.arange(count)):  # a prefix of the tree needs no move
            self.cache.move(length + nodes.to(self.device), length, row)
        self.lengths[row] = length + count


def _root_only(token: int) -> tuple[Tensor, Tensor, Tensor]:
    """A one-node tree: plain decoding's step, and a finished row's placeholder."""
    return torch.tensor([token]), torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool)


def _start(
    runner: BatchRunner, prompts: Sequence[Tensor], max_new_tokens: int, depth: int
) -> tuple[float, list[TargetOutput], float]:
    """Check and reserve, then prefill: (start time, per-row outputs, prefill seconds)."""
    if not prompts:
        raise ValueError("batched decoding needs at least one prompt")
    for prompt in prompts:
        check_budget(runner, prompt, max_new_tokens, depth)
    runner.reserve(len(prompts), max(len(p) for p in prompts) + max_new_tokens + depth + 1)
    device = runner.device
    start = device_clock(device)
    outputs = runner.prefill(prompts)
    return start, outputs, device_clock(device) - start


@torch.no_grad()
def plain_generate_batch(
    runner: BatchRunner,
    prompts: Sequence[Tensor],
    max_new_tokens: int,
    sampling: Sampling,
    eos_ids: Collection[int],
    generators: Sequence[torch.Generator | None],
) -> list[Generation]:
    """Token-by-token decoding of B prompts together (the baseline at batch size B). Row b
    samples with ``generators[b]``; its ``total_s`` ends when it stops."""
    device = runner.device
    start, outputs, prefill_s = _start(runner, prompts, max_new_tokens, 0)
    tokens = [[sampling.choose(o.logits[-1], g)] for o, g in zip(outputs, generators, strict=True)]
    stops = [cut_at_stop(row, max_new_tokens, eos_ids)[1] for row in tokens]
    ends = [prefill_s if stop else None for stop in stops]
    steps: list[list[StepRecord]] = [[] for _ in prompts]
    while any(stop is None for stop in stops):
        begin = device_clock(device)
        outputs = runner.verify([_root_only(row[-1]) for row in tokens])
        seconds = device_clock(device) - begin
        for b, output in enumerate(outputs):
            if stops[b] is not None:
                continue
            runner.commit(b, [0])
            tokens[b].append(sampling.choose(output.logits[-1], generators[b]))
            steps[b].append(StepRecord(1, 0, 0, 0.0, seconds, 0.0))
            stops[b] = cut_at_stop(tokens[b], max_new_tokens, eos_ids)[1]
            if stops[b] is not None:
                ends[b] = device_clock(device) - start
    return [
        Generation(cut_at_stop(row, max_new_tokens, eos_ids)[0], prefill_s, end, stop, row_steps)
        for row, end, stop, row_steps in zip(tokens, ends, stops, steps, strict=True)
    ]


@torch.no_grad()
def speculative_generate_batch(
    runner: BatchRunner,
    drafters: Sequence[Drafter],
    prompts: Sequence[Tensor],
    max_new_tokens: int,
    sampling: Sampling,
    eos_ids: Collection[int],
    generators: Sequence[torch.Generator | None],
    typical: Typical | None = None,
) -> list[Generation]:
    """Speculative decoding of B prompts together: row b drafts with ``drafters[b]`` (one per
    row: a drafter holds one sequence's state) and samples with ``generators[b]``; the target
    verifies every row's tree in one forward. Lossless unless ``typical`` is given; row b's
    tokens are those :func:`~specdraft.eval.decode.speculative_generate` emits for its prompt."""
    if len(drafters) < len(prompts):
        raise ValueError(f"{len(prompts)} prompts need {len(prompts)} drafters, got {len(drafters)}")
    device = runner.device
    depth = max(drafter.max_depth for drafter in drafters)
    start, outputs, prefill_s = _start(runner, prompts, max_new_tokens, depth)
    roots = [sampling.choose(o.logits[-1], g) for o, g in zip(outputs, generators, strict=True)]
    for drafter, prompt, output, root in zip(drafters, prompts, outputs, roots, strict=False):
        drafter.reset()
        drafter.commit(prompt.tolist(), output, root)
    tokens = [[root] for root in roots]
    stops = [cut_at_stop(row, max_new_tokens, eos_ids)[1] for row in tokens]
    ends = [prefill_s if stop else None for stop in stops]
    steps: list[list[StepRecord]] = [[] for _ in prompts]
    while any(stop is None for stop in stops):
        begin = device_clock(device)
        live = [b for b, stop in enumerate(stops) if stop is None]
        drafts = {b: drafters[b].draft(roots[b], sampling, generators[b]) for b in live}
        drafted = device_clock(device)
        trees = [
            (drafts[b].tokens, drafts[b].tree.depths, drafts[b].tree.attention_mask)
            if b in drafts
            else _root_only(roots[b])
            for b in range(len(prompts))
        ]
        outputs = runner.verify(trees)
        verified = device_clock(device)
        accepted = {}
        for b in live:
            drafter, draft, output = drafters[b], drafts[b], outputs[b]
            drafter.verified(output)
            nodes, accepted_tokens, roots[b] = accept_draft(
                draft, output.logits, sampling, generators[b], typical
            )
            accepted[b] = len(nodes) - 1
            runner.commit(b, nodes)
            tokens[b].extend([*accepted_tokens[1:], roots[b]])
            drafter.observe(draft.tree.num_nodes - 1, len(nodes) - 1)
            stops[b] = cut_at_stop(tokens[b], max_new_tokens, eos_ids)[1]
            if stops[b] is None:
                drafter.commit(accepted_tokens, output.rows(nodes), roots[b])
            else:
                ends[b] = device_clock(device) - start
        bookkeeping = device_clock(device) - verified
        for b in live:
            tree = drafts[b].tree
            steps[b].append(
                StepRecord(
                    tree.num_nodes,
                    int(tree.depths.max()),
                    accepted[b],
                    drafted - begin,
                    verified - drafted,
                    bookkeeping,
                )
            )
    return [
        Generation(cut_at_stop(row, max_new_tokens, eos_ids)[0], prefill_s, end, stop, row_steps)
        for row, end, stop, row_steps in zip(tokens, ends, stops, steps, strict=True)
    ]
