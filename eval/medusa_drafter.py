"""The drafter of Medusa heads: every head ranks its own position from one hidden state, so
the tree is static (or a chain): :class:`~specdraft.eval.parallel_drafter.ParallelDrafter`."""

from __future__ import annotations

import torch
from torch import Tensor

from specdraft.eval.drafters import Chain, DynamicTree, ScoreFilter, TreeShape
from specdraft.eval.kernels import compiled_step
from specdraft.eval.parallel_drafter import ParallelDrafter
from specdraft.eval.runner import TargetOutput
from specdraft.heads.medusa import MedusaHead


class MedusaDrafter(ParallelDrafter):
    """Medusa heads: head k ranks the token k+2 positions after the last committed one, all
    from that position's target hidden state, so a node's candidates do not depend on the
    drafted prefix and the tree is static (or a chain). ``compile``: the heads through
    ``torch.compile``."""

    name = "MedusaHead"

    def __init__(
        self,
        head: MedusaHead,
        shape: TreeShape,
        score_filter: ScoreFilter | None = None,
        compile: bool = False,
    ) -> None:
        if isinstance(shape, DynamicTree):
            raise ValueError(
                "Medusa heads draft chains or static trees, not dynamic trees: use a shape like "
                "{kind: static, rank_accept: [[0.6, 0.2], [0.4, 0.1]], num_nodes: 6} (methods=medusa)"
            )
        depth = shape.depth if isinstance(shape, Chain) else max(len(p) for p in shape.paths)
        if depth > head.num_heads:
            raise ValueError(
                f"a depth-{depth} draft needs {depth} Medusa heads; this head has {head.num_heads}"
            )
        super().__init__(shape, score_filter)
        self.head = head
        self._heads = compiled_step(head) if compile else head
        self.dtype = next(head.parameters()).dtype
        self.device = next(head.parameters()).device
        self.vocab_size = head.spec.vocab_size
        self.to_target = torch.arange(self.vocab_size, device=self.device)
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.last_hidden: Tensor | None = None

    def commit(self, tokens: list[int], target: TargetOutput, next_token: int) -> None:
        super().commit(tokens, target, next_token)
        self.last_hidden = target.hidden[-1:].to(self.device, self.dtype)

    def depth_log_probs(self, root: int) -> Tensor:
        """Head k ranks depth k + 1: K×V from the last committed position's hidden state."""
        return self._heads(self.last_hidden)[:, 0].float().log_softmax(-1)
