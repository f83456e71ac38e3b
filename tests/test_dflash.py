"""The DFlash head: its block attention against a dense reference, many blocks in one training
forward against each block run alone, the anchors, the per-step positions the objective trains
on, and its frozen parts."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from specdraft.data.features import FeatureBatch
from specdraft.heads import DFlashConfig, DFlashHead, random_target_weights
from specdraft.heads.dflash import Blocks, block_attention
from specdraft.train.losses import LossWeights
from specdraft.train.objective import DraftObjective, RolloutConfig

BLOCK = 4


@pytest.fixture(scope="module")
def spec(tiny_target):
    return tiny_target.spec


@pytest.fixture(scope="module")
def weights(spec):
    return random_target_weights(spec, seed=1)


def make_head(spec, weights, **overrides) -> DFlashHead:
    config = {"num_layers": 2, "block_size": BLOCK, "mask_token_id": None, "anchor_fraction": 0.5}
    torch.manual_seed(0)
    head = DFlashHead(spec, weights, DFlashConfig(**{**config, **overrides})).double()
    for name, p in head.named_parameters():  # away from the init: norms and projections all matter
        p.data.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.05))
    return head


def make_batch(spec, lengths=(13, 9), seed=0) -> FeatureBatch:
    generator = torch.Generator().manual_seed(seed)
    rows, length = len(lengths), max(lengths)
    attention = torch.zeros(rows, length, dtype=torch.long)
    for row, n in enumerate(lengths):
        attention[row, :n] = 1
    loss_mask = attention.clone()
    loss_mask[:, :3] = 0  # a prompt: the first tokens are not supervised
    taps = len(spec.aux_layer_ids) * spec.hidden_size
    return FeatureBatch(
        input_ids=torch.randint(0, spec.vocab_size, (rows, length), generator=generator) * attention,
        attention_mask=attention,
        loss_mask=loss_mask,
        hidden=torch.randn(rows, length, spec.hidden_size, generator=generator, dtype=torch.float64),
        aux=torch.randn(rows, length, taps, generator=generator, dtype=torch.float64)
        * attention.unsqueeze(-1),
    )


def test_block_attention_equals_a_dense_masked_softmax():
    """Independent reference: every block's queries over [context keys it may see | all n·k block
    keys] under one dense mask (its own block only), grouped-query heads repeated."""
    torch.manual_seed(0)
    batch, heads, kv, n, k, d, length = 2, 4, 2, 3, 5, 8, 7
    query = torch.randn(batch, heads, n, k, d, dtype=torch.float64)
    context_key, context_value = (torch.randn(batch, kv, length, d, dtype=torch.float64) for _ in "kv")
    key, value = (torch.randn(batch, kv, n, k, d, dtype=torch.float64) for _ in "kv")
    context = torch.rand(batch, n, length) < 0.6
    context[:, :, 0] = True
    got = block_attention(query, context_key, context_value, key, value, context)

    keys = torch.cat([context_key, key.reshape(batch, kv, n * k, d)], dim=2).repeat_interleave(heads // kv, 1)
    values = torch.cat([context_value, value.reshape(batch, kv, n * k, d)], dim=2)
    values = values.repeat_interleave(heads // kv, 1)
    own_block = torch.arange(n).repeat_interleave(k)
    allowed = torch.cat(
        [
            context.repeat_interleave(k, dim=1),
            (own_block[:, None] == own_block[None, :]).expand(batch, -1, -1),
        ],
        dim=-1,
    )
    scores = query.reshape(batch, heads, n * k, d) @ keys.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    expected = (scores.softmax(-1) @ values).reshape(batch, heads, n, k, d)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_many_blocks_in_one_forward_equal_each_block_run_alone(spec, weights):
    """A training forward's step j output at column (b, block) is the block at that anchor run by
    itself over the target features before its anchor only, and q = anchor + j − 1."""
    head = make_head(spec, weights).eval()
    batch = make_batch(spec)
    predictions = head.training_predictions(batch, steps=BLOCK - 1, detach=True)
    anchors, kept = head.sample_anchors(batch)
    assert predictions.outputs.shape[:2] == (BLOCK - 1, anchors.numel())
    features = head.context_features(batch.aux)
    checked = 0
    for column, (row, anchor) in enumerate(
        zip(torch.arange(2).repeat_interleave(anchors.shape[1]), anchors.flatten(), strict=True)
    ):
        if not kept.flatten()[column]:
            continue
        row, anchor = int(row), int(anchor)
        past = features[row : row + 1, :anchor]
        context_kv = head.context_keys_values(past, torch.arange(anchor)[None])
        blocks = Blocks(
            head.block_tokens(batch.input_ids[row, anchor].view(1, 1)), torch.tensor([[anchor]]), None
        )
        alone = head.block_outputs(blocks, context_kv, torch.float64)[0, 0]  # k×H
        for j in range(1, BLOCK):
            assert int(predictions.positions[j - 1, column]) == min(
                anchor + j - 1, batch.input_ids.shape[1] - 1
            )
            assert int(predictions.batch_index[j - 1, column]) == row
            torch.testing.assert_close(predictions.outputs[j - 1, column], alone[j], rtol=1e-9, atol=1e-9)
        checked += 1
    assert checked >= 4


def test_anchors_and_valid_steps(spec, weights):
    """Anchors: candidates only (the next token supervised), the fraction asked, sorted, the same
    blocks at every validation and for the same batch seed; a step is valid where its q is
    supervised and inside the sequence."""
    head = make_head(spec, weights)
    batch = make_batch(spec, lengths=(16, 11))
    supervised = (batch.loss_mask[:, 1:] * batch.attention_mask[:, 1:]).bool()
    head.eval()
    anchors, kept = head.sample_anchors(batch)
    again, _ = head.sample_anchors(batch)
    assert torch.equal(anchors, again)
    for row in range(2):
        chosen = anchors[row][kept[row]]
        assert len(chosen) == math.ceil(int(supervised[row].sum()) * 0.5)
        assert torch.equal(chosen, chosen.sort().values) and len(chosen.unique()) == len(chosen)
        assert bool(supervised[row, chosen].all())
    head.train()
    batch.seed = 7
    first, _ = head.sample_anchors(batch)
    assert torch.equal(first, head.sample_anchors(batch)[0])
    batch.seed = 8
    assert not torch.equal(first, head.sample_anchors(batch)[0])

    head.eval()
    predictions = head.training_predictions(batch, BLOCK - 1, True)
    q, b = predictions.positions, predictions.batch_index
    inside = (anchors.flatten()[None] + torch.arange(BLOCK - 1)[:, None]) < batch.input_ids.shape[1]
    padded_supervision = torch.cat([supervised, torch.zeros(2, 1, dtype=torch.bool)], dim=1)
    expected = kept.flatten()[None] & inside & padded_supervision[b, q]
    assert torch.equal(predictions.valid, expected)
    assert not bool(predictions.valid.all()) and bool(predictions.valid.any())


def test_the_objective_trains_each_step_at_its_own_positions(spec, weights):
    """Σ_j β^(j−1) · mean over step j's valid (b, q) of CE(draft logits, x_{q+1}), written out."""
    head = make_head(spec, weights).eval()
    batch = make_batch(spec)
    objective = DraftObjective(
        LossWeights(ce=1.0), RolloutConfig(step_weight_base=0.7), eval_steps=1, chunk_size=5
    )
    out = objective(head, batch, train=True)
    predictions = head.training_predictions(batch, BLOCK - 1, True)
    expected = 0.0
    for j in range(BLOCK - 1):
        valid = predictions.valid[j]
        b, q = predictions.batch_index[j][valid], predictions.positions[j][valid]
        logits = head.logits(predictions.outputs[j][valid])
        ce = F.cross_entropy(logits.float(), batch.input_ids[b, q + 1])
        expected = expected + 0.7**j * ce
        assert out.counts[j] == int(valid.sum())
        target_argmax = head.target_logits(batch.hidden[b, q]).argmax(-1)
        assert out.matches[j] == int((logits.argmax(-1) == target_argmax).sum())
    torch.testing.assert_close(out.loss.double(), expected.double(), rtol=1e-5, atol=1e-6)
    assert len(out.accuracy) == BLOCK - 1


def test_frozen_parts_stay_frozen_and_every_weight_trains(spec, weights):
    head = make_head(spec, weights)
    state = head.state_dict()
    assert not any(name.startswith("target_") for name in state), sorted(state)
    before = {n: b.clone() for n, b in head.named_buffers()}
    batch = make_batch(spec)
    predictions = head.training_predictions(batch, BLOCK - 1, True)
    head.logits(predictions.outputs[predictions.valid]).sum().backward()
    for name, buffer in head.named_buffers():
        assert torch.equal(buffer, before[name]), name
    missing = [n for n, p in head.named_parameters() if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    assert not missing


def test_bad_configs_are_refused(spec, weights):
    with pytest.raises(ValueError, match="block_size >= 2"):
        DFlashConfig(num_layers=1, block_size=1, mask_token_id=None, anchor_fraction=0.5)
    with pytest.raises(ValueError, match="anchor_fraction"):
        DFlashConfig(num_layers=1, block_size=4, mask_token_id=None, anchor_fraction=0)
    config = DFlashConfig(num_layers=1, block_size=4, mask_token_id=spec.vocab_size, anchor_fraction=0.5)
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashHead(spec, weights, config)
    head = DFlashHead(spec, weights, DFlashConfig(1, 4, None, 0.5))
    assert head.config.mask_token_id == spec.vocab_size - 1  # null: the last id, resolved and recorded
