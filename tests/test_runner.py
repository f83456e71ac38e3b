"""Tree verification on the HF target equals running each path on its own; KV compaction keeps
exactly the accepted path. Both runner modes: the default (attention over the committed prefix)
and the static steps CUDA graphs replay (``graphs=True``: the whole cache, masked; run eagerly on
a CPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import chain_paths

from specdraft.data.attention import attention_windows, column_positions, windowed_masks
from specdraft.data.features import TokenBatch, extract_features
from specdraft.data.tiny import TINY_SLIDING_WINDOW, tiny_random_target
from specdraft.eval.runner import TargetRunner
from specdraft.eval.trees import tree_buffers


def fresh_logits(target, tokens: list[int]) -> torch.Tensor:
    """The target's next-token logits after ``tokens``, from scratch (no cache, no tree)."""
    with torch.no_grad():
        return target.model(input_ids=torch.tensor([tokens])).logits[0, -1].float()


@pytest.mark.parametrize("graphs", [False, True])
def test_tree_verify_and_commit_match_plain_forwards(tiny_target, graphs):
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, tiny_target.spec.vocab_size, (10,), generator=generator).tolist()
    runner = TargetRunner(tiny_target, graphs=graphs)
    output = runner.prefill(torch.tensor(prompt))
    logits, hidden = output.logits, output.hidden
    torch.testing.assert_close(logits[-1], fresh_logits(tiny_target, prompt), rtol=1e-5, atol=1e-5)
    assert hidden.shape == (10, tiny_target.spec.hidden_size)

    tree = tree_buffers([[0], [1], [0, 0], [0, 1], [1, 0]])
    root = int(logits[-1].argmax())
    nodes = [root, *torch.randint(3, tiny_target.spec.vocab_size, (5,), generator=generator).tolist()]
    tree_logits = runner.verify(torch.tensor(nodes), tree).logits
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
    chain_logits = runner.verify(torch.tensor(chain_nodes), chain).logits
    for depth in range(3):
        expected = fresh_logits(tiny_target, committed + chain_nodes[: depth + 1])
        torch.testing.assert_close(chain_logits[depth], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("graphs", [False, True])
def test_runner_features_equal_offline_extraction(tiny_target, graphs):
    """What the decoder feeds a head online (prefill, then verified and committed nodes) equals
    what training reads from the feature cache for the same tokens."""
    spec = tiny_target.spec
    tokens = torch.randint(3, spec.vocab_size, (14,), generator=torch.Generator().manual_seed(1))
    batch = TokenBatch(tokens[None], torch.ones(1, 14, dtype=torch.long), torch.ones(1, 14, dtype=torch.long))
    offline = extract_features(tiny_target, batch, aux_layer_ids=spec.aux_layer_ids)
    runner = TargetRunner(tiny_target, spec.aux_layer_ids, graphs=graphs)
    first = runner.prefill(tokens[:9])
    tree = tree_buffers([[0], [1], [0, 0], [0, 0, 0], [1, 0]])  # nodes: root, a, b, a0, b0, a00
    nodes = [tokens[9], tokens[10], 5, tokens[11], 7, tokens[12]]
    verified = runner.verify(torch.tensor(nodes), tree)
    path = [0, 1, 3, 5]
    runner.commit(path)
    last = runner.extend(tokens[13:])
    hidden = torch.cat([first.hidden, verified.rows(path).hidden, last.hidden])
    aux = torch.cat([first.aux, verified.rows(path).aux, last.aux])
    torch.testing.assert_close(hidden, offline.hidden[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux, offline.aux[0], rtol=1e-5, atol=1e-5)
    assert runner.length == 14


@pytest.mark.parametrize("graphs", [False, True])
def test_commit_of_a_prefix_crops_the_rest(tiny_target, graphs):
    runner = TargetRunner(tiny_target, graphs=graphs)
    runner.prefill(torch.tensor([5, 6, 7]))
    runner.verify(torch.tensor([8, 9, 10, 11]), tree_buffers(chain_paths(3)))
    runner.commit([0, 1])
    assert runner.length == 5 and runner.cache.get_seq_length() == 5
    with pytest.raises(RuntimeError, match="nothing verified"):
        runner.commit([0])
    logits = runner.extend(torch.tensor([12])).logits
    torch.testing.assert_close(
        logits[-1], fresh_logits(tiny_target, [5, 6, 7, 8, 9, 12]), rtol=1e-5, atol=1e-5
    )


def test_windowed_masks_hide_the_keys_a_window_leaves_out():
    """A tree verified after a 4-token past under a window of 3 keys: node 2 (depth 1, the
    root's child, position 5) sees positions 3..5 — past position 3, the root (column 4,
    position 4) and itself (column 6) — and not its sibling at column 5; a global layer sees all
    of its past and ancestors."""
    visible = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 1]]).bool()
    positions = torch.tensor([[4, 5, 5]])
    keys = column_positions(7, torch.arange(4, 7), positions)
    assert keys.tolist() == [[0, 1, 2, 3, 4, 5, 5]]
    windows = {"full_attention": None, "sliding_attention": 3}
    masks = windowed_masks(visible[None, None], windows, positions, keys)
    assert torch.equal(masks["full_attention"][0, 0], visible)
    assert masks["sliding_attention"][0, 0].int().tolist() == [
        [0, 0, 1, 1, 1, 0, 0],
        [0, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 1, 1, 0, 1],
    ]
    unwindowed = visible[None, None]
    assert windowed_masks(unwindowed, {None: None}, positions, keys) is unwindowed
    hidden = torch.finfo(torch.float32).min
    additive = torch.zeros(visible.shape).masked_fill(~visible, hidden)[None, None]
    one = windowed_masks(additive, {None: 3}, positions, keys)  # every layer windowed alike
    assert one[0, 0, 0, 1] == hidden and one[0, 0, 0, 2] == 0


def test_attention_windows_follow_the_config():
    assert attention_windows(tiny_random_target(seed=0).model.config) == {None: None}
    mistral = tiny_random_target(seed=0, family="mistral").model.config
    assert attention_windows(mistral) == {None: TINY_SLIDING_WINDOW}
    gemma = tiny_random_target(seed=0, family="gemma2").model.config
    assert attention_windows(gemma) == {"full_attention": None, "sliding_attention": TINY_SLIDING_WINDOW}
    qwen = tiny_random_target(seed=0, family="qwen2").model.config
    assert set(attention_windows(qwen).values()) == {None}  # a window it does not use
