"""shape: auto (eval/autoshape.py) on the tiny fp32 target: the simulated acceptance is what greedy
decoding accepts at the same positions; the choice follows the costs (plain decoding when verifying
is dear); a method with shape auto still reproduces plain greedy output; the latency probe is
cached by key; interpolation literal."""

from __future__ import annotations

import json

import pytest
import torch

from specdraft.data.target import target_weights
from specdraft.eval import autoshape
from specdraft.eval.autoshape import (
    PLAIN,
    VerifyLatency,
    accepted_along,
    cached_verify_latency,
    calibrate,
    choose_shape,
    greedy_continuations,
    probe_verify_latency,
    simulate,
)
from specdraft.eval.decode import Typical, plain_generate, speculative_generate
from specdraft.eval.drafters import Chain, Draft, DynamicTree
from specdraft.eval.feature_drafter import FeatureHeadDrafter
from specdraft.eval.methods import build_method, tree_shape
from specdraft.eval.runner import TargetRunner
from specdraft.eval.sampling import Sampling
from specdraft.eval.trees import tree_buffers
from specdraft.heads.registry import build_head

GREEDY = Sampling()
NEW_TOKENS = 24
CANDIDATES = [
    {"kind": "chain", "depth": 1},
    {"kind": "chain", "depth": 3},
    {"kind": "dynamic", "depth": 3, "top_k": 2, "total_tokens": 6},
]


def eagle_head(target):
    torch.manual_seed(0)
    return build_head("eagle", {"fc_bias": False}, target.spec, target_weights(target)).eval()


HEAD_WEIGHT = 3.0  # an untrained head's log-probs spread ~3× less than the tiny target's


def noisy_target_filter(target, strength: float):
    """Draft scores = the target's logits + noise (``strength`` × their spread) fixed by the
    context, + the head's own log-probs, scaled to count as much (so a head fed the wrong features drafts
    differently):
    greedy drafts that match the target's argmax often, not always."""
    cache: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}

    def score_filter(context: list[int], ahead: int, scores: torch.Tensor) -> torch.Tensor:
        key = (tuple(context), ahead)
        if key not in cache:
            with torch.no_grad():
                logits = target.model(input_ids=torch.tensor([context])).logits[0, -1].float()
            noise = torch.randn(logits.shape, generator=torch.Generator().manual_seed(hash(key) % 2**31))
            cache[key] = (logits + strength * logits.std() * noise).log_softmax(-1)
        return (cache[key] + HEAD_WEIGHT * scores).log_softmax(-1)

    return score_filter


def prompts(target, count: int = 2) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, target.spec.vocab_size, (10,), generator=generator) for _ in range(count)]


def recording_drafter(head, shape, score_filter, seen: dict) -> FeatureHeadDrafter:
    """A drafter whose filter first records the head's own scores per (context, tokens committed
    — what came from the target, not from the head's drafts —, ahead)."""

    def record(context: list[int], ahead: int, scores: torch.Tensor) -> torch.Tensor:
        seen[(tuple(context), len(drafter.history), ahead)] = scores.clone()
        return score_filter(context, ahead, scores)

    drafter = FeatureHeadDrafter(head, shape, record)
    return drafter


@pytest.mark.parametrize("shape", [Chain(depth=3), DynamicTree(depth=3, top_k=2, total_tokens=6)])
def test_simulated_acceptance_is_what_greedy_decoding_accepts(tiny_target, shape):
    """At every position greedy decoding visits, the simulation accepts as many drafts, and the
    head scores every context both see alike (the simulation feeds it the same features)."""
    head, score_filter = eagle_head(tiny_target), noisy_target_filter(tiny_target, 1.0)
    runner = TargetRunner(tiny_target)
    prompt = prompts(tiny_target, 1)[0]
    decoded, simulated = {}, {}
    drafter = recording_drafter(head, shape, score_filter, decoded)
    generation = speculative_generate(runner, drafter, prompt, NEW_TOKENS, GREEDY, ())
    continuation = generation.tokens  # greedy speculative == plain greedy: the target's argmax
    [calibration] = calibrate(runner, [prompt], [continuation])
    drafter = recording_drafter(head, shape, score_filter, simulated)
    simulation = simulate(drafter, [calibration], tiny_target.device)
    assert len(simulation.accepted) == len(continuation) - 1  # every position
    position, compared = 0, 0
    for step in generation.steps:
        if position + shape.depth + 1 < len(continuation):  # the simulation sees the whole tree's worth
            assert simulation.accepted[position] == step.accepted, (position, step)
            compared += 1
        position += step.accepted + 1
    accepted = set(simulation.accepted)
    assert compared > 3 and len(accepted) > 1, accepted  # some accepted, some rejected
    common = set(decoded) & set(simulated)
    assert len(common) > len(decoded) // 2, (len(common), len(decoded))
    for key in common:
        torch.testing.assert_close(simulated[key], decoded[key], rtol=1e-4, atol=1e-4, msg=str(key))


@pytest.mark.parametrize("shape", [Chain(depth=3), DynamicTree(depth=3, top_k=2, total_tokens=6)])
def test_simulation_of_device_rounds_drafts_what_the_host_path_drafts(tiny_target, shape):
    """Simulated as greedy rounds on the device (what decoding on a static runner runs), the
    drafter drafts the same tree at every position as simulated on the host."""
    from test_device_rounds import recording

    head, runner = eagle_head(tiny_target), TargetRunner(tiny_target)
    prompt = prompts(tiny_target, 1)[0]
    continuation = speculative_generate(
        runner, FeatureHeadDrafter(head, shape), prompt, NEW_TOKENS, GREEDY, ()
    )
    [calibration] = calibrate(runner, [prompt], [continuation.tokens])
    host_trees, device_trees = [], []
    host = simulate(recording(FeatureHeadDrafter(head, shape), host_trees), [calibration], tiny_target.device)
    drafter = recording(FeatureHeadDrafter(head, shape, graphs=True), device_trees)
    device = simulate(drafter, [calibration], tiny_target.device, on_device=True)
    assert len(device_trees) == len(continuation.tokens) - 1
    assert device_trees == host_trees
    assert (device.accepted, device.nodes) == (host.accepted, host.nodes)


def test_accepted_along_follows_the_tree():
    # root → a(5), b(6); a → c(7); tokens: root 0, 5, 6, 7
    draft = Draft(torch.tensor([0, 5, 6, 7]), tree_buffers([(0,), (1,), (0, 0)]))
    assert accepted_along(draft, [5, 7, 1]) == 2
    assert accepted_along(draft, [6, 7]) == 1
    assert accepted_along(draft, [9]) == 0
    assert accepted_along(draft, []) == 0


def test_the_choice_follows_the_costs(tiny_target, monkeypatch):
    head, score_filter = eagle_head(tiny_target), noisy_target_filter(tiny_target, 0.3)
    runner = TargetRunner(tiny_target)
    calibrations = calibrate(
        runner, prompts(tiny_target), greedy_continuations(runner, prompts(tiny_target), NEW_TOKENS)
    )
    # Each shape simulated once: its draft and commit times are measured, and the min_gain
    # boundary below is 1 % wide, narrower than their noise on a loaded machine (it failed once in
    # CI that way).
    simulated, simulate_once = {}, autoshape.simulate

    def simulate(drafter, calibrations, device, on_device=False):
        key = repr(drafter.shape)
        if key not in simulated:
            simulated[key] = simulate_once(drafter, calibrations, device, on_device)
        return simulated[key]

    monkeypatch.setattr(autoshape, "simulate", simulate)

    def choose(latency, min_gain=0.0):
        return choose_shape(
            lambda shape: FeatureHeadDrafter(head, shape, score_filter),
            tree_shape,
            CANDIDATES,
            calibrations,
            latency,
            runner,
            finalists=0,  # the prediction alone: measuring would follow the real (tiny) costs
            min_gain=min_gain,
            progress=False,
        )

    free = choose(VerifyLatency(1.0, {2: 1.0, 64: 1.0}))  # a verify costs one plain step: trees pay
    by_shape = {json.dumps(dict(p.shape)): p for p in free.predictions}
    assert free.shape != {"kind": PLAIN}
    assert free.chosen.tokens_per_s == max(p.tokens_per_s for p in free.predictions)
    assert (
        by_shape[json.dumps(CANDIDATES[1])].tokens_per_step
        > by_shape[json.dumps(CANDIDATES[0])].tokens_per_step
    )
    # speculation must beat plain decoding by more than min_gain
    gain = free.chosen.tokens_per_s / free.predictions[0].tokens_per_s - 1
    assert choose(VerifyLatency(1.0, {2: 1.0, 64: 1.0}), min_gain=0.99 * gain).shape == free.shape
    assert choose(VerifyLatency(1.0, {2: 1.0, 64: 1.0}), min_gain=1.01 * gain).shape == {"kind": PLAIN}
    dear = choose(VerifyLatency(1.0, {2: 10.0, 64: 40.0}))  # a verify costs 10+ plain steps
    assert dear.shape == {"kind": PLAIN}
    assert len(dear.predictions) == 1 + len(CANDIDATES)


def test_finalists_are_decoded_for_real_and_the_fastest_measured_wins(tiny_target):
    head = eagle_head(tiny_target)
    runner = TargetRunner(tiny_target)
    continuations = greedy_continuations(runner, prompts(tiny_target), 12)
    calibrations = calibrate(runner, prompts(tiny_target), continuations)
    choice = choose_shape(
        lambda shape: FeatureHeadDrafter(head, shape),
        tree_shape,
        CANDIDATES,
        calibrations,
        VerifyLatency(1.0, {2: 1.0, 64: 1.0}),
        runner,
        finalists=2,
        progress=False,
    )
    measured = [p for p in choice.predictions if p.measured_tokens_per_s is not None]
    assert len(measured) == 3 and measured[0].shape == {"kind": PLAIN}  # 2 finalists + plain decoding
    assert all(p.measured_tokens_per_s > 0 for p in measured)
    ranked = sorted(choice.predictions[1:], key=lambda p: p.tokens_per_s, reverse=True)
    assert {json.dumps(dict(p.shape)) for p in measured[1:]} == {
        json.dumps(dict(p.shape)) for p in ranked[:2]
    }
    assert choice.chosen.measured_tokens_per_s == max(p.measured_tokens_per_s for p in measured)
    record = choice.record()
    assert record["measured_tokens_per_s"] == choice.chosen.measured_tokens_per_s


@pytest.mark.parametrize("verify_cost", [0.5, 10.0], ids=["a-tree-wins", "nothing-pays"])
def test_a_method_with_shape_auto_reproduces_plain_greedy_output(tiny_target, verify_cost):
    """The untrained head accepts ~nothing: a verify at half a plain step's cost makes a tree win
    anyway, at ten steps plain decoding does; either way the output is plain greedy's."""
    head = eagle_head(tiny_target)
    runner = TargetRunner(tiny_target)
    prompt = prompts(tiny_target, 1)[0]
    expected = plain_generate(runner, prompt, NEW_TOKENS, GREEDY, ()).tokens

    def chooser(name, method_runner, drafter_for, candidates):
        calibrations = calibrate(method_runner, [prompt], [expected])
        latency = VerifyLatency(1.0, {2: verify_cost, 64: verify_cost})  # drafting is ~free beside it
        return choose_shape(
            drafter_for, tree_shape, candidates, calibrations, latency, method_runner, 0, progress=False
        )

    method = build_method(
        "head_auto",
        {"type": "head", "checkpoint": "tiny", "shape": {"kind": "auto", "candidates": CANDIDATES}},
        tiny_target,
        heads=lambda _: head,
        draft_model=lambda: None,
        shortlist=lambda: None,
        eos_ids=(),
        max_new_tokens=NEW_TOKENS,
        typical=Typical(epsilon=0.09, delta=0.3),
        choose_shape=chooser,
    )
    generation = method.generate(prompt, GREEDY, 0)
    assert generation.tokens == expected
    chosen = method.details["auto_shape"]["chosen"]
    assert (chosen == {"kind": PLAIN}) == (verify_cost > 1)
    assert all(step.depth == 0 for step in generation.steps) == (verify_cost > 1)  # no drafts


def test_verify_latency_is_probed_once_per_key(tmp_path, tiny_target):
    runner = TargetRunner(tiny_target)
    probes = []

    def probe():
        probes.append(1)
        return probe_verify_latency(runner, [2, 4], past=16, repeats=2)

    key = {"machine": "this one", "threads": 2}
    first, path = cached_verify_latency(tmp_path, key, probe)
    assert set(first.verify_s) == {2, 4} and first.plain_s > 0 and len(probes) == 1
    again, again_path = cached_verify_latency(tmp_path, key, probe)
    assert again_path == path and len(probes) == 1  # read back, not probed
    assert again.plain_s == pytest.approx(first.plain_s) and again.verify_s == pytest.approx(first.verify_s)
    cached_verify_latency(tmp_path, {**key, "threads": 1}, probe)
    assert len(probes) == 2
    # The probed runner still decodes like a fresh one.
    prompt = prompts(tiny_target, 1)[0]
    assert (
        plain_generate(runner, prompt, 8, GREEDY, ()).tokens
        == plain_generate(TargetRunner(tiny_target), prompt, 8, GREEDY, ()).tokens
    )


def test_verify_latency_interpolates_between_probed_counts():
    latency = VerifyLatency(0.010, {2: 0.012, 8: 0.018, 16: 0.034})
    assert latency.at(2) == pytest.approx(0.012)
    assert latency.at(5) == pytest.approx(0.015)
    assert latency.at(12) == pytest.approx(0.026)
    assert latency.at(24) == pytest.approx(0.050)  # beyond: the last slope
    assert latency.at(1) == pytest.approx(0.011)  # below: the first slope
    again = VerifyLatency.from_record(latency.record())
    assert again.plain_s == pytest.approx(latency.plain_s) and again.verify_s == pytest.approx(
        latency.verify_s
    )
