"""Benchmark metrics from per-turn records, and their plots.

A record is one method's answer to one turn: ``{"method", "question_id", "category", "turn",
"temperature", "tokens", "total_s", "prefill_s", "stop", "steps": [[nodes, depth, accepted,
draft_s, verify_s, bookkeeping_s], …]}`` (HF baselines have no steps).

Metrics (docs/architecture.md §3): τ = output tokens after the first ÷ target forwards after the prefill;
α_d = P(depth d accepted | depth d−1 accepted and the tree reached depth d); tokens/s over the
whole wall time (prefill included); speedup = tokens/s ÷ plain decoding's on the same turns.
The estimate τ·t_target(1) / (t_draft + t_verify(n) + t_bookkeeping) is the speedup the
measured step times predict; ``overhead_share`` = (t_draft + t_bookkeeping) / t_verify(n).
:func:`paired_bootstrap` puts a confidence interval on one method's τ and tokens/s against another's.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

NODES, DEPTH, ACCEPTED, DRAFT_S, VERIFY_S, BOOKKEEPING_S = range(6)
MIN_PLOTTED_ATTEMPTS = 30  # a depth tried fewer times is left off the plot (its rate is noise)
BOOTSTRAP_SAMPLES = 4000  # resamples of the prompts: the 2.5 % quantile then rests on 100 of them
CONFIDENCE = 0.95


def depth_attempts(steps: Sequence[Sequence[float]]) -> list[int]:
    """For d = 1..max depth: the steps whose tree reached depth d with depth d−1 accepted."""
    max_depth = max((int(s[DEPTH]) for s in steps), default=0)
    return [sum(s[DEPTH] >= d and s[ACCEPTED] >= d - 1 for s in steps) for d in range(1, max_depth + 1)]


def acceptance_per_depth(steps: Sequence[Sequence[float]]) -> list[float | None]:
    """α_d for d = 1..max depth (None where no step reached depth d)."""
    rates: list[float | None] = []
    for d, attempts in enumerate(depth_attempts(steps), start=1):
        accepted = sum(s[ACCEPTED] >= d for s in steps)
        rates.append(accepted / attempts if attempts else None)
    return rates


def _mean_ms(steps: Sequence[Sequence[float]], column: int) -> float | None:
    return 1000 * statistics.fmean(s[column] for s in steps) if steps else None


def metrics(records: Sequence[dict[str, Any]], plain: Sequence[dict[str, Any]] | None) -> dict[str, Any]:
    """Metrics of one method over ``records``; ``plain`` = plain decoding on the same turns."""
    tokens = sum(len(r["tokens"]) for r in records)
    seconds = sum(r["total_s"] for r in records)
    steps = [s for r in records for s in r.get("steps") or []]
    has_steps = any(r.get("steps") is not None for r in records)
    forwards = len(steps)
    result: dict[str, Any] = {
        "turns": len(records),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": tokens / seconds if seconds else None,
    }
    if has_steps:
        committed = sum(len(r["tokens"]) - 1 for r in records if r.get("steps") is not None)
        result.update(
            target_forwards=forwards,
            tau=committed / forwards if forwards else None,
            acceptance_per_depth=acceptance_per_depth(steps),
            depth_attempts=depth_attempts(steps),
            mean_nodes=statistics.fmean(s[NODES] for s in steps) if steps else None,
            draft_ms=_mean_ms(steps, DRAFT_S),
            verify_ms=_mean_ms(steps, VERIFY_S),
            bookkeeping_ms=_mean_ms(steps, BOOKKEEPING_S),
        )
    if plain is not None:
        plain_tokens = sum(len(r["tokens"]) for r in plain)
        plain_seconds = sum(r["total_s"] for r in plain)
        if seconds and plain_seconds and plain_tokens:
            result["speedup"] = (tokens / seconds) / (plain_tokens / plain_seconds)
        plain_steps = [s for r in plain for s in r.get("steps") or []]
        if has_steps and plain_steps and steps and result.get("verify_ms"):
            target_step_ms = _mean_ms(plain_steps, VERIFY_S)
            overhead_ms = result["draft_ms"] + result["bookkeeping_ms"]
            result["plain_step_ms"] = target_step_ms
            result["overhead_share"] = overhead_ms / result["verify_ms"]
            result["speedup_estimate"] = result["tau"] * target_step_ms / (overhead_ms + result["verify_ms"])
    return result


def paired_bootstrap(
    records: Iterable[dict[str, Any]],
    method: str,
    reference: str,
    samples: int = BOOTSTRAP_SAMPLES,
    seed: int = 0,
    confidence: float = CONFIDENCE,
) -> dict[str, Any]:
    """τ and tokens/s of ``method`` against ``reference`` on the prompts both answered (records of
    ONE temperature), with percentile-bootstrap intervals paired by prompt.

    Each resample draws prompts (question ids, all their turns) with replacement and recomputes
    both methods' τ over them as τ itself is computed (tokens after the first ÷ target forwards,
    summed), and their tokens/s likewise (tokens ÷ wall seconds, summed), so a long answer weighs
    as much as in τ, and a prompt that is easy for both methods moves both alike. Returns
    ``{"prompts", "tau", "tau_reference", "difference", "ratio", "speed_ratio"}``, the last three
    ``{"estimate", "low", "high"}`` (τ − τ_ref, τ / τ_ref, and tokens/s ÷ the reference's: None
    when a record has no wall time)."""
    # question id -> [committed, forwards, tokens, seconds] of method, then of reference
    totals: dict[str, list[float]] = {}
    timed = True
    for record in records:
        if record["method"] not in (method, reference) or record.get("steps") is None:
            continue
        entry = totals.setdefault(record["question_id"], [0.0] * 8)
        offset = 0 if record["method"] == method else 4
        entry[offset] += len(record["tokens"]) - 1
        entry[offset + 1] += len(record["steps"])
        entry[offset + 2] += len(record["tokens"])
        timed = timed and "total_s" in record
        entry[offset + 3] += record.get("total_s", 0.0)
    paired = [entry for entry in totals.values() if entry[1] and entry[5]]
    if not paired:
        raise ValueError(f"no prompt answered by both {method!r} and {reference!r} with a step record")
    counts = torch.tensor(paired, dtype=torch.float64)  # N×8
    generator = torch.Generator().manual_seed(seed)
    drawn = counts[torch.randint(len(paired), (samples, len(paired)), generator=generator)].sum(dim=1)
    whole = counts.sum(dim=0)
    tau, tau_reference = whole[0] / whole[1], whole[4] / whole[5]
    resampled_tau, resampled_reference = drawn[:, 0] / drawn[:, 1], drawn[:, 4] / drawn[:, 5]
    speed_ratio = None
    if timed and bool(whole[3] > 0) and bool(whole[7] > 0):
        speed = (whole[2] / whole[3]) / (whole[6] / whole[7])
        resampled_speed = (drawn[:, 2] / drawn[:, 3]) / (drawn[:, 6] / drawn[:, 7])
        speed_ratio = percentile_interval(speed, resampled_speed, confidence)
    return {
        "prompts": len(paired),
        "tau": float(tau),
        "tau_reference": float(tau_reference),
        "difference": percentile_interval(
            tau - tau_reference, resampled_tau - resampled_reference, confidence
        ),
        "ratio": percentile_interval(tau / tau_reference, resampled_tau / resampled_reference, confidence),
        "speed_ratio": speed_ratio,
    }


def percentile_interval(
    estimate: torch.Tensor | float, resampled: torch.Tensor, confidence: float = CONFIDENCE
) -> dict[str, float]:
    """``{"estimate", "low", "high"}``: the estimate on the whole sample and the central
    ``confidence`` percentile interval of its bootstrap resamples (``resampled``: R values)."""
    tail = (1 - confidence) / 2
    quantiles = torch.tensor([tail, 1 - tail], dtype=resampled.dtype)
    low, high = torch.quantile(resampled, quantiles).tolist()
    return {"estimate": float(estimate), "low": low, "high": high}


def lossless_check(records: Sequence[dict[str, Any]], plain: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Greedy outputs against plain decoding's, turn by turn: exact matches and the matching prefix.

    Later turns condition on the method's own earlier answers, so ``first_turns`` is the clean
    comparison. In bf16, a tree forward rounds differently from single-token forwards, so
    near-ties can part ways (docs/architecture.md §6): that is reported, not assumed away."""
    by_turn = {(r["question_id"], r["turn"]): r["tokens"] for r in plain}
    prefixes, exact, first_exact, first_total = [], 0, 0, 0
    for record in records:
        reference = by_turn.get((record["question_id"], record["turn"]))
        if reference is None:
            continue
        ours = record["tokens"]
        prefix = next((i for i, (a, b) in enumerate(zip(ours, reference, strict=False)) if a != b), None)
        if prefix is None:
            prefix = min(len(ours), len(reference))
        same = ours == reference
        prefixes.append(prefix / max(len(reference), 1))
        exact += same
        if record["turn"] == 0:
            first_total += 1
            first_exact += same
    return {
        "turns_compared": len(prefixes),
        "exact_turns": exact,
        "first_turns_exact": f"{first_exact}/{first_total}",
        "mean_matching_prefix_fraction": statistics.fmean(prefixes) if prefixes else None,
    }


def summarize(records: Iterable[dict[str, Any]], plain_method: str = "plain") -> dict[str, Any]:
    """{temperature: {method: {overall, per_category, lossless (T=0)}}}."""
    grouped: dict[float, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for record in records:
        grouped[record["temperature"]][record["method"]].append(record)
    report: dict[str, Any] = {}
    for temperature, methods in sorted(grouped.items()):
        plain = methods.get(plain_method)
        section: dict[str, Any] = {}
        for method, rows in methods.items():
            categories = sorted({r["category"] for r in rows})
            entry: dict[str, Any] = {"overall": metrics(rows, plain)}
            entry["per_category"] = {
                c: metrics(
                    [r for r in rows if r["category"] == c],
                    [r for r in plain if r["category"] == c] if plain else None,
                )
                for c in categories
            }
            if temperature == 0 and plain is not None and method != plain_method:
                entry["lossless"] = lossless_check(rows, plain)
            section[method] = entry
        report[f"T={temperature:g}"] = section
    return report


def summarize_batches(records: Iterable[dict[str, Any]], plain_method: str = "plain") -> dict[str, Any]:
    """The batch benchmark's records (one per row, with ``batch_size``, ``batch`` and the batch's
    ``wall_s``) -> ``{temperature: {"sizes": {B: {method: metrics}}, "crossover": …}}``.

    Per batch size and method: throughput = tokens of every row ÷ the batches' wall time (tokens/s
    over all rows), its ratio to plain decoding's at the same size, the median per-row latency
    (ms per token from its batch's start to its own end), τ, and at T=0 how many rows equal plain
    decoding's. ``crossover``: per method, the smallest batch size at which it is no faster
    than plain decoding (None: faster at every size measured)."""
    grouped: dict[float, dict[int, dict[str, list[dict[str, Any]]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    for record in records:
        grouped[record["temperature"]][record["batch_size"]][record["method"]].append(record)
    report: dict[str, Any] = {}
    for temperature, sizes in sorted(grouped.items()):
        section: dict[int, dict[str, Any]] = {}
        for size, methods in sorted(sizes.items()):
            plain = methods.get(plain_method)
            entries = {}
            for method, rows in methods.items():
                walls = {r["batch"]: r["wall_s"] for r in rows}
                tokens = sum(len(r["tokens"]) for r in rows)
                entry = {
                    "rows": len(rows),
                    "tokens": tokens,
                    "wall_s": round(sum(walls.values()), 3),
                    "tokens_per_s": tokens / sum(walls.values()),
                    "row_ms_per_token": statistics.median(
                        1000 * r["total_s"] / len(r["tokens"]) for r in rows
                    ),
                    "tau": metrics(rows, None).get("tau"),
                }
                if temperature == 0 and plain is not None and method != plain_method:
                    expected = {r["question_id"]: r["tokens"] for r in plain}
                    same = sum(r["tokens"] == expected.get(r["question_id"]) for r in rows)
                    entry["identical_to_plain"] = f"{same}/{len(rows)}"
                entries[method] = entry
            if plain is not None:
                plain_rate = entries[plain_method]["tokens_per_s"]
                for entry in entries.values():
                    entry["speedup"] = entry["tokens_per_s"] / plain_rate
            section[size] = entries
        names = list(dict.fromkeys(m for entries in section.values() for m in entries if m != plain_method))
        crossover = {
            name: next(
                (
                    size
                    for size, entries in section.items()
                    if name in entries and entries[name].get("speedup", 0) <= 1
                ),
                None,
            )
            for name in names
        }
        report[f"T={temperature:g}"] = {"sizes": section, "crossover": crossover}
    return report


def plot(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """acceptance_per_depth.png and speedup.png from :func:`summarize`'s output."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for temperature, methods in report.items():
        for method, entry in methods.items():
            overall = entry["overall"]
            rates = overall.get("acceptance_per_depth") or []
            attempts = overall.get("depth_attempts") or []
            points = [
                (d, rate)
                for d, (rate, tried) in enumerate(zip(rates, attempts, strict=True), start=1)
                if rate is not None and tried >= MIN_PLOTTED_ATTEMPTS
            ]
            if points:
                axes.plot(*zip(*points, strict=True), marker="o", label=f"{method} ({temperature})")
    axes.set(xlabel="draft depth d", ylabel="acceptance rate α_d", ylim=(0, 1))
    axes.set_title(f"Acceptance per depth (depths tried ≥ {MIN_PLOTTED_ATTEMPTS} times)")
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.legend(fontsize=7)
    figure.tight_layout()
    written.append(out_dir / "acceptance_per_depth.png")
    figure.savefig(written[-1], dpi=120)
    plt.close(figure)

    figure, axes = plt.subplots(figsize=(8, 4.5))
    temperatures = list(report)
    methods = list(dict.fromkeys(m for section in report.values() for m in section))  # config order
    width = 0.8 / max(len(temperatures), 1)
    for i, temperature in enumerate(temperatures):
        values = [report[temperature].get(m, {}).get("overall", {}).get("speedup") or 0 for m in methods]
        axes.bar([x + i * width for x in range(len(methods))], values, width, label=temperature)
    axes.axhline(1.0, color="gray", linewidth=0.8)
    axes.set_xticks(
        [x + width * (len(temperatures) - 1) / 2 for x in range(len(methods))],
        methods,
        rotation=30,
        ha="right",
    )
    axes.set(ylabel="speedup vs plain decoding", title="Speedup (tokens/s ratio, same run)")
    axes.legend()
    figure.tight_layout()
    written.append(out_dir / "speedup.png")
    figure.savefig(written[-1], dpi=120)
    plt.close(figure)
    return written
