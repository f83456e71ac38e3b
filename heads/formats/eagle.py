"""EAGLE-1/2 (and HASS) and EAGLE-3 heads in the layouts of the official EAGLE code, vLLM and SGLang.

Each layout is a key map from specdraft's names plus a Llama-style draft config. What the
engines do with what they cannot use is the danger (checked against their loaders):

* vLLM's EAGLE-1 fc has no bias and drops an ``fc.bias`` silently; a ``layers.0.input_layernorm``
  stops the engine. SGLang's EAGLE-1 fc ALWAYS has a bias (randomly initialised when the file has
  none), so a bias-free head is written with an explicit zero bias.
* vLLM and SGLang skip weight names they do not know, so the exact names are checked here.
* EAGLE-3 aux layers: vLLM names the residual stream ENTERING layer i (specdraft's convention);
  SGLang names layer OUTPUTS and adds 1 itself, so it gets ``id - 1``. vLLM's speculators reader
  defaults ``norm_before_residual`` to True; specdraft's EAGLE-3 keeps the residual un-normed, so it
  is written explicitly.
* SGLang ties the draft lm_head to the embedding when ``tie_word_embeddings`` is true (the
  target's own config often says so): the draft config always says false.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from specdraft.heads.formats.record import FormatError, HeadRecord
from specdraft.heads.spec import TargetSpec
from specdraft.heads.vocab import full_vocab_maps

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
SGLANG_EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle"


def llama_draft_config(spec: TargetSpec, architectures: list[str], dtype: str) -> dict[str, Any]:
    """A one-layer Llama config with the target's shapes (what every engine builds the layer from)."""
    if dict(spec.rope_parameters).get("rope_type", "default") != "default":
        raise FormatError(f"target {spec.name}: only the default rotary embedding can be exported")
    eos = list(spec.eos_token_ids)
    return {
        "architectures": architectures,
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": float(dict(spec.rope_parameters).get("rope_theta", 10000.0)),
        "max_position_embeddings": spec.max_position_embeddings,
        "vocab_size": spec.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": spec.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": spec.pad_token_id,
        "torch_dtype": dtype,
    }


def decoder_layer_shapes(spec: TargetSpec, prefix: str, attention_input: int) -> dict[str, tuple[int, ...]]:
    """The draft decoder layer's weights (no input norm) under ``prefix``."""
    hidden, q_out, kv_out = (
        spec.hidden_size,
        spec.num_attention_heads * spec.head_dim,
        spec.num_kv_heads * spec.head_dim,
    )
    inter = spec.intermediate_size
    return {
        f"{prefix}self_attn.q_proj.weight": (q_out, attention_input),
        f"{prefix}self_attn.k_proj.weight": (kv_out, attention_input),
        f"{prefix}self_attn.v_proj.weight": (kv_out, attention_input),
        f"{prefix}self_attn.o_proj.weight": (hidden, q_out),
        f"{prefix}post_attention_layernorm.weight": (hidden,),
        f"{prefix}mlp.gate_proj.weight": (inter, hidden),
        f"{prefix}mlp.up_proj.weight": (inter, hidden),
        f"{prefix}mlp.down_proj.weight": (hidden, inter),
    }


def rename(tensors: dict[str, Tensor], prefixes: dict[str, str]) -> dict[str, Tensor]:
    """Rename keys by their longest matching prefix (keys without one keep their name)."""
    renamed = {}
    for name, tensor in tensors.items():
        matches = [old for old in prefixes if name.startswith(old)]
        if matches:
            old = max(matches, key=len)
            name = prefixes[old] + name[len(old) :]
        renamed[name] = tensor
    return renamed


# --- EAGLE-1/2 ---------------------------------------------------------------------------------

EAGLE_KEYS = {"layer.": "layers.0."}  # specdraft -> every engine's EAGLE-1 names


def eagle_shapes(spec: TargetSpec, fc_bias: bool) -> dict[str, tuple[int, ...]]:
    hidden = spec.hidden_size
    shapes = {"fc.weight": (hidden, 2 * hidden), **decoder_layer_shapes(spec, "layers.0.", hidden)}
    if fc_bias:
        shapes["fc.bias"] = (hidden,)
    return shapes


def eagle_files(record: HeadRecord, engine: str, dtype: str) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """engine: "eagle" (the official code), "vllm" or "sglang"."""
    fc_bias = bool(record.config.get("fc_bias", False))
    tensors = rename(record.state, EAGLE_KEYS)
    if engine == "vllm" and fc_bias:
        raise FormatError(
            "format vllm: this EAGLE head was trained with an fc bias (head.config.fc_bias=true), which "
            "vLLM silently ignores (the head would lose acceptance there). Retrain with fc_bias=false, or "
            "export format=eagle / sglang, which keep the bias"
        )
    if engine == "sglang" and not fc_bias:
        # SGLang's fc always has a bias: give it the exact value, zero, instead of its random init.
        tensors["fc.bias"] = torch.zeros(record.spec.hidden_size, dtype=tensors["fc.weight"].dtype)
    architectures = [SGLANG_EAGLE_ARCHITECTURE] if engine == "sglang" else ["LlamaForCausalLM"]
    config = llama_draft_config(record.spec, architectures, dtype)
    config["bias"] = fc_bias or engine == "sglang"  # the official code reads the fc bias from here
    return config, tensors


def eagle_record(
    config: dict[str, Any], tensors: dict[str, Tensor], spec: TargetSpec, engine: str
) -> HeadRecord:
    tensors = rename(tensors, {v: k for k, v in EAGLE_KEYS.items()})
    if engine == "sglang" and "fc.bias" in tensors and not torch.any(tensors["fc.bias"]):
        tensors.pop("fc.bias")  # the zero bias written for SGLang's always-biased fc
    fc_bias = "fc.bias" in tensors
    return HeadRecord("eagle", {"fc_bias": fc_bias, "kind": "eagle"}, spec, tensors)


# --- EAGLE-3 -----------------------------------------------------------------------------------

EAGLE3_KEYS = {
    "layer.": "midlayer.",
    "hidden_norm.": "midlayer.hidden_norm.",
    "input_layernorm.": "midlayer.input_layernorm.",
}


def eagle3_shapes(spec: TargetSpec, draft_vocab: int, with_maps: bool) -> dict[str, tuple[int, ...]]:
    hidden = spec.hidden_size
    shapes = {
        "fc.weight": (hidden, len(spec.aux_layer_ids) * hidden),
        "midlayer.hidden_norm.weight": (hidden,),
        "midlayer.input_layernorm.weight": (hidden,),
        **decoder_layer_shapes(spec, "midlayer.", 2 * hidden),
        "norm.weight": (hidden,),
        "lm_head.weight": (draft_vocab, hidden),
    }
    if with_maps:
        shapes.update({"d2t": (draft_vocab,), "t2d": (spec.vocab_size,)})
    return shapes


def eagle3_files(
    record: HeadRecord, engine: str, dtype: str, speculative_tokens: int = 3, verifier: str | None = None
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """engine: "vllm", "sglang" or "speculators" (vLLM's speculators format)."""
    spec = record.spec
    tensors = rename(record.state, EAGLE3_KEYS)
    draft_vocab = int(tensors["lm_head.weight"].shape[0])
    if draft_vocab == spec.vocab_size:
        # A full-vocabulary head needs no maps; vLLM has no parameter to load them into.
        tensors.pop("d2t", None)
        tensors.pop("t2d", None)
    layer_config = llama_draft_config(spec, [EAGLE3_ARCHITECTURE], dtype)
    layer_config.update({"draft_vocab_size": draft_vocab, "target_hidden_size": spec.hidden_size})
    aux = list(spec.aux_layer_ids)
    if engine == "vllm":
        config = {**layer_config, "eagle_aux_hidden_state_layer_ids": aux, "norm_before_residual": False}
    elif engine == "sglang":
        if len(aux) != 3:
            raise FormatError(
                f"format sglang: SGLang's EAGLE-3 fc reads exactly 3 aux layers; this head fuses {len(aux)} "
                f"({aux}). vLLM reads any number: export format=vllm"
            )
        if min(aux) < 1:
            raise FormatError(
                f"format sglang: aux layer id 0 (the embedding output) has no SGLang name (SGLang names "
                f"layer outputs: id - 1); this head taps {aux}"
            )
        config = {**layer_config, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux]}}
    elif engine == "speculators":
        if speculative_tokens < 1:
            raise FormatError(
                f"format speculators: speculative_tokens must be >= 1, got {speculative_tokens}"
            )
        layer_config["architectures"] = ["LlamaForCausalLM"]
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.1.0",
            "draft_vocab_size": draft_vocab,
            "target_hidden_size": spec.hidden_size,
            "norm_before_residual": False,
            "eagle_aux_hidden_state_layer_ids": aux,
            "transformer_layer_config": layer_config,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
                "verifier": {"name_or_path": verifier or spec.name, "architectures": [spec.architecture]},
            },
            "torch_dtype": dtype,
        }
    else:
        raise FormatError(f"EAGLE-3 engine {engine!r} is not one of vllm, sglang, speculators")
    return config, tensors


def eagle3_record(
    config: dict[str, Any], tensors: dict[str, Tensor], spec: TargetSpec, engine: str
) -> HeadRecord:
    if engine == "speculators":
        layer_config, aux = (
            config.get("transformer_layer_config", {}),
            config.get("eagle_aux_hidden_state_layer_ids"),
        )
        if config.get("norm_before_residual", True):
            raise FormatError(
                "speculators config: norm_before_residual is true (or absent: vLLM's default), which "
                "specdraft's EAGLE-3 head does not implement"
            )
    elif engine == "sglang":
        layer_config = config
        aux = [i + 1 for i in config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids", [])]
    else:
        layer_config, aux = config, config.get("eagle_aux_hidden_state_layer_ids")
        if config.get("norm_before_residual", False):
            raise FormatError(
                "config: norm_before_residual=true is not implemented by specdraft's EAGLE-3 head"
            )
    if not aux:
        raise FormatError(f"{engine} config: no EAGLE-3 aux layer ids (eagle_aux_hidden_state_layer_ids)")
    draft_vocab = int(
        layer_config.get("draft_vocab_size") or config.get("draft_vocab_size") or spec.vocab_size
    )
    tensors = rename(tensors, {v: k for k, v in EAGLE3_KEYS.items()})
    if draft_vocab == spec.vocab_size and "d2t" not in tensors:
        head_config = {"draft_vocab_size": None, "kind": "eagle3"}
        tensors["d2t"], tensors["t2d"] = full_vocab_maps(spec.vocab_size)
    else:
        head_config = {"draft_vocab_size": draft_vocab, "kind": "eagle3"}
    return HeadRecord("eagle3", head_config, replace(spec, aux_layer_ids=tuple(aux)), tensors)
