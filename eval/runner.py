"""The frozen HF target as a decoder sees it: prefill, tree verification, KV compaction.

Tree verification runs every drafted node in ONE forward: positions = committed length + node
depth, and a custom 4D mask lets each node see the committed past plus its own ancestors (no
copied modeling code: transformers uses a 4D mask as given). After acceptance, the KV cache
keeps the committed past plus the accepted nodes, in path order.

The runner also hands out what draft heads read from the target: the last hidden state (after
the final norm) and, for EAGLE-3, the aux layers (captured with forward pre-hooks, the same
convention as feature extraction: id i = the stream entering decoder layer i).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache

from specdraft.data.target import Target
from specdraft.eval.trees import TreeBuffers


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
    """One sequence (batch 1) on the frozen target with a KV cache.

    ``length`` counts the tokens in the cache. The decoder's newest token (the "root": sampled
    from the last logits, not yet run) is always outside the cache and is node 0 of the next
    verification.
    """

    def __init__(self, target: Target, aux_layer_ids: Sequence[int] = ()) -> None:
        self.target, self.model = target, target.model
        self.aux_layer_ids = tuple(aux_layer_ids)
        layers = self.model.get_decoder().layers
        for layer_id in self.aux_layer_ids:
            if not 0 <= layer_id < len(layers):
                raise ValueError(f"aux layer id {layer_id} out of range 0..{len(layers) - 1}")
        self.cache: DynamicCache | None = None
        self.length = 0
        self._pending = 0  # verified tokens in the cache that are not committed yet

    @torch.no_grad()
    def _forward(self, input_ids: Tensor, positions: Tensor, mask: Tensor | None) -> TargetOutput:
        decoder = self.model.get_decoder()
        captured: dict[int, Tensor] = {}

        def capture(layer_id: int):
            def hook(module, args, kwargs):
                captured[layer_id] = (args[0] if args else kwargs["hidden_states"])[0]

            return hook

        handles = [
            decoder.layers[i].register_forward_pre_hook(capture(i), with_kwargs=True)
            for i in self.aux_layer_ids
        ]
        try:
            output = decoder(
                input_ids=input_ids.unsqueeze(0).to(self.target.device),
                position_ids=positions.unsqueeze(0).to(self.target.device),
                attention_mask=mask,
                past_key_values=self.cache,
                use_cache=True,
            )
        finally:
            for handle in handles:
                handle.remove()
        self.cache = output.past_key_values
        hidden = output.last_hidden_state[0]
        logits = self.model.get_output_embeddings()(hidden)  # target dtype: fp32 copies cost ms per tree
        aux = torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1) if self.aux_layer_ids else None
        return TargetOutput(logits, hidden, aux)

    def prefill(self, input_ids: Tensor) -> TargetOutput:
        """Reset and run the prompt (n tokens, causal); they are committed at once."""
        self.cache, self.length, self._pending = DynamicCache(), 0, 0
        output = self._forward(input_ids, torch.arange(len(input_ids)), None)
        self.length = len(input_ids)
        return output

    def extend(self, input_ids: Tensor) -> TargetOutput:
        """Run n more tokens causally after the committed past and commit them (plain decoding
        is ``extend`` of one token; a new chat turn is ``extend`` of the turn's tokens)."""
        self._drop_pending()
        output = self._forward(input_ids, self.length + torch.arange(len(input_ids)), None)
        self.length += len(input_ids)
        return output

    def verify(self, node_tokens: Tensor, tree: TreeBuffers) -> TargetOutput:
        """Run the n tree nodes (node 0 = the root) after the committed past. They stay in the
        cache, uncommitted, until :meth:`commit`."""
        self._drop_pending()
        dtype = self.target.dtype
        bias = tree.attention_bias(self.length, dtype=torch.float32)
        mask = bias.clamp(min=torch.finfo(dtype).min).to(dtype)[None, None].to(self.target.device)
        output = self._forward(node_tokens, self.length + tree.depths, mask)
        self._pending = len(node_tokens)
        return output

    def commit(self, nodes: list[int]) -> None:
        """Keep the committed past plus ``nodes`` (indices into the last verified tree, root
        first, in path order); drop every other verified node from the cache."""
        if not self._pending:
            raise RuntimeError("TargetRunner.commit: nothing verified since the last commit")
        if nodes != list(range(len(nodes))):  # a prefix of the verified nodes needs no move
            # Move the accepted nodes' K/V right after the committed past (only those rows are
            # copied; the committed past stays where it is), then cut the rest off.
            source = self.length + torch.tensor(nodes, dtype=torch.long, device=self.target.device)
            destination = slice(self.length, self.length + len(nodes))
            for layer in _plain_layers(self.cache):
                layer.keys[:, :, destination] = layer.keys[:, :, source]
                layer.values[:, :, destination] = layer.values[:, :, source]
        self._drop_pending(keep=len(nodes))

    def _drop_pending(self, keep: int = 0) -> None:
        """Commit the first ``keep`` pending positions and drop the rest from the cache."""
        if self._pending:
            self.length += keep
            if self._pending > keep:
                truncate_cache(self.cache, self.length)
            self._pending = 0


def _plain_layers(cache: DynamicCache):
    for layer in cache.layers:
        if hasattr(layer, "cumulative_length"):  # sliding-window layers keep a running count
            raise NotImplementedError(f"KV compaction of {type(layer).__name__} caches is not supported")
        if layer.keys is not None:
            yield layer


def truncate_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of every layer's keys and values (a view, no copy)."""
    for layer in _plain_layers(cache):
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]
