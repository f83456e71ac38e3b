"""A stand-in for llama.cpp's ``convert_hf_to_gguf.py`` on an EAGLE-3 draft, for the tests of
``specdraft-export format=llamacpp`` where the real converter (``make llamacpp``) is absent.

    python llamacpp_fake_converter.py DRAFT_DIR --target-model-dir DIR --outtype T --outfile OUT

It writes what the pinned converter writes (conversion/llama.py of llama-cpp-python 0.3.36's
llama.cpp: names, q/k rows regrouped for GGML's rotary pairs, 1-D tensors in f32, ``d2t`` offsets
as absolute int64 ids, ``t2d`` dropped; ``eagle3.*`` metadata from both configs), written here
from that description with numpy, not with specdraft's code. ``FAKE_CONVERTER_MISTAKE`` makes it
err the way a converter of another version could: ``no_permute``, ``taps``, ``drop_norm``,
``fail`` (exit 1 without a file).
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
        kind = TYPES[args.outtype] if value.ndim > 1 else TYPES["f32"]
        data = value if kind == TYPES["f32"] else gguf.quants.quantize(value, kind)
        writer.add_tensor(NAMES[name], data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
