"""The quickstart's time budget: size every stage to fit, from the rates the probe measured.

Machines differ by 6× per stage (regeneration ran at 163 tokens/s on an AMX-bf16 CPU and 27 on
an AVX2 EPYC), so a fixed number of conversations and steps is 45 minutes on one machine and
two hours on another. Instead:

1. :func:`specdraft.recipes.probe.probe` times a few seconds of each stage's own work on this
   machine (:class:`~specdraft.recipes.probe.Throughput`);
2. :func:`make_plan` splits the budget: an eval time box (what :func:`eval_seconds` says this
   machine's decoding needs, at most ``eval_share``), the start-up of every stage, then data
   (regeneration + features) and training by ``data_share``, and turns seconds into
   conversations and optimizer steps with the probed rates;
3. :func:`retime_training`: when training starts, what the stages before it saved (or overran)
   against their ETAs is given to (or taken from) its steps, once.

The plan is written once per quickstart directory (and again when training is resized) and
reused when the quickstart resumes (:mod:`specdraft.recipes.plan`), so a re-run never re-sizes
(and so never orphans) the work already done.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from specdraft.eval.autoshape import VerifyLatency
from specdraft.recipes.probe import Throughput

SECONDS_PER_MINUTE = 60


@dataclass(frozen=True)
class BudgetRules:
    """How the budget is split (conf/quickstart.yaml ``budget``)."""

    margin: float  # planned to (1 - margin) × budget: the stages' own noise
    eval_share: float  # of the budget: the eval's time box (at most, when sized from the probe)
    data_share: float  # of what is left for data + training: regeneration + features
    answer_tokens: float  # mean tokens of a regenerated answer (the probe decodes only a few)
    min_conversations: int
    min_train_steps: int
    eval_tau: float  # the τ the eval's time box is sized for
    eval_draft_per_depth: float  # drafting per tree depth, in plain decoding steps
    eval_safety: float  # the box over the estimate
    eval_min_minutes: float  # the smallest box sized from the probe

    def __post_init__(self) -> None:
        if not 0 < self.data_share < 1 or self.margin < 0 or self.eval_share < 0:
            raise ValueError(f"budget: data_share must lie in (0, 1), margin and eval_share be >= 0: {self}")
        if self.margin + self.eval_share >= 1:
            raise ValueError(
                f"budget: margin + eval_share must be < 1, got {self.margin} + {self.eval_share}"
            )


@dataclass(frozen=True)
class TrainShape:
    """The training stage's validations: ``validations`` evenly spaced during the run (then the
    final weights on the whole held-out split), each of ``limit_val_batches`` batches (an int)
    or that fraction of the held-out split (a float, Lightning's convention: 1.0 is all of it)."""

    heldout_fraction: float
    validations: int
    limit_val_batches: int | float

    def __post_init__(self) -> None:
        if not isinstance(self.validations, int) or self.validations < 0:
            raise ValueError(f"budget.validations must be an int >= 0, got {self.validations!r}")


@dataclass(frozen=True)
class Plan:
    """The sizes of the stages and the expected seconds of each (``eta_s``, by stage name);
    ``val_check_interval``: training steps between two validations; ``train_fit_s``: the seconds
    of training's steps and periodic validations (its stage without start-up and the final
    validation), its deadline (None in plans written before it)."""

    budget_minutes: float
    conversations: int
    train_steps: int
    eval_minutes: float
    eta_s: dict[str, float]
    val_check_interval: int
    train_fit_s: float | None = None

    @property
    def total_s(self) -> float:
        return sum(self.eta_s.values())

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "total_s": self.total_s}


class BudgetError(ValueError):
    """The budget cannot hold the smallest useful quickstart on this machine."""


def make_plan(
    budget_minutes: float,
    throughput: Throughput,
    rules: BudgetRules,
    shape: TrainShape,
    self_distill: bool,
    conversations: int | None = None,
    train_steps: int | None = None,
    eval_minutes: float | None = None,
    captured: bool = False,
) -> Plan:
    """Size conversations, optimizer steps and the eval's time box to fit ``budget_minutes``.

    Explicit ``conversations`` / ``train_steps`` / ``eval_minutes`` are kept as given (and the
    ETAs say what they cost); the others are sized from the time left. ``captured``: regeneration
    captures the features as it answers (its probe timed it so), so there are no cache stages.
    Raises BudgetError when the sized stages fall below ``rules.min_*``."""
    if captured and not self_distill:
        raise ValueError("features are captured during regeneration: captured needs self_distill")
    t = throughput
    budget_s = budget_minutes * SECONDS_PER_MINUTE
    eval_s = eval_minutes * SECONDS_PER_MINUTE if eval_minutes is not None else rules.eval_share * budget_s
    names = stage_names(self_distill, captured)
    left_s = (1 - rules.margin) * budget_s - (t.probe_s + t.startup_s * len(names) + eval_s)
    cost = ConversationCost.of(t, rules, self_distill, captured)
    sized_conversations, sized_steps = conversations is None, train_steps is None
    if conversations is None:
        conversations = min(math.floor(rules.data_share * left_s / cost.total_s), t.source_conversations)
    validation = ValidationCost.of(t, shape, shape.heldout_fraction * conversations * cost.tokens)
    if train_steps is None:
        train_left_s = left_s - conversations * cost.total_s - validation.final_s - validation.periodic_s
        train_steps = math.floor(train_left_s / t.train_step_s)
    val_check_interval = validation_interval(train_steps, shape.validations)

    if (sized_conversations and conversations < rules.min_conversations) or (
        sized_steps and train_steps < rules.min_train_steps
    ):
        needed_s = _smallest_budget_s(
            t, rules, shape, cost, validation.periodic_s, len(names),
            None if sized_conversations else conversations, None if sized_steps else train_steps,
            None if eval_minutes is None else eval_s,
        )  # fmt: skip
        raise BudgetError(
            f"budget_minutes={budget_minutes:g} is too small on this machine: it leaves "
            f"{max(conversations, 0)} conversations and {max(train_steps, 0)} training steps, below the "
            f"minimum {rules.min_conversations} and {rules.min_train_steps} (budget.min_conversations, "
            f"budget.min_train_steps); ask for {math.ceil(needed_s / SECONDS_PER_MINUTE) + 1} minutes"
        )

    heldout = shape.heldout_fraction * conversations
    eta = {}
    if self_distill:
        eta["regen"] = t.startup_s + conversations * cost.regen_s
    if not captured:
        eta["cache train"] = t.startup_s + (conversations - heldout) * cost.features_s
        eta["cache heldout"] = t.startup_s + heldout * cost.features_s
    fit_s = train_steps * t.train_step_s + train_steps // val_check_interval * validation.each_s
    eta["train"] = t.startup_s + fit_s + validation.final_s
    eta["export"] = t.startup_s
    eta["eval"] = t.startup_s + eval_s
    eta = {"probe": t.probe_s, **{name: round(seconds, 1) for name, seconds in eta.items()}}
    return Plan(
        budget_minutes,
        conversations,
        train_steps,
        eval_s / SECONDS_PER_MINUTE,
        eta,
        val_check_interval,
        round(fit_s, 1),
    )


def stage_names(self_distill: bool, captured: bool) -> list[str]:
    """The quickstart's stages, in order, as its plan and its ETAs name them."""
    return [
        *(["regen"] if self_distill else []),
        *([] if captured else ["cache train", "cache heldout"]),
        "train",
        "export",
        "eval",
    ]


@dataclass(frozen=True)
class ConversationCost:
    """Seconds per requested conversation: its answer (``regen_s``: prefill + decoding at
    ``regen_rows`` rows), then its features (``features_s``: prompt + answer tokens, none when the
    answer captured them); ``tokens`` its cached tokens. Prompts too long to answer cost (almost)
    nothing."""

    regen_s: float
    features_s: float
    tokens: float

    @property
    def total_s(self) -> float:
        return self.regen_s + self.features_s

    @classmethod
    def of(cls, t: Throughput, rules: BudgetRules, self_distill: bool, captured: bool) -> ConversationCost:
        answered = t.answered_fraction
        regen_s = 0.0
        if self_distill:
            regen_s = answered * (t.regen_prefill_s + rules.answer_tokens * t.regen_step_s / t.regen_rows)
        tokens = answered * (t.prompt_tokens + rules.answer_tokens) if self_distill else t.conversation_tokens
        return cls(regen_s, 0.0 if captured else tokens / t.cache_tokens_per_s, tokens)


@dataclass(frozen=True)
class ValidationCost:
    """Seconds of training's validations: ``each_s`` per periodic one and ``periodic_s`` for all of
    them (a fixed number: their cost does not grow with the steps), then ``final_s`` for the final
    weights over the whole held-out split."""

    each_s: float
    periodic_s: float
    final_s: float

    @classmethod
    def of(cls, t: Throughput, shape: TrainShape, heldout_tokens: float) -> ValidationCost:
        final_s = heldout_tokens / t.val_positions_per_s
        if isinstance(shape.limit_val_batches, float):
            each_s = shape.limit_val_batches * final_s
        else:
            each_s = shape.limit_val_batches * t.train_batch_positions / t.val_positions_per_s
        return cls(each_s, shape.validations * each_s, final_s)


def retime_training(
    plan: Plan, throughput: Throughput, ahead_s: float, validations: int, min_train_steps: int
) -> Plan:
    """The plan with its training resized by ``ahead_s``: the seconds the stages before training
    finished ahead of their ETAs (negative: behind). The probe's errors on regeneration and
    features (the feature writer ran ~1.4× faster than probed on an AMX Xeon) then go to, or come
    out of, the one stage whose size is free up to its start; never below ``min_train_steps``."""
    steps = max(min_train_steps, plan.train_steps + math.floor(ahead_s / throughput.train_step_s))
    if steps == plan.train_steps:
        return plan
    added_s = (steps - plan.train_steps) * throughput.train_step_s
    eta = dict(plan.eta_s)
    eta["train"] = round(eta["train"] + added_s, 1)
    fit_s = None if plan.train_fit_s is None else round(plan.train_fit_s + added_s, 1)
    return replace(
        plan,
        train_steps=steps,
        eta_s=eta,
        val_check_interval=validation_interval(steps, validations),
        train_fit_s=fit_s,
    )


def validation_interval(train_steps: int, validations: int) -> int:
    """Steps between two periodic validations: ``validations`` of them spaced evenly over a
    ``train_steps`` run (one more falls on its last step when the interval divides it; none: an
    interval past its end)."""
    return max(1, math.ceil(train_steps / (validations + 1))) if validations else train_steps + 1


def _smallest_budget_s(
    t: Throughput,
    rules: BudgetRules,
    shape: TrainShape,
    cost: ConversationCost,
    validations_s: float,
    stages: int,
    conversations: int | None,
    train_steps: int | None,
    eval_s: float | None,
) -> float:
    """The smallest budget whose plan meets both minimums, given what the user fixed. The final
    validation grows with the conversations (``k`` seconds per second of data)."""
    per_conversation_s = cost.total_s
    k = shape.heldout_fraction * cost.tokens / t.val_positions_per_s / per_conversation_s
    steps_s = (train_steps or rules.min_train_steps) * t.train_step_s + validations_s
    if conversations is not None:  # the data is fixed: the rest must hold the training
        left_s = conversations * per_conversation_s * (1 + k) + steps_s
    elif train_steps is not None:  # the steps are fixed: the data share must hold the minimum
        left_s = max(
            rules.min_conversations * per_conversation_s / rules.data_share, steps_s / (1 - rules.data_share)
        )
    else:
        left_s = max(
            rules.min_conversations * per_conversation_s / rules.data_share,
            steps_s / (1 - rules.data_share - rules.data_share * k),
        )
    fixed_s = t.probe_s + t.startup_s * stages
    if eval_s is None:
        return (left_s + fixed_s) / (1 - rules.margin - rules.eval_share)
    return (left_s + fixed_s + eval_s) / (1 - rules.margin)


def eval_seconds(
    throughput: Throughput,
    rules: BudgetRules,
    trees: Sequence[tuple[int, int]],
    questions: int,
    new_tokens: int,
) -> float | None:
    """The eval's time box from the probe: ``questions`` × ``new_tokens`` tokens of plain decoding
    and of each tree ((depth, nodes) pairs), every tree step a verification plus its drafting
    (``eval_draft_per_depth`` plain steps per depth) committing ``eval_tau`` tokens, and a prefill
    per question and method; × ``eval_safety``. None when the eval was not probed.

    Measured on the quickstart's eval (its reports' draft / verify ms): a 60 / 24 / 12-node tree
    verified in 1.7 / 1.3 / 1.1 plain steps on an AMX Xeon, 3.7 / 2.1 / 1.6 on an AVX2 EPYC, and
    drafted in 0.07–0.09 plain steps per depth; its heads reached τ 2.0–2.4 (AMX), 1.5–1.8 (AVX2)."""
    if throughput.eval_plain_s is None or not throughput.eval_verify_s:
        return None
    plain_s = throughput.eval_plain_s
    verify = VerifyLatency(plain_s, {int(n): v for n, v in throughput.eval_verify_s})
    per_token_s = plain_s + sum(
        (verify.at(nodes) + rules.eval_draft_per_depth * depth * plain_s) / rules.eval_tau
        for depth, nodes in trees
    )
    prefill_s = (1 + len(trees)) * (throughput.regen_prefill_s or plain_s)
    return rules.eval_safety * questions * (new_tokens * per_token_s + prefill_s)


def describe(plan: Plan, throughput: Throughput, hardware: str, eval_what: str, self_distill: bool) -> str:
    """The plan as the quickstart prints it before starting: one line per stage with its ETA."""
    t = throughput
    lines = [
        f"quickstart plan: budget {plan.budget_minutes:g} min on {hardware} "
        f"(probed in {clock(t.probe_s)}; stage start-up {t.startup_s:.0f} s each)"
    ]
    detail = {
        "probe": "each stage's work timed for a few seconds",
        "cache train": f"features at {t.cache_tokens_per_s:,.0f} tokens/s",
        "cache heldout": "",
        "train": f"{plan.train_steps} steps × {t.train_batch_positions:,} positions "
        f"({t.train_batch_positions / t.train_step_s:,.0f} positions/s), validated every "
        f"{plan.val_check_interval}",
        "export": "",
        "eval": f"time box {plan.eval_minutes:.1f} min: {eval_what}",
    }
    if self_distill:
        rate = t.regen_rows / t.regen_step_s
        detail["regen"] = f"{plan.conversations} conversations ({rate:,.0f} tokens/s at {t.regen_rows} rows)"
        if "cache train" not in plan.eta_s:
            detail["regen"] += ", their features captured as they are answered"
    else:
        detail["cache train"] = f"{plan.conversations} conversations; " + detail["cache train"]
    for name, seconds in plan.eta_s.items():
        lines.append(f"  {name:<14} ~{clock(seconds):>6}   {detail.get(name, '')}".rstrip())
    lines.append(f"  {'total':<14} ~{clock(plan.total_s):>6}   of {clock(plan.budget_minutes * 60)}")
    return "\n".join(lines)


def clock(seconds: float) -> str:
    """``m:ss``."""
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes}:{seconds:02d}"
