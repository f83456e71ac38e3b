"""What drafters share whose candidates for every depth come from ONE forward (Medusa heads, DFlash
blocks): depth d's candidates depend on the committed context and the root only, never on the
drafted prefix, so a draft is per-depth log-probs D×V turned into a chain, a static tree of
sibling-rank paths, or an EAGLE-2-style dynamic tree over those per-depth candidates."""

from __future__ import annotations

import torch
from torch import Tensor

from specdraft.eval.drafters import (
    Chain,
    Draft,
    Drafter,
    DraftNode,
    DynamicTree,
    StaticTree,
    TreeGrowth,
)
from specdraft.eval.sampling import Sampling
from specdraft.eval.trees import tree_buffers


class ParallelDrafter(Drafter):
    """A drafter whose :meth:`depth_log_probs` ranks every depth at once. Subclasses set
    ``vocab_size`` and ``to_target`` (draft index → target id) and implement
    :meth:`depth_log_probs`. The score filter (tests) sees each depth's candidates with the
    context they are conditioned on: the committed tokens and the root, ``ahead`` = depth − 1."""

    def depth_log_probs(self, root: int) -> Tensor:
        """fp32 log-probs D×V' (D ≥ ``max_depth``): row d − 1 ranks the candidates for depth d."""
        raise NotImplementedError

    @torch.no_grad()
    def draft(self, root: int, sampling: Sampling, generator: torch.Generator | None = None) -> Draft:
        log_probs = self.depth_log_probs(root)
        if self.score_filter is not None:
            context = [*self.history, root]
            log_probs = torch.cat(
                [
                    self._filtered([context], d, log_probs[d : d + 1], self.to_target)
                    for d in range(len(log_probs))
                ]
            )
        growth = TreeGrowth([DraftNode(root, -1, 0, ())])
        shape = self.shape
        if isinstance(shape, Chain):
            step = lambda node: log_probs[growth.nodes[node].depth]  # noqa: E731
            return self._chain(growth, log_probs[0], step, self.to_target, sampling, generator)
        if isinstance(shape, StaticTree):
            return self._parallel_static(growth, shape, log_probs)
        return self._parallel_dynamic(growth, shape, log_probs)

    def _parallel_static(self, growth: TreeGrowth, shape: StaticTree, log_probs: Tensor) -> Draft:
        """Path (r_1, …, r_d) is depth d's r_d-th ranked candidate under its parent."""
        paths = sorted(shape.paths, key=lambda p: (len(p), p))
        width = [0] * max(len(p) for p in paths)
        for path in paths:
            width[len(path) - 1] = max(width[len(path) - 1], path[-1] + 1)
        ranked = [log_probs[d].topk(w) for d, w in enumerate(width)]
        by_path = {(): 0}
        for path in paths:
            top = ranked[len(path) - 1]
            rank = path[-1]
            by_path[path] = growth.add(
                int(self.to_target[top.indices[rank]]), by_path[path[:-1]], rank, float(top.values[rank])
            )
        return growth.draft(list(range(1, len(growth.nodes))), self._memoised_tree)

    def _parallel_dynamic(self, growth: TreeGrowth, shape: DynamicTree, log_probs: Tensor) -> Draft:
        """EAGLE-2 over per-depth candidates: each of the ``top_k`` best frontier nodes (by
        cumulative draft log-prob) gets depth d's ``top_k`` candidates as children, then the
        ``total_tokens − 1`` best nodes are kept. Ties go to the node created first, a parent
        before its children (a child never scores above its parent), so the kept set is a tree."""
        k = shape.top_k
        frontier = [0]
        for d in range(shape.depth):
            top = log_probs[d].topk(k)
            values, indices = top.values.tolist(), top.indices.tolist()
            children = [
                growth.add(int(self.to_target[index]), parent, rank, growth.nodes[parent].score + value)
                for parent in frontier
                for rank, (value, index) in enumerate(zip(values, indices, strict=True))
            ]
            frontier = sorted(children, key=lambda n: -growth.nodes[n].score)[:k]  # stable
        ranked = sorted(range(1, len(growth.nodes)), key=lambda n: -growth.nodes[n].score)
        # Not memoised: the kept paths vary from round to round.
        return growth.draft(sorted(ranked[: shape.total_tokens - 1]), tree_buffers)
