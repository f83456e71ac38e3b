"""The fused, chunked vocabulary losses equal the reference terms of losses.py, values and gradients."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from specdraft.heads.vocab import draft_vocab_from_counts, target_to_draft_index
from specdraft.train import vocab_major
from specdraft.train.fused import TERMS, DraftSide, TargetSide, fused_vocab_losses
from specdraft.train.losses import LossWeights, lk_lambda, step_loss


def reference(
    hidden,
    weight,
    target_hidden,
    target_weight,
    valid,
    step_weights,
    weights,
    vocab,
    t2d_index,
    topk_ids,
    topk_probs,
    labels,
    logit_softcap=None,
):
    """The unfused computation: full N×V logits (capped as Gemma 2 caps them, with a cap),
    losses.step_loss, autograd."""
    target_logits = target_hidden @ target_weight.T
    if logit_softcap is not None:
        target_logits = logit_softcap * torch.tanh(target_logits / logit_softcap)
    argmax = target_logits.argmax(-1)
    keep = torch.ones_like(argmax, dtype=torch.bool)
    if vocab is not None:
        target_logits = target_logits[:, vocab]
        keep = t2d_index[argmax] >= 0
        topk_ids = t2d_index[topk_ids]
        labels = torch.where(labels >= 0, t2d_index[labels.clamp(min=0)], -1)
    p = target_logits.softmax(-1)
    total, values, matches = 0, [], []
    for j in range(hidden.shape[0]):
        rows = valid[j] & keep
        logits = hidden[j] @ weight.T
        terms = step_loss(
            weights,
            logits[rows],
            target_probs=p[rows],
            topk_ids=topk_ids[rows],
            topk_probs=topk_probs[rows],
            labels=labels[rows],
        )
        total = total + step_weights[j] * terms["loss"]
        values.append([terms[name].item() if name in terms else None for name in TERMS])
        drafted = logits.argmax(-1) if vocab is None else vocab[logits.argmax(-1)]
        matches.append(int(((drafted == argmax) & valid[j]).sum()))
    return total, values, matches


K = 4  # the target's top-K in these problems


def random_problem(seed: int, steps: int, n: int, reduced: bool, unlabelled_every: int) -> SimpleNamespace:
    """fp64 inputs of fused_vocab_losses: S×N×H draft states and a trainable projection over a
    30-token vocabulary (12 draft tokens when ``reduced``), the target's states, lm_head and top-K,
    valid positions and labels (every ``unlabelled_every``-th −1)."""
    torch.manual_seed(seed)
    h, vocab_size = 8, 30
    dtype = torch.float64
    hidden = torch.randn(steps, n, h, dtype=dtype, requires_grad=True)
    target_hidden = torch.randn(n, h, dtype=dtype)
    target_weight = torch.randn(vocab_size, h, dtype=dtype)
    vocab = t2d_index = None
    draft_size = vocab_size
    if reduced:
        d2t, t2d = draft_vocab_from_counts(torch.rand(vocab_size), 12)
        vocab, t2d_index, draft_size = torch.arange(12) + d2t, target_to_draft_index(t2d), 12
    weight = torch.randn(draft_size, h, dtype=dtype, requires_grad=True)
    valid = torch.rand(steps, n) > 0.2
    topk_probs, topk_ids = (target_hidden @ target_weight.T).softmax(-1).topk(K, dim=-1)
    labels = torch.randint(0, vocab_size, (n,))
    labels[::unlabelled_every] = -1
    return SimpleNamespace(
        hidden=hidden, weight=weight, target_hidden=target_hidden, target_weight=target_weight,
        valid=valid, vocab=vocab, t2d_index=t2d_index, topk_ids=topk_ids, topk_probs=topk_probs,
        labels=labels,
    )  # fmt: skip


def loss_inputs(problem: SimpleNamespace, step_weights: list[float], weights: LossWeights) -> tuple:
    """``reference``'s arguments after the draft and target projections."""
    return (
        problem.valid, step_weights, weights, problem.vocab, problem.t2d_index, problem.topk_ids,
        problem.topk_probs, problem.labels,
    )  # fmt: skip


def sides(problem: SimpleNamespace, step_weights: list[float]) -> tuple[DraftSide, TargetSide]:
    """The same problem as ``fused_vocab_losses``' draft and target sides."""
    draft = DraftSide(
        problem.hidden, problem.weight, problem.valid, step_weights, problem.vocab, problem.t2d_index
    )
    target = TargetSide(
        problem.target_hidden, problem.target_weight, problem.topk_ids, problem.topk_probs, problem.labels
    )
    return draft, target


def assert_fused_equals_reference(problem: SimpleNamespace, weights: LossWeights, chunk_size: int) -> None:
    """Values, active terms, matches and gradients of ``fused_vocab_losses`` against ``reference``
    over three steps weighted 1, 0.5, 0.25; again with the target's argmax given."""
    hidden, weight = problem.hidden, problem.weight
    projections = (hidden, weight, problem.target_hidden, problem.target_weight)
    inputs = loss_inputs(problem, [1.0, 0.5, 0.25], weights)
    draft, target = sides(problem, [1.0, 0.5, 0.25])

    expected, values, matches = reference(*projections, *inputs)
    expected_grads = torch.autograd.grad(expected, [hidden, weight])
    out = fused_vocab_losses(draft, target, weights, chunk_size)
    grads = torch.autograd.grad(out.loss * 2.0, [hidden, weight])  # the upstream gradient is applied
    torch.testing.assert_close(out.loss.double(), expected.double(), rtol=1e-6, atol=1e-6)
    active = [i for i, name in enumerate(TERMS) if getattr(weights, name) > 0]
    torch.testing.assert_close(
        out.terms[:, active].double(),
        torch.tensor([[step[i] for i in active] for step in values], dtype=torch.float64),
        rtol=1e-5,
        atol=1e-6,
    )
    assert out.matches.tolist() == matches
    assert out.counts.tolist() == problem.valid.sum(-1).tolist()
    for got, want in zip(grads, expected_grads, strict=True):
        # losses.py computes its softmaxes in fp32: agreement to fp32 rounding.
        torch.testing.assert_close(got, 2.0 * want, rtol=1e-5, atol=1e-6)
    # The target's argmax given (its cached top-1) instead of computed: the same result.
    given = fused_vocab_losses(draft, replace(target, argmax=problem.topk_ids[:, 0]), weights, chunk_size)
    torch.testing.assert_close(given.loss, out.loss)
    assert given.matches.tolist() == matches


@pytest.mark.parametrize("reduced", [False, True])
@pytest.mark.parametrize("chunk_size", [3, 64])
def test_fused_equals_reference(reduced, chunk_size):
    problem = random_problem(0, steps=3, n=20, reduced=reduced, unlabelled_every=5)
    weights = LossWeights(soft_ce=0.3, forward_kl=0.2, topk=1.5, topk_k=K, ce=0.7)
    assert_fused_equals_reference(problem, weights, chunk_size)


@pytest.mark.parametrize("reduced", [False, True])
def test_a_capped_target_distribution_equals_the_reference(reduced):
    """Gemma 2's final logits are soft-capped: the target distribution the terms compare with is
    the capped one (a cap of 1 bends these logits, of spread ~3, a lot)."""
    problem = random_problem(1, steps=2, n=12, reduced=reduced, unlabelled_every=4)
    weights = LossWeights(soft_ce=0.5, forward_kl=0.5, topk=0.0, ce=0.0, lk_alpha=0.5)
    step_weights = [1.0, 0.5]
    inputs = loss_inputs(problem, step_weights, weights)
    expected, _, _ = reference(
        problem.hidden,
        problem.weight,
        problem.target_hidden,
        problem.target_weight,
        *inputs,
        logit_softcap=1.0,
    )
    uncapped, _, _ = reference(
        problem.hidden, problem.weight, problem.target_hidden, problem.target_weight, *inputs
    )
    draft, target = sides(problem, step_weights)
    out = fused_vocab_losses(draft, replace(target, logit_softcap=1.0), weights, chunk_size=5)
    torch.testing.assert_close(out.loss.double(), expected.double(), rtol=1e-6, atol=1e-6)
    assert abs(float(expected) - float(uncapped)) > 1e-2  # the cap matters here


LK_WEIGHTS = {
    "lk_alpha": LossWeights(lk_alpha=1.0),
    "lk_lambda": LossWeights(lk_lambda=1.0),
    "beside_every_term": LossWeights(
        soft_ce=0.3, forward_kl=0.2, topk=0.5, topk_k=K, ce=0.2, lk_alpha=0.4, lk_lambda=0.7, lk_eta=2.0
    ),
}


@pytest.mark.parametrize("reduced", [False, True])
@pytest.mark.parametrize("weights", list(LK_WEIGHTS.values()), ids=list(LK_WEIGHTS))
def test_lk_terms_equal_the_reference(weights, reduced):
    """The LK terms (losses.lk_alpha, losses.lk_lambda), alone and beside every other term, over
    the full and a reduced vocabulary; in one chunk, whose λ is the reference's."""
    problem = random_problem(2, steps=3, n=20, reduced=reduced, unlabelled_every=5)
    assert_fused_equals_reference(problem, weights, chunk_size=64)
    if weights.lk_lambda == 0:  # LK^α has no batch statistic: any chunking gives the same
        assert_fused_equals_reference(problem, weights, chunk_size=3)


def test_lk_lambda_takes_its_blend_weight_per_chunk():
    """Over several chunks, each chunk's λ = exp(−η·ᾱ) is its own trained positions' mean α: the
    reference term per chunk, weighted by the chunk's share of the step's trained positions."""
    problem = random_problem(3, steps=1, n=20, reduced=False, unlabelled_every=5)
    hidden, weight, valid = problem.hidden, problem.weight, problem.valid[0]
    weights, chunk_size = LossWeights(lk_lambda=1.0, lk_eta=3.0), 6
    p = (problem.target_hidden @ problem.target_weight.T).softmax(-1)
    logits = hidden[0] @ weight.T
    expected = 0
    for start in range(0, 20, chunk_size):
        rows = torch.zeros(20, dtype=torch.bool)
        rows[start : start + chunk_size] = True
        rows &= valid
        expected = expected + lk_lambda(logits[rows], p[rows], weights.lk_eta) * rows.sum() / valid.sum()
    expected_grads = torch.autograd.grad(expected, [hidden, weight])
    draft, target = sides(problem, [1.0])
    out = fused_vocab_losses(draft, target, weights, chunk_size)
    torch.testing.assert_close(out.loss.double(), expected.double(), rtol=1e-6, atol=1e-6)
    for got, want in zip(torch.autograd.grad(out.loss, [hidden, weight]), expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    one_chunk = fused_vocab_losses(draft, target, weights, chunk_size=64)
    assert not torch.allclose(one_chunk.loss, out.loss)  # the chunk's λ, not the batch's


@pytest.mark.parametrize("reduced", [False, True])
def test_sparse_targets_alone_never_read_the_target_distribution(reduced):
    """Top-K and label terms only, the target's argmax given (its cached top-1): the values and
    gradients of the reference, and the target's hidden states are never projected (NaN there
    changes nothing)."""
    problem = random_problem(1, steps=2, n=17, reduced=reduced, unlabelled_every=4)
    hidden, weight, target_hidden = problem.hidden, problem.weight, problem.target_hidden
    weights = LossWeights(soft_ce=0.0, topk=0.02, topk_k=K, ce=0.5)
    inputs = loss_inputs(problem, [1.0, 0.7], weights)
    expected, values, matches = reference(hidden, weight, target_hidden, problem.target_weight, *inputs)
    expected_grads = torch.autograd.grad(expected, [hidden, weight])
    draft, target = sides(problem, [1.0, 0.7])
    unread = replace(
        target, hidden=torch.full_like(target_hidden, float("nan")), argmax=problem.topk_ids[:, 0]
    )
    out = fused_vocab_losses(draft, unread, weights, chunk_size=5)
    grads = torch.autograd.grad(out.loss, [hidden, weight])
    torch.testing.assert_close(out.loss.double(), expected.double(), rtol=1e-6, atol=1e-6)
    for column in (TERMS.index("topk"), TERMS.index("ce")):
        want = torch.tensor([step[column] for step in values], dtype=torch.float64)
        torch.testing.assert_close(out.terms[:, column].double(), want, rtol=1e-5, atol=1e-6)
    assert out.matches.tolist() == matches
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_frozen_projection_gets_no_gradient():
    hidden = torch.randn(1, 5, 4, requires_grad=True)
    weight = torch.randn(7, 4)
    draft = DraftSide(hidden, weight, torch.ones(1, 5, dtype=torch.bool), [1.0])
    out = fused_vocab_losses(
        draft, TargetSide(torch.randn(5, 4), torch.randn(7, 4)), LossWeights(soft_ce=1.0), chunk_size=128
    )
    out.loss.backward()
    assert hidden.grad is not None and weight.grad is None
    with pytest.raises(ValueError, match="'topk' has weight"):
        fused_vocab_losses(
            draft, TargetSide(torch.randn(5, 4), torch.randn(7, 4)), LossWeights(topk=1.0), chunk_size=128
        )


def test_per_step_projections_and_no_grad():
    """S×V×H weights (Medusa heads with their own lm_heads): step j reads weight j, and its
    gradient goes to weight j only. Under no_grad the values are the same and nothing is kept."""
    torch.manual_seed(1)
    steps, n, h, vocab_size = 2, 9, 6, 11
    dtype = torch.float64
    hidden = torch.randn(steps, n, h, dtype=dtype, requires_grad=True)
    weight = torch.randn(steps, vocab_size, h, dtype=dtype, requires_grad=True)
    target_hidden, target_weight = torch.randn(n, h, dtype=dtype), torch.randn(vocab_size, h, dtype=dtype)
    valid = torch.rand(steps, n) > 0.3
    labels = torch.randint(0, vocab_size, (n,))
    weights, step_weights = LossWeights(soft_ce=0.5, ce=1.0), [1.0, 0.8]
    unused = torch.zeros(n, 1, dtype=torch.long), torch.zeros(n, 1, dtype=dtype)
    expected = sum(
        reference(
            hidden[j : j + 1], weight[j], target_hidden, target_weight, valid[j : j + 1],
            [step_weights[j]], weights, None, None, *unused, labels,
        )[0]
        for j in range(steps)
    )  # fmt: skip
    expected_grads = torch.autograd.grad(expected, [hidden, weight])
    draft = DraftSide(hidden, weight, valid, step_weights)
    target = TargetSide(target_hidden, target_weight, labels=labels)
    out = fused_vocab_losses(draft, target, weights, chunk_size=4)
    torch.testing.assert_close(out.loss.double(), expected.double(), rtol=1e-6, atol=1e-6)
    for got, want in zip(torch.autograd.grad(out.loss, [hidden, weight]), expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        evaluated = fused_vocab_losses(draft, target, weights, chunk_size=4)
    assert evaluated.loss.grad_fn is None
    torch.testing.assert_close(evaluated.loss, out.loss.detach())
    torch.testing.assert_close(evaluated.terms, out.terms)
    with pytest.raises(ValueError, match="3 per-step draft weights for 2 steps"):
        fused_vocab_losses(
            replace(draft, weight=torch.randn(3, vocab_size, h, dtype=dtype)), target, weights, chunk_size=128
        )


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("gathered", [1024, 24], ids=["one-gathering", "flushed-every-chunk"])
@pytest.mark.parametrize("per_step", [False, True])
def test_bf16_inputs_agree_with_the_fp64_reference(per_step, gathered, device, monkeypatch):
    """bf16 hidden states and projections (bf16-mixed training) take the reduced-precision path
    (a contiguous Wᵀ for the gradient matmul, the weight gradient gathered over chunks and steps
    before its matmul, here all at once or a flush before nearly every 16-position chunk):
    values and gradients agree with the fp64 reference of the same bf16 numbers to bf16
    rounding of the logits, with oneDNN's matmuls on a CPU and cuBLAS's on a GPU."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setattr(vocab_major, "WEIGHT_GRAD_POSITIONS", gathered)
    torch.manual_seed(2)
    steps, n, h, vocab_size = 2, 40, 16, 50
    hidden = torch.randn(steps, n, h).bfloat16().to(device).requires_grad_()
    shape = (steps, vocab_size, h) if per_step else (vocab_size, h)
    weight = (0.3 * torch.randn(shape)).bfloat16().to(device).requires_grad_()
    target_hidden = torch.randn(n, h).bfloat16().to(device)
    target_weight = (0.3 * torch.randn(vocab_size, h)).bfloat16().to(device)
    valid = torch.rand(steps, n).to(device) > 0.2
    weights, step_weights = LossWeights(soft_ce=1.0), [1.0, 0.5]
    out = fused_vocab_losses(
        DraftSide(hidden, weight, valid, step_weights), TargetSide(target_hidden, target_weight), weights, 16
    )
    got = torch.autograd.grad(out.loss, [hidden, weight])
    hidden64, weight64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    unused = (
        torch.zeros(n, 1, dtype=torch.long, device=device),
        torch.zeros(n, 1, dtype=torch.float64, device=device),
    )
    labels = torch.zeros(n, dtype=torch.long, device=device)
    expected = sum(
        reference(
            hidden64[j : j + 1], weight64[j] if per_step else weight64, target_hidden.double(),
            target_weight.double(), valid[j : j + 1], [step_weights[j]], weights, None, None, *unused, labels,
        )[0]
        for j in range(steps)
    )  # fmt: skip
    want = torch.autograd.grad(expected, [hidden64, weight64])
    torch.testing.assert_close(out.loss.double(), expected, rtol=2e-2, atol=1e-2)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.double(), w, rtol=5e-2, atol=2e-3)


def test_the_argmax_is_the_first_maximal_index_among_ties():
    """Logits rounded to bf16 tie often (~6 % of 8k-row columns): the argmax read off the
    maximum must be the first maximal row, as torch.argmax gives."""
    from specdraft.train.vocab_major import first_argmax

    torch.manual_seed(3)
    logits = (3 * torch.randn(4096, 64)).bfloat16().float()
    logits[:, 0] = 1.0  # every row tied: row 0
    logits[[7, 900, 4000], 1] = 50.0  # three tied at the top: row 7
    assert ((logits == logits.amax(0)).sum(0) > 1).sum() > 3  # ties besides the planted ones
    last_first = torch.arange(logits.shape[0], 0, -1, dtype=logits.dtype).unsqueeze(-1)
    shifted = logits - logits.amax(0, keepdim=True)
    got = first_argmax(shifted, torch.empty_like(logits), last_first)
    assert torch.equal(got, logits.argmax(0))
    assert got[:2].tolist() == [0, 7]


def test_frozen_rows_are_kept_while_the_lm_head_is_unchanged_and_refused_for_another_projection():
    from specdraft.train.vocab_major import FrozenRows

    torch.manual_seed(4)
    lm_head, vocab = torch.randn(30, 8), torch.tensor([2, 5, 7, 11])
    rows = FrozenRows(lm_head, vocab, torch.bfloat16)
    assert torch.equal(rows.rows, lm_head[vocab].bfloat16()) and rows.transposed.is_contiguous()
    assert rows.prepared_from(lm_head, vocab, torch.bfloat16)
    assert not rows.prepared_from(lm_head, vocab, torch.float32)
    assert not rows.prepared_from(lm_head.clone(), vocab, torch.bfloat16)
    lm_head.add_(1.0)  # changed in place: prepared again
    assert not rows.prepared_from(lm_head, vocab, torch.bfloat16)

    hidden = torch.randn(1, 6, 8, requires_grad=True)
    full = FrozenRows(lm_head, None, torch.float32)
    valid, target, weights = (
        torch.ones(1, 6, dtype=torch.bool),
        TargetSide(torch.randn(6, 8), lm_head),
        LossWeights(soft_ce=1.0),
    )
    kept = fused_vocab_losses(DraftSide(hidden, full.rows, valid, [1.0], frozen=full), target, weights, 128)
    fresh = fused_vocab_losses(DraftSide(hidden, lm_head, valid, [1.0]), target, weights, 128)
    torch.testing.assert_close(kept.loss, fresh.loss)
    with pytest.raises(ValueError, match="frozen rows given for another projection"):
        fused_vocab_losses(
            DraftSide(hidden, lm_head.clone(), valid, [1.0], frozen=full), target, weights, 128
        )
