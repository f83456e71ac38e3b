"""The decode loop's invariants for a DFlash head (eval/block_drafter.py), on the tiny fp32 target
whose greedy output does not repeat (conftest.diverse_target; docs/architecture.md §6):

* greedy speculative output == plain greedy output for a chain, a static tree and a dynamic tree,
  untrained, oracle and adversarial drafts; the oracle accepts every depth, the adversary none;
* a sampled chain reproduces the target's distribution (chi-square of every prefix);
* drafter equivalence: every depth's draft distribution equals the head run from scratch over the
  committed prefix (a fresh target forward, the whole context without a cache);
* batched rows equal plain decoding; the methods build it (``drafter_for_head``) and ``shape:
  auto`` tries its deep chains; a depth beyond the block is refused.
"""

from __future__ import annotations

import pytest
import torch
from conftest import prefix_chi_squares
from test_decode import (
    BLOCK,
    DRAFT_DEPTH,
    GREEDY,
    MAX_NEW,
    SHAPES,
    TOP2,
    TRIALS,
    near_target_filter,
    prompt_ids,
    reference_filter,
    target_block_probabilities,
)

from specdraft.data.features import TokenBatch, extract_features
from specdraft.data.target import target_weights
from specdraft.eval.autoshape import VerifyLatency, calibrate, choose_shape, greedy_continuations
from specdraft.eval.batch import BatchRunner, speculative_generate_batch
from specdraft.eval.block_drafter import BlockDrafter
from specdraft.eval.decode import Typical, plain_generate, speculative_generate
from specdraft.eval.drafters import Chain, DynamicTree, StaticTree
from specdraft.eval.methods import build_method, drafter_for_head, tree_shape
from specdraft.eval.runner import TargetRunner
from specdraft.heads.dflash import Blocks
from specdraft.heads.registry import build_head

BLOCK_SIZE = 6  # drafts depths 1..5; SHAPES draft up to depth 4
CONFIG = {"num_layers": 2, "block_size": BLOCK_SIZE, "mask_token_id": None, "anchor_fraction": 0.5}


def dflash_head(target):
    torch.manual_seed(1)
    head = build_head("dflash", CONFIG, target.spec, target_weights(target))
    with torch.no_grad():  # untrained, but not a fresh init's near-identity norms
        for parameter in head.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return head.eval()


def runner_for(target) -> TargetRunner:
    return TargetRunner(target, target.spec.aux_layer_ids)


@pytest.fixture(scope="module")
def head(diverse_target):
    return dflash_head(diverse_target)


@pytest.fixture(scope="module")
def plain(diverse_target):
    prompt = prompt_ids(diverse_target)
    return prompt, plain_generate(TargetRunner(diverse_target), prompt, MAX_NEW, GREEDY, ()).tokens


@pytest.mark.parametrize("draft", ["untrained", "oracle", "adversarial"])
@pytest.mark.parametrize("shape", [*SHAPES, "whole-block"])
def test_greedy_speculative_equals_plain(diverse_target, head, plain, shape, draft):
    prompt, expected = plain
    score_filter = (
        None if draft == "untrained" else reference_filter(prompt.tolist() + expected, draft == "oracle")
    )
    tree = Chain(depth=BLOCK_SIZE - 1) if shape == "whole-block" else SHAPES[shape]
    drafter = BlockDrafter(head, tree, score_filter)
    generation = speculative_generate(runner_for(diverse_target), drafter, prompt, MAX_NEW, GREEDY, ())
    assert generation.tokens == expected
    accepted = [step.accepted for step in generation.steps]
    if draft == "oracle":
        depth = drafter.max_depth
        assert all(step.accepted == step.depth == depth for step in generation.steps[:-1]), accepted
        assert len(generation.steps) == -(-(MAX_NEW - 1) // (depth + 1))
    elif draft == "adversarial":
        assert accepted == [0] * (MAX_NEW - 1)


def test_a_sampled_chain_reproduces_the_target_distribution(tiny_target):
    """T>0: each depth is sampled from its block position's distribution and handed to the
    verifier as draft_probs (test_decode's near-target scores make drafts often accepted)."""
    prompt = prompt_ids(tiny_target, seed=7)
    expected = target_block_probabilities(tiny_target, prompt, BLOCK, TOP2)
    drafter = BlockDrafter(
        dflash_head(tiny_target), Chain(depth=DRAFT_DEPTH), near_target_filter(tiny_target, 0.5)
    )
    runner, generator = runner_for(tiny_target), torch.Generator().manual_seed(0)
    counts: dict[tuple[int, ...], int] = {}
    outcomes = {"accepted all": 0, "rejected some": 0}
    for _ in range(TRIALS):
        generation = speculative_generate(runner, drafter, prompt, BLOCK, TOP2, (), generator)
        counts[tuple(generation.tokens)] = counts.get(tuple(generation.tokens), 0) + 1
        step = generation.steps[0]
        outcomes["accepted all" if step.accepted == step.depth else "rejected some"] += 1
    results = prefix_chi_squares(counts, expected)
    assert all(statistic < critical for statistic, critical in results), (results, counts)
    assert min(outcomes.values()) > 0.05 * TRIALS, outcomes


def head_from_scratch(target, head, committed: list[int], root: int) -> torch.Tensor:
    """Draft log-probs (block_size − 1)×V of the block [root, masks] after ``committed``: the
    target's aux taps from one fresh forward over all of it, the head's context keys/values of
    every position, the block over all of them — no cache, no position bookkeeping but the anchor."""
    ones = torch.ones(1, len(committed), dtype=torch.long)
    features = extract_features(
        target, TokenBatch(torch.tensor([committed]), ones, ones), aux_layer_ids=head.target_taps
    )
    with torch.no_grad():
        context = head.context_features(features.aux)
        context_kv = head.context_keys_values(context, torch.arange(len(committed))[None])
        blocks = Blocks(head.block_tokens(torch.tensor([[root]])), torch.tensor([[len(committed)]]), None)
        outputs = head.block_outputs(blocks, context_kv, torch.float32)
        return head.logits(outputs[0, 0, 1:]).float().log_softmax(-1)


@pytest.mark.parametrize("shape", ["chain", "dynamic"])
def test_every_depth_scores_like_the_head_from_scratch(diverse_target, head, shape):
    """Greedy equality is blind to drafting bugs that only lower acceptance (a context key written
    one position off, a layer's cache read by another): every distribution the drafter ranks a
    depth's candidates with equals the head over a from-scratch context, round after round."""
    seen: list[tuple[list[int], int, torch.Tensor]] = []

    def record(context: list[int], ahead: int, scores: torch.Tensor) -> torch.Tensor:
        seen.append((list(context), ahead, scores.clone()))
        return scores

    drafter = BlockDrafter(head, SHAPES[shape], record)
    speculative_generate(runner_for(diverse_target), drafter, prompt_ids(diverse_target), 12, GREEDY, ())
    assert len({len(context) for context, _, _ in seen}) > 3  # several rounds, after several commits
    expected = {}
    for context, ahead, scores in seen:
        key = tuple(context)
        if key not in expected:
            expected[key] = head_from_scratch(diverse_target, head, context[:-1], context[-1])
        torch.testing.assert_close(
            scores, expected[key][ahead], rtol=1e-4, atol=1e-4, msg=f"{context} +{ahead}"
        )


@pytest.mark.parametrize("shape", ["chain", "dynamic"])
def test_batch_rows_equal_plain(diverse_target, head, shape):
    generator = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(3, diverse_target.spec.vocab_size, (n,), generator=generator) for n in (12, 5, 9)
    ]
    alone = [plain_generate(TargetRunner(diverse_target), p, MAX_NEW, GREEDY, ()).tokens for p in prompts]
    drafters = [BlockDrafter(head, SHAPES[shape]) for _ in prompts]
    generations = speculative_generate_batch(
        BatchRunner(diverse_target, diverse_target.spec.aux_layer_ids),
        drafters,
        prompts,
        MAX_NEW,
        GREEDY,
        (),
        [None] * len(prompts),
    )
    assert [g.tokens for g in generations] == alone


@pytest.mark.parametrize(
    "shape",
    [
        Chain(depth=BLOCK_SIZE),
        StaticTree(((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 0))),
        DynamicTree(depth=BLOCK_SIZE, top_k=2, total_tokens=8),
    ],
    ids=["chain", "static", "dynamic"],
)
def test_a_depth_beyond_the_block_is_refused(head, shape):
    with pytest.raises(ValueError, match=f"depth-{BLOCK_SIZE} draft needs block position {BLOCK_SIZE}"):
        BlockDrafter(head, shape)


def test_a_commit_without_the_aux_taps_is_refused(diverse_target, head):
    prompt = prompt_ids(diverse_target)
    output = TargetRunner(diverse_target).prefill(prompt)  # no aux layers captured
    with pytest.raises(ValueError, match="reads the target's aux layers"):
        BlockDrafter(head, Chain(depth=2)).commit(prompt.tolist(), output, 5)


def test_the_methods_decode_a_dflash_head(diverse_target, head, plain):
    """``drafter_for_head`` maps the head to its drafter, and a head method's runner captures the
    taps it reads: the method's greedy output is plain decoding's."""
    assert isinstance(drafter_for_head(head, Chain(depth=3)), BlockDrafter)
    prompt, expected = plain
    method = build_method(
        "dflash",
        {
            "type": "head",
            "checkpoint": "x",
            "shape": {"kind": "dynamic", "depth": 3, "top_k": 2, "total_tokens": 6},
        },
        diverse_target,
        heads=lambda _: head,
        draft_model=lambda: None,
        shortlist=lambda: None,
        eos_ids=(),
        max_new_tokens=MAX_NEW,
        typical=Typical(epsilon=0.09, delta=0.3),
    )
    assert method.generate(prompt, GREEDY, 0).tokens == expected


def test_shape_auto_tries_the_block_drafters_deep_chains(diverse_target, head):
    """The configured candidates stop at depth 2; the block drafter adds its chains up to the
    whole block (1, 2, 4 and block_size − 1), each simulated once."""
    runner = runner_for(diverse_target)
    prompts = [prompt_ids(diverse_target, seed) for seed in (1, 2)]
    calibrations = calibrate(runner, prompts, greedy_continuations(runner, prompts, 8))
    latency = VerifyLatency(1e-3, {2: 1e-3, 8: 1.5e-3})
    configured = [
        {"kind": "chain", "depth": 2},
        {"kind": "dynamic", "depth": 2, "top_k": 2, "total_tokens": 4},
    ]
    choice = choose_shape(
        lambda shape: BlockDrafter(head, shape),
        tree_shape,
        configured,
        calibrations,
        latency,
        runner,
        0,
        progress=False,
    )
    tried = [dict(p.shape) for p in choice.predictions[1:]]
    chains = [{"kind": "chain", "depth": d} for d in (1, 2, 4, BLOCK_SIZE - 1)]
    assert tried == [*configured, chains[0], chains[2], chains[3]]
