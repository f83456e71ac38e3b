"""data/packed_linear.py, data/attention.py and eval/kernels.py: pre-packed linear weights give
the same outputs, keep the module, and fall back to plain PyTorch wherever a gradient is needed;
attention on the key/value heads gives transformers' SDPA outputs; compiled steps decode the same
tokens."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specdraft.data.attention import (
    GROUPED_QUERY_ATTENTION,
    grouped_query_attention,
    use_grouped_query_attention,
)
from specdraft.data.packed_linear import PackedLinear, pack_linear_weights
from specdraft.data.target import target_weights
from specdraft.data.tiny import tiny_random_target
from specdraft.eval.decode import plain_generate, speculative_generate
from specdraft.eval.drafters import DynamicTree
from specdraft.eval.feature_drafter import FeatureHeadDrafter
from specdraft.eval.runner import TargetRunner
from specdraft.eval.sampling import Sampling
from specdraft.eval.trees import tree_buffers
from specdraft.heads.registry import build_head

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")


def test_packed_linear_matches_and_keeps_the_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 96), nn.SiLU(), nn.Linear(96, 300, bias=False))
    weight = model[2].weight
    keys = set(model.state_dict())
    x = torch.randn(3, 5, 48)
    with torch.no_grad():
        expected = model(x)
    assert pack_linear_weights(model) == 2
    assert isinstance(model[0], PackedLinear) and model[2].weight is weight
    assert set(model.state_dict()) == keys  # the packed copy is not a parameter or buffer
    with torch.no_grad():
        # any number of rows, any leading shape
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(x[:, :1]), expected[:, :1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(x[0, 0]), expected[0, 0], rtol=1e-5, atol=1e-5)
    model(x).sum().backward()  # with grad enabled: the plain nn.Linear path, gradients flow
    assert weight.grad is not None and weight.grad.abs().sum() > 0


def test_greedy_speculative_equals_plain_on_a_packed_target():
    target = tiny_random_target(seed=0)
    assert pack_linear_weights(target.model) > 0
    prompt = torch.randint(3, target.spec.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    expected = plain_generate(TargetRunner(target), prompt, 24, Sampling(), ()).tokens
    torch.manual_seed(1)
    head = build_head("eagle", {"fc_bias": False}, target.spec, target_weights(target)).eval()
    drafter = FeatureHeadDrafter(head, DynamicTree(depth=3, top_k=3, total_tokens=8))
    assert speculative_generate(TargetRunner(target), drafter, prompt, 24, Sampling(), ()).tokens == expected


def test_grouped_query_attention_gives_sdpas_outputs_on_every_path_the_runner_takes():
    """Prefill, a causal multi-token extend after a past (SDPA's masks must still be built), a
    one-token step, and a tree verification under its mask (the path that changes: the query
    heads stacked on their key/value head) all give what transformers' SDPA gives, on a runner
    with dynamic and with static shapes."""
    target = tiny_random_target(seed=0)  # 4 query heads on 2 key/value heads
    model = target.model
    assert model.config.num_attention_heads > model.config.num_key_value_heads
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, target.spec.vocab_size, (20,), generator=generator)
    more = torch.randint(3, target.spec.vocab_size, (5,), generator=generator)
    tree = tree_buffers([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
    nodes = torch.randint(3, target.spec.vocab_size, (tree.num_nodes,), generator=generator)

    def outputs() -> list[torch.Tensor]:
        logits = []
        for static in (False, True):  # static: masks over the cache's whole capacity (graphs=True)
            runner = TargetRunner(target, graphs=static)
            logits += [
                runner.prefill(prompt).logits,
                runner.extend(more).logits,
                runner.extend(more[:1]).logits,
            ]
            logits.append(runner.verify(nodes, tree).logits)
        return logits

    expected = outputs()
    assert use_grouped_query_attention(model) and model.config._attn_implementation == GROUPED_QUERY_ATTENTION
    for got, want in zip(outputs(), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and a query that saw its siblings would differ: the mask reaches every stacked row
    model.set_attn_implementation("sdpa")
    runner = TargetRunner(target)
    runner.prefill(prompt), runner.extend(more), runner.extend(more[:1])
    chain = tree_buffers([(0,) * depth for depth in range(1, tree.num_nodes)])  # each node sees all before
    assert not torch.allclose(runner.verify(nodes, chain).logits, expected[3], atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_token_bf16_query_runs_as_rows_of_its_key_value_head(monkeypatch, dtype):
    """Plain decoding's step (one query token, no mask): in bf16 on a CPU the query heads are
    stacked as rows of their key/value head (SDPA's enable_gqa kernel is ~5x slower there), in
    fp32 transformers' enable_gqa stays; both give grouped-query attention's outputs (each query
    head reads key/value head h // groups)."""
    module = nn.Module()
    module.num_key_value_groups = 3
    generator = torch.Generator().manual_seed(0)
    query, key, value = (
        torch.randn(2, heads, length, 16, generator=generator).to(dtype)
        for heads, length in ((6, 1), (2, 40), (2, 40))
    )
    scores = query.float() @ key.float().repeat_interleave(3, 1).transpose(-1, -2) / 4
    expected = (scores.softmax(-1) @ value.float().repeat_interleave(3, 1)).transpose(1, 2)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        calls.append((tuple(q.shape), kwargs.get("enable_gqa", False)))
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    output, _ = grouped_query_attention(module, query, key, value, None)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(output.float(), expected, rtol=tolerance, atol=tolerance)
    stacked = dtype == torch.bfloat16
    assert calls == [((2, 2, 3, 16), False)] if stacked else calls == [((2, 6, 1, 16), True)]


def test_compiled_steps_decode_the_same_tokens_and_drafts():
    """``compile: true`` (the target's decoder and the head's step through torch.compile) changes
    how fast, not what: the same greedy tokens as uncompiled plain decoding, and the same drafts
    (greedy equality alone is blind to a drafter that drafts differently)."""
    target = tiny_random_target(seed=0)
    pack_linear_weights(target.model)  # as the bench runs it: packed, and compiled on request
    prompt = torch.randint(3, target.spec.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    expected = plain_generate(TargetRunner(target), prompt, 24, Sampling(), ()).tokens
    torch.manual_seed(1)
    head = build_head("eagle", {"fc_bias": False}, target.spec, target_weights(target)).eval()
    with torch.no_grad():  # away from the near-identity of a fresh init, so drafts vary
        for parameter in head.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    pack_linear_weights(head)
    shape = DynamicTree(depth=3, top_k=3, total_tokens=8)
    eager, compiled = FeatureHeadDrafter(head, shape), FeatureHeadDrafter(head, shape, compile=True)
    runner = TargetRunner(target, compile=True)
    assert plain_generate(runner, prompt, 24, Sampling(), ()).tokens == expected
    assert speculative_generate(runner, compiled, prompt, 24, Sampling(), ()).tokens == expected

    output = TargetRunner(target).prefill(prompt)
    root = int(output.logits[-1].argmax())
    drafts = []
    for drafter in (eager, compiled):
        drafter.reset()
        drafter.commit(prompt.tolist(), output, root)
        drafts.append(drafter.draft(root, Sampling()))
    torch.testing.assert_close(compiled.root_log_probs, eager.root_log_probs)
    assert torch.equal(drafts[0].tokens, drafts[1].tokens)
    assert torch.equal(drafts[0].tree.parents, drafts[1].tree.parents)
