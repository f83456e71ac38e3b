"""The frozen HF target as a decoder sees it: prefill, tree verification, acceptance.

Built like gpt-fast, without copying modeling code:

* the KV cache (:class:`~specdraft.data.kv_cache.PositionalKVCache`, a transformers ``Cache``)
  is ONE tensor for every layer's keys and values, allocated once and reused across sequences;
  a forward writes its n new entries at positions ``length .. length+n`` and attends over the
  prefix view — nothing is concatenated, nothing is freed;
* tree verification runs every drafted node in one forward: positions = committed length + node
  depth, and a 4D additive mask (transformers uses a 4D mask as given) lets each node see the
  committed past plus its own ancestors. The mask lives in a preallocated buffer: only the tree's
  n×n block is written per step, and cleared after;
* acceptance moves the accepted nodes' entries next to the committed past with ONE gather/copy
  over all layers, keys and values (none when the accepted nodes are a prefix of the tree); the
  rejected entries are simply overwritten by the next forward;
* EAGLE-3's aux layers come from transformers' own output recording (``output_hidden_states``
  with the selected indices; its hooks are installed once per model), the same convention as
  feature extraction: id i = the stream entering decoder layer i;
* ``graphs=True`` runs every forward with STATIC shapes — attention over the cache's whole
  capacity under an n×capacity mask, keys and values written at positions given as a tensor — so
  that on CUDA each step size (one token, a tree's node count) replays a CUDA graph
  (:mod:`specdraft.eval.graphs`); the prompt runs the same static step eagerly. On a CPU the
  static step runs eagerly (the tests check it there) and attends over more keys than it needs,
  so CPUs keep the default (``graphs: auto``);
* :meth:`TargetRunner.verify_greedy` (static runners, T=0): verification, greedy acceptance and
  the cache move in one fixed-shape step, the committed length a device tensor, nothing read
  back — what lets a decoding step sync with the host once (:mod:`specdraft.eval.decode`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from specdraft.data.attention import attention_windows, column_positions, windowed_masks
from specdraft.data.families import output_logits
from specdraft.data.generate import greedy_tokens
from specdraft.data.kv_cache import PositionalKVCache
from specdraft.data.target import Target
from specdraft.eval.acceptance import greedy_accept_tree
from specdraft.eval.graphs import GraphedStep
from specdraft.eval.kernels import compiled_step
from specdraft.eval.trees import TreeBuffers


def decoder_features(
    decoder,
    cache: PositionalKVCache,
    aux_layer_ids: Sequence[int],
    input_ids: Tensor,
    positions: Tensor,
    mask: Tensor | None,
    windows: dict[str | None, int | None],
) -> tuple[Tensor, Tensor | None]:
    """The target's decoder over input_ids, positions B×n with ``mask`` (B×1×n×keys additive,
    or None: causal, which transformers windows itself) on ``cache``: hidden B×n×H (after the
    final norm) and the aux layers' B×n×k·H (None without ``aux_layer_ids``). A windowed target's
    layers each get ``mask`` with their window applied (:func:`windowed_masks`; ``windows``: the
    decoder's :func:`attention_windows`, found once by the caller)."""
    if mask is not None and any(window is not None for window in windows.values()):
        written = cache.write_index
        if written is None:
            n = positions.shape[-1]
            written = torch.arange(cache.write_at, cache.write_at + n, device=positions.device)
        keys = column_positions(mask.shape[-1], written, positions)
        mask = windowed_masks(mask, windows, positions, keys)
    output = decoder(
        input_ids=input_ids,
        position_ids=positions,
        attention_mask=mask,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=list(aux_layer_ids) if aux_layer_ids else False,
    )
    if not aux_layer_ids:
        return output.last_hidden_state, None
    return output.last_hidden_state, torch.cat([output.hidden_states[i] for i in aux_layer_ids], dim=-1)


@dataclass(frozen=True)
class TargetOutput:
    """For n positions (in the target's dtype): logits n×V, hidden n×H (after the final norm),
    aux n×k·H or None."""

    logits: Tensor
    hidden: Tensor
    aux: Tensor | None

    def rows(self, index: Tensor | list[int]) -> TargetOutput:
        index = torch.as_tensor(index, dtype=torch.long, device=self.logits.device)
        aux = None if self.aux is None else self.aux[index]
        return TargetOutput(self.logits[index], self.hidden[index], aux)


class TargetRunner:
    """One sequence (batch 1) on the frozen target with a positional KV cache.

    ``length`` counts the committed tokens. The decoder's newest token (the "root": sampled from
    the last logits, not yet run) is always outside the cache and is node 0 of the next
    verification. The cache and the mask buffer are kept between sequences. ``compile``: the
    decoder's forward through ``torch.compile`` (:func:`specdraft.eval.kernels.compiled_step`).
    ``graphs``: static steps, replayed from CUDA graphs on CUDA (see the module docstring).
    """

    def __init__(
        self,
        target: Target,
        aux_layer_ids: Sequence[int] = (),
        compile: bool = False,
        graphs: bool = False,
    ) -> None:
        self.target, self.model = target, target.model
        self.aux_layer_ids = tuple(aux_layer_ids)
        decoder = self.model.get_decoder()
        num_layers = len(decoder.layers)
        for layer_id in self.aux_layer_ids:
            if not 0 <= layer_id < num_layers:
                raise ValueError(f"aux layer id {layer_id} out of range 0..{num_layers - 1}")
        self.device, self.dtype = target.device, target.dtype
        self._decoder = compiled_step(decoder) if compile else decoder
        self._windows = attention_windows(self.model.config)
        self._logits = partial(output_logits, self.model.config, self.model.get_output_embeddings())
        self.cache = PositionalKVCache.for_model(self.model, self.dtype, self.device)
        self.static = graphs
        self._static_step = GraphedStep(self._step, enabled=graphs)
        self._greedy_graph = GraphedStep(self._verify_greedy_step, enabled=graphs)
        # Additive tree mask rows × capacity: 0 everywhere except the current tree's block.
        self._bias = torch.zeros(0, 0, dtype=self.dtype, device=self.device)
        self._masked = torch.finfo(self.dtype).min
        self.length = 0
        self._pending = 0  # verified tokens in the cache that are not committed yet

    def reserve(self, length: int) -> None:
        """Make room for a sequence of ``length`` tokens (prompt + new tokens + draft depth)."""
        storage = self.cache.storage
        self.cache.reserve(length)
        if self.cache.storage is not storage:  # the graphs wrote into the old storage
            self._static_step.reset()
            self._greedy_graph.reset()

    def _step(self, input_ids: Tensor, positions: Tensor, write_index: Tensor | None, mask: Tensor | None):
        """The target over n tokens: input_ids, positions 1×n; write_index n (a static step) or
        None (written at ``cache.write_at``); mask 1×1×n×keys additive or None (causal). Returns
        (logits n×V, hidden n×H[, aux n×k·H])."""
        self.cache.write_index = write_index
        hidden, aux = decoder_features(
            self._decoder, self.cache, self.aux_layer_ids, input_ids, positions, mask, self._windows
        )
        hidden = hidden[0]
        logits = self._logits(hidden)  # target dtype: fp32 copies cost ms per tree
        return (logits, hidden) if aux is None else (logits, hidden, aux[0])

    @torch.no_grad()
    def _forward(
        self, input_ids: Tensor, positions: Tensor, visible: Tensor | None, replay: bool = True
    ) -> TargetOutput:
        """Run n tokens after the committed past; ``visible`` n×n bool: which of them each one
        attends (None: causal)."""
        n = len(input_ids)
        self.reserve(self.length + n)
        input_ids = input_ids.to(self.device)[None]
        positions = positions.to(self.device)[None]
        if self.static:
            if visible is None:
                visible = torch.ones(n, n, dtype=torch.bool, device=self.device).tril_()
            mask = self._static_mask(self.length, visible.to(self.device, non_blocking=True))
            write_index = torch.arange(self.length, self.length + n, device=self.device)
            step = self._static_step if replay else self._static_step.eager
            outputs = step(input_ids, positions, write_index, mask)
        else:
            self.cache.write_at = self.length
            mask = None
            if visible is not None:
                past = self.length
                self._reserve_bias(n, past + n)
                block = self._bias[:n, past : past + n]
                block.masked_fill_(~visible.to(self.device, non_blocking=True), self._masked)
                mask = self._bias[None, None, :n, : past + n]
            try:
                outputs = self._step(input_ids, positions, None, mask)
            finally:
                if visible is not None:
                    block.zero_()  # these columns are the next step's committed past
        self.cache.write_at = self.length + n
        return TargetOutput(outputs[0], outputs[1], outputs[2] if len(outputs) > 2 else None)

    def _static_mask(self, past: int | Tensor, visible: Tensor) -> Tensor:
        """1×1×n×capacity additive mask of a static step over n tokens written at ``past ..
        past+n`` (an int, or a 0-dim tensor on the device): the committed past, and among the n
        what ``visible`` (n×n bool) allows."""
        n, capacity = len(visible), self.cache.capacity
        columns = torch.arange(capacity, device=self.device)
        mask = torch.full((n, capacity), self._masked, dtype=self.dtype, device=self.device)
        mask.masked_fill_(columns < past, 0)
        block = torch.full((n, n), self._masked, dtype=self.dtype, device=self.device).masked_fill_(
            visible, 0
        )
        return mask.scatter_(1, (past + torch.arange(n, device=self.device)).expand(n, n), block)[None, None]

    def prefill(self, input_ids: Tensor) -> TargetOutput:
        """Start a sequence: run the prompt (n tokens, causal); they are committed at once."""
        self.length, self._pending = 0, 0
        output = self._forward(input_ids, torch.arange(len(input_ids)), None, replay=False)
        self.length = len(input_ids)
        return output

    def extend(self, input_ids: Tensor) -> TargetOutput:
        """Run n more tokens causally after the committed past and commit them: plain decoding's
        step is ``extend`` of one token (replayed from a CUDA graph on a static runner; more
        tokens run the same static step eagerly)."""
        self._pending = 0  # uncommitted entries are overwritten
        n = len(input_ids)
        output = self._forward(input_ids, self.length + torch.arange(n), None, replay=n == 1)
        self.length += n
        return output

    def verify(self, node_tokens: Tensor, tree: TreeBuffers) -> TargetOutput:
        """Run the n tree nodes (node 0 = the root) after the committed past. They stay in the
        cache, uncommitted, until :meth:`commit`."""
        self._pending = 0
        depths = tree.depths.to(self.device, non_blocking=True)
        output = self._forward(node_tokens, self.length + depths, tree.attention_mask)
        self._pending = len(node_tokens)
        return output

    def verify_greedy(
        self, past: Tensor, tokens: Tensor, ancestors: Tensor, max_depth: int
    ) -> tuple[Tensor, ...]:
        """Verify a tree, accept greedily and commit, on the device (a static runner only): one
        CUDA graph per tree size, nothing read back. past: 0-dim, the committed length; tokens
        n (node 0 = the root); ancestors n×n bool (:func:`~specdraft.eval.acceptance.
        greedy_accept_tree`); ``max_depth``: the deepest a tree of this drafter goes.

        Returns (found, past', hidden[, aux]): found max_depth+3 int64 = [accepted drafts c, the
        tree's depth, then the token after each of the max_depth+1 committed positions: the c
        accepted drafts, the target's next token, padding]; past' = past + c + 1; hidden
        (max_depth+1)×H[, aux (max_depth+1)×k·H] the target's features at those positions (rows
        past c+1 are padding). The host learns c from ``found`` (the step's one sync) and then
        calls :meth:`advance`."""
        if not self.static:
            raise RuntimeError("verify_greedy runs static steps: build the runner with graphs=True")
        self.reserve(self.length + max(len(tokens), max_depth + 1))
        return self._greedy_graph(past, tokens, ancestors, max_depth)

    def _verify_greedy_step(self, past: Tensor, tokens: Tensor, ancestors: Tensor, max_depth: int):
        n = len(tokens)
        depths = ancestors.sum(-1) - 1
        written = past + torch.arange(n, device=self.device)
        logits, *features = self._step(
            tokens[None], (past + depths)[None], written, self._static_mask(past, ancestors)
        )
        path, count, next_token = greedy_accept_tree(tokens, ancestors, greedy_tokens(logits), max_depth)
        # The path's entries to past .. past+max_depth (the padding lands beyond what is committed).
        self.cache.move(past + path, past)
        ahead = torch.arange(max_depth + 1, device=self.device)
        follow = torch.where(ahead < count, tokens[torch.cat([path[1:], path[-1:]])], next_token)
        found = torch.cat([count[None], depths.max()[None], follow])
        return (found, past + count + 1, *(rows[path] for rows in features))

    def advance(self, count: int) -> None:
        """The host's side of a :meth:`verify_greedy`: ``count`` drafts were accepted there."""
        self.length += count + 1
        self.cache.write_at = self.length
        self._pending = 0

    def _reserve_bias(self, rows: int, columns: int) -> None:
        have_rows, have_columns = self._bias.shape
        if rows > have_rows or columns > have_columns:
            columns = max(columns, self.cache.capacity)
            self._bias = torch.zeros(max(rows, have_rows), columns, dtype=self.dtype, device=self.device)

    def commit(self, nodes: Sequence[int] | Tensor) -> None:
        """Keep the committed past plus ``nodes`` (indices into the last verified tree, root
        first, in path order); every other verified entry is dropped (overwritten later)."""
        if not self._pending:
            raise RuntimeError("TargetRunner.commit: nothing verified since the last commit")
        nodes = torch.as_tensor(nodes, dtype=torch.long)
        count = len(nodes)
        if not torch.equal(nodes, torch.arange(count)):  # a prefix of the tree needs no move
            self.cache.move(self.length + nodes.to(self.device), self.length)
        self.length += count
        self.cache.write_at = self.length
        self._pending = 0
