"""Tree verification on the HF target equals running each path on its own; KV compaction keeps
exactly the accepted path."""

from __future__ import annotations

import torch

from specdraft.eval.runner import TargetRunner
from specdraft.eval.trees import chain_paths, tree_buffers


def fresh_logits(target, tokens: list[int]) -> torch.Tensor:
    """The target's next-token logits after ``tokens``, from scratch (no cache, no tree)."""
    with torch.no_grad():
        return target.model(input_ids=torch.tensor([tokens])).logits[0, -1].float()


def test_tree_verify_and_commit_match_plain_forwards(tiny_target):
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, tiny_target.spec.vocab_size, (10,), generator=generator).tolist()
    runner = TargetRunner(tiny_target)
    logits, hidden = runner.prefill(torch.tensor(prompt))
    torch.testing.assert_close(logits[-1], fresh_logits(tiny_target, prompt), rtol=1e-5, atol=1e-5)
    assert hidden.shape == (10, tiny_target.spec.hidden_size)

    tree = tree_buffers([[0], [1], [0, 0], [0, 1], [1, 0]])
    root = int(logits[-1].argmax())
    nodes = [root, *torch.randint(3, tiny_target.spec.vocab_size, (5,), generator=generator).tolist()]
    tree_logits, _ = runner.verify(torch.tensor(nodes), tree)
    for node in range(tree.num_nodes):
        ancestors, current = [], node
        while current >= 0:
            ancestors.insert(0, current)
            current = int(tree.parents[current])
        expected = fresh_logits(tiny_target, prompt + [nodes[i] for i in ancestors])
        torch.testing.assert_close(tree_logits[node], expected, rtol=1e-5, atol=1e-5)

    # Accept root → (0,) → (0, 1); the next round continues from exactly that sequence.
    runner.commit([0, 1, 4])
    committed = [*prompt, nodes[0], nodes[1], nodes[4]]
    assert runner.length == len(committed)
    new_root = int(tree_logits[4].argmax())
    chain = tree_buffers(chain_paths(2))
    chain_nodes = [new_root, 7, 9]
    chain_logits, _ = runner.verify(torch.tensor(chain_nodes), chain)
    for depth in range(3):
        expected = fresh_logits(tiny_target, committed + chain_nodes[: depth + 1])
        torch.testing.assert_close(chain_logits[depth], expected, rtol=1e-5, atol=1e-5)
