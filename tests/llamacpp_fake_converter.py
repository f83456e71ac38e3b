"""A stand-in for llama.cpp's ``convert_hf_to_gguf.py`` on an EAGLE-3 or a DFlash draft, for the
tests of ``specdraft-export format=llamacpp`` where the real converter (``make llamacpp``) is absent.

    python llamacpp_fake_converter.py DRAFT_DIR --target-model-dir DIR --outtype T --outfile OUT

It writes what the pinned converter writes (llama-cpp-python 0.3.36's llama.cpp), written here from
that description with numpy, not with specdraft's code:
* EAGLE-3 (conversion/llama.py): names, q/k rows regrouped for GGML's rotary pairs, 1-D tensors in
  f32, ``d2t`` offsets as absolute int64 ids, ``t2d`` dropped; ``eagle3.*`` metadata from both configs;
* DFlash (conversion/qwen.py ``DFlashModel``, a ``DFlashDraftModel`` config): Qwen3 names per layer
  (``blk.i.*``), q/k rows as they are (NEOX rotary), ``dflash.*`` metadata with the target layers
  + 1, the mask token as ``tokenizer.ggml.mask_token_id``; it needs the target config's
  ``architectures`` (to pick the tokenizer code).
``FAKE_CONVERTER_MISTAKE`` makes it err the way a converter of another version could:
``no_permute`` (EAGLE-3), ``taps``, ``drop_norm``, ``causal`` (DFlash), ``fail`` (exit 1 without
a file).
"""

import argparse
import json
import os
import sys
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

NAMES = {
    "fc.weight": "fc.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
DFLASH_NAMES = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
}
DFLASH_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TYPES = {
    "f32": gguf.GGMLQuantizationType.F32,
    "f16": gguf.GGMLQuantizationType.F16,
    "bf16": gguf.GGMLQuantizationType.BF16,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
}


def regroup(w: np.ndarray, heads: int) -> np.ndarray:
    """Per head, rows (x0..x_{d/2-1}, y0..y_{d/2-1}) → (x0, y0, x1, y1, …)."""
    d = w.shape[0] // heads
    out = np.empty_like(w)
    for h in range(heads):
        block = w[h * d : (h + 1) * d]
        out[h * d : (h + 1) * d : 2] = block[: d // 2]
        out[h * d + 1 : (h + 1) * d : 2] = block[d // 2 :]
    return out


def add_matrix(writer, name: str, value: np.ndarray, outtype: str) -> None:
    kind = TYPES[outtype] if value.ndim > 1 else TYPES["f32"]
    data = value if kind == TYPES["f32"] else gguf.quants.quantize(value, kind)
    writer.add_tensor(name, data, raw_dtype=kind)


def write_dflash(args, config: dict, target: dict, tensors: dict, mistake: str) -> None:
    assert target.get("architectures"), "DFlash: failed to detect the target's model architecture"
    dflash = config["dflash_config"]
    writer = gguf.GGUFWriter(args.outfile, "dflash")
    writer.add_uint32("dflash.block_count", config["num_hidden_layers"])
    writer.add_uint32("dflash.block_size", config["block_size"])
    layers = [i + 1 for i in dflash["target_layer_ids"]]
    writer.add_array("dflash.target_layers", layers[::-1] if mistake == "taps" else layers)
    writer.add_bool("dflash.attention.causal", mistake == "causal" or bool(dflash.get("causal")))
    writer.add_uint32("tokenizer.ggml.mask_token_id", dflash["mask_token_id"])
    for name, value in tensors.items():
        if mistake == "drop_norm" and name == "norm.weight":
            continue
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            gguf_name = f"blk.{index}.{DFLASH_LAYER_NAMES[rest.removesuffix('.weight')]}.weight"
        else:
            gguf_name = DFLASH_NAMES[name]
        add_matrix(writer, gguf_name, value.astype(np.float32), args.outtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("--target-model-dir", type=Path, required=True)
    parser.add_argument("--outtype", required=True)
    parser.add_argument("--outfile", type=Path, required=True)
    args = parser.parse_args()
    mistake = os.environ.get("FAKE_CONVERTER_MISTAKE", "")
    if mistake == "fail":
        sys.exit("fake converter: failing as asked")
    config = json.loads((args.model / "config.json").read_text())
    target = json.loads((args.target_model_dir / "config.json").read_text())
    assert (args.target_model_dir / "tokenizer_config.json").is_file(), "no tokenizer in the target dir"
    tensors = load_file(args.model / "model.safetensors")
    if "DFlashDraftModel" in config.get("architectures", []):
        write_dflash(args, config, target, tensors, mistake)
        return
    writer = gguf.GGUFWriter(args.outfile, "eagle3")
    writer.add_uint32("eagle3.block_count", config["num_hidden_layers"])
    taps = config.get("eagle_aux_hidden_state_layer_ids") or [2, target["num_hidden_layers"] // 2, 0]
    writer.add_array("eagle3.target_layers", taps[::-1] if mistake == "taps" else taps)
    writer.add_uint32("eagle3.target_hidden_size", config.get("target_hidden_size", target["hidden_size"]))
    writer.add_bool("eagle3.norm_before_residual", config.get("norm_before_residual", False))
    for name, value in tensors.items():
        if name == "t2d" or (mistake == "drop_norm" and name == "norm.weight"):
            continue
        if name == "d2t":
            writer.add_tensor("d2t", value.astype(np.int64) + np.arange(value.size, dtype=np.int64))
            continue
        value = value.astype(np.float32)
        if mistake != "no_permute" and name.endswith("q_proj.weight"):
            value = regroup(value, config["num_attention_heads"])
        elif mistake != "no_permute" and name.endswith("k_proj.weight"):
            value = regroup(value, config["num_key_value_heads"])
        add_matrix(writer, NAMES[name], value, args.outtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
