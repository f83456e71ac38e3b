"""Batched speculative decoding on a tiny fp32 target (eval/batch.py):

* every row of a batch emits what decoding its prompt alone emits — plain and speculative,
  greedy, at B = 1..4, for ragged prompts, chains and static and dynamic trees, EAGLE, EAGLE-3 and
  Medusa heads, rows that stop at EOS while the others go on;
* the ragged cache: each row's committed keys and values equal those of its prompt decoded alone;
* sampling through a batch reproduces the target's distribution in every row (chi-square);
* malformed batch sizes get one clear error.

The target is conftest's ``diverse_target``: the default tiny one repeats a single token from a
few tokens on, which any misplaced key or mask would repeat too.
"""

from __future__ import annotations

import pytest
import torch
from conftest import prefix_chi_squares, rejects
from test_acceptance import tree_rule
from test_decode import (
    BLOCK,
    GREEDY,
    HEADS,
    SHAPES,
    TOP2,
    drafter_for,
    near_target_filter,
    random_head,
    reference_filter,
    target_block_probabilities,
)

from specdraft.eval import decode
from specdraft.eval.batch import (
    BatchRunner,
    check_batch_sizes,
    plain_generate_batch,
    speculative_generate_batch,
)
from specdraft.eval.decode import plain_generate, speculative_generate
from specdraft.eval.drafters import Chain, DynamicTree
from specdraft.eval.lookahead import Lookahead, LookaheadDrafter
from specdraft.eval.runner import TargetRunner

MAX_NEW = 24
PROMPT_LENGTHS = (12, 5, 17, 9)  # ragged on purpose


@pytest.fixture(scope="module")
def target(diverse_target):
    return diverse_target


def prompts(target, count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [
        torch.randint(3, target.spec.vocab_size, (length,), generator=generator)
        for length in PROMPT_LENGTHS[:count]
    ]


def aux_ids(target, kind: str) -> tuple[int, ...]:
    return target.spec.aux_layer_ids if kind.startswith("eagle3") else ()


@pytest.fixture(scope="module")
def alone(target):
    """Each prompt decoded alone, greedily (the reference every row must reproduce)."""
    runner = TargetRunner(target)
    return [plain_generate(runner, p, MAX_NEW, GREEDY, ()).tokens for p in prompts(target, 4)]


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_plain_batch_equals_each_prompt_alone(target, alone, rows):
    generations = plain_generate_batch(
        BatchRunner(target), prompts(target, rows), MAX_NEW, GREEDY, (), [None] * rows
    )
    assert [g.tokens for g in generations] == alone[:rows]
    assert all(g.stop == "length" and len(g.steps) == MAX_NEW - 1 for g in generations)


@pytest.mark.parametrize("draft", ["untrained", "oracle"])
@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", list(HEADS))
def test_greedy_speculative_batch_equals_plain_per_row(target, alone, kind, shape, rows, draft):
    """Untrained drafts are mostly rejected; the oracle's (the row's own continuation ranked
    first, unless a reduced draft vocabulary lacks it) are accepted, so rows advance by
    different lengths in the same step."""
    if kind == "medusa" and shape == "dynamic":
        pytest.skip("Medusa candidates do not depend on the drafted prefix: static trees only")
    head = random_head(target, kind)
    filters = [
        reference_filter(p.tolist() + continuation, oracle=True) if draft == "oracle" else None
        for p, continuation in zip(prompts(target, rows), alone, strict=False)
    ]
    drafters = [drafter_for(head, kind, SHAPES[shape], f) for f in filters]
    runner = BatchRunner(target, aux_ids(target, kind))
    generations = speculative_generate_batch(
        runner, drafters, prompts(target, rows), MAX_NEW, GREEDY, (), [None] * rows
    )
    assert [g.tokens for g in generations] == alone[:rows]
    accepted = [sum(step.accepted for step in g.steps) for g in generations]
    if draft == "oracle" and kind != "eagle3-reduced":
        assert min(accepted) >= MAX_NEW // 2, accepted


def test_rows_with_trees_of_different_sizes(target, alone):
    """Threshold chains: the oracle's rows (probability ~1) draft 4 tokens, the untrained rows stop
    after 1, so the narrow trees are padded next to the wide ones in every forward."""
    rows = 4
    head = random_head(target, "eagle")
    shape = Chain(depth=4, threshold=0.5)
    drafters = [
        drafter_for(head, "eagle", shape, reference_filter(p.tolist() + alone[b], True) if b % 2 else None)
        for b, p in enumerate(prompts(target, rows))
    ]
    generations = speculative_generate_batch(
        BatchRunner(target), drafters, prompts(target, rows), MAX_NEW, GREEDY, (), [None] * rows
    )
    assert [g.tokens for g in generations] == alone[:rows]
    sizes = [{step.nodes for step in g.steps} for g in generations]
    assert sizes[0] == {2} and max(sizes[1]) == 5, sizes


def test_lookahead_rows_equal_plain(target, alone):
    """Lookahead decoding per row: its trees change size from step to step and row to row."""
    rows = 4
    drafters = [
        LookaheadDrafter(Lookahead(window=3, ngram=3, guesses=3, pool_per_token=4)) for _ in range(rows)
    ]
    generations = speculative_generate_batch(
        BatchRunner(target), drafters, prompts(target, rows), MAX_NEW, GREEDY, (), [None] * rows
    )
    assert [g.tokens for g in generations] == alone[:rows]
    assert len({step.nodes for g in generations for step in g.steps}) > 1


def test_rows_stop_at_their_own_eos(target, alone):
    """Row 1 stops at its 6th token (made EOS); the others run to the end, every row as alone."""
    eos = alone[1][5]
    expected = []
    for p in prompts(target, 3):
        expected.append(plain_generate(TargetRunner(target), p, MAX_NEW, GREEDY, (eos,)).tokens)
    assert len(expected[1]) == 6
    head = random_head(target, "eagle")
    drafters = [drafter_for(head, "eagle", DynamicTree(depth=3, top_k=2, total_tokens=6)) for _ in range(3)]
    generations = speculative_generate_batch(
        BatchRunner(target), drafters, prompts(target, 3), MAX_NEW, GREEDY, (eos,), [None] * 3
    )
    assert [g.tokens for g in generations] == expected
    assert generations[1].stop == "eos"
    assert generations[1].total_s <= max(g.total_s for g in generations)
    plain = plain_generate_batch(BatchRunner(target), prompts(target, 3), MAX_NEW, GREEDY, (eos,), [None] * 3)
    assert [g.tokens for g in plain] == expected


def test_ragged_cache_rows_hold_what_each_prompt_alone_holds(target):
    """After a batch, row b's committed keys/values are those of its sequence run alone — the
    scatter by per-row position and the per-row move put every entry in its place."""
    rows = 3
    head = random_head(target, "eagle")
    shape = Chain(depth=3)
    runner = BatchRunner(target)
    batch = speculative_generate_batch(
        runner,
        [drafter_for(head, "eagle", shape) for _ in range(rows)],
        prompts(target, rows),
        MAX_NEW,
        GREEDY,
        (),
        [None] * rows,
    )
    for b, prompt in enumerate(prompts(target, rows)):
        single = TargetRunner(target)
        generation = speculative_generate(
            single, drafter_for(head, "eagle", shape), prompt, MAX_NEW, GREEDY, ()
        )
        assert generation.tokens == batch[b].tokens
        length = runner.lengths[b]
        assert length == single.length
        torch.testing.assert_close(
            runner.cache.storage[:, :, b, :, :length],
            single.cache.storage[:, :, 0, :, :length],
            rtol=1e-5,
            atol=1e-5,
        )


# 32 rows × 125 rounds = 4,000 sampled blocks: enough to see a verifier that accepts drafts 10 %
# too often (min(1, 1.1·p)): over seeds 0–2 its 2-token-prefix chi-square read 42–78 and its
# 3-token one 93–135 against critical values of 19.7 and 28.1 (family alpha 0.001), a noncentral
# chi-square whose power is above 0.99 at each; the correct rule stayed under half of every
# prefix's critical value.
SAMPLING_ROWS, SAMPLING_ROUNDS = 32, 125
OVER_ACCEPTANCE_10 = 1.1


def batch_sampling_blocks(target) -> tuple[dict[tuple[int, ...], int], dict[str, int]]:
    """How often each BLOCK-token block was sampled by SAMPLING_ROWS rows (the same prompt in
    each) over SAMPLING_ROUNDS batches, and how often the first round accepted all / rejected some."""
    prompt = prompts(target, 1)[0]
    head = random_head(target, "eagle")
    score_filter = near_target_filter(target, 0.5)
    shape = DynamicTree(depth=2, top_k=2, total_tokens=5)
    drafters = [drafter_for(head, "eagle", shape, score_filter) for _ in range(SAMPLING_ROWS)]
    generators = [torch.Generator().manual_seed(b) for b in range(SAMPLING_ROWS)]
    runner = BatchRunner(target)
    counts: dict[tuple[int, ...], int] = {}
    outcomes = {"accepted all": 0, "rejected some": 0}
    for _ in range(SAMPLING_ROUNDS):
        for generation in speculative_generate_batch(
            runner, drafters, [prompt] * SAMPLING_ROWS, BLOCK, TOP2, (), generators
        ):
            block = tuple(generation.tokens)
            counts[block] = counts.get(block, 0) + 1
            step = generation.steps[0]
            outcomes["accepted all" if step.accepted == step.depth else "rejected some"] += 1
    return counts, outcomes


def test_sampling_in_a_batch_reproduces_the_target_distribution(tiny_target):
    """Every row of a batch (the same prompt in each) samples the target's distribution over its
    first BLOCK tokens (conftest.prefix_chi_squares; expected from the independent reference of
    the filters), the other rows accepting and rejecting beside it. On the default tiny target,
    whose peaked distributions let whole blocks be accepted: both branches of the rule run."""
    counts, outcomes = batch_sampling_blocks(tiny_target)
    expected = target_block_probabilities(tiny_target, prompts(tiny_target, 1)[0], BLOCK)
    results = prefix_chi_squares(counts, expected)
    assert all(statistic < critical for statistic, critical in results), (results, counts)
    assert min(outcomes.values()) > 0.05 * SAMPLING_ROWS * SAMPLING_ROUNDS, outcomes


def test_the_batch_sampling_test_sees_a_verifier_that_accepts_ten_percent_too_often(tiny_target, monkeypatch):
    """The test above, end to end through the batched decoder, with recursive rejection sampling
    replaced by one that accepts each draft with min(1, 1.1·p): it must fail."""
    monkeypatch.setattr(decode, "tree_rejection_sample", tree_rule(over_accept=OVER_ACCEPTANCE_10))
    counts, _ = batch_sampling_blocks(tiny_target)
    expected = target_block_probabilities(tiny_target, prompts(tiny_target, 1)[0], BLOCK)
    assert rejects(counts, expected)


@pytest.mark.parametrize("sizes", [[], [0], [1, -2], [2.5], [True], 4, "4"])
def test_malformed_batch_sizes_get_one_clear_error(sizes):
    with pytest.raises(ValueError, match=r"bench\.batch_sizes: expected a non-empty list of positive int"):
        check_batch_sizes(sizes, "bench.batch_sizes")


def test_a_batch_needs_a_prompt_and_a_drafter_per_row(target):
    with pytest.raises(ValueError, match="at least one prompt"):
        plain_generate_batch(BatchRunner(target), [], MAX_NEW, GREEDY, (), [])
    head = random_head(target, "eagle")
    with pytest.raises(ValueError, match="2 prompts need 2 drafters"):
        speculative_generate_batch(
            BatchRunner(target),
            [drafter_for(head, "eagle", Chain(depth=2))],
            prompts(target, 2),
            MAX_NEW,
            GREEDY,
            (),
            [None] * 2,
        )
