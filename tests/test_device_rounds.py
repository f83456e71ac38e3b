"""Greedy rounds on the device (eval/decode.py ``_greedy_on_device``): a step is the drafter's
round and the target's greedy verification, each one fixed-shape call (a CUDA graph on a GPU,
run eagerly here), and one host sync. Each piece equals the host path it replaces:

* ``greedy_accept_tree`` (acceptance on the ancestor matrix) equals acceptance over the retrieve
  indices, and a hand-counted tree;
* ``TargetRunner.verify_greedy`` finds the accepted path, the next token and the features that
  verify + accept + commit find on the host, and leaves the same KV cache;
* ``FeatureHeadDrafter.next_round`` (a padded commit of the accepted path + the next tree) drafts
  the tree that ``commit`` + ``draft`` draft, for every accepted count;
* end to end: tokens == plain greedy decoding, and with an on-device oracle every draft is
  accepted (a random head accepts almost nothing, so that case needs its own drafter).
"""

from __future__ import annotations

import pytest
import torch
from conftest import chain_paths
from test_decode import GREEDY, MAX_NEW, prompt_ids, random_head, runner_for

from specdraft.eval.acceptance import greedy_accept, greedy_accept_tree
from specdraft.eval.decode import plain_generate, speculative_generate
from specdraft.eval.drafters import Chain, Drafter, DynamicTree
from specdraft.eval.feature_drafter import FeatureHeadDrafter
from specdraft.eval.runner import TargetRunner
from specdraft.eval.trees import tree_buffers, tree_from_parents

SHAPES = {"chain": Chain(depth=4), "dynamic": DynamicTree(depth=4, top_k=3, total_tokens=10)}
KINDS = ["eagle", "eagle3", "eagle3-reduced"]


def test_greedy_accept_tree_by_hand():
    # root 0 -> 1, 2; 1 -> 3, 4; 2 -> 5; 3 -> 6
    ancestors = tree_from_parents([-1, 0, 0, 1, 1, 2, 3]).attention_mask
    tokens = torch.tensor([7, 10, 11, 12, 13, 14, 15])
    argmax = torch.tensor([10, 13, 50, 60, 99, 70, 80])  # 1 matches under 0, 4 under 1; 99 next
    path, count, next_token = greedy_accept_tree(tokens, ancestors, argmax, max_depth=3)
    assert (path.tolist(), int(count), int(next_token)) == ([0, 1, 4, 4], 2, 99)
    argmax[0] = 11  # now 2 matches, and 5 under it (argmax[2] = 50 ≠ 14): one draft
    path, count, next_token = greedy_accept_tree(tokens, ancestors, argmax, max_depth=3)
    assert (path.tolist(), int(count), int(next_token)) == ([0, 2, 2, 2], 1, 50)
    argmax[0] = 42  # nothing matches: the target's own token
    path, count, next_token = greedy_accept_tree(tokens, ancestors, argmax, max_depth=3)
    assert (path.tolist(), int(count), int(next_token)) == ([0, 0, 0, 0], 0, 42)
    chain = tree_buffers(chain_paths(3)).attention_mask
    path, count, next_token = greedy_accept_tree(
        torch.tensor([1, 2, 3, 4]), chain, torch.tensor([2, 3, 4, 5]), max_depth=3
    )
    assert (path.tolist(), int(count), int(next_token)) == ([0, 1, 2, 3], 3, 5)


def test_greedy_accept_tree_equals_acceptance_over_paths():
    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        n = int(torch.randint(1, 16, (), generator=generator))
        parents = [-1] + [int(torch.randint(0, i, (), generator=generator)) for i in range(1, n)]
        tree = tree_from_parents(parents)
        # Siblings carry distinct tokens, as top-k drafts do.
        tokens = torch.randperm(50, generator=generator)[:n]
        argmax = torch.randint(0, 50, (n,), generator=generator)
        for node in range(1, n):  # most drafts match, so long paths get accepted
            if torch.rand((), generator=generator) < 0.7:
                argmax[parents[node]] = tokens[node]
        retrieve = tree.retrieve_indices
        candidates = torch.where(retrieve[:, 1:] >= 0, tokens[retrieve[:, 1:].clamp(min=0)], -1)
        row, accepted = greedy_accept(candidates, argmax[retrieve.clamp(min=0)])
        expected_path = retrieve[row, : int(accepted) + 1].tolist()
        depth = int(tree.depths.max())
        path, count, next_token = greedy_accept_tree(tokens, tree.attention_mask, argmax, depth + 1)
        assert int(count) == int(accepted), trial
        assert path.tolist() == expected_path + [expected_path[-1]] * (depth + 1 - int(accepted)), trial
        assert int(next_token) == int(argmax[expected_path[-1]]), trial


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_verify_greedy_equals_verify_accept_commit(tiny_target, kind, accepted):
    prompt = prompt_ids(tiny_target)
    greedy = plain_generate(runner_for(tiny_target, kind), prompt, 5, GREEDY, ()).tokens
    # A tree whose main chain (nodes 1, 3, 6) follows greedy decoding up to `accepted` drafts;
    # the siblings (2, 4, 5) carry other tokens.
    parents = [-1, 0, 0, 1, 1, 2, 3]
    wrong = [t + 1 for t in greedy]
    chain = [greedy[d] if d <= accepted else wrong[d] for d in (1, 2, 3)]
    tokens = torch.tensor([greedy[0], chain[0], wrong[1] + 1, chain[1], wrong[2] + 1, 5, chain[2]])
    tree = tree_from_parents(parents)
    max_depth = 4

    host = runner_for(tiny_target, kind)
    host.prefill(prompt)
    output = host.verify(tokens, tree)
    nodes = [0, 1, 3, 6][: accepted + 1]
    host.commit(nodes)

    device = TargetRunner(tiny_target, host.aux_layer_ids, graphs=True)
    device.prefill(prompt)
    past = torch.tensor(len(prompt))
    found, new_past, *features = device.verify_greedy(past, tokens, tree.attention_mask, max_depth)
    follow = [*greedy[1 : accepted + 2]] + [greedy[accepted + 1]] * (max_depth - accepted)
    assert found.tolist() == [accepted, 3, *follow]
    assert int(new_past) == len(prompt) + accepted + 1
    rows = output.rows(nodes)
    torch.testing.assert_close(features[0][: accepted + 1], rows.hidden)
    if rows.aux is not None:
        torch.testing.assert_close(features[1][: accepted + 1], rows.aux)
    device.advance(accepted)
    assert device.length == host.length
    committed = host.length
    torch.testing.assert_close(
        device.cache.storage[..., :committed, :], host.cache.storage[..., :committed, :], rtol=1e-5, atol=1e-5
    )
    # and both go on alike
    token = torch.tensor([greedy[accepted + 1]])
    torch.testing.assert_close(device.extend(token).logits, host.extend(token).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", KINDS)
def test_next_round_equals_commit_then_draft(tiny_target, kind, shape):
    head, tree_shape = random_head(tiny_target, kind), SHAPES[shape]
    max_depth = tree_shape.depth
    prompt = prompt_ids(tiny_target)
    runner = runner_for(tiny_target, kind)
    output = runner.prefill(prompt)
    root = int(output.logits[-1].argmax())
    generator = torch.Generator().manual_seed(1)
    for accepted in range(max_depth + 1):
        host, device = FeatureHeadDrafter(head, tree_shape), FeatureHeadDrafter(head, tree_shape, graphs=True)
        for drafter in (host, device):
            drafter.commit(prompt.tolist(), output, root)
        assert device.rounds_on_device(GREEDY) and not host.rounds_on_device(type(GREEDY)(temperature=1.0))
        draft = host.draft(root, GREEDY)
        tokens, ancestors = device.first_round(len(prompt) + 32)
        assert tokens.tolist() == draft.tokens.tolist()
        assert torch.equal(ancestors, draft.tree.attention_mask)

        # Commit `accepted` drafts (any tokens will do) and the next root, with real features.
        path = [root, *torch.randint(3, 90, (accepted,), generator=generator).tolist()]
        next_token = int(torch.randint(3, 90, (), generator=generator))
        features = runner.verify(torch.tensor(path), tree_buffers(chain_paths(accepted)))
        host.commit(path, features, next_token)
        expected = host.draft(next_token, GREEDY)

        pad = max_depth - accepted  # the rows past the accepted ones are padding
        found = torch.tensor([accepted, 0, *path[1:], next_token, *[next_token] * pad])
        rows = [
            torch.cat([x, x[-1:].expand(pad, -1)]) for x in (features.hidden, features.aux) if x is not None
        ]
        tokens, ancestors = device.next_round(torch.tensor(len(prompt)), found, *rows)
        assert tokens.tolist() == expected.tokens.tolist(), accepted
        assert torch.equal(ancestors, expected.tree.attention_mask), accepted


def recording(drafter: FeatureHeadDrafter, trees: list) -> FeatureHeadDrafter:
    """Record the tokens of every tree ``drafter`` drafts, on either path."""
    for name in ("draft", "first_round", "next_round"):
        method = getattr(drafter, name)

        def record(*args, method=method, name=name, **kwargs):
            result = method(*args, **kwargs)
            trees.append((result.tokens if name == "draft" else result[0]).tolist())
            return result

        setattr(drafter, name, record)
    return drafter


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", KINDS)
def test_device_rounds_decode_like_plain_and_like_the_host_path(tiny_target, kind, shape):
    """Same tokens as plain decoding, and the same trees, step for step, as the host path (a
    random head accepts almost nothing, so equal outputs alone would not show a drafting bug)."""
    prompt = prompt_ids(tiny_target)
    expected = plain_generate(TargetRunner(tiny_target), prompt, MAX_NEW, GREEDY, ()).tokens
    head = random_head(tiny_target, kind)
    host_trees, device_trees = [], []
    host_drafter = recording(FeatureHeadDrafter(head, SHAPES[shape]), host_trees)
    host = speculative_generate(runner_for(tiny_target, kind), host_drafter, prompt, MAX_NEW, GREEDY, ())
    aux = runner_for(tiny_target, kind).aux_layer_ids
    device_runner = TargetRunner(tiny_target, aux, graphs=True)
    drafter = FeatureHeadDrafter(head, SHAPES[shape], graphs=True)
    for eos in ((), {expected[17]}):  # a mid-sequence EOS ends both alike
        device = speculative_generate(device_runner, drafter, prompt, MAX_NEW, GREEDY, eos)
        reference = plain_generate(TargetRunner(tiny_target), prompt, MAX_NEW, GREEDY, eos)
        assert (device.tokens, device.stop) == (reference.tokens, reference.stop)
    device = speculative_generate(
        device_runner, recording(drafter, device_trees), prompt, MAX_NEW, GREEDY, ()
    )
    assert device.tokens == expected == host.tokens
    assert device_trees == host_trees
    assert [(s.nodes, s.depth, s.accepted) for s in device.steps] == [
        (s.nodes, s.depth, s.accepted) for s in host.steps
    ]


class DeviceOracle(Drafter):
    """Drafts, on device tensors only, a chain along a known continuation (``reference``: the
    prompt and greedy decoding's tokens) — or one token off it (``adversarial``) — with a wrong
    sibling under the root: acceptance must take whole chains, and nothing at all."""

    name = "device_oracle"

    def __init__(self, reference: list[int], depth: int, adversarial: bool = False) -> None:
        super().__init__(Chain(depth=depth))
        # room to read past the end of the reference near the end of a sequence
        self.reference = torch.tensor(reference + [0] * (depth + 2)) + int(adversarial)
        parents = [-1, *range(depth), 0]
        self.ancestors = tree_from_parents(parents).attention_mask

    def rounds_on_device(self, sampling) -> bool:
        return sampling.greedy

    def first_round(self, length: int):
        return self._tree(torch.tensor(len(self.history)), torch.tensor(self._root))

    def commit(self, tokens, target, next_token) -> None:
        super().commit(tokens, target, next_token)
        self._root = next_token

    def next_round(self, past, found, *features):
        count = found[0]
        return self._tree(past + count + 1, found[2:][count])

    def _tree(self, past, root):
        drafts = self.reference[past + 1 + torch.arange(self.shape.depth)]
        sibling = (drafts[:1] + 7) % 90
        return torch.cat([root[None], drafts, sibling]), self.ancestors


@pytest.mark.parametrize("adversarial", [False, True])
def test_device_rounds_accept_whole_chains_from_an_oracle(tiny_target, adversarial):
    prompt = prompt_ids(tiny_target)
    expected = plain_generate(TargetRunner(tiny_target), prompt, MAX_NEW, GREEDY, ()).tokens
    drafter = DeviceOracle(prompt.tolist() + expected, depth=4, adversarial=adversarial)
    generation = speculative_generate(
        TargetRunner(tiny_target, graphs=True), drafter, prompt, MAX_NEW, GREEDY, ()
    )
    assert generation.tokens == expected
    accepted = [step.accepted for step in generation.steps]
    if adversarial:
        assert accepted == [0] * (MAX_NEW - 1)
    else:
        assert all(step.accepted == step.depth == 4 for step in generation.steps[:-1]), accepted
        assert len(generation.steps) == -(-(MAX_NEW - 1) // 5)
