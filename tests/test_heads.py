"""Draft heads: shapes, parameter counts, frozen parts, no shared weights, draft vocab maps."""

from __future__ import annotations

import pytest
import torch

from specdraft.heads import (
    Eagle3Config,
    Eagle3Head,
    EagleConfig,
    EagleHead,
    MedusaConfig,
    MedusaHead,
    draft_vocab_from_counts,
    layers,
    random_target_weights,
)
from specdraft.heads.layers import causal_mask, stacked_query_attention
from specdraft.heads.vocab import target_to_draft_index


@pytest.fixture(scope="module")
def spec(tiny_target):
    return tiny_target.spec


@pytest.fixture(scope="module")
def weights(spec):
    return random_target_weights(spec, seed=1)


def trainable(module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def test_medusa_parameter_count_and_blocks_not_shared(spec, weights):
    H, V = spec.hidden_size, spec.vocab_size
    head = MedusaHead(spec, weights, MedusaConfig(num_heads=3, num_layers=2, own_lm_head=False))
    assert trainable(head) == 3 * 2 * (H * H + H)
    own = MedusaHead(spec, weights, MedusaConfig(num_heads=3, num_layers=2, own_lm_head=True))
    assert trainable(own) == 3 * 2 * (H * H + H) + 3 * V * H
    # Medusa's reference bug `[ResBlock(H)] * L` shares one block; ours are distinct tensors.
    pointers = {p.data_ptr() for p in own.parameters()}
    assert len(pointers) == len(list(own.parameters()))
    for lm_head in own.lm_heads:
        assert torch.equal(lm_head.weight, weights.lm_head)
    hidden = torch.randn(2, 5, H)
    logits = head(hidden)
    assert logits.shape == (3, 2, 5, V)
    # W starts at zero, so a block is x + SiLU(b): with b = 0 the head is the target's lm_head.
    for block in head.blocks[1]:
        assert torch.count_nonzero(block.linear.weight) == 0
        torch.nn.init.zeros_(block.linear.bias)
    torch.testing.assert_close(head(hidden)[1], hidden @ weights.lm_head.T)


def test_eagle_parameter_count(spec, weights):
    H, inter, heads, kv, d = (
        spec.hidden_size,
        spec.intermediate_size,
        spec.num_attention_heads,
        spec.num_kv_heads,
        spec.head_dim,
    )
    layer = H * heads * d + 2 * H * kv * d + heads * d * H + 3 * H * inter + H
    assert trainable(EagleHead(spec, weights, EagleConfig(fc_bias=False))) == 2 * H * H + layer
    assert trainable(EagleHead(spec, weights, EagleConfig(fc_bias=True))) == 2 * H * H + H + layer
    # EAGLE-3: attention reads 2H; fc fuses k aux layers; 3 norms; a draft-vocab lm_head.
    k = len(spec.aux_layer_ids)
    e3 = Eagle3Head(spec, weights, Eagle3Config(draft_vocab_size=100))
    layer3 = 2 * H * heads * d + 2 * 2 * H * kv * d + heads * d * H + 3 * H * inter + H
    assert trainable(e3) == k * H * H + layer3 + 3 * H + 100 * H


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3"])
def test_frozen_target_weights_stay_out_of_state_and_gradients(spec, weights, kind):
    head = {
        "medusa": lambda: MedusaHead(
            spec, weights, MedusaConfig(num_heads=4, num_layers=1, own_lm_head=False)
        ),
        "eagle": lambda: EagleHead(spec, weights, EagleConfig(fc_bias=False)),
        "eagle3": lambda: Eagle3Head(spec, weights, Eagle3Config(draft_vocab_size=None)),
    }[kind]()
    state = {k: v.clone() for k, v in head.state_dict().items()}
    assert not any(name.startswith("target_") for name in state), sorted(state)
    assert all(p.requires_grad for p in head.parameters())
    for name, buffer in head.named_buffers():
        assert not buffer.requires_grad, name
    # A backward pass leaves the frozen embedding / lm_head untouched and gradient-free.
    before = {n: b.clone() for n, b in head.named_buffers()}
    tokens = torch.randint(0, spec.vocab_size, (2, 6))
    hidden = torch.randn(2, 6, spec.hidden_size)
    if kind == "medusa":
        loss = head(hidden).sum()
    else:
        aux = torch.randn(2, 6, len(spec.aux_layer_ids) * spec.hidden_size)
        features = head.initial_features(hidden, aux)
        positions = torch.arange(6).expand(2, 6)
        out, _, _ = head.step(features, tokens, positions, causal_mask(6))
        loss = head.logits(out).sum()
    loss.backward()
    for name, buffer in head.named_buffers():
        assert torch.equal(buffer, before[name]), name
    assert all(p.grad is not None for p in head.parameters() if p.requires_grad)


def test_eagle3_warm_start_and_vocab_maps(spec, weights):
    counts = torch.zeros(spec.vocab_size)
    counts[[7, 3, 200, 50]] = torch.tensor([5.0, 9.0, 9.0, 1.0])
    d2t, t2d = draft_vocab_from_counts(counts, 3)
    # The three most frequent (3 and 200 tie at 9, then 7), ordered by target id; offsets.
    assert (torch.arange(3) + d2t).tolist() == [3, 7, 200]
    assert d2t.tolist() == [3, 6, 198]
    assert t2d.nonzero().squeeze(-1).tolist() == [3, 7, 200]
    assert target_to_draft_index(t2d)[[3, 7, 200, 4]].tolist() == [0, 1, 2, -1]
    head = Eagle3Head(spec, weights, Eagle3Config(draft_vocab_size=3))
    head.set_draft_vocab(d2t, t2d)
    assert torch.equal(head.lm_head.weight, weights.lm_head[[3, 7, 200]])
    assert head.draft_to_target(torch.tensor([0, 2])).tolist() == [3, 200]
    assert {"d2t", "t2d"} <= set(head.state_dict())


def test_eagle3_rejects_inconsistent_vocab(spec, weights):
    d2t, t2d = draft_vocab_from_counts(torch.ones(spec.vocab_size), 10)
    head = Eagle3Head(spec, weights, Eagle3Config(draft_vocab_size=20))
    with pytest.raises(ValueError, match=r"expected \(20,\)"):
        head.set_draft_vocab(d2t, t2d)
    state = {k: v.clone() for k, v in head.state_dict().items()}
    with pytest.raises(ValueError, match="t2d marks 19 tokens"):  # a loaded state is checked too
        head.load_state_dict({**state, "t2d": state["t2d"].clone().index_fill_(0, torch.tensor([0]), False)})
    with pytest.raises(ValueError, match="does not mark"):
        head.set_draft_vocab(torch.full((20,), 5), state["t2d"])
    swapped = state["d2t"].clone()
    swapped[:2] = torch.tensor([1, -1])  # draft ids 0 and 1 -> target ids 1 and 0
    with pytest.raises(ValueError, match="increasing target ids"):
        head.set_draft_vocab(swapped, state["t2d"])
    with pytest.raises(ValueError, match="draft_vocab_size must be >= 1"):
        Eagle3Head(spec, weights, Eagle3Config(draft_vocab_size=0))
    # No smaller than the target's vocabulary: the full vocabulary, as the config records it.
    assert (
        Eagle3Head(spec, weights, Eagle3Config(draft_vocab_size=spec.vocab_size + 5)).config.draft_vocab_size
        is None
    )
    with pytest.raises(ValueError, match="draft_vocab_size must be"):
        draft_vocab_from_counts(torch.ones(5), 6)


def test_weights_of_the_wrong_shape_are_refused(spec, weights):
    from dataclasses import replace

    other = replace(spec, vocab_size=spec.vocab_size + 1)
    with pytest.raises(ValueError, match="embedding has shape"):
        EagleHead(other, weights, EagleConfig(fc_bias=False))


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3"])
def test_head_rebuilds_from_its_state(spec, weights, kind):
    from specdraft.heads.registry import build_head, head_from_state

    config = {
        "medusa": {"num_heads": 2, "num_layers": 1, "own_lm_head": False},
        "eagle": {"fc_bias": True},
        "eagle3": {"draft_vocab_size": 50},
    }[kind]
    torch.manual_seed(0)
    head = build_head(kind, config, spec, weights)
    head.choose_vocabulary(lambda: torch.rand(spec.vocab_size))
    for p in head.parameters():
        p.data.normal_()
    state = {k: v.clone() for k, v in head.state_dict().items()}
    rebuilt = head_from_state(kind, config, spec, weights, state)
    x = torch.randn(2, 3, spec.hidden_size)
    if kind == "medusa":
        torch.testing.assert_close(rebuilt(x), head(x), rtol=0, atol=0)
    else:
        torch.testing.assert_close(rebuilt.logits(x), head.logits(x), rtol=0, atol=0)
    state.pop(next(k for k in state if k.endswith(".weight")))
    with pytest.raises(RuntimeError, match="Missing key"):
        head_from_state(kind, config, spec, weights, state)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_step_writing_into_a_preallocated_cache_equals_one_given_the_past(spec, weights, kind):
    """Decoding writes a step's keys/values into the head's cache at ``cache_index`` and attends
    over the whole cache under a mask; it must equal the step that is given the past and
    concatenates (training's path): same outputs, same new keys/values, now in the cache."""
    torch.manual_seed(0)
    head = (
        EagleHead(spec, weights, EagleConfig(fc_bias=False))
        if kind == "eagle"
        else Eagle3Head(spec, weights, Eagle3Config(draft_vocab_size=None))
    ).eval()
    past, n, capacity = 5, 3, 12
    kv_shape = (1, spec.num_kv_heads, capacity, spec.head_dim)
    cache_key, cache_value = torch.randn(kv_shape), torch.randn(kv_shape)  # junk beyond the past
    features = torch.randn(1, n, spec.hidden_size)
    tokens = torch.randint(0, spec.vocab_size, (1, n))
    positions = past + torch.arange(n)[None]
    with torch.no_grad():
        expected = head.step(
            features,
            tokens,
            positions,
            causal_mask(n, past=past),
            cache_key[:, :, :past],
            cache_value[:, :, :past],
        )
        # The new entries go to the middle of the cache; the junk after them stays masked.
        mask = torch.full((n, capacity), float("-inf"))
        mask[:, :past] = 0
        mask[:, past : past + n] = causal_mask(n)
        written = head.step(features, tokens, positions, mask, cache_key, cache_value, past + torch.arange(n))
    for got, want in zip(written, expected, strict=True):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(cache_key[:, :, past : past + n], expected[1])
    torch.testing.assert_close(cache_value[:, :, past : past + n], expected[2])


@pytest.mark.parametrize("mask_dims", [0, 2, 4])
@pytest.mark.parametrize("n", [1, 3])
def test_stacked_queries_attend_as_grouped_query_attention(n, mask_dims):
    """Query heads stacked as rows of their key/value head (one token, or n under a mask tiled
    over the rows) give grouped-query attention: query head h reads key/value head h // groups,
    each token under its own mask row."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 6, n, 8, generator=generator)
    keys, values = (
        torch.randn(2, 2, 10, 8, generator=generator),
        torch.randn(2, 2, 10, 8, generator=generator),
    )
    visible = torch.rand(n, 10, generator=generator) > 0.3
    visible[:, 0] = True
    additive = torch.zeros(n, 10).masked_fill(~visible, float("-inf"))
    mask = {0: None, 2: additive, 4: additive[None, None].expand(2, 1, n, 10)}[mask_dims]
    scores = query @ keys.repeat_interleave(3, 1).transpose(-1, -2) / 8**0.5
    if mask is not None:
        scores = scores + additive
    expected = scores.softmax(-1) @ values.repeat_interleave(3, 1)
    torch.testing.assert_close(stacked_query_attention(query, keys, values, mask), expected)


@pytest.mark.parametrize("n", [1, 3])
def test_a_bf16_draft_step_attends_with_its_queries_stacked(spec, weights, n, monkeypatch):
    """A decoding step's few bf16 query tokens under a mask on a CPU (where SDPA's grouped-query
    kernel is slow) run as rows of their key/value head, with what that kernel gives."""
    torch.manual_seed(0)
    head = EagleHead(spec, weights, EagleConfig(fc_bias=False)).eval().to(torch.bfloat16)
    past, capacity = 5, 12
    kv_shape = (1, spec.num_kv_heads, capacity, spec.head_dim)
    cache = torch.randn(kv_shape).bfloat16(), torch.randn(kv_shape).bfloat16()
    features = torch.randn(1, n, spec.hidden_size).bfloat16()
    tokens = torch.randint(0, spec.vocab_size, (1, n))
    mask = torch.full((n, capacity), float("-inf"))
    mask[:, :past] = 0
    mask[:, past : past + n] = causal_mask(n)

    def step():
        keys, values = (c.clone() for c in cache)
        with torch.no_grad():
            return head.step(
                features, tokens, past + torch.arange(n)[None], mask, keys, values, past + torch.arange(n)
            )

    stacked = []
    monkeypatch.setattr(
        layers, "stacked_query_attention", lambda *a: stacked.append(1) or stacked_query_attention(*a)
    )
    got = step()
    assert stacked
    monkeypatch.setattr(layers, "SLOW_GROUPED_QUERY_KERNEL", frozenset())  # SDPA's enable_gqa
    for ours, sdpa in zip(got, step(), strict=True):
        torch.testing.assert_close(ours.float(), sdpa.float(), rtol=2e-2, atol=2e-2)
    assert len(stacked) == 1
