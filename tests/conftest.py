"""Shared fixtures. The default tier runs on the tiny in-memory target and never downloads."""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from specdraft.data.target import Target
from specdraft.data.tiny import tiny_random_target
from specdraft.train.objective import simulated_tau


@pytest.fixture(scope="session")
def tiny_target() -> Target:
    return tiny_random_target(seed=0)


# The default tiny target's greedy output repeats one token after a few steps, which would repeat
# under a misplaced key, position or mask too: decoding invariants run on this wider init, whose
# greedy output does not repeat (docs/architecture.md §6).
DIVERSE_INIT = 0.2


@pytest.fixture(scope="session")
def diverse_target() -> Target:
    return tiny_random_target(seed=0, initializer_range=DIVERSE_INIT)


def requires_package(name: str) -> pytest.MarkDecorator:
    """Skip unless the (--no-deps) asset package ``name`` is installed (`make install-assets`)."""
    return pytest.mark.skipif(importlib.util.find_spec(name) is None, reason=f"{name} is not installed")


# -- an independent reference for the sampling filters ---------------------------------------------
def reference_probs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> list[float]:
    """The distribution plain sampling draws from, written out one token at a time in float64 so
    that the T>0 tests do not compute their expectation with the code they test
    (eval/sampling.py): softmax(logits / temperature) over the top_k most likely tokens (0: all),
    then the smallest most-likely-first set whose mass reaches top_p — the token that crosses
    top_p included — renormalised."""
    values = [float(v) / temperature for v in logits.double().tolist()]
    ranked = sorted(range(len(values)), key=lambda token: -values[token])
    kept = ranked[:top_k] if 0 < top_k < len(values) else ranked
    kept = [
        t for t in ranked if values[t] >= values[kept[-1]]
    ]  # ties with the k-th stay, as torch keeps them
    peak = max(values[t] for t in kept)
    weight = {t: math.exp(values[t] - peak) for t in kept}
    total = sum(weight.values())
    nucleus, mass = [], 0.0
    for token in kept:
        if mass >= top_p:
            break
        nucleus.append(token)
        mass += weight[token] / total
    total = sum(weight[t] for t in nucleus)
    return [weight[t] / total if t in nucleus else 0.0 for t in range(len(values))]


# -- the statistics of the T>0 tests ---------------------------------------------------------------
FAMILY_ALPHA = 0.001  # chance that a correct sampler fails one whole prefix_chi_squares family


def chi_square_critical(df: int, alpha: float) -> float:
    """The (1 − alpha) quantile of chi-square with ``df`` degrees of freedom, by Wilson–Hilferty
    (within ~1 % from df = 3 on; above the exact value at df = 1, which only makes it stricter
    on a wrong rule's side)."""
    z = float(torch.special.ndtri(torch.tensor(1 - alpha, dtype=torch.float64)))
    h = 2 / (9 * df)
    return df * (1 - h + z * h**0.5) ** 3


def prefix_chi_squares(
    counts: Mapping[tuple[int, ...], int], expected: Mapping[tuple[int, ...], float]
) -> list[tuple[float, float]]:
    """(chi-square, critical value) for each prefix length 1..L of emitted L-token blocks.

    ``counts``: how often each block was emitted; ``expected``: the target's probability of every
    block it can emit (summing to 1). Scoring every prefix, not only the whole block, keeps the
    power where a bias lives: an over-accepting rule shifts the FIRST tokens (a 5 % over-acceptance
    hides among the many cells of whole blocks), a bonus drawn from the wrong row shifts only the
    LAST. Each prefix is tested at FAMILY_ALPHA / L (Bonferroni)."""
    unexpected = set(counts) - set(expected)
    assert not unexpected, f"blocks the target cannot emit: {sorted(unexpected)[:5]}"
    trials, length = sum(counts.values()), len(next(iter(expected)))
    results = []
    for n in range(1, length + 1):
        observed: dict[tuple[int, ...], int] = {}
        probability: dict[tuple[int, ...], float] = {}
        for block, p in expected.items():
            probability[block[:n]] = probability.get(block[:n], 0.0) + p
        for block, count in counts.items():
            observed[block[:n]] = observed.get(block[:n], 0) + count
        cells = {cell: p for cell, p in probability.items() if p > 0}
        if len(cells) < 2:  # one possible prefix: nothing to test
            continue
        statistic = sum((observed.get(cell, 0) - trials * p) ** 2 / (trials * p) for cell, p in cells.items())
        results.append((statistic, chi_square_critical(len(cells) - 1, FAMILY_ALPHA / length)))
    return results


def rejects(counts: Mapping[tuple[int, ...], int], expected: Mapping[tuple[int, ...], float]) -> bool:
    """Whether some prefix of the emitted blocks departs from the target's distribution."""
    return any(statistic > critical for statistic, critical in prefix_chi_squares(counts, expected))


# -- training configs ------------------------------------------------------------------------------
def compose_train(run_dir: Path, *overrides: str):
    """The real train config, composed as the CLI would, with its output dir set to ``run_dir``.
    fp32 unless a test asks otherwise: what these tests check must not depend on the CPU's flags
    (``precision: auto`` is checked through the CLI in test_cli_smoke)."""
    with initialize_config_module("specdraft.conf", version_base="1.3"):
        cfg = compose(
            "train",
            overrides=["trainer.precision=32-true", *overrides, f"paths.output_dir={run_dir}"],
            return_hydra_config=True,
        )
    HydraConfig.instance().set_config(cfg)  # for ${hydra:runtime.choices.*}
    with open_dict(cfg):
        del cfg.hydra
    return cfg


def assert_validated(summary: Mapping) -> None:
    """A training run's summary reports a simulated τ that its own validation accuracies make:
    ``val/sim_tau`` = 1 + Σ_k Π_{i≤k} acc_i, each acc a share, and the best checkpoint's τ at
    least the last validation's. (τ ≥ 1 alone holds by definition and catches nothing.)"""
    last = summary["last_val"]
    steps = sorted(int(name.rsplit("_", 1)[1]) for name in last if name.startswith("val/acc_"))
    assert steps == list(range(1, len(steps) + 1)) and steps, sorted(last)
    accuracy = [last[f"val/acc_{j}"] for j in steps]
    assert all(0.0 <= acc <= 1.0 for acc in accuracy), accuracy
    assert last["val/sim_tau"] == pytest.approx(simulated_tau(accuracy), rel=1e-6)
    assert summary["best_sim_tau"] >= last["val/sim_tau"] - 1e-6


def assert_tau_matches_acceptance(overall: Mapping, turns: int, max_depth: int) -> None:
    """τ, counted from the tokens a method emitted, agrees with the acceptance its verify steps
    recorded: each of the F target forwards commits its accepted drafts + 1 token, so the
    committed tokens τ·F are F + Σ_d α_d·attempts_d, less what a turn's last step cut at
    max_new_tokens or EOS (at most max_depth a turn)."""
    forwards = overall["target_forwards"]
    accepted = sum(
        rate * attempts
        for rate, attempts in zip(overall["acceptance_per_depth"], overall["depth_attempts"], strict=True)
        if rate is not None
    )
    assert len(overall["acceptance_per_depth"]) <= max_depth
    committed = overall["tau"] * forwards
    assert committed <= forwards + accepted + 1e-6
    assert forwards + accepted <= committed + turns * max_depth + 1e-6


def chain_paths(depth: int) -> list[tuple[int, ...]]:
    """The tree paths (eval/trees.py) of a chain of ``depth`` top-1 drafts."""
    return [(0,) * d for d in range(1, depth + 1)]
