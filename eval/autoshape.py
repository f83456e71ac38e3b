"""``shape: auto``: the draft shape that decodes fastest on the machine at hand — or no
speculation at all when none pays.

Expected speed of a shape s (greedy decoding)::

    tokens/s(s) = E[1 + accepted | s] / (draft_s(s) + verify_s(nodes(s)) + commit_s(s))
    tokens/s(plain) = 1 / plain_step_s

* ``verify_s(n)``: the target's forward over an n-node tree after a fixed past, probed once on
  this machine (:func:`probe_verify_latency`) and cached per machine, target, dtype, threads and
  kernels (:func:`cached_verify_latency`) — on an AVX2 CPU a 12-node verify costs ~1.5 plain
  steps, on a GPU about one, which is why the best shape differs between machines;
* ``E[accepted]``, ``draft_s`` and ``commit_s``: the drafter itself, run at EVERY position of a
  few held-out greedy continuations of the target (:func:`simulate`): at position t it drafts a
  tree from root x_t and accepts the longest path that matches x_{t+1}, x_{t+2}, … — exactly
  what greedy verification would accept there, because the continuation IS the target's argmax.
  No target forward per shape: one prefill per calibration prompt feeds every candidate.

The prediction ranks; a measurement decides: the few best predicted shapes and plain decoding
then decode the calibration prompts for real, interleaved, and the fastest wins if it beats
plain decoding by more than a margin (:func:`choose_shape`). That step exists because the
model's parts were measured apart: on an AVX2 EPYC a 2-node verify cost 1.04 plain steps back
to back in the probe but 1.12 inside the decode loop, and held-out ShareGPT gave τ 1.25 where
MT-bench gave 1.18 — enough to predict +13 % for a shape that ran 4 % slower than plain
decoding.

The choice is made at T=0 and applied at every temperature.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from specdraft.eval.decode import device_clock, plain_generate, speculative_generate
from specdraft.eval.drafters import Draft, Drafter, TreeShape
from specdraft.eval.runner import TargetOutput, TargetRunner
from specdraft.eval.sampling import Sampling
from specdraft.eval.trees import tree_buffers, tree_from_ancestors
from specdraft.system.files import write_json_atomic

log = logging.getLogger(__name__)

GREEDY = Sampling()
PLAIN = "plain"  # the choice that drafts nothing


# -- the target's cost on this machine ------------------------------------------------------------
@dataclass(frozen=True)
class VerifyLatency:
    """Median seconds of one target forward after a fixed past: ``plain_s`` for one token (a
    plain decoding step), ``verify_s[n]`` for an n-node tree."""

    plain_s: float
    verify_s: Mapping[int, float]

    def at(self, nodes: float) -> float:
        """verify seconds for ``nodes`` nodes, linear between (and beyond) the probed counts."""
        counts = sorted(self.verify_s)
        if len(counts) == 1:
            return self.verify_s[counts[0]]
        low = max([c for c in counts[:-1] if c <= nodes] or [counts[0]])
        high = counts[counts.index(low) + 1]
        slope = (self.verify_s[high] - self.verify_s[low]) / (high - low)
        return self.verify_s[low] + slope * (nodes - low)

    def record(self) -> dict[str, Any]:
        verify_ms = {str(n): 1e3 * seconds for n, seconds in self.verify_s.items()}
        return {"plain_ms": 1e3 * self.plain_s, "verify_ms": verify_ms}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> VerifyLatency:
        return cls(record["plain_ms"] / 1e3, {int(n): ms / 1e3 for n, ms in record["verify_ms"].items()})


@torch.no_grad()
def probe_verify_latency(
    runner: TargetRunner, node_counts: Sequence[int], past: int, repeats: int, seed: int = 0
) -> VerifyLatency:
    """Time plain steps and n-node tree verifications after a ``past``-token random prompt
    (the cost of a forward hardly depends on the tokens or on the tree's shape: one level of
    n − 1 children stands for every n-node tree). One warm-up, then the median of ``repeats``."""
    generator = torch.Generator().manual_seed(seed)
    vocab = runner.target.spec.vocab_size
    prompt = torch.randint(0, vocab, (past,), generator=generator)
    runner.reserve(past + (1 + repeats) * (2 + len(node_counts)))
    runner.prefill(prompt)
    device = runner.device

    def median_seconds(forward: Callable[[], None]) -> float:
        times = []
        for _ in range(1 + repeats):
            begin = device_clock(device)
            forward()
            times.append(device_clock(device) - begin)
        return statistics.median(times[1:])

    def plain_step() -> None:
        runner.extend(torch.randint(0, vocab, (1,), generator=generator))

    def verify(n: int) -> Callable[[], None]:
        tree = tree_buffers([(rank,) for rank in range(n - 1)])

        def run() -> None:
            runner.verify(torch.randint(0, vocab, (n,), generator=generator), tree)
            runner.commit([0])  # keep the root: the past grows by one token per forward

        return run

    plain_s = median_seconds(plain_step)
    return VerifyLatency(plain_s, {n: median_seconds(verify(n)) for n in sorted(set(node_counts))})


def cached_verify_latency(
    cache_dir: Path, key: Mapping[str, Any], probe: Callable[[], VerifyLatency]
) -> tuple[VerifyLatency, Path]:
    """The latency recorded under ``key`` (machine, target, dtype, threads, kernels, probe
    settings) in ``cache_dir``, probed and written (atomically) on first use."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"verify_latency-{digest}.json"
    if path.exists():
        stored = json.loads(path.read_text())
        if stored.get("key") == key:
            log.info("verify latency: %s", path)
            return VerifyLatency.from_record(stored["latency"]), path
    latency = probe()
    write_json_atomic(path, {"key": key, "latency": latency.record()})
    log.info("verify latency probed and cached in %s", path)
    return latency, path


# -- the head's acceptance, simulated ---------------------------------------------------------------
@dataclass(frozen=True)
class Calibration:
    """A prompt, the target's greedy continuation, and the target's features at every position
    of both (``output``: rows for prompt + continuation; its logits are not kept, n×0)."""

    prompt: list[int]
    continuation: list[int]
    output: TargetOutput


@torch.no_grad()
def greedy_continuations(runner: TargetRunner, prompts: Sequence[Tensor], new_tokens: int) -> list[list[int]]:
    """The target's greedy continuation of each prompt (``new_tokens`` tokens; EOS is no stop)."""
    return [plain_generate(runner, prompt, new_tokens, GREEDY, ()).tokens for prompt in prompts]


@torch.no_grad()
def calibrate(
    runner: TargetRunner, prompts: Sequence[Tensor], continuations: Sequence[list[int]]
) -> list[Calibration]:
    """The target's features along prompt + continuation (one prefill each) on ``runner``,
    whose aux layers are the ones its drafters read."""
    calibrations = []
    for prompt, continuation in zip(prompts, continuations, strict=True):
        tokens = torch.cat([prompt, torch.tensor(continuation, dtype=torch.long)])
        runner.reserve(len(tokens))
        output = runner.prefill(tokens)
        output = TargetOutput(output.logits[:, :0], output.hidden, output.aux)  # logits: not needed
        calibrations.append(Calibration(prompt.tolist(), list(continuation), output))
    return calibrations


def accepted_along(draft: Draft, continuation: Sequence[int]) -> int:
    """Drafts greedy verification accepts when the target's next tokens are ``continuation``:
    the depth of the deepest tree path that spells its beginning."""
    tokens, parents = draft.tokens.tolist(), draft.tree.parents.tolist()
    children: dict[int, dict[int, int]] = {}
    for node, parent in enumerate(parents):
        if parent >= 0:
            children.setdefault(parent, {}).setdefault(tokens[node], node)
    node, accepted = 0, 0
    for token in continuation:
        node = children.get(node, {}).get(token, -1)
        if node < 0:
            break
        accepted += 1
    return accepted


@dataclass
class Simulation:
    """A shape's drafter over every calibration position: accepted drafts, verified nodes, and
    the seconds of each draft and each one-token commit."""

    accepted: list[int] = field(default_factory=list)
    nodes: list[int] = field(default_factory=list)
    draft_s: list[float] = field(default_factory=list)
    commit_s: list[float] = field(default_factory=list)


@torch.no_grad()
def simulate(
    drafter: Drafter, calibrations: Sequence[Calibration], device: torch.device, on_device: bool = False
) -> Simulation:
    """Run ``drafter`` as greedy decoding would at every position of every calibration
    continuation, committing one target token at a time. ``on_device``: as greedy rounds on the
    device (decoding on a static runner, :mod:`specdraft.eval.decode`): one call commits the
    last token and drafts the next tree, timed as drafting."""
    result = Simulation()
    for calibration in calibrations:
        prompt, continuation, output = calibration.prompt, calibration.continuation, calibration.output
        drafter.reset()
        drafter.commit(prompt, output.rows(list(range(len(prompt)))), continuation[0])
        for t in range(len(continuation) - 1):
            if on_device and t > 0:  # the round after committing continuation[t − 1], none accepted
                row, padding = len(prompt) + t - 1, drafter.max_depth + 1
                found = torch.tensor([0, 0, *[continuation[t]] * padding], device=output.hidden.device)
                rows = [
                    x[row : row + 1].expand(padding, -1) for x in (output.hidden, output.aux) if x is not None
                ]
                past = torch.tensor(row, device=found.device)
            begin = device_clock(device)
            if not on_device:
                draft = drafter.draft(continuation[t], GREEDY)
            elif t == 0:
                tokens, ancestors = drafter.first_round(len(prompt) + len(continuation))
            else:
                tokens, ancestors = drafter.next_round(past, found, *rows)
            drafted = device_clock(device)
            if on_device:
                draft = Draft(tokens, tree_from_ancestors(ancestors))
            result.accepted.append(accepted_along(draft, continuation[t + 1 :]))
            result.nodes.append(draft.tree.num_nodes)
            result.draft_s.append(drafted - begin)
            if on_device:  # committed by the next round
                result.commit_s.append(0.0)
                continue
            row = len(prompt) + t
            begin = device_clock(device)
            drafter.commit([continuation[t]], output.rows([row]), continuation[t + 1])
            result.commit_s.append(device_clock(device) - begin)
    return result


# -- the choice ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prediction:
    """One candidate's expected step: tokens per step, seconds, tokens per second."""

    shape: Mapping[str, Any]  # the shape's config, or {"kind": "plain"}
    tokens_per_step: float
    nodes: float
    draft_s: float
    verify_s: float
    commit_s: float
    measured_tokens_per_s: float | None = None  # finalists: the real decode loop, calibration prompts

    @property
    def step_s(self) -> float:
        return self.draft_s + self.verify_s + self.commit_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    def record(self) -> dict[str, Any]:
        return {
            "shape": dict(self.shape),
            "tokens_per_step": self.tokens_per_step,
            "nodes": self.nodes,
            "draft_ms": 1e3 * self.draft_s,
            "verify_ms": 1e3 * self.verify_s,
            "commit_ms": 1e3 * self.commit_s,
            "predicted_tokens_per_s": self.tokens_per_s,
            "measured_tokens_per_s": self.measured_tokens_per_s,
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Prediction:
        return cls(
            record["shape"],
            record["tokens_per_step"],
            record["nodes"],
            record["draft_ms"] / 1e3,
            record["verify_ms"] / 1e3,
            record["commit_ms"] / 1e3,
            record.get("measured_tokens_per_s"),
        )


def predict(shape: Mapping[str, Any], simulation: Simulation, latency: VerifyLatency) -> Prediction:
    nodes = statistics.fmean(simulation.nodes)
    return Prediction(
        shape,
        1 + statistics.fmean(simulation.accepted),
        nodes,
        statistics.median(simulation.draft_s),
        latency.at(nodes),
        statistics.median(simulation.commit_s),
    )


@dataclass(frozen=True)
class ShapeChoice:
    """The chosen shape's config ({"kind": "plain"}: no speculation) and every prediction."""

    shape: Mapping[str, Any]
    predictions: Sequence[Prediction]
    latency: VerifyLatency

    @property
    def chosen(self) -> Prediction:
        return next(p for p in self.predictions if p.shape == self.shape)

    def record(self) -> dict[str, Any]:
        return {
            "chosen": dict(self.shape),
            "predicted_tokens_per_s": self.chosen.tokens_per_s,
            "measured_tokens_per_s": self.chosen.measured_tokens_per_s,
            "predictions": [p.record() for p in self.predictions],
            "latency": self.latency.record(),
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> ShapeChoice:
        predictions = [Prediction.from_record(p) for p in record["predictions"]]
        return cls(record["chosen"], predictions, VerifyLatency.from_record(record["latency"]))


@torch.no_grad()
def measure_decoding(
    runner: TargetRunner,
    drafters: Sequence[Drafter | None],
    calibrations: Sequence[Calibration],
) -> list[float]:
    """Tokens/s of greedy decoding with each drafter (None: plain decoding) over the calibration
    prompts, as many tokens as their continuations, interleaved per prompt so that machine load
    hits all alike. Prefills are left out: they are the same for all. Each decodes the first
    prompt once untimed first: one-time costs (CUDA graph captures) are no part of a speed."""
    tokens, seconds = [0] * len(drafters), [0.0] * len(drafters)
    first = calibrations[0]
    for drafter in drafters:
        prompt, new_tokens = torch.tensor(first.prompt), len(first.continuation)
        if drafter is None:
            plain_generate(runner, prompt, new_tokens, GREEDY, ())
        else:
            speculative_generate(runner, drafter, prompt, new_tokens, GREEDY, ())
    for calibration in calibrations:
        prompt, new_tokens = torch.tensor(calibration.prompt), len(calibration.continuation)
        for i, drafter in enumerate(drafters):
            if drafter is None:
                generation = plain_generate(runner, prompt, new_tokens, GREEDY, ())
            else:
                generation = speculative_generate(runner, drafter, prompt, new_tokens, GREEDY, ())
            tokens[i] += len(generation.tokens) - 1  # the first comes from the prefill
            seconds[i] += generation.total_s - generation.prefill_s
    return [count / spent for count, spent in zip(tokens, seconds, strict=True)]


def choose_shape(
    make_drafter: Callable[[TreeShape], Drafter],
    tree_shape: Callable[[Mapping[str, Any]], TreeShape],
    candidates: Sequence[Mapping[str, Any]],
    calibrations: Sequence[Calibration],
    latency: VerifyLatency,
    runner: TargetRunner,
    finalists: int,
    min_gain: float = 0.0,
    progress: bool = True,
) -> ShapeChoice:
    """Simulate every candidate shape (configs ``{kind: chain|static|dynamic, …}``) with the
    drafter ``make_drafter`` builds and predict its tokens/s, plain decoding included; then run
    the ``finalists`` best predictions and plain decoding for real on the calibration prompts
    (:func:`measure_decoding`) and choose the fastest measured — the prediction ranks, the
    measurement decides (0 finalists: the best prediction). The fastest shape is chosen only if
    it beats plain decoding by more than ``min_gain`` (0.05 = 5 %): a smaller lead is within the
    noise of a short measurement, and plain decoding is the side that cannot lose. A shape the
    drafter refuses (a Medusa head has no dynamic trees) is skipped; the shapes the drafter
    itself proposes (:meth:`~specdraft.eval.drafters.Drafter.candidate_shapes`: a block
    drafter's deep chains) are tried after the configured ones."""
    plain = Prediction({"kind": PLAIN}, 1.0, 1.0, 0.0, latency.plain_s, 0.0)
    predictions, drafters = [plain], {}
    pending = [dict(config) for config in candidates]
    progress_bar = tqdm(total=len(pending), desc="shape: auto", unit="shape", disable=not progress)
    for config in pending:  # grows by the drafter's own candidates
        progress_bar.update()
        try:
            drafter = make_drafter(tree_shape(config))
        except ValueError as error:
            log.info("shape: auto skips %s (%s)", config, error)
            continue
        proposed = [shape for shape in drafter.candidate_shapes() if shape not in pending]
        pending.extend(proposed)
        progress_bar.total += len(proposed)
        on_device = runner.static and drafter.rounds_on_device(GREEDY)
        prediction = predict(config, simulate(drafter, calibrations, runner.device, on_device), latency)
        predictions.append(prediction)
        drafters[id(prediction)] = drafter
    progress_bar.close()
    speed = lambda p: p.tokens_per_s  # noqa: E731
    if finalists > 0:
        ranked = sorted(predictions[1:], key=lambda p: p.tokens_per_s, reverse=True)[:finalists]
        measured = dict(
            zip(
                [id(p) for p in (plain, *ranked)],
                measure_decoding(runner, [None, *(drafters[id(p)] for p in ranked)], calibrations),
                strict=True,
            )
        )
        predictions = [replace(p, measured_tokens_per_s=measured.get(id(p))) for p in predictions]
        speed = lambda p: p.measured_tokens_per_s or 0.0  # noqa: E731
    best = max(predictions[1:], key=speed, default=predictions[0])
    if speed(best) <= (1 + min_gain) * speed(predictions[0]):
        best = predictions[0]  # plain decoding
    for p in predictions:
        log.info(
            "shape %s: %.2f tokens/step, %.1f nodes, draft %.1f + verify %.1f + commit %.1f ms"
            " → %.1f tok/s predicted%s%s",
            dict(p.shape),
            p.tokens_per_step,
            p.nodes,
            1e3 * p.draft_s,
            1e3 * p.verify_s,
            1e3 * p.commit_s,
            p.tokens_per_s,
            "" if p.measured_tokens_per_s is None else f", {p.measured_tokens_per_s:.1f} measured",
            "  ← chosen" if p.shape == best.shape else "",
        )
    return ShapeChoice(best.shape, predictions, latency)
