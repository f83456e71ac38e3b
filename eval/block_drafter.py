"""The drafter of DFlash heads (block drafting, docs/architecture.md §3 "Block drafting"): one head
forward over the block [root, mask, …, mask] fills every depth at once, so the shapes are
:class:`~specdraft.eval.parallel_drafter.ParallelDrafter`'s."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from specdraft.data.kv_cache import grow_positions
from specdraft.eval.drafters import ScoreFilter, TreeShape
from specdraft.eval.parallel_drafter import ParallelDrafter
from specdraft.eval.runner import TargetOutput
from specdraft.heads.dflash import Blocks, DFlashHead

# ``shape: auto`` tries chains whose depths grow by this factor from 1 up to the block's last
# position (and that one): a deeper chain costs a bigger verification, hardly a longer draft.
CHAIN_DEPTH_GROWTH = 2


class BlockDrafter(ParallelDrafter):
    """DFlash heads. The context cache holds every draft layer's keys/values of the committed
    positions — the head's projection of the target's fused aux taps there
    (``head.context_keys_values``) — in one preallocated tensor written by position at each
    commit (never concatenated; it grows by :func:`~specdraft.data.kv_cache.grow_positions`).
    A draft is ONE head forward of the full block [root, mask × (block_size − 1)] at positions
    L … L + block_size − 1 (L = the committed length) over the cache's first L positions;
    block position d ranks depth d's candidates, whatever was drafted before it (as Medusa's
    heads). Only the depths the shape uses go through the lm_head. A vocabulary shortlist does not
    apply: the head reads out through the target's whole lm_head."""

    name = "DFlashHead"

    def __init__(self, head: DFlashHead, shape: TreeShape, score_filter: ScoreFilter | None = None) -> None:
        super().__init__(shape, score_filter)
        depth = self.max_depth
        if depth > head.block_size - 1:
            raise ValueError(
                f"a depth-{depth} draft needs block position {depth}; this DFlash head's blocks of "
                f"{head.block_size} draft depths 1..{head.block_size - 1}"
            )
        self.head = head
        self.dtype = next(head.parameters()).dtype
        self.device = next(head.parameters()).device
        self.vocab_size = head.spec.vocab_size
        self.to_target = torch.arange(self.vocab_size, device=self.device)
        spec = head.spec
        # layers × (keys, values) × 1 × kv heads × positions × head_dim
        self.kv = torch.zeros(
            len(head.layers), 2, 1, spec.num_kv_heads, 0, spec.head_dim, dtype=self.dtype, device=self.device
        )
        self.reset()

    def candidate_shapes(self) -> list[dict[str, Any]]:
        """Chains of depth 1, 2, 4, … and block_size − 1 (the whole block)."""
        last, depths, depth = self.head.block_size - 1, [], 1
        while depth < last:
            depths.append(depth)
            depth *= CHAIN_DEPTH_GROWTH
        return [{"kind": "chain", "depth": d} for d in [*depths, last]]

    @torch.no_grad()
    def commit(self, tokens: list[int], target: TargetOutput, next_token: int) -> None:
        if target.aux is None:
            raise ValueError(
                f"a DFlash head reads the target's aux layers {self.head.target_taps}: the target "
                "runner must capture them (TargetRunner(target, head.target_taps))"
            )
        past, count = len(self.history), len(tokens)
        self.kv = grow_positions(self.kv, past + count, keep=past)
        features = self.head.context_features(target.aux.to(self.device, self.dtype)[None])  # 1×n×H
        positions = past + torch.arange(count, device=self.device)
        for layer, (key, value) in enumerate(self.head.context_keys_values(features, positions[None])):
            self.kv[layer, 0, :, :, past : past + count] = key
            self.kv[layer, 1, :, :, past : past + count] = value
        super().commit(tokens, target, next_token)

    def depth_log_probs(self, root: int) -> Tensor:
        """The block after the committed L positions: (max_depth)×V, row d − 1 = block position d."""
        past = len(self.history)
        blocks = Blocks(
            tokens=self.head.block_tokens(torch.tensor([[root]], device=self.device)),  # 1×1×k
            anchors=torch.tensor([[past]], device=self.device),
            context=None,  # the cache's first L positions are exactly the context
        )
        context_kv = [(keys[:, :, :past], values[:, :, :past]) for keys, values in self.kv]
        outputs = self.head.block_outputs(blocks, context_kv, self.dtype)  # 1×1×k×H
        return self.head.logits(outputs[0, 0, 1 : 1 + self.max_depth]).float().log_softmax(-1)
