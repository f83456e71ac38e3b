"""Lookahead decoding: the tree it drafts (its two branches, by hand), the window and the n-gram
pool it learns from the target, losslessness (greedy == plain; the target's distribution at
T>0), and its settings' errors."""

from __future__ import annotations

import pytest
import torch
from conftest import prefix_chi_squares
from test_decode import TOP2, target_block_probabilities

from specdraft.eval.decode import plain_generate, speculative_generate
from specdraft.eval.lookahead import Lookahead, LookaheadDrafter
from specdraft.eval.methods import build_method
from specdraft.eval.runner import TargetOutput, TargetRunner
from specdraft.eval.sampling import Sampling
from specdraft.eval.trees import tree_from_parents

GREEDY = Sampling()


def prompt(target, seed=0, length=12):
    return torch.randint(3, target.spec.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))


def drafter_with(levels, pool, window, ngram, guesses=2, pool_per_token=4):
    drafter = LookaheadDrafter(Lookahead(window, ngram, guesses, pool_per_token))
    drafter.levels = [list(level) for level in levels]
    drafter.pool = {first: dict.fromkeys(grams) for first, grams in pool.items()}
    return drafter


def test_the_tree_holds_the_pools_ngrams_as_a_trie_and_the_window_as_diagonals():
    """W=2, N=3, root 7, the pool's 2-grams after 7: (1, 2) then (1, 3) (most recent last).

    node: 0 root 7 | 1: 1, 2: 3, 3: 2 (the trie, most recent n-gram first) | window level 0:
    4: 10, 5: 11 (a chain) | level 1: 6: 20 under 4, 7: 21 under 5 (each column's diagonal)."""
    drafter = drafter_with([[10, 11], [20, 21]], {7: [(1, 2), (1, 3)], 10: [(99, 98)]}, window=2, ngram=3)
    draft = drafter.draft(7, GREEDY)
    assert draft.tokens.tolist() == [7, 1, 3, 2, 10, 11, 20, 21]
    assert draft.tree.parents.tolist() == [-1, 0, 1, 1, 0, 4, 4, 5]
    assert draft.tree.depths.tolist() == [0, 1, 2, 2, 1, 2, 2, 3]  # level l, column k: k + l + 1
    attends = {node: row.nonzero().flatten().tolist() for node, row in enumerate(draft.tree.attention_mask)}
    assert attends[7] == [0, 4, 5, 7]  # level 1, column 1: the root, level 0 up to column 1, itself
    assert attends[6] == [0, 4, 6]
    assert attends[3] == [0, 1, 3]  # the verification branch never sees the window, nor it the branch
    assert drafter._newest == [6, 7]
    alone = drafter_with([[10, 11], [20, 21]], {7: [(1, 2)]}, 2, 3, guesses=0).draft(7, GREEDY)
    assert alone.tokens.tolist() == [7, 10, 11, 20, 21]  # G = 0: the lookahead branch alone


def test_the_target_output_moves_the_window_and_fills_the_pool():
    """The argmax at each newest-level node is the next iteration's guess; the column's diagonal
    plus it is an n-gram (first token -> continuation); the pool keeps the most recent."""
    drafter = drafter_with(
        [[10, 11], [20, 21]], {10: [(5, 6)]}, window=2, ngram=3, guesses=1, pool_per_token=1
    )
    assert drafter.draft(7, GREEDY).tokens.tolist() == [7, 10, 11, 20, 21]  # nothing pooled after 7
    logits = torch.zeros(5, 50)
    logits[3, 30] = logits[4, 31] = 1.0  # the newest level's nodes (columns 0, 1)
    logits[1, 44] = 1.0  # an older level's output is not an iteration
    drafter.verified(TargetOutput(logits, torch.zeros(5, 4), None))
    assert drafter.levels == [[20, 21], [30, 31]]
    assert drafter.pool == {10: {(20, 30): None}, 11: {(21, 31): None}}  # (5, 6) evicted: 1 per token


@pytest.mark.parametrize("window,ngram,guesses", [(1, 2, 0), (3, 3, 2), (4, 4, 4), (5, 3, 5)])
def test_greedy_lookahead_equals_plain(tiny_target, window, ngram, guesses):
    """fp32: whatever the window guesses and the pool proposes, the output is plain greedy's; on
    the tiny target's repetitive output the larger settings accept drafts (both code paths run)."""
    ids = prompt(tiny_target)
    expected = plain_generate(TargetRunner(tiny_target), ids, 60, GREEDY, ()).tokens
    drafter = LookaheadDrafter(Lookahead(window, ngram, guesses, max(1, 2 * guesses)))
    generation = speculative_generate(TargetRunner(tiny_target), drafter, ids, 60, GREEDY, ())
    assert generation.tokens == expected
    if guesses >= 4:
        assert sum(step.accepted for step in generation.steps) > 10 and drafter.pool


class SeededLookahead(LookaheadDrafter):
    """A drafter whose first step holds drafts the target often accepts: the pool holds, after
    each of the target's top-2 first tokens, its top-2 next tokens each followed by the greedy
    token; the window holds the greedy continuation after the top first token."""

    def __init__(self, target, ids):
        super().__init__(Lookahead(window=2, ngram=3, guesses=4, pool_per_token=4))
        self.seed_pool, self.seed_levels = {}, None
        with torch.no_grad():
            first = TOP2.probs(target.model(input_ids=ids[None]).logits[0, -1]).nonzero().flatten().tolist()
            for token in first:
                context = torch.cat([ids, torch.tensor([token])])
                nexts = TOP2.probs(target.model(input_ids=context[None]).logits[0, -1]).nonzero().flatten()
                grams = {}
                for second in nexts.tolist():
                    longer = torch.cat([context, torch.tensor([second])])
                    grams[(second, int(target.model(input_ids=longer[None]).logits[0, -1].argmax()))] = None
                self.seed_pool[token] = grams
            self.seed_levels = [[first[0], first[-1]], [first[-1], first[0]]]

    def commit(self, tokens, target, next_token):
        seeding = not self.levels
        super().commit(tokens, target, next_token)
        if seeding:
            self.levels = [list(level) for level in self.seed_levels]
            self.pool = {first: dict(grams) for first, grams in self.seed_pool.items()}


def test_sampling_with_lookahead_reproduces_the_target_distribution(tiny_target):
    """T=1, top-2: the first 4 tokens (root, what the first tree's paths give, the bonus or the
    target's token after a rejection) follow the target's distribution, every prefix of them."""
    ids = prompt(tiny_target, seed=7)
    block = 4
    expected = target_block_probabilities(tiny_target, ids, block)
    drafter = SeededLookahead(tiny_target, ids)
    runner = TargetRunner(tiny_target)
    generator = torch.Generator().manual_seed(0)
    counts: dict[tuple[int, ...], int] = {}
    accepted = {0: 0, 1: 0, 2: 0}  # drafts accepted in the first step
    for _ in range(1000):
        generation = speculative_generate(runner, drafter, ids, block, TOP2, (), generator)
        counts[tuple(generation.tokens)] = counts.get(tuple(generation.tokens), 0) + 1
        accepted[min(generation.steps[0].accepted, 2)] += 1
    results = prefix_chi_squares(counts, expected)
    assert all(statistic < critical for statistic, critical in results), (results, counts)
    # The pool covers the whole top-2 support after the root, so a first draft is always
    # accepted; the second is rejected (then the target's token comes from the residual) or
    # accepted (then the bonus follows): both ran.
    assert accepted[1] > 50 and accepted[2] > 50, accepted


@pytest.mark.parametrize(
    "settings,message",
    [
        ((0, 3, 2, 4), "window W must be >= 1, got 0"),
        ((3, 1, 2, 4), "n-gram size N must be >= 2, got 1"),
        ((3, 3, -1, 4), "guesses G must be >= 0, got -1"),
        ((3, 3, 4, 2), "pool_per_token must be >= max"),
    ],
)
def test_malformed_settings_are_one_clear_error(settings, message):
    with pytest.raises(ValueError, match=message):
        Lookahead(*settings)


def test_the_bench_method_names_missing_settings(tiny_target):
    def method(config):
        return build_method(
            "la",
            {"type": "lookahead", **config},
            tiny_target,
            heads=lambda _: None,
            draft_model=lambda: None,
            shortlist=lambda: None,
            eos_ids=(),
            max_new_tokens=8,
            typical=None,
        )

    with pytest.raises(
        ValueError, match=r"method la: lookahead needs .*; missing \['guesses', 'pool_per_token'\]"
    ):
        method({"window": 3, "ngram": 3})
    built = method({"window": 3, "ngram": 3, "guesses": 2, "pool_per_token": 4})
    assert built.type == "lookahead" and built.lossless
    assert built.details == {"lookahead": {"window": 3, "ngram": 3, "guesses": 2, "pool_per_token": 4}}
    assert len(built.generate(prompt(tiny_target), GREEDY, 0).tokens) == 8


def test_parents_build_the_same_buffers_as_ancestors():
    tree = tree_from_parents([-1, 0, 0, 1, 3])
    assert tree.depths.tolist() == [0, 1, 1, 2, 3]
    assert tree.retrieve_indices.tolist() == [[0, 2, -1, -1], [0, 1, 3, 4]]
    with pytest.raises(ValueError, match="node 2: parent 3"):
        tree_from_parents([-1, 0, 3, 1])
