"""The frozen HF target as a decoder sees it: prefill, tree verification, KV compaction.

Tree verification runs every drafted node in ONE forward: positions = committed length + node
depth, and a custom 4D mask lets each node see the committed past plus its own ancestors (no
copied modeling code: transformers uses a 4D mask as given). After acceptance, the KV cache
keeps the committed past plus the accepted nodes, in path order.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache

from specdraft.data.target import Target
from specdraft.eval.trees import TreeBuffers


class TargetRunner:
    """One sequence (batch 1) on the frozen target with a KV cache.

    ``prefill`` / ``verify`` return (logits n×V fp32, last hidden state n×H after the final norm).
    """

    def __init__(self, target: Target) -> None:
        self.target, self.model = target, target.model
        self.cache: DynamicCache | None = None
        self.length = 0  # committed tokens in the cache

    @torch.no_grad()
    def _forward(self, input_ids: Tensor, positions: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
        output = self.model.get_decoder()(
            input_ids=input_ids.unsqueeze(0).to(self.target.device),
            position_ids=positions.unsqueeze(0).to(self.target.device),
            attention_mask=mask,
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache = output.past_key_values
        hidden = output.last_hidden_state[0]
        return self.model.get_output_embeddings()(hidden).float(), hidden

    def prefill(self, input_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Reset and run the prompt (n tokens, causal)."""
        self.cache, self.length = DynamicCache(), 0
        logits, hidden = self._forward(input_ids, torch.arange(len(input_ids)), None)
        self.length = len(input_ids)
        return logits, hidden

    def verify(self, node_tokens: Tensor, tree: TreeBuffers) -> tuple[Tensor, Tensor]:
        """Run the n tree nodes (node 0 = the last committed-but-not-yet-cached token, i.e. the
        root) after the committed past. Leaves them in the cache until :meth:`commit`."""
        dtype = self.target.dtype
        bias = tree.attention_bias(self.length, dtype=torch.float32)
        mask = bias.clamp(min=torch.finfo(dtype).min).to(dtype)[None, None].to(self.target.device)
        return self._forward(node_tokens, self.length + tree.depths, mask)

    def commit(self, nodes: list[int]) -> None:
        """Keep the committed past plus ``nodes`` (indices into the last verified tree, root
        first, in path order); drop every other verified node from the cache."""
        keep = torch.cat([torch.arange(self.length), self.length + torch.tensor(nodes, dtype=torch.long)])
        keep = keep.to(self.target.device)
        for layer in self.cache.layers:
            layer.keys = layer.keys[:, :, keep]
            layer.values = layer.values[:, :, keep]
        self.length += len(nodes)
