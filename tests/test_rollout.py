"""The multi-step rollout: literal masks, the attention that computes them without materialising them,
and step j of training == the j-th draft step at decode time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdraft.data.features import TokenBatch, extract_features
from specdraft.data.target import target_weights
from specdraft.heads import Eagle3Config, Eagle3Head, EagleConfig, EagleHead
from specdraft.heads.layers import AlignedMask, aligned_attention, causal_mask
from specdraft.heads.rollout import rollout
from specdraft.train.objective import RolloutConfig

NEG = float("-inf")


def test_alignment_mask_literal():
    # Step 1 is the causal mask.
    torch.testing.assert_close(AlignedMask(1).dense(3), causal_mask(3))
    # Step 2, T=4: level-1 keys up to p−1, level-2 key at p itself.
    expected = torch.tensor(
        [
            [NEG, NEG, NEG, NEG, 0, NEG, NEG, NEG],
            [0, NEG, NEG, NEG, NEG, 0, NEG, NEG],
            [0, 0, NEG, NEG, NEG, NEG, 0, NEG],
            [0, 0, 0, NEG, NEG, NEG, NEG, 0],
        ]
    )
    torch.testing.assert_close(AlignedMask(2).dense(4), expected)
    # Step 3, query p=3: level 1 up to q=1, level 2 at q=2, level 3 at q=3.
    row = AlignedMask(3).dense(4)[3]
    assert (row == 0).nonzero().squeeze(-1).tolist() == [0, 1, 4 + 2, 8 + 3]


def tiny_features(target, length=12, batch=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, target.spec.vocab_size, (batch, length), generator=generator)
    ones = torch.ones_like(input_ids)
    return extract_features(target, TokenBatch(input_ids, ones, ones), target.spec.aux_layer_ids)


def decode_steps(head, features, input_ids, t, steps):
    """The head drafting autoregressively after the target accepted position t (KV cache, one
    position per step), fed the true next tokens. Returns the output of each step."""
    batch = input_ids.shape[0]
    prefix = torch.arange(t + 1).expand(batch, -1)
    out, key, value = head.step(features[:, : t + 1], input_ids[:, 1 : t + 2], prefix, causal_mask(t + 1))
    outputs = [out[:, -1:]]
    for k in range(2, steps + 1):
        position = t + k - 1
        out, new_key, new_value = head.step(
            outputs[-1],
            input_ids[:, position + 1 : position + 2],
            torch.full((batch, 1), position),
            torch.zeros(1, position + 1),
            key,
            value,
        )
        key, value = torch.cat([key, new_key], dim=2), torch.cat([value, new_value], dim=2)
        outputs.append(out)
    return [o[:, 0] for o in outputs]


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("detach", [True, False])
def test_training_step_j_is_decode_step_j(tiny_target, kind, detach):
    steps = 4
    batch = tiny_features(tiny_target)
    torch.manual_seed(0)
    weights = target_weights(tiny_target)
    if kind == "eagle":
        head = EagleHead(tiny_target.spec, weights, EagleConfig(fc_bias=False))
    else:
        head = Eagle3Head(tiny_target.spec, weights, Eagle3Config(draft_vocab_size=None))
    head = head.double()
    features = head.initial_features(batch.hidden.double(), batch.aux.double())
    outputs = rollout(head, features, batch.input_ids, steps, detach)
    for t in (steps - 1, 5, 7):  # the last draft step still has a true next token
        drafted = decode_steps(head, features, batch.input_ids, t, steps)
        for j in range(1, steps + 1):
            p = t + j - 1
            torch.testing.assert_close(outputs[j - 1][:, p], drafted[j - 1], rtol=0, atol=1e-10)
            torch.testing.assert_close(
                head.logits(outputs[j - 1][:, p]), head.logits(drafted[j - 1]), rtol=0, atol=1e-9
            )


def test_detach_cuts_the_gradient_between_steps(tiny_target):
    batch = tiny_features(tiny_target)
    head = EagleHead(tiny_target.spec, target_weights(tiny_target), EagleConfig(fc_bias=False))
    for detach, connected in ((True, False), (False, True)):
        outputs = rollout(head, batch.hidden, batch.input_ids, 2, detach)
        (grad,) = torch.autograd.grad(outputs[1].sum(), outputs[0], allow_unused=True)
        assert (grad is not None and grad.abs().sum() > 0) == connected
    # Detaching changes gradients, never values.
    a = rollout(head, batch.hidden, batch.input_ids, 3, detach=True)
    b = rollout(head, batch.hidden, batch.input_ids, 3, detach=False)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_rollout_config_validation():
    assert RolloutConfig(steps=3, step_weight_base=0.5).step_weight(3) == 0.25
    with pytest.raises(ValueError, match="steps must be >= 1"):
        RolloutConfig(steps=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("levels", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("length", [2, 9])
def test_aligned_attention_equals_the_dense_mask(dtype, levels, length):
    """The merged causal + diagonal computation equals SDPA under the dense mask, values and the
    gradients of queries, keys and values (grouped heads; queries with no level-1 key at all;
    more levels than positions)."""
    torch.manual_seed(levels * 10 + length)
    query = torch.randn(2, 4, length, 8, dtype=dtype, requires_grad=True)
    keys = torch.randn(2, 2, levels * length, 8, dtype=dtype, requires_grad=True)
    values = torch.randn(2, 2, levels * length, 8, dtype=dtype, requires_grad=True)
    upstream = torch.randn(2, 4, length, 8, dtype=dtype)
    mask = AlignedMask(levels).dense(length).to(dtype)
    expected = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), [query, keys, values])
    got = aligned_attention(query, keys, values, levels)
    grads = torch.autograd.grad((got * upstream).sum(), [query, keys, values])
    tolerance = {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got, expected, **tolerance)
    for name, grad, want in zip(["query", "keys", "values"], grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, want, **tolerance, msg=lambda m, name=name: f"{name}: {m}")


def test_aligned_attention_under_bf16_autocast():
    """bf16 inputs under autocast (bf16-mixed training): the result and gradients are those of the
    dense mask in fp64 on the same inputs, to bf16 rounding."""
    torch.manual_seed(3)
    length, levels = 7, 3
    inputs = [torch.randn(1, 4, length, 8), *[torch.randn(1, 2, levels * length, 8) for _ in range(2)]]
    upstream = torch.randn(1, 4, length, 8)
    low = [x.bfloat16().requires_grad_() for x in inputs]
    exact = [x.bfloat16().double().requires_grad_() for x in inputs]
    mask = AlignedMask(levels).dense(length).double()
    expected = F.scaled_dot_product_attention(*exact, attn_mask=mask, enable_gqa=True)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), exact)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = aligned_attention(*low, levels)
    assert got.dtype == torch.bfloat16
    grads = torch.autograd.grad((got.double() * upstream).sum(), low)
    torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=2e-2)
    for grad, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad.double(), want, rtol=5e-2, atol=5e-2)
