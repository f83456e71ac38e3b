"""``specdraft-export format=llamacpp``: an EAGLE-3 or DFlash head as the GGUF llama.cpp's speculative
decoding loads (``--spec-type draft-eagle3`` / ``draft-dflash``; GGUF architecture ``eagle3`` /
``dflash``).

The GGUF layout (tensor names, the rotary permutation of q/k, the metadata keys) belongs to
llama.cpp, so llama.cpp's own converter writes it, fetched pinned by ``make llamacpp`` and run in a
Python that has its packages (``conf/export.yaml`` ``llamacpp``). This module:

1. refuses what llama.cpp cannot serve, in one line: a head kind other than EAGLE-3 and DFlash, an
   EAGLE-3 head that does not fuse exactly three target layers, a target family llama.cpp has not
   served these drafts for (:data:`LLAMACPP_TARGETS`), a missing converter;
2. writes the head in the layout the converter reads (:mod:`specdraft.heads.formats`: vLLM's for
   EAGLE-3, z-lab's for DFlash) and the target's HF config and tokenizer (the converter copies the
   vocabulary from them, and reads the target's architecture to pick its tokenizer code) into a
   scratch directory;
3. runs the converter into the staging directory of ``out``;
4. reads the GGUF back and compares every tensor with the head's as the converter must have
   written it (EAGLE-3's q/k permuted, norms in f32, ``d2t`` as absolute target ids, the other
   weights in ``outtype``) bit for bit, and the metadata llama.cpp's drafting reads (taps, width,
   layers; DFlash's block size, mask token and non-causal block attention);
5. only then moves ``out`` (``model.gguf`` + ``config.json``, our provenance) into place.

Taps need no conversion: llama.cpp captures each target layer's INPUT (``t_layer_inp[i]``, the
residual stream entering layer i), specdraft's ``aux_layer_ids`` convention (the converter copies
EAGLE-3's ``eagle_aux_hidden_state_layer_ids`` as they are and adds 1 to z-lab's DFlash ids, which
name layer outputs). Neither draft carries an embedding: both borrow the target's, and a
full-vocabulary draft its lm_head too, as in training.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from torch import Tensor

from specdraft.data.target import Target
from specdraft.heads.formats import FormatError, HeadRecord, export_files, serving_formats
from specdraft.heads.formats.files import (
    CONFIG_FILE,
    GGUF_FILE,
    PROVENANCE_KEY,
    WEIGHTS_FILE,
    check_destination,
)
from specdraft.system.files import write_dir_atomic

LLAMACPP_FORMAT = "llamacpp"
LLAMACPP_EAGLE3_TAPS = 3  # llama.cpp's EAGLE-3 graph reads exactly three target layers
OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # the converter's --outtype choices for a draft's matrices
# The target architectures llama.cpp has served these exports for (tests/test_interop_llamacpp.py):
# the converter and llama.cpp's tap capture are per architecture, so others are refused, not guessed.
LLAMACPP_TARGETS = ("LlamaForCausalLM",)
FETCHED_MARKER = "FETCHED"  # scripts/interop/fetch_llamacpp.py writes it last: the pinned version
CONVERTER_TAIL_LINES = 5  # of a failed converter's output, in the error
QUANT_TYPES = {
    "f32": gguf.GGMLQuantizationType.F32,
    "f16": gguf.GGMLQuantizationType.F16,
    "bf16": gguf.GGMLQuantizationType.BF16,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
}
# The vLLM EAGLE-3 layout's names → llama.cpp's (blk.0 is the draft's one layer).
EAGLE3_NAMES = {
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
    "d2t": "d2t",
}
# z-lab's DFlash layout → llama.cpp's: the fusion's names, and each draft layer's (layers.i → blk.i).
DFLASH_NAMES = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
}
DFLASH_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
DFLASH_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
MASK_TOKEN_KEY = "tokenizer.ggml.mask_token_id"  # where llama.cpp's DFlash reads its mask token


def eagle3_gguf_name(name: str) -> str | None:
    return EAGLE3_NAMES.get(name)


def dflash_gguf_name(name: str) -> str | None:
    if name in DFLASH_NAMES:
        return DFLASH_NAMES[name]
    layer = DFLASH_LAYER.fullmatch(name)
    if layer is None or layer[2] not in DFLASH_LAYER_NAMES:
        return None
    return f"blk.{layer[1]}.{DFLASH_LAYER_NAMES[layer[2]]}"


def eagle3_metadata(record: HeadRecord) -> dict[str, Any]:
    return {
        "general.architecture": "eagle3",
        "eagle3.target_layers": list(record.spec.aux_layer_ids),
        "eagle3.target_hidden_size": record.spec.hidden_size,
        "eagle3.block_count": 1,
    }


def dflash_metadata(record: HeadRecord) -> dict[str, Any]:
    return {
        "general.architecture": "dflash",
        "dflash.target_layers": list(record.spec.aux_layer_ids),
        "dflash.block_count": int(record.config["num_layers"]),
        "dflash.block_size": int(record.config["block_size"]),
        "dflash.attention.causal": False,  # llama.cpp runs the block causally unless told
        MASK_TOKEN_KEY: int(record.config["mask_token_id"]),
    }


def check_eagle3_taps(record: HeadRecord) -> None:
    taps = list(record.spec.aux_layer_ids)
    if len(taps) != LLAMACPP_EAGLE3_TAPS:
        raise FormatError(
            f"format={LLAMACPP_FORMAT}: llama.cpp's EAGLE-3 fuses exactly {LLAMACPP_EAGLE3_TAPS} target "
            f"layers; this head fuses {len(taps)} ({taps})"
        )


@dataclass(frozen=True)
class GgufLayout:
    """How llama.cpp's converter writes one head kind. ``source``: the specdraft format it reads;
    ``gguf_name``: a source tensor's GGUF name (None: not one llama.cpp knows); ``regroup_rotary``:
    whether q/k rows are regrouped for GGML's NORM rotary (EAGLE-3's draft is a Llama layer; DFlash's
    are Qwen3's, rotated NEOX-style, HF's own halves); ``dropped``: source tensors the GGUF does not
    hold; ``metadata``: the keys llama.cpp's drafting reads, as they must read; ``check``: what
    llama.cpp additionally refuses."""

    source: str
    gguf_name: Callable[[str], str | None]
    regroup_rotary: bool
    dropped: tuple[str, ...]
    metadata: Callable[[HeadRecord], dict[str, Any]]
    check: Callable[[HeadRecord], None]


GGUF_LAYOUTS = {
    # t2d (target → draft ids): llama.cpp scatters the draft's logits through d2t alone
    "eagle3": GgufLayout("vllm", eagle3_gguf_name, True, ("t2d",), eagle3_metadata, check_eagle3_taps),
    "dflash": GgufLayout("dflash", dflash_gguf_name, False, (), dflash_metadata, lambda record: None),
}


@dataclass(frozen=True)
class Converter:
    """llama.cpp's ``convert_hf_to_gguf.py`` (from ``make llamacpp``) and a Python to run it in."""

    script: Path
    python: Path

    def check(self) -> None:
        for path, what in ((self.script, "converter"), (self.python, "converter's Python")):
            if not Path(path).is_file():
                raise FormatError(
                    f"format=llamacpp: llama.cpp's {what} {path} does not exist; `make llamacpp` fetches "
                    "the pinned converter and builds its Python (or set llamacpp.script / llamacpp.python)"
                )

    def version(self) -> str:
        marker = Path(self.script).parent / FETCHED_MARKER
        return marker.read_text().strip() if marker.is_file() else "unknown (not fetched by make llamacpp)"


def check_servable(record: HeadRecord) -> None:
    """One line for a head llama.cpp cannot serve."""
    if record.kind not in GGUF_LAYOUTS:
        raise FormatError(
            f"format={LLAMACPP_FORMAT} exports {'/'.join(GGUF_LAYOUTS)} heads, not {record.kind!r}: "
            "llama.cpp serves no EAGLE-1/2 or Medusa drafts; format=vllm serves every EAGLE head in vLLM"
        )
    if record.spec.architecture not in LLAMACPP_TARGETS:
        raise FormatError(
            f"format={LLAMACPP_FORMAT} has been served by llama.cpp for {'/'.join(LLAMACPP_TARGETS)} "
            f"targets only, not {record.spec.architecture}; this head exports as "
            f"{' / '.join(serving_formats(record))}"
        )
    GGUF_LAYOUTS[record.kind].check(record)


def write_gguf_export(
    out_dir: Path,
    record: HeadRecord,
    *,
    target: Target,
    converter: Converter,
    outtype: str,
    overwrite: bool = False,
) -> Path:
    """Convert ``record`` into ``out_dir/model.gguf`` with llama.cpp's converter, read it back and
    compare it with the head, then move ``out_dir`` into place (``config.json`` beside it records
    where it came from). Nothing is written at ``out_dir`` when any step fails."""
    if outtype not in OUTTYPES:
        raise FormatError(f"llamacpp.outtype={outtype!r}: expected one of {list(OUTTYPES)}")
    check_servable(record)
    converter.check()
    check_destination(out_dir, overwrite)
    config, tensors = export_files(record, GGUF_LAYOUTS[record.kind].source, target_spec=target.spec)
    config[PROVENANCE_KEY] = {
        **config[PROVENANCE_KEY],
        "format": LLAMACPP_FORMAT,
        "outtype": outtype,
        "converter": converter.version(),
        "exported_from": dict(record.provenance or {}),  # the checkpoint specdraft reads the head from
    }

    def fill(staging: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="specdraft-gguf-") as scratch:
            draft_dir, target_dir = Path(scratch) / "draft", Path(scratch) / "target"
            write_converter_input(draft_dir, config, tensors)
            write_target_folder(target, target_dir)
            run_converter(converter, draft_dir, target_dir, staging / GGUF_FILE, outtype)
        check_gguf(staging / GGUF_FILE, tensors, record, outtype)
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        check_destination(out_dir, overwrite)  # again: something may have appeared meanwhile

    return write_dir_atomic(out_dir, fill)


def write_converter_input(draft_dir: Path, config: dict, tensors: dict[str, Tensor]) -> None:
    """The head as the converter's input folder (it reads ``config.json`` and ``model*.safetensors``)."""
    draft_dir.mkdir(parents=True)
    save_file({k: t.detach().contiguous().clone() for k, t in tensors.items()}, draft_dir / WEIGHTS_FILE)
    (draft_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def write_target_folder(target: Target, target_dir: Path) -> None:
    """The target's HF config and tokenizer (no weights): the converter takes the layer count,
    width and vocabulary size from the config, picks its tokenizer code by the config's
    ``architectures`` (which a target read from a GGUF lacks) and copies the tokenizer into the GGUF."""
    config = copy.deepcopy(target.model.config)
    config.architectures = [target.spec.architecture]
    try:
        config.save_pretrained(target_dir)
        target.tokenizer.save_pretrained(target_dir)
    except (OSError, TypeError, ValueError) as error:
        raise FormatError(
            f"format={LLAMACPP_FORMAT}: the target {target.spec.name!r} cannot be written as an HF config "
            f"and tokenizer for llama.cpp's converter ({error})"
        ) from None


def run_converter(
    converter: Converter, draft_dir: Path, target_dir: Path, gguf_path: Path, outtype: str
) -> None:
    command = [
        str(converter.python),
        str(converter.script),
        str(draft_dir),
        "--target-model-dir",
        str(target_dir),
        "--outtype",
        outtype,
        "--outfile",
        str(gguf_path),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not gguf_path.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-CONVERTER_TAIL_LINES:]
        raise FormatError(
            f"format={LLAMACPP_FORMAT}: llama.cpp's converter failed (exit {done.returncode}): "
            + " | ".join(tail)
        )


def expected_gguf(tensors: dict[str, Tensor], record: HeadRecord, outtype: str) -> dict[str, np.ndarray]:
    """The float32 (int64 for ``d2t``) values the converter must write for the source-layout
    ``tensors``: norms stay f32, matrices go through ``outtype`` (Q8_0 quantised as gguf-py does),
    EAGLE-3's q/k rows are interleaved for llama.cpp's rotary layout, ``d2t`` offsets become target ids."""
    spec, layout = record.spec, GGUF_LAYOUTS[record.kind]
    expected = {}
    for name, tensor in tensors.items():
        if name in layout.dropped:
            continue
        gguf_name = layout.gguf_name(name)
        if gguf_name is None:
            raise FormatError(f"format={LLAMACPP_FORMAT}: no llama.cpp name for the head's tensor {name}")
        if name == "d2t":
            expected[gguf_name] = (tensor.long() + torch.arange(tensor.numel())).numpy()
            continue
        value = tensor.detach().float()
        if layout.regroup_rotary and name.endswith("q_proj.weight"):
            value = interleave_rotary_rows(value, spec.num_attention_heads)
        elif layout.regroup_rotary and name.endswith("k_proj.weight"):
            value = interleave_rotary_rows(value, spec.num_kv_heads)
        expected[gguf_name] = as_written(value, outtype if value.dim() > 1 else "f32")
    return expected


def interleave_rotary_rows(weight: Tensor, heads: int) -> Tensor:
    """HF's rotary layout (each head's first half of rows, then its second) → GGML's NORM rope,
    which rotates adjacent pairs: row j of the first half goes next to row j of the second.

    weight: (heads · head_dim, in) → the same shape."""
    rows, columns = weight.shape
    half = rows // heads // 2
    return weight.reshape(heads, 2, half, columns).transpose(1, 2).reshape(rows, columns)


def as_written(value: Tensor, outtype: str) -> np.ndarray:
    """``value`` stored as ``outtype`` and read back as float32."""
    if outtype in ("f32", "f16"):
        return value.to(torch.float16 if outtype == "f16" else torch.float32).float().numpy()
    if outtype == "bf16":
        return value.to(torch.bfloat16).float().numpy()
    quant = QUANT_TYPES[outtype]
    return gguf.quants.dequantize(gguf.quants.quantize(value.numpy(), quant), quant).reshape(value.shape)


def check_gguf(path: Path, tensors: dict[str, Tensor], record: HeadRecord, outtype: str) -> None:
    """The converted GGUF holds exactly the head: the metadata llama.cpp's drafting reads, and every
    tensor equal to what :func:`expected_gguf` says the converter writes."""
    reader = gguf.GGUFReader(path)
    expected = expected_gguf(tensors, record, outtype)
    written = {t.name: t for t in reader.tensors}
    problems = []
    metadata = GGUF_LAYOUTS[record.kind].metadata(record)
    for key, value in metadata.items():
        field = reader.get_field(key)
        found = None if field is None else field.contents()
        if found != value:
            problems.append(f"{key} is {found!r}, expected {value!r}")
    if set(written) != set(expected):
        problems.append(f"tensors {sorted(set(written) ^ set(expected))} appear on one side only")
    for name in sorted(set(written) & set(expected)):
        values = read_tensor(written[name])
        if values.shape != expected[name].shape or not np.array_equal(values, expected[name]):
            problems.append(f"{name} differs ({written[name].tensor_type.name} {list(values.shape)})")
    if problems:
        raise FormatError(f"{path}: llama.cpp's converter did not write this head: " + "; ".join(problems))


def read_tensor(tensor: gguf.ReaderTensor) -> np.ndarray:
    """A GGUF tensor as float32 (int64 stays int64), in torch's (rows, columns) order."""
    if tensor.tensor_type == gguf.GGMLQuantizationType.I64:
        return np.asarray(tensor.data, dtype=np.int64).reshape(-1)
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return values.reshape(tuple(int(n) for n in reversed(tensor.shape)))
