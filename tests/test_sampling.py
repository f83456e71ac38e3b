"""Sampling.probs (eval/sampling.py) against the independent reference of tests/conftest.py: the
T>0 invariant tests compute their expected distributions with that reference, so a bug inside
the filters the decoder shares with plain decoding cannot hide in both sides of a test."""

from __future__ import annotations

import pytest
import torch
from conftest import reference_probs

from specdraft.eval.sampling import Sampling

VOCAB = 50
SETTINGS = [
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.3, 5, 1.0),
    (1.0, 0, 0.9),
    (1.0, 0, 0.5),
    (0.8, 10, 0.6),
    (1.0, 1, 1.0),
]


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_probs_equal_the_reference(temperature, top_k, top_p):
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = 3 * torch.randn(VOCAB, generator=generator)
        got = Sampling(temperature, top_p, top_k).probs(logits).double()
        expected = torch.tensor(reference_probs(logits, temperature, top_k, top_p), dtype=torch.float64)
        assert torch.equal(got > 0, expected > 0), (temperature, top_k, top_p)
        assert torch.allclose(got, expected, atol=1e-6), (temperature, top_k, top_p)


def test_top_p_keeps_the_token_that_crosses_it():
    """Masses 0.5, 0.3, 0.2 at top_p 0.6: the second token crosses 0.6 and is kept; at top_p 0.4
    the first alone reaches it and is all that is left (never nothing: no NaN)."""
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    crossing = Sampling(1.0, top_p=0.6).probs(logits)
    assert torch.allclose(crossing, torch.tensor([0.625, 0.375, 0.0]))
    alone = Sampling(1.0, top_p=0.4).probs(logits)
    assert torch.equal(alone, torch.tensor([1.0, 0.0, 0.0]))
