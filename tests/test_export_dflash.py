"""DFlash exports: the z-lab layout (``format=dflash``), vLLM's (``vllm``) and the speculators
format read back bit for bit (tests/test_export.py covers every kind and dtype); here what a round
trip cannot see. A z-lab export, loaded by a re-implementation of z-lab's ``DFlashDraftModel``
forward written below from the reference's description, drafts the same logits as our head; the
layer ids convert by hand-written expectation; what the layouts cannot hold is refused in one line;
``specdraft-export`` converts a DFlash training checkpoint that ``specdraft-eval`` loads back."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_module
from safetensors.torch import load_file
from torch import Tensor
from transformers import AutoConfig
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from specdraft.data.target import target_weights
from specdraft.data.tiny import tiny_random_target
from specdraft.eval.load import load_head
from specdraft.eval.runner import TargetRunner
from specdraft.heads.dflash import Blocks
from specdraft.heads.formats import FormatError, HeadRecord, export_files, read_export, write_export
from specdraft.heads.frozen import random_target_weights
from specdraft.heads.registry import build_head, config_record
from specdraft.train.export import export

CONFIG = {"num_layers": 2, "block_size": 4, "mask_token_id": 7, "anchor_fraction": 0.5}
LAYOUTS = ("dflash", "vllm", "speculators")


@pytest.fixture(scope="module")
def target():
    return tiny_random_target(seed=0)


def random_head(target, config: dict = CONFIG, seed: int = 0):
    """A DFlash head whose every weight (norms included) is random and distinct: a swapped or
    dropped name changes the draft."""
    head = build_head("dflash", config, target.spec, target_weights(target))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.copy_(1.0 + torch.randn(parameter.shape, generator=generator) * 0.3)
        for name, parameter in head.named_parameters():
            if name.endswith("proj.weight") or name == "fc.weight":
                parameter.mul_(0.3 / math.sqrt(parameter.shape[1]))
    return head.eval()


def record_of(head) -> HeadRecord:
    return HeadRecord("dflash", config_record(head), head.spec, head.state_dict())


# -- z-lab's DFlashDraftModel, re-implemented from its description --------------------------------
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def zlab_draft_logits(export_dir: Path, target, prompt: list[int], anchor_token: int) -> Tensor:
    """block_size×V draft logits of z-lab's forward, reading only the export's files and the target.

    The target runs the prompt; the context is ``hidden_norm(fc(cat(hidden_states[id + 1] for id in
    target_layer_ids)))`` over every prompt position. The block (the anchor token, then mask tokens,
    embedded by the target) sits at the positions after the prompt. Each Qwen3 layer: input norm;
    queries from the block, keys/values from [context; block] through the SAME k/v projections,
    q_norm / k_norm per head, rotary at positions 0..T+k-1, attention not causal (no mask);
    post-attention norm, SwiGLU MLP; the final ``norm``, read out by the target's lm_head."""
    config = AutoConfig.from_pretrained(export_dir)  # as z-lab's from_pretrained reads it
    weights = load_file(export_dir / "model.safetensors")
    eps, d = config.rms_norm_eps, config.head_dim
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    with torch.no_grad():
        states = target.model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        fused = torch.cat([states[i + 1] for i in config.dflash_config["target_layer_ids"]], dim=-1)
        context = rms_norm(fused @ weights["fc.weight"].T, weights["hidden_norm.weight"], eps)
        block = [anchor_token] + [config.dflash_config["mask_token_id"]] * (config.block_size - 1)
        x = target.model.get_input_embeddings()(torch.tensor([block]))
        length, k = context.shape[1], len(block)
        cos, sin = Qwen3RotaryEmbedding(config)(x, torch.arange(length + k)[None])
        cos, sin = cos[:, None], sin[:, None]  # 1×1×L×d
        for i in range(config.num_hidden_layers):
            w = {
                name.removeprefix(f"layers.{i}."): t
                for name, t in weights.items()
                if name.startswith(f"layers.{i}.")
            }
            h = rms_norm(x, w["input_layernorm.weight"], eps)
            q = rms_norm(
                (h @ w["self_attn.q_proj.weight"].T).view(1, k, heads, d), w["self_attn.q_norm.weight"], eps
            )
            keys = torch.cat([context, h], dim=1) @ w["self_attn.k_proj.weight"].T
            keys = rms_norm(keys.view(1, length + k, kv_heads, d), w["self_attn.k_norm.weight"], eps)
            values = (torch.cat([context, h], dim=1) @ w["self_attn.v_proj.weight"].T).view(
                1, length + k, kv_heads, d
            )
            q, keys, values = q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
            q = q * cos[..., -k:, :] + rotate_half(q) * sin[..., -k:, :]
            keys = keys * cos + rotate_half(keys) * sin
            keys = keys.repeat_interleave(heads // kv_heads, dim=1)
            values = values.repeat_interleave(heads // kv_heads, dim=1)
            attended = F.scaled_dot_product_attention(q, keys, values, is_causal=False)
            x = x + attended.transpose(1, 2).reshape(1, k, heads * d) @ w["self_attn.o_proj.weight"].T
            h = rms_norm(x, w["post_attention_layernorm.weight"], eps)
            gate, up = h @ w["mlp.gate_proj.weight"].T, h @ w["mlp.up_proj.weight"].T
            x = x + (F.silu(gate) * up) @ w["mlp.down_proj.weight"].T
        return target.model.lm_head(rms_norm(x, weights["norm.weight"], eps))[0]


def our_draft_logits(head, target, prompt: list[int], anchor_token: int) -> Tensor:
    """block_size×V: our head over the aux taps the decoder's TargetRunner captures."""
    with torch.no_grad():
        aux = TargetRunner(target, head.spec.aux_layer_ids).prefill(torch.tensor(prompt)).aux[None]
        features = head.context_features(aux)
        context_kv = head.context_keys_values(features, torch.arange(len(prompt))[None])
        blocks = Blocks(
            head.block_tokens(torch.tensor([[anchor_token]])), torch.tensor([[len(prompt)]]), None
        )
        return head.logits(head.block_outputs(blocks, context_kv, features.dtype))[0, 0]


@pytest.mark.parametrize("layout", ["dflash", "vllm"])
def test_a_zlab_layout_export_drafts_our_logits_in_zlab_forward(target, tmp_path, layout):
    head = random_head(target)
    out = write_export(tmp_path / layout, record_of(head), layout, target_spec=target.spec)
    prompt = target.tokenizer("the quick brown fox jumps over")["input_ids"]
    theirs = zlab_draft_logits(out, target, prompt, anchor_token=prompt[-1] + 1)
    ours = our_draft_logits(head, target, prompt, anchor_token=prompt[-1] + 1)
    assert theirs.shape == ours.shape == (CONFIG["block_size"], target.spec.vocab_size)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert ours.std(0).mean() > 0.1  # the block positions draft different distributions


def test_layer_ids_convert_to_layer_outputs_by_hand(target):
    """Our taps name the stream entering a layer; z-lab's name layer outputs: (2, 15, 27) of a
    30-layer target are z-lab's [1, 14, 26]; vLLM's and the speculators' own ids are ours."""
    spec = replace(target.spec, num_layers=30, aux_layer_ids=(2, 15, 27))
    head = build_head("dflash", CONFIG, spec, random_target_weights(spec, seed=0))
    record = HeadRecord("dflash", config_record(head), spec, head.state_dict())
    configs = {layout: export_files(record, layout, target_spec=spec)[0] for layout in LAYOUTS}
    for layout in ("dflash", "vllm"):
        assert configs[layout]["dflash_config"]["target_layer_ids"] == [1, 14, 26]
        assert configs[layout]["dflash_config"]["mask_token_id"] == 7
        assert configs[layout]["block_size"] == 4 and configs[layout]["num_target_layers"] == 30
    assert "eagle_aux_hidden_state_layer_ids" not in configs["dflash"]  # z-lab's file, as z-lab writes it
    assert configs["vllm"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert configs["speculators"]["aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert configs["speculators"]["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3


def test_every_layout_reads_back_the_block_the_mask_and_the_taps(target, tmp_path):
    head = random_head(target, {**CONFIG, "block_size": 8, "mask_token_id": None})
    record = record_of(head)  # mask None resolves to the target's last token, as the head does
    assert record.config["mask_token_id"] == target.spec.vocab_size - 1
    for layout in ("native", *LAYOUTS):
        back = read_export(
            write_export(tmp_path / layout, record, layout, target_spec=target.spec), target.spec
        )
        assert back.kind == "dflash" and back.spec.aux_layer_ids == target.spec.aux_layer_ids, layout
        assert {k: back.config[k] for k in ("num_layers", "block_size", "mask_token_id")} == {
            "num_layers": 2,
            "block_size": 8,
            "mask_token_id": target.spec.vocab_size - 1,
        }, layout
        loaded = load_head(tmp_path / layout, target)  # what specdraft-eval / -bench build
        assert loaded.block_size == 8 and loaded.target_taps == target.spec.aux_layer_ids


def test_a_foreign_zlab_checkpoint_loads_without_our_provenance(target, tmp_path):
    """z-lab's own file has no ``specdraft`` key: detected by its architecture, taps + 1."""
    head = random_head(target)
    config, tensors = export_files(record_of(head), "dflash", target_spec=target.spec)
    del config["specdraft"], config["dflash_config"]["causal"]
    (tmp_path / "zlab").mkdir()
    (tmp_path / "zlab" / "config.json").write_text(json.dumps(config))
    from safetensors.torch import save_file

    save_file(tensors, tmp_path / "zlab" / "model.safetensors")
    back = read_export(tmp_path / "zlab", target.spec)
    assert back.kind == "dflash" and back.spec.aux_layer_ids == (1, 2, 3) and back.config["block_size"] == 4
    assert all(torch.equal(back.state[k], v) for k, v in head.state_dict().items())


def test_what_the_layouts_cannot_hold_is_refused_in_one_line(target):
    tap0 = tiny_random_target(seed=0, aux_layer_ids=(0, 2, 3))
    record = record_of(random_head(tap0))
    for layout in LAYOUTS:
        with pytest.raises(FormatError, match=r"layer 0 \(the embedding output\).*taps \[0, 2, 3\]") as error:
            export_files(record, layout, target_spec=tap0.spec)
        assert "\n" not in str(error.value)
    export_files(record, "native", target_spec=tap0.spec)  # our own format holds any tap
    for wrong in ("eagle", "sglang", "medusa"):
        with pytest.raises(
            FormatError, match=r"not 'dflash'; a head of kind dflash exports as one of \['dflash'"
        ):
            export_files(record_of(random_head(target)), wrong, target_spec=target.spec)
    scaled = replace(
        target.spec, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}
    )
    scaled_record = replace(record_of(random_head(target)), spec=scaled)
    with pytest.raises(FormatError, match=r"rope_type='llama3' is not implemented") as error:
        export_files(scaled_record, "dflash", target_spec=scaled)
    assert "\n" not in str(error.value)


def test_a_causal_sliding_or_rotated_foreign_draft_is_refused(target):
    config, tensors = export_files(record_of(random_head(target)), "dflash", target_spec=target.spec)
    from specdraft.heads.formats import record_from_files

    causal = {**config, "dflash_config": {**config["dflash_config"], "causal": True}}
    with pytest.raises(FormatError, match="causal block attention"):
        record_from_files(causal, tensors, target.spec)
    sliding = {**config, "layer_types": ["sliding_attention", "full_attention"]}
    with pytest.raises(FormatError, match="sliding-window draft layers"):
        record_from_files(sliding, tensors, target.spec)
    for rope in ({"rope_theta": 1e6}, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}):
        with pytest.raises(FormatError, match=r"rotary embedding .* is not the plain one of target"):
            record_from_files({**config, **rope}, tensors, target.spec)
    shifted = {**config, "eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
    with pytest.raises(FormatError, match=r"do not name the layers.*expected each \+ 1"):
        record_from_files(shifted, tensors, target.spec, format="vllm")


def test_specdraft_export_converts_a_dflash_run_for_specdraft_eval(target, tmp_path):
    head = random_head(target)
    run_dir = tmp_path / "train" / "dflash"
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    checkpoint.parent.mkdir(parents=True)
    record = {"kind": "dflash", "config": config_record(head), "target_spec": target.spec.to_dict()}
    state = {f"head.{k}": v for k, v in head.state_dict().items()}
    torch.save({"state_dict": state, "specdraft": record}, checkpoint)
    with initialize_config_module("specdraft.conf", version_base="1.3"):
        for layout in LAYOUTS:
            cfg = compose(
                "export",
                overrides=[
                    "target=tiny_random",
                    f"paths.log_dir={tmp_path}",
                    f"checkpoint={run_dir}",
                    f"format={layout}",
                ],
            )
            out = export(cfg)
            assert out == tmp_path / "export" / f"dflash-{layout}"
            loaded = load_head(out, target)
            for name, value in head.state_dict().items():
                assert torch.equal(loaded.state_dict()[name], value), f"{layout}: {name}"
