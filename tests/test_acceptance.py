"""Acceptance rules: greedy on literal tensors; sampling reproduces the target's distribution
over the WHOLE emitted block, the bonus token after full acceptance included (chi-square of every
prefix of 3-token blocks on a 4-token vocabulary), with enough trials that a rule which accepts
5 % too often, or draws the bonus from the wrong row, fails."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import prefix_chi_squares, rejects

from specdraft.data.generate import greedy_tokens
from specdraft.eval.acceptance import (
    greedy_accept,
    speculative_sample_chain,
    tree_rejection_sample,
    typical_accept,
)
from specdraft.eval.trees import tree_buffers

VOCAB = 4
DRAFTS = 2  # per block; with the bonus token a block has up to 3 tokens
BLOCK = DRAFTS + 1
# 20k blocks: a 5 % over-acceptance gives a first-token chi-square of ~25–40 against a critical
# ~19 (measured over seeds); a correct rule stays near its 3 degrees of freedom.
TRIALS = 20_000
OVER_ACCEPTANCE = 1.05
GROSS_ERROR_TRIALS = 2_000  # a wrong residual or bonus row is far off: fewer trials show it


def test_greedy_accept_literal():
    candidates = torch.tensor([[5, 6, 7], [5, 8, -1], [9, 1, 2]])
    target_argmax = torch.tensor([[5, 6, 0, 3], [5, 8, 4, 4], [1, 1, 1, 1]])
    assert tuple(map(int, greedy_accept(candidates, target_argmax))) == (
        0,
        2,
    )  # commit 5, 6 then the target's 0
    assert tuple(map(int, greedy_accept(torch.tensor([[3]]), torch.tensor([[4, 4]])))) == (
        0,
        0,
    )  # only the target's 4


class ToyModel:
    """A next-token distribution for every prefix, fixed by a seed (a stand-in LM)."""

    def __init__(self, seed: int, sharpness: float) -> None:
        self.seed, self.sharpness, self.table = seed, sharpness, {}

    def __call__(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in self.table:
            generator = torch.Generator().manual_seed(hash((self.seed, prefix)) % 2**31)
            logits = torch.randn(VOCAB, generator=generator, dtype=torch.float64) * self.sharpness
            self.table[prefix] = logits.softmax(-1)
        return self.table[prefix]


TARGET, DRAFT = ToyModel(1, 1.5), ToyModel(2, 1.0)


def emitted_blocks(emit, trials: int = TRIALS) -> dict[tuple[int, ...], int]:
    """Run ``emit(generator) -> tokens`` ``trials`` times; counts of the emitted BLOCK-token blocks
    (a block cut short by a rejection is completed from the target, as the next rounds would)."""
    generator = torch.Generator().manual_seed(0)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(trials):
        tokens = emit(generator)
        while len(tokens) < BLOCK:
            tokens.append(int(torch.multinomial(TARGET(tuple(tokens)), 1, generator=generator)))
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    return counts


def target_blocks() -> dict[tuple[int, ...], float]:
    """The target's probability of every BLOCK-token block."""
    expected = {}
    for block in itertools.product(range(VOCAB), repeat=BLOCK):
        expected[block] = float(torch.tensor([TARGET(block[:i])[block[i]] for i in range(BLOCK)]).prod())
    return expected


def assert_preserves_the_target(rule_emit) -> None:
    results = prefix_chi_squares(emitted_blocks(rule_emit), target_blocks())
    assert all(statistic < critical for statistic, critical in results), results


def chain_emit(rule):
    def emit(generator):
        drafts, draft_probs = [], []
        for _ in range(DRAFTS):
            q = DRAFT(tuple(drafts))
            draft_probs.append(q)
            drafts.append(int(torch.multinomial(q, 1, generator=generator)))
        target_probs = torch.stack([TARGET(tuple(drafts[:i])) for i in range(DRAFTS + 1)])
        accepted, token = rule(torch.tensor(drafts), torch.stack(draft_probs), target_probs, generator)
        return [*drafts[:accepted], token]

    return emit


def chain_rule(resample_from_p=False, over_accept=1.0, bonus_row=-1):
    """speculative_sample_chain with one thing wrong: resample from p instead of the residual
    max(0, p − q), accept ``over_accept`` times too often, or draw the bonus from another row."""

    def rule(draft_tokens, draft_probs, target_probs, generator):
        for i, token in enumerate(draft_tokens.tolist()):
            if (
                torch.rand((), generator=generator) * draft_probs[i, token]
                <= over_accept * target_probs[i, token]
            ):
                continue
            residual = target_probs[i] if resample_from_p else (target_probs[i] - draft_probs[i]).clamp(min=0)
            return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
        return len(draft_tokens), int(torch.multinomial(target_probs[bonus_row], 1, generator=generator))

    return rule


def test_chain_speculative_sampling_preserves_the_target_distribution():
    assert_preserves_the_target(chain_emit(speculative_sample_chain))


@pytest.mark.parametrize(
    "wrong,trials",
    [
        ({"resample_from_p": True}, GROSS_ERROR_TRIALS),
        ({"over_accept": OVER_ACCEPTANCE}, TRIALS),
        ({"bonus_row": -2}, GROSS_ERROR_TRIALS),
    ],
    ids=["resample-from-p", "over-accept-5%", "bonus-from-wrong-row"],
)
def test_chain_test_catches_a_wrong_rule(wrong, trials):
    assert rejects(emitted_blocks(chain_emit(chain_rule(**wrong)), trials), target_blocks())


PATHS = [[0], [1], [2], [0, 0], [0, 1], [1, 0]]


def tree_emit(rule):
    buffers = tree_buffers(PATHS)

    def emit(generator):
        # Deterministic top-k drafts: the r-th most likely draft token under each node's context.
        contexts: dict[tuple[int, ...], tuple[int, ...]] = {(): ()}
        tokens = [0]
        for path in buffers.paths:
            context = contexts[path[:-1]]
            token = int(DRAFT(context).argsort(descending=True)[path[-1]])
            contexts[path] = (*context, token)
            tokens.append(token)
        target_probs = torch.stack([TARGET(contexts[p]) for p in ((), *buffers.paths)])
        accepted, token = rule(torch.tensor(tokens), buffers.parents, target_probs, generator)
        return [tokens[node] for node in accepted] + [token]

    return emit


def tree_rule(resample_from_p=False, over_accept=1.0, bonus_from_parent=False):
    """tree_rejection_sample with one thing wrong: after rejecting every child sample from the
    ORIGINAL p, accept ``over_accept`` times too often, or draw the bonus after a fully accepted
    path from the leaf's parent's row."""

    def rule(tokens, parents, target_probs, generator):
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(parents.tolist()):
            if parent >= 0:
                children.setdefault(parent, []).append(node)
        accepted, node = [], 0
        while True:
            p = target_probs[node].clone()
            for child in children.get(node, []):
                if torch.rand((), generator=generator) < over_accept * p[tokens[child]]:
                    accepted.append(child)
                    node = child
                    break
                if not resample_from_p:
                    p[tokens[child]] = 0
                    p = p / p.sum()
            else:
                if bonus_from_parent and node not in children and node > 0:
                    p = target_probs[int(parents[node])]
                return accepted, int(torch.multinomial(p, 1, generator=generator))

    return rule


def test_tree_rejection_sampling_preserves_the_target_distribution():
    assert_preserves_the_target(tree_emit(tree_rejection_sample))


@pytest.mark.parametrize(
    "wrong,trials",
    [
        ({"resample_from_p": True}, GROSS_ERROR_TRIALS),
        ({"over_accept": OVER_ACCEPTANCE}, TRIALS),
        ({"bonus_from_parent": True}, GROSS_ERROR_TRIALS),
    ],
    ids=["resample-from-p", "over-accept-5%", "bonus-from-wrong-row"],
)
def test_tree_test_catches_a_wrong_rule(wrong, trials):
    assert rejects(emitted_blocks(tree_emit(tree_rule(**wrong)), trials), target_blocks())


def test_greedy_tokens_take_the_first_maximum_like_argmax():
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randint(0, 40, (64, 5000), generator=generator).float() / 8).bfloat16()  # many ties
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
    assert int(greedy_tokens(torch.tensor([1.0, 3.0, 3.0]))) == 1


# Medusa's typical acceptance at T>0: a drafted token is judged by its PARENT's distribution (the
# one it was drawn against), epsilon 0.3, delta 0.3.
TYPICAL_EPSILON, TYPICAL_DELTA = 0.3, 0.3


def typical_threshold(p: list[float]) -> float:
    """min(epsilon, delta·exp(−H(p))), written out."""
    entropy = -sum(x * math.log(x) for x in p if x > 0)
    return min(TYPICAL_EPSILON, TYPICAL_DELTA * math.exp(-entropy))


@pytest.mark.parametrize(
    "parent,child,token,accepted",
    [
        # p_parent(1) = 0.15 lies under the parent's threshold (0.163): rejected; the child's
        # own distribution (uniform: threshold 0.1, p_child(1) = 0.33) would accept it.
        ([0.8, 0.15, 0.05], [1 / 3, 1 / 3, 1 / 3], 1, False),
        # p_parent(0) = 0.33 is over the parent's threshold (0.1): accepted; the child's own
        # distribution (p_child(0) = 0.01) would reject it.
        ([1 / 3, 1 / 3, 1 / 3], [0.01, 0.98, 0.01], 0, True),
    ],
    ids=["rejected-by-its-parent", "accepted-by-its-parent"],
)
def test_typical_acceptance_judges_a_token_by_its_parents_distribution(parent, child, token, accepted):
    assert (parent[token] > typical_threshold(parent)) == accepted  # the case is what it says
    probs = torch.tensor([parent, child])
    nodes, _ = typical_accept(
        torch.tensor([0, token]),
        torch.tensor([[0, 1]]),
        probs,
        TYPICAL_EPSILON,
        TYPICAL_DELTA,
        torch.Generator().manual_seed(0),
    )
    assert nodes == ([1] if accepted else [])
