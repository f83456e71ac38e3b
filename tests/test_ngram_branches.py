"""Prompt-lookup n-gram branches inside a head's tree (eval/ngram_branches.py): which continuations
are found, how they join the head's tree within its budget, that they are accepted where the
context repeats itself, and that decoding with them stays lossless (greedy == plain in fp32 for
every head kind and shape; the T>0 chi-square is in test_decode.py)."""

from __future__ import annotations

import pytest
import torch
from test_decode import GREEDY, HEADS, MAX_NEW, SHAPES, drafter_for, random_head, reference_filter, runner_for

from specdraft.eval.autoshape import accepted_along
from specdraft.eval.decode import plain_generate, speculative_generate
from specdraft.eval.drafters import Draft
from specdraft.eval.methods import method_problems
from specdraft.eval.ngram_branches import (
    NgramBranchDrafter,
    NgramBranches,
    continuations,
    node_budget,
    with_branches,
)
from specdraft.eval.runner import TargetRunner
from specdraft.eval.trees import tree_from_parents

SETTINGS = NgramBranches(tokens=3, max_ngram=3, min_ngram=1, branches=2)


def positions_of(context: list[int]) -> dict[int, list[int]]:
    positions: dict[int, list[int]] = {}
    for i, token in enumerate(context[:-1]):  # the root (last) is not committed yet
        positions.setdefault(token, []).append(i)
    return positions


def test_continuations_longest_match_first_then_latest_first_distinct():
    #          0  1  2  3  4  5  6  7  8  9 10 11 12
    context = [5, 6, 7, 1, 2, 9, 6, 7, 3, 4, 8, 6, 7]
    # The 3-gram (8, 6, 7) never occurs earlier; the 2-gram (6, 7) at 1-2 and 6-7: latest first.
    assert continuations(context, positions_of(context), SETTINGS) == [[3, 4, 8], [1, 2, 9]]
    one = NgramBranches(tokens=2, max_ngram=3, min_ngram=1, branches=1)
    assert continuations(context, positions_of(context), one) == [[3, 4]]
    # The same continuation found twice counts once; a shorter n-gram fills the remaining branches.
    repeated = [1, 2, 3, 1, 2, 3, 9, 2]
    assert continuations(repeated, positions_of(repeated), SETTINGS) == [[3, 9, 2], [3, 1, 2]]
    # A continuation may run to the end of the context (shorter than ``tokens``); none found: [].
    assert continuations([4, 5, 4], positions_of([4, 5, 4]), SETTINGS) == [[5, 4]]
    assert continuations([1, 2, 3], positions_of([1, 2, 3]), SETTINGS) == []
    # min_ngram = 2: a single matching token is not enough.
    two = NgramBranches(tokens=3, max_ngram=3, min_ngram=2, branches=2)
    assert continuations([4, 5, 6, 4], positions_of([4, 5, 6, 4]), two) == []
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        NgramBranches(tokens=3, max_ngram=1, min_ngram=2, branches=1)


def draft_of(tokens: list[int], parents: list[int]) -> Draft:
    return Draft(torch.tensor(tokens), tree_from_parents(parents))


def test_branches_share_drafted_nodes_and_take_the_last_created_leaves_budget():
    # The head's tree: root 10 → a 11 (→ c 13), b 12 (→ d 14); nodes in creation order.
    head = draft_of([10, 11, 12, 13, 14], [-1, 0, 0, 1, 2])
    # The branch 11 → 13 → 15 shares a and c, adds one node; a budget of 5 drops the last-created
    # leaf no branch uses (d), so the tree keeps 5 nodes.
    merged = with_branches(head, [[11, 13, 15]], budget=5)
    assert merged.tokens.tolist() == [10, 11, 12, 13, 15]
    assert merged.tree.parents.tolist() == [-1, 0, 0, 1, 3]
    assert accepted_along(merged, [11, 13, 15]) == 3
    # Room enough: nothing dropped; a second branch under the root.
    roomy = with_branches(head, [[11, 13, 15], [16]], budget=8)
    assert roomy.tokens.tolist() == [10, 11, 12, 13, 14, 15, 16]
    assert roomy.tree.parents.tolist() == [-1, 0, 0, 1, 2, 3, 0]
    # A parent left childless by a drop becomes a leaf that can be dropped in turn (b after d).
    tight = with_branches(head, [[11, 13, 15], [16]], budget=5)
    assert tight.tokens.tolist() == [10, 11, 13, 15, 16]
    assert tight.tree.parents.tolist() == [-1, 0, 1, 2, 0]
    # A branch the head drafted already: the same tree, verified as a tree (no chain probabilities).
    chain = Draft(torch.tensor([10, 11, 13]), tree_from_parents([-1, 0, 1]), torch.rand(2, 20))
    same = with_branches(chain, [[11, 13]], budget=3)
    assert same.tokens.tolist() == [10, 11, 13] and same.tree is chain.tree and same.draft_probs is None


def test_a_branch_budget_beyond_the_tree_is_refused(diverse_target):
    head = drafter_for(random_head(diverse_target, "eagle"), "eagle", SHAPES["chain"])  # 4 nodes + the root
    with pytest.raises(ValueError, match="need up to 6 nodes; the tree holds 4"):
        NgramBranchDrafter(head, NgramBranches(tokens=3, max_ngram=2, min_ngram=1, branches=2))
    assert node_budget(SHAPES["dynamic"]) == 10 and node_budget(SHAPES["chain"]) == 5
    problems = method_problems(
        {"m": {"type": "head", "checkpoint": "x", "shape": {"kind": "chain"}, "ngram": {"n": 1}}}
    )
    assert problems and "ngram: expected tokens, max_ngram, min_ngram, branches" in problems[0]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3"])
def test_a_repeated_context_is_drafted_and_accepted_along_its_branch(diverse_target, kind, shape):
    """The context A B A B…: from the second A on, the branch spells what follows (what an
    untrained head almost never drafts), so greedy verification of a target that continued the
    same way would accept the whole branch."""
    if kind == "medusa" and shape == "dynamic":
        pytest.skip("Medusa candidates do not depend on the drafted prefix: static trees only")
    generator = torch.Generator().manual_seed(5)
    block = torch.randint(3, diverse_target.spec.vocab_size, (24,), generator=generator).tolist()
    sequence = block + block
    settings = NgramBranches(tokens=3, max_ngram=3, min_ngram=2, branches=1)
    drafter = NgramBranchDrafter(
        drafter_for(random_head(diverse_target, kind), kind, SHAPES[shape]), settings
    )
    runner = runner_for(diverse_target, kind)
    output = runner.prefill(torch.tensor(sequence))
    prompt = 8
    drafter.reset()
    drafter.commit(sequence[:prompt], output.rows(list(range(prompt))), sequence[prompt])
    with_branch, plain_head = [], []
    for t in range(prompt, len(sequence) - 4):
        draft = drafter.draft(sequence[t], GREEDY)
        assert draft.tree.num_nodes <= node_budget(SHAPES[shape])
        following = sequence[t + 1 :]
        (with_branch if t >= len(block) + 1 else plain_head).append(accepted_along(draft, following))
        drafter.commit([sequence[t]], output.rows([t]), sequence[t + 1])
    assert with_branch == [3] * len(with_branch)  # every step of the second copy
    assert max(plain_head) <= 1  # an untrained head: the first copy is new to it


@pytest.mark.parametrize("draft", ["untrained", "oracle", "adversarial"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", list(HEADS))
def test_greedy_speculative_with_branches_equals_plain(diverse_target, kind, shape, draft):
    """Greedy equality with the branches on, for every head kind and shape, on a prompt that
    repeats itself (so that branches are drafted, mostly wrong)."""
    if kind == "medusa" and shape == "dynamic":
        pytest.skip("Medusa candidates do not depend on the drafted prefix: static trees only")
    if kind == "eagle3-reduced" and draft == "oracle":
        pytest.skip("the true continuation may lie outside a reduced draft vocabulary")
    generator = torch.Generator().manual_seed(1)
    half = torch.randint(3, diverse_target.spec.vocab_size, (10,), generator=generator)
    prompt = torch.cat([half, half])
    expected = plain_generate(TargetRunner(diverse_target), prompt, MAX_NEW, GREEDY, ()).tokens
    reference = prompt.tolist() + expected
    score_filter = None if draft == "untrained" else reference_filter(reference, draft == "oracle")
    inner = drafter_for(random_head(diverse_target, kind), kind, SHAPES[shape], score_filter)
    drafter = NgramBranchDrafter(inner, NgramBranches(tokens=2, max_ngram=3, min_ngram=1, branches=2))
    generation = speculative_generate(runner_for(diverse_target, kind), drafter, prompt, MAX_NEW, GREEDY, ())
    assert generation.tokens == expected
    assert max(step.nodes for step in generation.steps) <= node_budget(SHAPES[shape])
