"""Golden values of the whole training objective: the loss, its terms, the accuracies and the
gradient of every trained parameter, per experiment, on one fixed batch of the tiny target.

``tests/golden/objective.safetensors`` was written by the objective of commit 0ebd256 (before the
training-speed work of issue 20) with ``python tests/test_objective_golden.py``; a faster
objective must reproduce it. Regenerate it only for an intended change of what is trained, and
say so in the commit. Everything runs in float64 and is stored in float32, so the tolerance only
absorbs rounding and summation order.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdraft.data.features import TokenBatch, extract_features
from specdraft.data.target import target_weights
from specdraft.data.tiny import tiny_random_target
from specdraft.heads import Eagle3Config, Eagle3Head, EagleConfig, EagleHead, MedusaConfig, MedusaHead
from specdraft.train.losses import LossWeights
from specdraft.train.objective import DraftObjective, RolloutConfig

GOLDEN = Path(__file__).parent / "golden" / "objective.safetensors"
TOP_K = 4
EVAL_STEPS = 4
REDUCED_VOCAB = 40  # of the tiny target's vocabulary: some supervised argmaxes fall outside it

# The loss settings of conf/loss/*.yaml (with K = TOP_K), frozen here: these are inputs of the golden file.
K = TOP_K
EXPERIMENTS = {
    "eagle": ("eagle", LossWeights(feature=1.0, soft_ce=0.1), RolloutConfig(1, 1.0, True)),
    "hass": ("eagle", LossWeights(feature=1.0, soft_ce=0.1, topk=1.0, topk_k=K), RolloutConfig(3, 0.5, True)),
    "eagle3": ("eagle3", LossWeights(soft_ce=1.0), RolloutConfig(3, 0.8, False)),
    "hass_eagle3": ("eagle3", LossWeights(soft_ce=1.0, topk=1.0, topk_k=K), RolloutConfig(3, 0.5, True)),
    "medusa": ("medusa", LossWeights(ce=1.0), RolloutConfig(1, 0.8, True)),
    "medusa_own_topk": ("medusa_own", LossWeights(ce=1.0, topk=0.5, topk_k=K), RolloutConfig(1, 0.8, True)),
    "eagle_forward_kl": (
        "eagle",
        LossWeights(feature=0.5, forward_kl=1.0, ce=0.3),
        RolloutConfig(2, 1.0, True),
    ),
}


def golden_batch():
    """Three rows of 20 tokens, one right-padded, the first 5 positions outside the loss mask;
    features, aux layers and the target's top-K of the tiny target in float64."""
    target = tiny_random_target(seed=0, dtype="float64")
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(3, target.spec.vocab_size, (3, 20), generator=generator)
    attention = torch.ones_like(input_ids)
    attention[2, 14:] = 0
    loss_mask = attention.clone()
    loss_mask[:, :5] = 0
    batch = extract_features(
        target, TokenBatch(input_ids, attention, loss_mask), target.spec.aux_layer_ids, top_k=TOP_K
    )
    # EAGLE's training noise, fixed: the head reads noisy features and regresses the clean ones.
    noise = torch.rand(batch.hidden.shape, generator=generator, dtype=torch.float64) - 0.5
    batch.input_hidden = batch.hidden + 0.1 * noise * batch.attention_mask.unsqueeze(-1)
    return target, batch


def build_head(kind: str, target):
    torch.manual_seed(11)
    spec, weights = target.spec, target_weights(target)
    if kind == "medusa":
        head = MedusaHead(spec, weights, MedusaConfig(num_heads=3, num_layers=1, own_lm_head=False))
    elif kind == "medusa_own":
        head = MedusaHead(spec, weights, MedusaConfig(num_heads=2, num_layers=1, own_lm_head=True))
    elif kind == "eagle":
        head = EagleHead(spec, weights, EagleConfig(fc_bias=False))
    else:
        counts = torch.arange(spec.vocab_size, 0, -1).double()
        head = Eagle3Head(spec, weights, Eagle3Config(draft_vocab_size=REDUCED_VOCAB))
        head.choose_vocabulary(lambda: counts)
    for parameter in head.parameters():  # away from the zero init of Medusa's blocks
        parameter.data.add_(0.05 * torch.randn_like(parameter))
    return head.double()


def objective_results(name: str, target, batch) -> dict[str, torch.Tensor]:
    kind, weights, rollout = EXPERIMENTS[name]
    head = build_head(kind, target)
    objective = DraftObjective(weights, rollout, eval_steps=EVAL_STEPS, chunk_size=128)
    trained = objective(head, batch, train=True)
    trained.loss.backward()
    results = {"loss": trained.loss.detach().reshape(1)}
    results.update({f"term/{k}": v.detach().double().reshape(1) for k, v in trained.terms.items()})
    results["matches"] = torch.tensor(trained.matches, dtype=torch.float64)
    results["counts"] = torch.tensor(trained.counts, dtype=torch.float64)
    results.update({f"grad/{k}": p.grad for k, p in head.named_parameters() if p.grad is not None})
    with torch.no_grad():
        evaluated = objective(head, batch, train=False)
    results["eval/loss"] = evaluated.loss.detach().double().reshape(1)
    results.update({f"eval/term/{k}": v.detach().double().reshape(1) for k, v in evaluated.terms.items()})
    results["eval/matches"] = torch.tensor(evaluated.matches, dtype=torch.float64)
    results["eval/counts"] = torch.tensor(evaluated.counts, dtype=torch.float64)
    # Stored in float32 (half the bytes; a wrong term or gradient is off by far more).
    return {f"{name}/{k}": v.float().contiguous() for k, v in results.items()}


@pytest.fixture(scope="module")
def golden_inputs():
    return golden_batch()


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_objective_matches_golden(golden_inputs, name):
    golden = {k: v for k, v in load_file(GOLDEN).items() if k.startswith(f"{name}/")}
    assert golden, f"{GOLDEN} has no entries for {name}"
    results = objective_results(name, *golden_inputs)
    assert sorted(results) == sorted(golden)
    for key, expected in golden.items():
        scale = float(expected.abs().max())
        torch.testing.assert_close(results[key], expected, rtol=1e-5, atol=1e-6 * scale, msg=key)


if __name__ == "__main__":
    target, batch = golden_batch()
    tensors = {}
    for experiment in EXPERIMENTS:
        tensors.update(objective_results(experiment, target, batch))
    GOLDEN.parent.mkdir(exist_ok=True)
    save_file(tensors, GOLDEN)
    print(f"wrote {len(tensors)} tensors to {GOLDEN}")
