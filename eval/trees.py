"""Static draft trees as tensors: attention mask, depths, retrieve indices (pure functions).

A tree is a list of paths; a path ``(r_0, …, r_{d−1})`` is the node reached by taking the r_0-th
ranked candidate at depth 1, then the r_1-th ranked child, … (Medusa "choices"; a chain of
depth D is ``[(0,), (0, 0), …]``). Node 0 is the root: the last token the target committed. The
other nodes are ordered by depth, then by path, so a node's ancestors always come before it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TreeBuffers:
    """For a tree of n = 1 + len(paths) nodes, L leaves and depth D:

    paths            the node paths in node order (node i+1 has paths[i]; the root is ()), for
                     trees built from paths; None for trees grown on tensors (dynamic trees)
    parents          n int64, parent node of each node (−1 for the root)
    depths           n int64, depth of each node (root 0): its position offset after the root
    attention_mask   n×n bool, True where node i may attend node j (its ancestors and itself)
    retrieve_indices L×(D+1) int64, the nodes of each root-to-leaf path, −1 padded
    """

    paths: tuple[tuple[int, ...], ...] | None
    parents: Tensor
    depths: Tensor
    attention_mask: Tensor
    retrieve_indices: Tensor

    @property
    def num_nodes(self) -> int:
        return len(self.parents)


def tree_buffers(paths: Sequence[Sequence[int]]) -> TreeBuffers:
    """Buffers for a static tree given by ``paths`` (every prefix of a path must be a path too;
    no paths at all is the root alone)."""
    ordered = sorted({tuple(int(r) for r in path) for path in paths}, key=lambda p: (len(p), p))
    for path in ordered:
        if not path or min(path) < 0:
            raise ValueError(f"tree path {list(path)}: ranks must be >= 0 and paths non-empty")
    index = {(): 0} | {path: i + 1 for i, path in enumerate(ordered)}
    missing = [list(p[:-1]) for p in ordered if p[:-1] not in index]
    if missing:
        raise ValueError(f"tree paths must include every prefix; missing {missing[:5]}")

    n = len(ordered) + 1
    parents = torch.full((n,), -1, dtype=torch.long)
    depths = torch.zeros(n, dtype=torch.long)
    mask = torch.eye(n, dtype=torch.bool)
    for path in ordered:
        node = index[path]
        parents[node], depths[node] = index[path[:-1]], len(path)
        for d in range(len(path)):  # the root and every proper prefix are ancestors
            mask[node, index[path[:d]]] = True

    is_prefix = {p[:-1] for p in ordered}
    leaves = sorted(p for p in ordered if p not in is_prefix) or [()]  # no paths: the root alone
    depth = max((len(p) for p in ordered), default=0)
    retrieve = torch.full((len(leaves), depth + 1), -1, dtype=torch.long)
    for row, leaf in enumerate(leaves):
        retrieve[row, : len(leaf) + 1] = torch.tensor([index[leaf[:d]] for d in range(len(leaf) + 1)])
    return TreeBuffers(tuple(ordered), parents, depths, mask, retrieve)


def tree_from_ancestors(ancestors: Tensor) -> TreeBuffers:
    """Buffers of a tree given as its ancestor matrix (n×n bool, node i's row marks its ancestors
    and itself; node 0 is the root and every node's ancestors come before it), on its device, in
    a few tensor ops: what a drafter growing a tree on tensors hands to verification."""
    n = len(ancestors)
    depths = ancestors.sum(-1) - 1
    # The parent is the deepest proper ancestor: the last one, as ancestors come first.
    proper = ancestors & ~torch.eye(n, dtype=torch.bool, device=ancestors.device)
    order = torch.arange(n, device=ancestors.device)
    parents = torch.where(proper.any(-1), torch.where(proper, order, -1).amax(-1), -1)
    is_parent = torch.zeros(n, dtype=torch.bool, device=ancestors.device)
    is_parent[parents[1:]] = True
    leaves = (~is_parent).nonzero().flatten()  # the root alone is its own leaf
    # Row r lists leaf r's path in node order: node j goes to column (its rank among the path).
    on_path = ancestors[leaves]
    columns = torch.where(on_path, on_path.cumsum(-1) - 1, n)  # column n collects the rest
    retrieve = torch.full((len(leaves), n + 1), -1, dtype=torch.long, device=ancestors.device)
    retrieve.scatter_(1, columns, order.expand(len(leaves), n).clone())
    width = int(depths.max()) + 1 if n > 1 else 1
    return TreeBuffers(None, parents, depths, ancestors, retrieve[:, :width])


def tree_from_parents(parents: Sequence[int]) -> TreeBuffers:
    """Buffers of a tree given by each node's parent (node 0, the root, has −1; every parent
    comes before its children), built on the host: for drafters that assemble a tree node by
    node (lookahead decoding)."""
    n = len(parents)
    ancestors = torch.eye(n, dtype=torch.bool)
    for node, parent in enumerate(parents):
        if (node == 0) != (parent < 0) or parent >= node:
            raise ValueError(f"node {node}: parent {parent} (the root alone has none; parents come first)")
        if parent >= 0:
            ancestors[node] |= ancestors[parent]
    return tree_from_ancestors(ancestors)


def best_static_tree(rank_accept: Sequence[Sequence[float]], num_nodes: int) -> list[tuple[int, ...]]:
    """The ``num_nodes`` paths of highest estimated reach probability (Medusa's tree construction).

    ``rank_accept[d][r]`` estimates the probability that the r-th ranked candidate at depth d+1
    is the accepted token; a path is reached with the product over its steps. Because that
    product only falls along a path, the best paths form a tree (every prefix is kept); they
    are enumerated best-first, ties broken by the paths' order (lexicographic).
    """
    if num_nodes < 1:
        raise ValueError(f"a static tree needs num_nodes >= 1, got {num_nodes}")
    for d, row in enumerate(rank_accept):
        if not row or any(not 0 <= p <= 1 for p in row):
            raise ValueError(f"rank_accept[{d}] must be non-empty probabilities, got {list(row)}")
    frontier = [(-float(p), (r,)) for r, p in enumerate(rank_accept[0])]
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < num_nodes:
        negative_reach, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < len(rank_accept):
            for r, p in enumerate(rank_accept[len(path)]):
                heapq.heappush(frontier, (negative_reach * p, (*path, r)))
    return chosen
