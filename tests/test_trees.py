"""Static tree buffers against hand-written tensors."""

from __future__ import annotations

import pytest
import torch
from conftest import chain_paths

from specdraft.eval.trees import best_static_tree, tree_buffers, tree_from_ancestors


def test_small_tree_literal():
    buffers = tree_buffers([[0], [1], [0, 0], [0, 1], [1, 0]])
    assert buffers.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0))
    expected_mask = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],
            [1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(buffers.attention_mask, expected_mask)
    assert buffers.depths.tolist() == [0, 1, 1, 2, 2, 2]
    assert buffers.parents.tolist() == [-1, 0, 0, 1, 1, 2]
    assert buffers.retrieve_indices.tolist() == [[0, 1, 3], [0, 1, 4], [0, 2, 5]]


def test_chain_and_unbalanced_tree():
    chain = tree_buffers(chain_paths(3))
    assert torch.equal(chain.attention_mask, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert chain.depths.tolist() == [0, 1, 2, 3]
    assert chain.retrieve_indices.tolist() == [[0, 1, 2, 3]]
    # Input order does not matter; a shallow leaf is padded with −1.
    tree = tree_buffers([[0, 0], [1], [0]])
    assert tree.paths == ((0,), (1,), (0, 0))
    assert tree.retrieve_indices.tolist() == [[0, 1, 3], [0, 2, -1]]


def test_tree_from_ancestors_equals_the_path_built_tree():
    tree = tree_buffers([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    grown = tree_from_ancestors(tree.attention_mask)
    assert grown.paths is None and grown.num_nodes == tree.num_nodes
    for field in ("parents", "depths", "attention_mask"):
        assert torch.equal(getattr(grown, field), getattr(tree, field)), field
    # the same root-to-leaf paths (leaves in node order here, in path order there)
    assert sorted(grown.retrieve_indices.tolist()) == sorted(tree.retrieve_indices.tolist())
    root_alone = tree_from_ancestors(torch.ones(1, 1, dtype=torch.bool))
    assert root_alone.retrieve_indices.tolist() == [[0]] and root_alone.parents.tolist() == [-1]


def test_bad_paths_are_refused():
    with pytest.raises(ValueError, match=r"missing \[\[1\]\]"):
        tree_buffers([[0], [1, 0]])
    with pytest.raises(ValueError, match="ranks must be >= 0"):
        tree_buffers([[-1]])


def test_best_static_tree_is_the_top_paths_by_reach():
    rank_accept = [[0.5, 0.3, 0.1], [0.6, 0.2], [0.9]]
    paths = best_static_tree(rank_accept, 6)
    # reach: (0) .5, (0,0) .3 = (1) .3 (the shorter path wins the tie only by order: (0,0) < (1,)),
    # (0,0,0) .27, (1,0) .18, (1,0,0) .162, then (0,1) = (2) = .1
    assert paths == [(0,), (0, 0), (1,), (0, 0, 0), (1, 0), (1, 0, 0)]
    tree_buffers(paths)  # every prefix is present
    assert best_static_tree([[1.0]] * 3, 10) == [(0,), (0, 0), (0, 0, 0)]  # a chain, capped by depth
    with pytest.raises(ValueError, match="rank_accept"):
        best_static_tree([[1.5]], 2)


def test_root_alone():
    buffers = tree_buffers([])
    assert buffers.num_nodes == 1 and buffers.retrieve_indices.tolist() == [[0]]
    assert buffers.attention_mask.tolist() == [[True]] and buffers.depths.tolist() == [0]
