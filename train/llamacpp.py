"""``specdraft-export format=llamacpp``: an EAGLE-3 head as the GGUF llama.cpp's speculative
decoding loads (``--spec-type draft-eagle3``; model type ``eagle3``).

The GGUF layout (tensor names, the rotary permutation of q/k, the metadata keys) belongs to
llama.cpp, so llama.cpp's own converter writes it, fetched pinned by ``make llamacpp`` and run in a
Python that has its packages (``conf/export.yaml`` ``llamacpp``). This module:

1. refuses what llama.cpp cannot serve, in one line: a head kind other than EAGLE-3, a head that
   does not fuse exactly three target layers, a missing converter;
2. writes the head in the vLLM layout (:mod:`specdraft.heads.formats`) and the target's HF config
   and tokenizer (the converter copies the vocabulary from them) into a scratch directory;
3. runs the converter into the staging directory of ``out``;
4. reads the GGUF back and compares every tensor with the head's as the converter must have
   written it (q/k permuted, norms in f32, ``d2t`` as absolute target ids, the other weights in
   ``outtype``) bit for bit, and the taps, width and architecture in its metadata;
5. only then moves ``out`` (``model.gguf`` + ``config.json``, our provenance) into place.

Taps need no conversion: llama.cpp captures each target layer's INPUT (``t_layer_inp[i]``, the
residual stream entering layer i), specdraft's ``aux_layer_ids`` convention, and the converter
copies ``eagle_aux_hidden_state_layer_ids`` as they are. The draft borrows the target's token
embedding (the export has none), as in training.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from torch import Tensor

from specdraft.data.target import Target
from specdraft.heads.formats import FormatError, HeadRecord, export_files
from specdraft.heads.formats.files import (
    CONFIG_FILE,
    GGUF_FILE,
    PROVENANCE_KEY,
    WEIGHTS_FILE,
    check_destination,
)
from specdraft.system.files import write_dir_atomic

LLAMACPP_FORMAT = "llamacpp"
SERVED_KINDS = ("eagle3",)  # llama.cpp serves EAGLE-3 and DFlash drafts; its DFlash GGUF is not written yet
LLAMACPP_TAPS = 3  # llama.cpp's EAGLE-3 graph reads exactly three target layers
OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # the converter's --outtype choices for a draft's matrices
GGUF_ARCHITECTURE = "eagle3"
FETCHED_MARKER = "FETCHED"  # scripts/interop/fetch_llamacpp.py writes it last: the pinned version
CONVERTER_TAIL_LINES = 5  # of a failed converter's output, in the error
QUANT_TYPES = {
    "f32": gguf.GGMLQuantizationType.F32,
    "f16": gguf.GGMLQuantizationType.F16,
    "bf16": gguf.GGMLQuantizationType.BF16,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
}
# The vLLM layout's names → llama.cpp's (blk.0 is the draft's one layer).
GGUF_NAMES = {
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
DROPPED = ("t2d",)  # the target → draft map: llama.cpp scatters draft logits through d2t alone


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
    if record.kind not in SERVED_KINDS:
        raise FormatError(
            f"format={LLAMACPP_FORMAT} exports {'/'.join(SERVED_KINDS)} heads, not {record.kind!r}: "
            "llama.cpp serves no EAGLE-1/2 or Medusa drafts, and specdraft does not write its DFlash "
            "GGUF yet; format=vllm serves every EAGLE and DFlash head in vLLM"
        )
    taps = list(record.spec.aux_layer_ids)
    if len(taps) != LLAMACPP_TAPS:
        raise FormatError(
            f"format={LLAMACPP_FORMAT}: llama.cpp's EAGLE-3 fuses exactly {LLAMACPP_TAPS} target layers; "
            f"this head fuses {len(taps)} ({taps})"
        )


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
    config, tensors = export_files(record, "vllm", target_spec=target.spec)
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
    """The head as a vLLM-layout folder, the converter's input (it reads ``model*.safetensors``)."""
    draft_dir.mkdir(parents=True)
    save_file({k: t.detach().contiguous().clone() for k, t in tensors.items()}, draft_dir / WEIGHTS_FILE)
    (draft_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def write_target_folder(target: Target, target_dir: Path) -> None:
    """The target's HF config and tokenizer (no weights): the converter takes the layer count,
    width and vocabulary size from the config and copies the tokenizer into the GGUF."""
    try:
        target.model.config.save_pretrained(target_dir)
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
    """The float32 (int64 for ``d2t``) values the converter must write for the vLLM-layout
    ``tensors``: norms stay f32, matrices go through ``outtype`` (Q8_0 quantised as gguf-py does),
    q/k rows are interleaved for llama.cpp's rotary layout, ``d2t`` offsets become target ids."""
    spec = record.spec
    expected = {}
    for name, tensor in tensors.items():
        if name in DROPPED:
            continue
        if name not in GGUF_NAMES:
            raise FormatError(f"format={LLAMACPP_FORMAT}: no llama.cpp name for the head's tensor {name}")
        if name == "d2t":
            expected["d2t"] = (tensor.long() + torch.arange(tensor.numel())).numpy()
            continue
        value = tensor.detach().float()
        if name.endswith("q_proj.weight"):
            value = interleave_rotary_rows(value, spec.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            value = interleave_rotary_rows(value, spec.num_kv_heads)
        expected[GGUF_NAMES[name]] = as_written(value, outtype if value.dim() > 1 else "f32")
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
    """The converted GGUF holds exactly the head: its architecture, taps and width, and every
    tensor equal to what :func:`expected_gguf` says the converter writes."""
    reader = gguf.GGUFReader(path)
    expected = expected_gguf(tensors, record, outtype)
    written = {t.name: t for t in reader.tensors}
    problems = []
    metadata = {
        "general.architecture": GGUF_ARCHITECTURE,
        f"{GGUF_ARCHITECTURE}.target_layers": list(record.spec.aux_layer_ids),
        f"{GGUF_ARCHITECTURE}.target_hidden_size": record.spec.hidden_size,
        f"{GGUF_ARCHITECTURE}.block_count": 1,
    }
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
