"""The drafter of Medusa heads: every head ranks its own position from one hidden state, so
the tree is static (or a chain)."""

from __future__ import annotations

import torch
from torch import Tensor

from specdraft.eval.drafters import (
    Chain,
    Draft,
    Drafter,
    DraftNode,
    DynamicTree,
    ScoreFilter,
    TreeGrowth,
    TreeShape,
)
from specdraft.eval.kernels import compiled_step
from specdraft.eval.runner import TargetOutput
from specdraft.eval.sampling import Sampling
from specdraft.heads.medusa import MedusaHead


class MedusaDrafter(Drafter):
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

    @torch.no_grad()
    def draft(self, root: int, sampling: Sampling, generator: torch.Generator | None = None) -> Draft:
        log_probs = self._heads(self.last_hidden)[:, 0].float().log_softmax(-1)  # K×V
        if self.score_filter is not None:
            context = [*self.history, root]
            log_probs = torch.cat(
                [
                    self._filtered([context], k, log_probs[k : k + 1], self.to_target)
                    for k in range(len(log_probs))
                ]
            )
        growth = TreeGrowth([DraftNode(root, -1, 0, ())])
        if isinstance(self.shape, Chain):
            step = lambda node: log_probs[growth.nodes[node].depth]  # noqa: E731
            return self._chain(growth, log_probs[0], step, self.to_target, sampling, generator)
        paths = sorted(self.shape.paths, key=lambda p: (len(p), p))
        width = [0] * max(len(p) for p in paths)
        for path in paths:
            width[len(path) - 1] = max(width[len(path) - 1], path[-1] + 1)
        ranked = [log_probs[d].topk(w) for d, w in enumerate(width)]
        by_path = {(): 0}
        for path in paths:
            top = ranked[len(path) - 1]
            rank = path[-1]
            by_path[path] = growth.add(
                int(top.indices[rank]), by_path[path[:-1]], rank, float(top.values[rank])
            )
        return growth.draft(list(range(1, len(growth.nodes))), self._memoised_tree)
