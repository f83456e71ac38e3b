"""A new head kind is its own module plus one registry line (heads/interface.py): ToyHead
(tests/toy_head.py), registered with that line, trains with specdraft-train (HASS: Top-K
distillation and a 3-step aligned rollout), reads back from its checkpoint and from a native
export, and decodes greedily exactly as its target does, with the drafter of its family."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_validated, compose_train
from hydra.utils import instantiate
from toy_head import ToyConfig, ToyHead

from specdraft.data.target import target_weights
from specdraft.eval.decode import plain_generate, speculative_generate
from specdraft.eval.drafters import Chain, DynamicTree
from specdraft.eval.load import load_head
from specdraft.eval.methods import drafter_for_head
from specdraft.eval.runner import TargetRunner
from specdraft.eval.sampling import Sampling
from specdraft.heads.formats import read_head, write_export
from specdraft.heads.registry import HEAD_KINDS, build_head
from specdraft.train.cli import train

MAX_NEW = 24
SHAPES = [Chain(depth=3), DynamicTree(depth=3, top_k=2, total_tokens=8)]


@pytest.fixture
def toy_kind(monkeypatch):
    monkeypatch.setitem(HEAD_KINDS, ToyHead.kind, ToyHead)  # the one registry line


def greedy_equals_plain(head: ToyHead, target) -> None:
    prompt = torch.randint(3, target.spec.vocab_size, (10,), generator=torch.Generator().manual_seed(0))
    expected = plain_generate(TargetRunner(target), prompt, MAX_NEW, Sampling(), ()).tokens
    for shape in SHAPES:
        drafter = drafter_for_head(head, shape)
        runner = TargetRunner(target, head.target_taps)
        generation = speculative_generate(runner, drafter, prompt, MAX_NEW, Sampling(), ())
        assert generation.tokens == expected, shape


def test_a_new_head_kind_trains_exports_and_decodes(tmp_path, toy_kind):
    cfg = compose_train(
        tmp_path / "run", "experiment=hass", "debug=smoke", "head.kind=toy",
        "~head.config.fc_bias", "+head.config.gate_init=0.5",
    )  # fmt: skip
    summary = train(cfg)
    assert summary["kind"] == "toy" and summary["global_step"] == cfg.trainer.max_steps
    assert_validated(summary)

    target = instantiate(cfg.target)
    checkpoint = tmp_path / "run" / "checkpoints" / "last.ckpt"
    head = load_head(checkpoint, target, dtype=torch.float32)
    assert isinstance(head, ToyHead) and head.config == ToyConfig(gate_init=0.5)
    assert not torch.equal(head.gate, torch.full_like(head.gate, 0.5)), "training did not reach the gate"

    export_dir = write_export(
        tmp_path / "native", read_head(checkpoint, target.spec), "native", target_spec=target.spec
    )
    exported = load_head(export_dir, target, dtype=torch.float32)
    assert exported.state_dict().keys() == head.state_dict().keys()
    assert all(torch.equal(exported.state_dict()[k], v) for k, v in head.state_dict().items())

    greedy_equals_plain(head.float(), target)


def test_a_new_head_kind_decodes_on_a_diverse_target(diverse_target, toy_kind):
    torch.manual_seed(1)
    head = build_head("toy", {}, diverse_target.spec, target_weights(diverse_target))
    with torch.no_grad():  # untrained, but not the init
        for parameter in head.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    greedy_equals_plain(head.eval(), diverse_target)
