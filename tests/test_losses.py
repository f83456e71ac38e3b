"""Golden values of the loss terms on fixed inputs, and the objective on the tiny target."""

from __future__ import annotations

import math

import pytest
import torch

from specdraft.data.features import TokenBatch, extract_features
from specdraft.data.target import target_weights
from specdraft.heads import (
    DFlashConfig,
    DFlashHead,
    Eagle3Config,
    Eagle3Head,
    EagleConfig,
    EagleHead,
    MedusaConfig,
    MedusaHead,
)
from specdraft.heads.vocab import VocabProjection
from specdraft.train.losses import (
    ALPHA_FLOOR,
    LossWeights,
    acceptance_rate,
    cross_entropy,
    feature_regression,
    forward_kl,
    lk_alpha,
    lk_lambda,
    soft_cross_entropy,
    step_loss,
    topk_distillation,
)
from specdraft.train.objective import DraftObjective, RolloutConfig, simulated_tau

LN2 = math.log(2.0)


def test_golden_values():
    # q = softmax([0, ln 2]) = [1/3, 2/3]; p = [1/2, 1/2].
    draft = torch.tensor([[0.0, LN2]])
    p = torch.tensor([[0.5, 0.5]])
    assert soft_cross_entropy(draft, p).item() == pytest.approx(0.5 * math.log(4.5))
    assert forward_kl(draft, p).item() == pytest.approx(0.5 * math.log(4.5) - math.log(2.0))
    assert forward_kl(torch.log(p), p).item() == pytest.approx(0.0, abs=1e-7)
    # Top-K: p = [0.7, 0.2, 0.1], K = 2, q = [1/2, 1/4, 1/4] → −(0.7 ln ½ + 0.2 ln ¼).
    draft3 = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    ids, probs = torch.tensor([[0, 1]]), torch.tensor([[0.7, 0.2]])
    assert topk_distillation(draft3, ids, probs).item() == pytest.approx(0.7 * LN2 + 0.2 * 2 * LN2)
    # A top-k token outside the draft vocabulary (−1) contributes nothing.
    assert topk_distillation(draft3, torch.tensor([[0, -1]]), probs).item() == pytest.approx(0.7 * LN2)
    # SmoothL1 (β = 1), mean over H then N: |d| = 0.5 → 0.125, |d| = 2 → 1.5.
    predicted, target = torch.tensor([[0.5, 2.0], [0.0, 0.0]]), torch.zeros(2, 2)
    assert feature_regression(predicted, target).item() == pytest.approx(((0.125 + 1.5) / 2 + 0) / 2)
    # Hard CE: label 1 of [1/3, 2/3] → ln 1.5; an ignored label (−1) still counts in the mean.
    two = torch.tensor([[0.0, LN2], [0.0, LN2]])
    assert cross_entropy(two, torch.tensor([1, -1])).item() == pytest.approx(math.log(1.5) / 2)
    # Empty selections give 0, not NaN.
    assert soft_cross_entropy(torch.zeros(0, 2), torch.zeros(0, 2)).item() == 0.0


def test_lk_golden_values_and_gradients():
    # q = softmax([0, ln 2]) = [1/3, 2/3], p = [1/2, 1/2]: α = 1/3 + 1/2 = 5/6. Only token 0 falls
    # short of p (q·[q < p] = [1/3, 0], its sum s = 1/3): ∂α/∂logits = [1/3, 0] − q·s = [2/9, −2/9].
    draft = torch.tensor([[0.0, LN2]], dtype=torch.float64, requires_grad=True)
    p = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    assert acceptance_rate(draft, p).item() == pytest.approx(5 / 6)
    value = lk_alpha(draft, p)
    assert value.item() == pytest.approx(math.log(6 / 5))
    (grad,) = torch.autograd.grad(value, draft)  # −(1/α)·∂α = −(6/5)·[2/9, −2/9]
    assert grad[0].tolist() == pytest.approx([-4 / 15, 4 / 15])
    # LK^λ = λ·KL + (1 − λ)·(1 − α), λ = exp(−η·ᾱ) held constant: its gradient blends KL's,
    # q − p = [−1/6, 1/6], and TV's, −∂α.
    blend, kl = math.exp(-3.0 * 5 / 6), 0.5 * math.log(4.5) - LN2
    value = lk_lambda(draft, p, eta=3.0)
    assert value.item() == pytest.approx(blend * kl + (1 - blend) / 6)
    (grad,) = torch.autograd.grad(value, draft)
    expected = [blend * -1 / 6 - (1 - blend) * 2 / 9, blend / 6 + (1 - blend) * 2 / 9]
    assert grad[0].tolist() == pytest.approx(expected)
    # η = 0: pure KL; the draft equal to the target: α = 1, both terms 0.
    assert lk_lambda(draft, p, eta=0.0).item() == pytest.approx(kl)
    assert lk_alpha(torch.log(p), p).item() == pytest.approx(0.0, abs=1e-6)  # fp32 softmax
    assert lk_lambda(torch.log(p), p, eta=3.0).item() == pytest.approx(0.0, abs=1e-6)
    # No shared mass: −log α stops at the floor, with no gradient; ᾱ is the mean over positions.
    disjoint = torch.tensor([[0.0, -80.0]], dtype=torch.float64, requires_grad=True)
    far = lk_alpha(disjoint, torch.tensor([[0.0, 1.0]], dtype=torch.float64))
    assert far.item() == pytest.approx(-math.log(ALPHA_FLOOR))
    assert torch.autograd.grad(far, disjoint)[0].abs().max().item() == 0.0
    two = torch.tensor([[0.0, LN2], [0.0, 0.0]], dtype=torch.float64)
    mean_alpha = (5 / 6 + 1) / 2  # the second position drafts p exactly
    expected_two = (math.exp(-3.0 * mean_alpha) * kl + (1 - math.exp(-3.0 * mean_alpha)) / 6) / 2
    assert lk_lambda(two, torch.tensor([[0.5, 0.5]] * 2, dtype=torch.float64), 3.0).item() == pytest.approx(
        expected_two
    )
    assert lk_alpha(torch.zeros(0, 2), torch.zeros(0, 2)).item() == 0.0
    assert lk_lambda(torch.zeros(0, 2), torch.zeros(0, 2), 3.0).item() == 0.0


def test_step_loss_weights_and_missing_inputs():
    draft = torch.tensor([[0.0, LN2]])
    p = torch.tensor([[0.5, 0.5]])
    terms = step_loss(LossWeights(soft_ce=0.1, forward_kl=2.0), draft, target_probs=p)
    assert set(terms) == {"soft_ce", "forward_kl", "loss"}
    expected = 0.1 * 0.5 * math.log(4.5) + 2.0 * (0.5 * math.log(4.5) - LN2)
    assert terms["loss"].item() == pytest.approx(expected)
    with pytest.raises(ValueError, match="'topk' has weight"):
        step_loss(LossWeights(topk=1.0), draft, target_probs=p)
    with pytest.raises(ValueError, match="must be >= 0"):
        LossWeights(feature=-1)
    with pytest.raises(ValueError, match="'lk_lambda' has weight"):
        step_loss(LossWeights(lk_lambda=1.0), draft)
    with pytest.raises(ValueError, match="lk_eta must be >= 0"):
        LossWeights(lk_eta=-1.0)


def test_simulated_tau():
    assert simulated_tau([]) == 1.0
    assert simulated_tau([0.5, 0.5, 1.0]) == pytest.approx(1 + 0.5 + 0.25 + 0.25)


@pytest.fixture(scope="module")
def features(tiny_target):
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, tiny_target.spec.vocab_size, (3, 16), generator=generator)
    attention = torch.ones_like(input_ids)
    attention[2, 11:] = 0
    loss_mask = attention.clone()
    loss_mask[:, :4] = 0
    batch = TokenBatch(input_ids, attention, loss_mask)
    return extract_features(tiny_target, batch, tiny_target.spec.aux_layer_ids, top_k=4)


def build(kind, target):
    spec, weights = target.spec, target_weights(target)
    if kind == "medusa":
        return MedusaHead(spec, weights, MedusaConfig(num_heads=3, num_layers=1, own_lm_head=False))
    if kind == "eagle":
        return EagleHead(spec, weights, EagleConfig(fc_bias=False))
    if kind == "dflash":
        return DFlashHead(
            spec, weights, DFlashConfig(num_layers=1, block_size=4, mask_token_id=None, anchor_fraction=0.5)
        )
    counts = torch.arange(spec.vocab_size).float()
    head = Eagle3Head(spec, weights, Eagle3Config(draft_vocab_size=200))
    head.choose_vocabulary(lambda: counts)
    return head


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3"])
def test_objective_runs_and_backpropagates(tiny_target, features, kind):
    torch.manual_seed(0)
    head = build(kind, tiny_target)
    weights = {
        "medusa": LossWeights(ce=1.0, topk=0.5, topk_k=3),
        "eagle": LossWeights(feature=1.0, soft_ce=0.1, topk=1.0, topk_k=3),
        "eagle3": LossWeights(soft_ce=1.0, topk=0.5, topk_k=3),
    }[kind]
    objective = DraftObjective(
        weights, RolloutConfig(steps=2, step_weight_base=0.5), eval_steps=3, chunk_size=128
    )
    out = objective(head, features, train=True)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert all(p.grad is not None for p in head.parameters())
    evaluated = objective(head, features, train=False)
    assert len(evaluated.counts) == 3
    assert all(0.0 <= a <= 1.0 for a in evaluated.accuracy)
    if kind != "medusa":
        # Supervised: p+1 in the loss mask, p = 3..14 (rows 0, 1) and 3..9 (row 2); step j would
        # drop p < j−1, none of which is supervised here.
        assert evaluated.counts == [12 + 12 + 7] * 3
        # The loss is Σ_j β^(j−1) loss_j over the TRAINED steps only.
        expected = out.terms["step1/loss"] + 0.5 * out.terms["step2/loss"]
        torch.testing.assert_close(out.loss.detach(), expected)
    else:
        # Head k supervises p when x_{p+2+k} is an assistant token: p = 2−k..13−k, 2−k..8−k.
        assert evaluated.counts == [12 + 12 + 7] * 3


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3", "dflash"])
def test_lk_terms_train_every_head_kind(tiny_target, features, kind):
    """LK^α and LK^λ through each head kind's objective: reported per step, in the loss with their
    weights, a gradient for every parameter, and a few optimiser steps on them raise the acceptance
    rate (lower −log α) on the batch."""
    torch.manual_seed(0)
    head = build(kind, tiny_target)
    weights = LossWeights(feature=1.0 if kind == "eagle" else 0.0, lk_alpha=0.5, lk_lambda=1.0)
    objective = DraftObjective(
        weights, RolloutConfig(steps=2, step_weight_base=0.5), eval_steps=3, chunk_size=7
    )
    out = objective(head, features, train=True)
    out.loss.backward()
    assert all(p.grad is not None for p in head.parameters())
    step1 = out.terms["step1/loss"].item() - (out.terms["step1/feature"].item() if kind == "eagle" else 0.0)
    lk = 0.5 * out.terms["step1/lk_alpha"].item() + out.terms["step1/lk_lambda"].item()
    assert step1 == pytest.approx(lk, rel=1e-5)
    assert 0 < out.terms["step1/lk_alpha"].item() < -math.log(ALPHA_FLOOR)
    optimizer = torch.optim.Adam(head.parameters(), lr=3e-3)
    before = objective(head, features, train=False).terms["step1/lk_alpha"].item()
    for _ in range(10):
        optimizer.zero_grad()
        objective(head, features, train=True).loss.backward()
        optimizer.step()
    assert objective(head, features, train=False).terms["step1/lk_alpha"].item() < before


def test_cached_and_recomputed_topk_agree(tiny_target, features):
    head = build("eagle", tiny_target)
    objective = DraftObjective(
        LossWeights(topk=1.0, topk_k=4), RolloutConfig(steps=1), eval_steps=4, chunk_size=128
    )
    cached = objective(head, features).terms["step1/topk"]
    features_without = type(features)(**{**vars(features), "topk_ids": None, "topk_probs": None})
    recomputed = objective(head, features_without).terms["step1/topk"]
    torch.testing.assert_close(cached, recomputed)
    with pytest.raises(ValueError, match="top-4"):
        DraftObjective(LossWeights(topk=1.0, topk_k=5), RolloutConfig(), eval_steps=4, chunk_size=128)(
            head, features
        )


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_reduced_training_vocabulary(tiny_target, features, kind):
    """draft_vocab restricts the vocabulary terms of heads that draft over the target vocabulary:
    the whole vocabulary as a "reduction" changes nothing; a real one trains only where the
    target's argmax lies inside it. EAGLE-3 has its own reduced vocabulary and refuses one that
    does not lie inside it."""
    weights = LossWeights(soft_ce=1.0, ce=0.5, topk=0.5, topk_k=3)
    rollout = RolloutConfig(steps=2, step_weight_base=0.5)
    results = []
    vocab_size = tiny_target.spec.vocab_size
    for draft_vocab in (None, torch.arange(vocab_size), torch.arange(0, vocab_size, 2)):
        torch.manual_seed(0)
        head = build(kind, tiny_target)
        out = DraftObjective(weights, rollout, eval_steps=4, chunk_size=128, draft_vocab=draft_vocab)(
            head, features
        )
        out.loss.backward()
        results.append((out, [p.grad.clone() for p in head.parameters() if p.grad is not None]))
    (full, full_grads), (same, same_grads), (half, _) = results
    torch.testing.assert_close(same.loss, full.loss)
    for got, want in zip(same_grads, full_grads, strict=True):
        torch.testing.assert_close(got, want)
    assert half.counts == full.counts and torch.isfinite(half.loss)
    assert half.loss.item() != pytest.approx(full.loss.item())
    with pytest.raises(
        ValueError, match=r"loss\.draft_vocab_size: none of its 10 tokens lies inside the head's own 200"
    ):
        DraftObjective(weights, rollout, eval_steps=4, chunk_size=128, draft_vocab=torch.arange(10))(
            build("eagle3", tiny_target), features
        )


def own_vocabulary(head) -> torch.Tensor:
    """The target ids a head drafts over."""
    projection = head.vocab_projection(torch.zeros(1, 1, head.spec.hidden_size))
    if projection.draft_vocab is None:
        return torch.arange(head.spec.vocab_size)
    return projection.draft_vocab


def loss_and_grads(kind, target, features, objective, train=True):
    torch.manual_seed(0)
    head = build(kind, target)
    out = objective(head, features, train=train)
    if not train:
        return out, []
    out.loss.backward()
    return out, [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in head.parameters()]


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_rollout_vocabulary_trains_later_steps_over_it(tiny_target, features, kind):
    """rollout_vocab: step 1 as without it, steps j >= 2 as over draft_vocab = rollout_vocab —
    losses, per-step terms and gradients (linear in the steps: the reference is the full run's
    step 1 plus the reduced run's steps 2..n) — and validation as without it."""
    weights = LossWeights(feature=1.0, soft_ce=1.0, ce=0.5, topk=0.5, topk_k=3)
    three, one = RolloutConfig(steps=3, step_weight_base=0.5), RolloutConfig(steps=1)
    vocab = own_vocabulary(build(kind, tiny_target))[::2]
    split, split_grads = loss_and_grads(
        kind,
        tiny_target,
        features,
        DraftObjective(weights, three, eval_steps=4, chunk_size=128, rollout_vocab=vocab),
    )
    first, first_grads = loss_and_grads(
        kind, tiny_target, features, DraftObjective(weights, one, eval_steps=4, chunk_size=128)
    )
    reduced, reduced_grads = loss_and_grads(
        kind,
        tiny_target,
        features,
        DraftObjective(weights, three, eval_steps=4, chunk_size=128, draft_vocab=vocab),
    )
    reduced_first, reduced_first_grads = loss_and_grads(
        kind,
        tiny_target,
        features,
        DraftObjective(weights, one, eval_steps=4, chunk_size=128, draft_vocab=vocab),
    )
    torch.testing.assert_close(split.loss, first.loss + reduced.loss - reduced_first.loss)
    for got, *parts in zip(split_grads, first_grads, reduced_grads, reduced_first_grads, strict=True):
        torch.testing.assert_close(got, parts[0] + parts[1] - parts[2])
    for name, value in split.terms.items():
        want = first.terms[name] if name.startswith("step1/") else reduced.terms[name]
        torch.testing.assert_close(value, want, msg=name)
    assert split.counts == reduced.counts and split.matches[1:] == reduced.matches[1:]
    assert split.matches[0] == first.matches[0]

    # Validation measures every step over the training vocabulary.
    objective = DraftObjective(weights, three, eval_steps=4, chunk_size=128, rollout_vocab=vocab)
    measured, _ = loss_and_grads(kind, tiny_target, features, objective, train=False)
    plain, _ = loss_and_grads(
        kind, tiny_target, features, DraftObjective(weights, three, eval_steps=4, chunk_size=128), train=False
    )
    assert measured.matches == plain.matches and measured.counts == plain.counts
    torch.testing.assert_close(measured.loss, plain.loss)


def test_rollout_vocabulary_of_medusa_heads(tiny_target, features):
    """Medusa's heads 2..k are its "later steps": trained over rollout_vocab, head 1 not."""
    weights = LossWeights(ce=1.0, topk=0.5, topk_k=3)
    vocab = torch.arange(0, tiny_target.spec.vocab_size, 2)
    rollout = RolloutConfig(steps=1, step_weight_base=0.8)
    split, _ = loss_and_grads(
        "medusa",
        tiny_target,
        features,
        DraftObjective(weights, rollout, eval_steps=4, chunk_size=128, rollout_vocab=vocab),
    )
    full, _ = loss_and_grads(
        "medusa", tiny_target, features, DraftObjective(weights, rollout, eval_steps=4, chunk_size=128)
    )
    reduced, _ = loss_and_grads(
        "medusa",
        tiny_target,
        features,
        DraftObjective(weights, rollout, eval_steps=4, chunk_size=128, draft_vocab=vocab),
    )
    assert len(split.counts) == 3
    for name, value in split.terms.items():
        torch.testing.assert_close(
            value, (full if name.startswith("step1/") else reduced).terms[name], msg=name
        )
    assert split.terms["step2/ce"].item() != pytest.approx(full.terms["step2/ce"].item())


def test_a_rollout_vocabulary_meets_a_heads_own_in_their_common_tokens(tiny_target, features):
    """For a head with its own vocabulary (EAGLE-3, perhaps warm-started from another run's), the
    rollout steps train over the tokens of the rollout vocabulary inside it: all of them changes
    nothing, a partial overlap is that overlap, none is one clear error."""
    weights, rollout = LossWeights(soft_ce=1.0, topk=0.5, topk_k=3), RolloutConfig(steps=2)
    own = own_vocabulary(build("eagle3", tiny_target))
    others = torch.tensor([i for i in range(tiny_target.spec.vocab_size) if i not in set(own.tolist())][:10])

    def run(vocab):
        return loss_and_grads(
            "eagle3",
            tiny_target,
            features,
            DraftObjective(weights, rollout, eval_steps=4, chunk_size=128, rollout_vocab=vocab),
        )

    (plain, plain_grads), (holding, holding_grads) = run(None), run(torch.cat([others, own]))
    torch.testing.assert_close(holding.loss, plain.loss)
    for got, want in zip(holding_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want)
    (partial, partial_grads), (common, common_grads) = run(torch.cat([others, own[:50]])), run(own[:50])
    torch.testing.assert_close(partial.loss, common.loss)
    for got, want in zip(partial_grads, common_grads, strict=True):
        torch.testing.assert_close(got, want)
    assert partial.loss.item() != pytest.approx(plain.loss.item())
    with pytest.raises(ValueError, match=r"loss\.rollout_vocab_size: none of its 10 tokens lies inside"):
        DraftObjective(weights, rollout, eval_steps=4, chunk_size=128, rollout_vocab=others)(
            build("eagle3", tiny_target), features
        )


def test_the_objective_finds_its_vocabularies_in_a_heads_own_once(tiny_target, features, monkeypatch):
    """Where the rollout vocabulary lies in an EAGLE-3 head's own (a count read on the host: a GPU
    sync) is found on the first batch and kept: later batches train as a fresh objective would;
    a head whose vocabulary changed is looked at again."""
    weights, rollout = LossWeights(soft_ce=1.0, topk=0.5, topk_k=3), RolloutConfig(steps=2)
    head = build("eagle3", tiny_target)
    own = own_vocabulary(head)
    vocab = own[100:150]
    looked_up = []
    restriction = VocabProjection.restriction

    def counting(projection, wanted):
        looked_up.append(wanted)
        return restriction(projection, wanted)

    monkeypatch.setattr(VocabProjection, "restriction", counting)
    objective = DraftObjective(weights, rollout, eval_steps=4, chunk_size=128, rollout_vocab=vocab)
    first, again = objective(head, features).loss, objective(head, features).loss
    assert len(looked_up) == 1
    torch.testing.assert_close(again, first)
    # 30 of its lowest ids out, 30 others in: the rollout vocabulary's rows in it move
    others = [i for i in range(head.spec.vocab_size) if i not in set(own.tolist())][:30]
    t2d = head.t2d.clone()
    t2d[own[:30]], t2d[others] = False, True
    ids = torch.nonzero(t2d).squeeze(-1)
    head.set_draft_vocab(ids - torch.arange(ids.numel()), t2d)
    changed = objective(head, features).loss
    assert len(looked_up) == 2
    fresh = DraftObjective(weights, rollout, eval_steps=4, chunk_size=128, rollout_vocab=vocab)(
        head, features
    ).loss
    torch.testing.assert_close(changed, fresh)
