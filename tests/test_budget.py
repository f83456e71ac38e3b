"""The quickstart's planner (recipes/budget.py make_plan): the budget split as documented, explicit
sizes kept, a too-small budget refused with the minutes that would do; the probe's step clock and
cache rate (recipes/probe.py). The probe itself runs in test_quickstart's end-to-end test."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from specdraft.data.chat import TokenizedConversation
from specdraft.data.conversations import Conversation, Message
from specdraft.data.features import length_batches
from specdraft.data.regen import GenerationSettings, TargetResponder
from specdraft.recipes import budget, probe
from specdraft.recipes.budget import BudgetError, BudgetRules, TrainShape, make_plan
from specdraft.recipes.probe import ProbeSettings, Throughput

# Rates of the order measured on a 2-core AVX2 EPYC with SmolLM2 (fp32).
THROUGHPUT = Throughput(
    startup_s=12.0,
    regen_rows=32,
    regen_prefill_s=0.1,
    regen_step_s=0.4,  # 80 tokens/s at 32 rows
    answered_fraction=0.8,
    prompt_tokens=100.0,
    conversation_tokens=900.0,
    source_conversations=17_000,
    cache_tokens_per_s=1000.0,
    train_step_s=10.0,
    train_batch_positions=4096,
    val_positions_per_s=1400.0,
    probe_s=70.0,
)
RULES = BudgetRules(
    margin=0.05, eval_share=0.2, data_share=0.5, answer_tokens=190, min_conversations=64, min_train_steps=50,
    eval_tau=1.8, eval_draft_per_depth=0.1, eval_safety=1.2, eval_min_minutes=1.0,
)  # fmt: skip
SHAPE = TrainShape(heldout_fraction=0.05, validations=4, limit_val_batches=8)


def heldout_validation_s(made) -> float:
    """One validation over the whole held-out split: 5 % of the conversations, 0.8 answered × (100
    prompt + 190 answer) tokens each."""
    return SHAPE.heldout_fraction * made.conversations * 0.8 * 290 / THROUGHPUT.val_positions_per_s


def plan(budget_minutes: float = 45, throughput: Throughput = THROUGHPUT, **sizes):
    return make_plan(budget_minutes, throughput, RULES, SHAPE, sizes.pop("self_distill", True), **sizes)


def test_the_plan_fills_the_budget_less_its_margin_and_splits_it_as_configured():
    made = plan()
    budget_s = 45 * 60
    assert list(made.eta_s) == ["probe", "regen", "cache train", "cache heldout", "train", "export", "eval"]
    assert 0.93 * budget_s < made.total_s <= 0.95 * budget_s  # whole conversations / steps only
    assert made.eval_minutes == pytest.approx(0.2 * 45)
    assert made.eta_s["eval"] == pytest.approx(THROUGHPUT.startup_s + 0.2 * budget_s)
    fixed_s = THROUGHPUT.probe_s + 6 * THROUGHPUT.startup_s + 0.2 * budget_s
    data_s = made.eta_s["regen"] + made.eta_s["cache train"] + made.eta_s["cache heldout"] - 3 * 12.0
    assert data_s == pytest.approx(0.5 * (0.95 * budget_s - fixed_s), rel=0.01)
    # per conversation: 0.8 × (0.1 + 190 × 0.4 / 32) s answering + 0.8 × 290 tokens / 1000 tokens/s
    assert made.conversations == int(
        0.5 * (0.95 * budget_s - fixed_s) / (0.8 * (0.1 + 190 * 0.4 / 32) + 0.232)
    )
    # training's deadline: its stage less the start-up and the final validation over the held-out split
    assert made.train_fit_s == pytest.approx(
        made.eta_s["train"] - THROUGHPUT.startup_s - heldout_validation_s(made), abs=0.1
    )


def test_features_captured_by_regeneration_cost_no_cache_stages():
    computed, captured = plan(), plan(captured=True)
    assert list(captured.eta_s) == ["probe", "regen", "train", "export", "eval"]
    budget_s, fixed_s = 45 * 60, THROUGHPUT.probe_s + 4 * THROUGHPUT.startup_s + 0.2 * 45 * 60
    # per conversation only its answer: 0.8 × (0.1 + 190 × 0.4 / 32) s
    assert captured.conversations == int(0.5 * (0.95 * budget_s - fixed_s) / (0.8 * (0.1 + 190 * 0.4 / 32)))
    assert captured.conversations > computed.conversations
    assert captured.eta_s["regen"] - 12.0 == pytest.approx(
        captured.conversations * 0.8 * (0.1 + 190 * 0.4 / 32),
        abs=0.1,  # ETAs in tenths of a second
    )
    with pytest.raises(ValueError, match="captured needs self_distill"):
        plan(captured=True, self_distill=False)


def test_faster_regeneration_buys_conversations_and_a_bigger_budget_buys_both():
    base = plan()
    faster = plan(throughput=replace(THROUGHPUT, regen_step_s=0.2))
    assert faster.conversations > base.conversations and faster.train_steps == pytest.approx(
        base.train_steps, abs=1
    )
    bigger = plan(budget_minutes=90)
    assert bigger.conversations > 2 * base.conversations and bigger.train_steps > 2 * base.train_steps


def test_explicit_sizes_are_kept_and_their_cost_shows_in_the_etas():
    made = plan(conversations=768, train_steps=400, eval_minutes=8)
    assert (made.conversations, made.train_steps, made.eval_minutes) == (768, 400, 8)
    assert made.total_s > 45 * 60  # 768 conversations and 400 steps do not fit 45 min here: the ETAs say so
    only_steps = plan(train_steps=60)
    assert only_steps.train_steps == 60 and only_steps.conversations == plan().conversations


def test_without_self_distillation_there_is_no_regeneration_and_whole_conversations_are_cached():
    made = plan(self_distill=False)
    assert "regen" not in made.eta_s
    per_conversation_s = THROUGHPUT.conversation_tokens / THROUGHPUT.cache_tokens_per_s
    cache_s = made.eta_s["cache train"] + made.eta_s["cache heldout"] - 2 * THROUGHPUT.startup_s
    assert cache_s == pytest.approx(made.conversations * per_conversation_s)


def test_a_budget_too_small_is_refused_with_the_minutes_that_would_do():
    with pytest.raises(BudgetError, match=r"budget_minutes=10 is too small on this machine") as caught:
        plan(budget_minutes=10)
    needed = int(re.search(r"ask for (\d+) minutes", str(caught.value)).group(1))
    enough = plan(budget_minutes=needed)
    with pytest.raises(BudgetError):  # and not far above what is needed (it adds a minute)
        plan(budget_minutes=needed - 2)
    assert enough.conversations >= RULES.min_conversations and enough.train_steps >= RULES.min_train_steps
    # with the data fixed, the minutes asked for hold that data and the minimum of training
    with pytest.raises(BudgetError) as caught:
        plan(budget_minutes=30, conversations=768)
    needed = int(re.search(r"ask for (\d+) minutes", str(caught.value)).group(1))
    assert plan(budget_minutes=needed, conversations=768).train_steps >= RULES.min_train_steps


def test_no_plan_asks_for_more_conversations_than_the_source_holds_and_fractions_validate_all():
    assert (
        plan(budget_minutes=600, throughput=replace(THROUGHPUT, source_conversations=500)).conversations
        == 500
    )
    many = replace(SHAPE, validations=20)  # validations weigh: the difference shows
    whole = make_plan(45, THROUGHPUT, RULES, replace(many, limit_val_batches=1.0), True, train_steps=100)
    tenth = make_plan(45, THROUGHPUT, RULES, replace(many, limit_val_batches=0.1), True, train_steps=100)
    # a float is the fraction of the held-out split
    assert whole.eta_s["train"] - tenth.eta_s["train"] == pytest.approx(
        20 * 0.9 * heldout_validation_s(whole), rel=1e-2
    )
    for wrong in (-1, 2.5):
        with pytest.raises(ValueError, match=r"budget\.validations must be an int >= 0"):
            TrainShape(0.05, wrong, 8)


def test_validations_are_a_fixed_number_spread_over_the_run_and_fewer_of_them_buy_steps():
    for validations in (0, 1, 3, 4, 7):
        made = make_plan(45, THROUGHPUT, RULES, replace(SHAPE, validations=validations), True)
        periodic = made.train_steps // made.val_check_interval
        # one more falls on the last step when the interval divides the run
        assert validations <= periodic <= validations + 1
        assert made.val_check_interval * validations < made.train_steps
    fewer = make_plan(45, THROUGHPUT, RULES, replace(SHAPE, validations=2), True)
    more = make_plan(45, THROUGHPUT, RULES, replace(SHAPE, validations=10), True)
    validation_s = SHAPE.limit_val_batches * THROUGHPUT.train_batch_positions / THROUGHPUT.val_positions_per_s
    assert fewer.conversations == more.conversations
    gained = 8 * validation_s / THROUGHPUT.train_step_s
    assert fewer.train_steps - more.train_steps == pytest.approx(gained, abs=1)
    # steps the user fixed are kept; the ETA counts the validations they get
    fixed = plan(train_steps=101)
    assert (fixed.train_steps, fixed.val_check_interval) == (101, 21)  # steps 21, 42, 63, 84
    heldout_s = heldout_validation_s(fixed)  # the final one
    assert fixed.eta_s["train"] == pytest.approx(
        THROUGHPUT.startup_s + 101 * THROUGHPUT.train_step_s + 4 * validation_s + heldout_s, rel=1e-3
    )


def test_training_is_resized_by_what_the_stages_before_it_saved_or_overran():
    made = plan()
    step_s = THROUGHPUT.train_step_s
    ahead = budget.retime_training(made, THROUGHPUT, 305.0, SHAPE.validations, RULES.min_train_steps)
    assert ahead.train_steps == made.train_steps + 30  # 305 s / 10 s per step, whole steps
    assert ahead.eta_s["train"] == pytest.approx(made.eta_s["train"] + 30 * step_s)
    assert ahead.train_fit_s == pytest.approx(made.train_fit_s + 30 * step_s)  # its deadline too
    assert ahead.val_check_interval == budget.validation_interval(ahead.train_steps, SHAPE.validations)
    assert {k: v for k, v in ahead.eta_s.items() if k != "train"} == {
        k: v for k, v in made.eta_s.items() if k != "train"
    }
    assert (ahead.conversations, ahead.eval_minutes) == (made.conversations, made.eval_minutes)
    behind = budget.retime_training(made, THROUGHPUT, -95.0, SHAPE.validations, RULES.min_train_steps)
    assert behind.train_steps == made.train_steps - 10  # an overrun costs whole steps (floor)
    assert budget.retime_training(made, THROUGHPUT, 9.9, SHAPE.validations, RULES.min_train_steps) is made
    never_below = budget.retime_training(made, THROUGHPUT, -1e6, SHAPE.validations, RULES.min_train_steps)
    assert never_below.train_steps == RULES.min_train_steps


def test_the_eval_box_is_sized_by_the_probed_decoding_of_each_tree():
    probed = replace(
        THROUGHPUT, regen_prefill_s=0.1, eval_plain_s=0.05, eval_verify_s=[[12, 0.06], [24, 0.07], [60, 0.09]]
    )
    rules = replace(RULES, eval_tau=2.0, eval_draft_per_depth=0.1, eval_safety=1.0)
    trees = [(6, 60), (5, 24), (3, 12)]
    # per token: plain 0.05 + Σ (verify + 0.1 · depth · 0.05) / 2 = 0.05 + 0.06 + 0.0475 + 0.0375;
    # a prefill per turn and method: 4 × 0.1
    assert budget.eval_seconds(probed, rules, trees, 16, 128) == pytest.approx(16 * (128 * 0.195 + 0.4))
    assert budget.eval_seconds(probed, replace(rules, eval_safety=1.5), trees, 16, 128) == pytest.approx(
        1.5 * 16 * (128 * 0.195 + 0.4)
    )
    # a node count between the probed ones is read linearly between them
    assert budget.eval_seconds(probed, rules, [(4, 18)], 1, 1) == pytest.approx(
        0.05 + (0.065 + 0.02) / 2 + 2 * 0.1
    )
    assert budget.eval_seconds(THROUGHPUT, rules, trees, 16, 128) is None  # not probed


class _Batch:
    def __init__(self, positions: int) -> None:
        self.attention_mask = torch.ones(1, positions)


def test_the_probe_times_a_training_step_from_its_start_to_the_next_and_validation_apart(monkeypatch):
    """The interval between two step starts holds the step AND fetching the next batch (the
    loader, its transfer, the noise): what the real run spends per step. A validation between two
    steps is timed on its own, not added to the step before it."""
    now = [0.0]
    monkeypatch.setattr(probe.time, "perf_counter", lambda: now[0])
    clock = probe._StepClock()

    def at(seconds, hook, *args):
        now[0] = seconds
        hook(None, None, *args)

    at(0.0, clock.on_train_batch_start, _Batch(100), 0)
    at(0.4, clock.on_train_batch_end, None, _Batch(100), 0)  # the step's own work ends here…
    at(1.0, clock.on_train_batch_start, _Batch(200), 1)  # …the next batch was ready only now
    at(2.5, clock.on_train_batch_start, _Batch(300), 2)
    at(3.0, clock.on_validation_start)
    at(3.0, clock.on_validation_batch_start, _Batch(50), 0)
    at(3.4, clock.on_validation_batch_end, None, _Batch(50), 0)
    at(9.0, clock.on_train_batch_start, _Batch(400), 3)  # after the validation: a new first step
    at(9.7, clock.on_train_batch_start, _Batch(500), 4)
    assert clock.train == [(1.0, 100), (1.5, 200), pytest.approx((0.7, 400))]
    assert clock.val == [pytest.approx((0.4, 50))]


def test_probe_settings_need_a_timed_step_after_the_warm_up():
    ProbeSettings(regen_new_tokens=2, cache_tokens=100, train_steps=3)
    with pytest.raises(ValueError, match="train_steps >= 3"):
        ProbeSettings(regen_new_tokens=2, cache_tokens=100, train_steps=2)


def test_the_cache_probe_takes_the_writers_fixed_cost_out_of_its_rate(monkeypatch, tmp_path):
    """A cache stage pays the writer's fixed cost (planning, the shard file, its hash) once; the
    probe's few thousand tokens would pay it per few thousand: a single sample measures it."""
    now = [0.0]
    monkeypatch.setattr(probe.time, "perf_counter", lambda: now[0])

    def write_cache(target, samples, out_dir, *args, **kwargs):  # 1.5 s + 1 ms per token
        now[0] += 1.5 + 0.001 * sum(len(s.input_ids) for s in samples)

    monkeypatch.setattr(probe, "write_cache", write_cache)
    samples = [TokenizedConversation(str(i), [0] * 300, [1] * 300) for i in range(40)]
    settings = ProbeSettings(regen_new_tokens=2, cache_tokens=3000, train_steps=3)
    rate = probe._probe_cache(None, samples, None, 1024, tmp_path / "features", settings)
    # 1,000 positions/s (not 3,000 / 4.5 s = 667), at a stage's padding (equal lengths: none here)
    assert rate == pytest.approx(1000.0 / probe.CACHE_STAGE_PADDING)


def test_the_cache_probe_times_padded_positions_not_tokens(monkeypatch, tmp_path):
    """The target computes every position of a length bucket: the probe's few buckets are padded
    far more than a stage's hundreds, so its tokens/s would understate the stage's."""
    now = [0.0]
    monkeypatch.setattr(probe.time, "perf_counter", lambda: now[0])

    def write_cache(target, samples, out_dir, *args, batch_tokens, **kwargs):  # 1 ms per position
        lengths = [len(s.input_ids) for s in samples]
        batches = length_batches(lengths, batch_tokens)
        now[0] += 0.001 * sum(len(rows) * max(lengths[i] for i in rows) for rows in batches)

    monkeypatch.setattr(probe, "write_cache", write_cache)
    lengths = [500 if i % 3 == 0 else 60 for i in range(60)]  # long and short in the same buckets
    samples = [TokenizedConversation(str(i), [0] * n, [1] * n) for i, n in enumerate(lengths)]
    settings = ProbeSettings(regen_new_tokens=2, cache_tokens=4000, train_steps=3)
    rate = probe._probe_cache(None, samples, None, 2048, tmp_path / "features", settings)
    assert rate == pytest.approx(1000.0 / probe.CACHE_STAGE_PADDING)


def test_the_probe_samples_only_the_first_turns_regeneration_answers(tiny_target):
    """A self-distilled cache holds only the turns whose prompt leaves room for an answer: the
    probe's cache and training steps time those, not the long prompts regeneration skips."""
    settings = GenerationSettings(temperature=0.0, top_p=1.0, seed=0, max_new_tokens=8)
    responder = TargetResponder(tiny_target, settings, max_prompt_tokens=128)

    def turn(name: str, words: int) -> Conversation:
        question = " ".join(["word"] * words)
        return Conversation(name, (Message("user", question), Message("assistant", "an answer")))

    turns = [turn("short-0", 3), turn("long", 200), turn("short-1", 5), turn("short-2", 4)]
    assert responder.prompt_ids([{"role": "user", "content": " ".join(["word"] * 200)}]) is None
    assert [c.id for c in probe.answered_turns(turns, responder, limit=2)] == ["short-0", "short-1"]
    everything = probe.answered_turns(turns, responder, limit=10)
    assert [c.id for c in everything] == ["short-0", "short-1", "short-2"]
