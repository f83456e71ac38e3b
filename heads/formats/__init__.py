"""Trained heads on disk: specdraft's native export and the layouts serving engines load.

    config, tensors = export_files(record, "vllm", target_spec=target.spec)
    write_export(out_dir, record, "sglang", target_spec=target.spec)
    record = read_export(out_dir, target.spec)          # any format written here, detected

| format      | kinds               | loaded by |
|-------------|---------------------|-----------|
| native      | every kind          | specdraft-eval / specdraft-bench |
| eagle       | eagle               | the official SafeAILab/EAGLE code (EAGLE-1/2, HASS) |
| vllm        | eagle eagle3 dflash | vLLM (``method: eagle`` / ``eagle3`` / ``dflash``) |
| speculators | eagle3 dflash       | vLLM, speculators format (method and depth in the config) |
| sglang      | eagle eagle3        | SGLang (``EAGLE`` / ``EAGLE3``) |
| medusa      | medusa              | vLLM Medusa |
| dflash      | dflash              | the official z-lab/dflash code (``DFlashDraftModel``); vLLM too |

Every export is checked before anything is written: the head must have been trained for the
target it is exported for (same shapes), its weights must be finite (a head read from a
checkpoint or an export is checked too), and the files must hold exactly the names and shapes
of the format (engines skip unknown names silently, which costs acceptance, not an error).
No export carries the target's embedding; only a Medusa head that drafts through the target's
own lm_head carries that real lm_head, because vLLM's Medusa has no other source for it.

An engine serves a draft only for some target families (``Format.targets``, read from the
engines' sources): a head exported for a target its engine does not serve is refused in one line
before anything is written, instead of loading and drafting something else.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specdraft.heads.formats.dflash import (
    DFLASH_ARCHITECTURE,
    dflash_files,
    dflash_record,
    dflash_shapes,
    is_dflash_config,
)
from specdraft.heads.formats.eagle import (
    EAGLE3_ARCHITECTURE,
    SGLANG_EAGLE_ARCHITECTURE,
    eagle3_files,
    eagle3_record,
    eagle3_shapes,
    eagle_files,
    eagle_record,
    eagle_shapes,
)
from specdraft.heads.formats.files import (
    PROVENANCE_KEY,
    cast_floats,
    check_finite,
    check_tensors,
    read_export_dir,
    write_export_dir,
)
from specdraft.heads.formats.medusa import medusa_files, medusa_record, medusa_shapes
from specdraft.heads.formats.native import is_native, native_files, native_record
from specdraft.heads.formats.record import FormatError, HeadRecord, check_target
from specdraft.heads.frozen import TargetWeights
from specdraft.heads.registry import (
    CHECKPOINT_KEY,
    CHECKPOINT_STATE_PREFIX,
    HEAD_KINDS,
    build_head,
    head_config,
)
from specdraft.heads.spec import TargetSpec

__all__ = [
    "FORMATS",
    "FormatError",
    "HeadRecord",
    "detect_format",
    "export_files",
    "read_checkpoint",
    "read_export",
    "read_head",
    "serving_formats",
    "write_export",
]


# Target architectures (transformers' class names, as TargetSpec.architecture holds them) of the
# families whose models the engines give their drafts what the drafts read. EAGLE-3 and DFlash need
# the target to hand over its aux hidden states: vLLM (0.32) does for Llama, Qwen2, Qwen3, and
# Mistral and Phi-3, which subclass its Llama (``SupportsEagle3``); SGLang's Mistral and Phi-3
# subclass its Llama too (``set_eagle3_layers_to_capture``). vLLM's and SGLang's EAGLE drafts and
# z-lab's DFlash draft embed tokens with the target's embedding matrix and no scale, so a Gemma
# head, which scales its embeddings by √H as Gemma does, would draft from other inputs there.
LLAMA_DERIVED_TARGETS = frozenset(
    {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM"}
)
# The official EAGLE code (ea_model.py) builds its own KV-cached copy of Llama, Qwen2 and Qwen3
# targets (and Mixtral) and no other.
EAGLE_CODE_TARGETS = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})
UNSCALED_EMBEDDINGS = "its draft embeds tokens with the target's embedding, without Gemma's √H scale"


@dataclass(frozen=True)
class Format:
    """kinds: the head kinds the layout holds (None: every registered kind); loaded_by: who reads
    it; targets: the target architectures it serves (None: every supported family), and why not
    the others."""

    kinds: tuple[str, ...] | None
    loaded_by: str
    targets: frozenset[str] | None = None
    targets_why: str = ""

    def holds(self) -> tuple[str, ...]:
        return tuple(HEAD_KINDS) if self.kinds is None else self.kinds

    def serves(self, spec: TargetSpec) -> bool:
        return self.targets is None or spec.architecture in self.targets


VLLM_TARGETS_WHY = (
    f"vLLM hands aux hidden states only to Llama-derived and Qwen targets, and {UNSCALED_EMBEDDINGS}"
)
FORMATS = {
    "native": Format(None, "specdraft-eval / specdraft-bench"),
    "eagle": Format(
        ("eagle",),
        "the official SafeAILab/EAGLE code",
        EAGLE_CODE_TARGETS,
        "it loads Llama, Qwen2 and Qwen3 targets only",
    ),
    "vllm": Format(("eagle", "eagle3", "dflash"), "vLLM", LLAMA_DERIVED_TARGETS, VLLM_TARGETS_WHY),
    "speculators": Format(
        ("eagle3", "dflash"), "vLLM (speculators format)", LLAMA_DERIVED_TARGETS, VLLM_TARGETS_WHY
    ),
    "sglang": Format(("eagle", "eagle3"), "SGLang", LLAMA_DERIVED_TARGETS, UNSCALED_EMBEDDINGS),
    "medusa": Format(("medusa",), "vLLM Medusa"),  # it reads the last hidden state, which every target has
    "dflash": Format(
        ("dflash",),
        "the official z-lab/dflash code (DFlashDraftModel); vLLM",
        LLAMA_DERIVED_TARGETS,
        UNSCALED_EMBEDDINGS,
    ),
}


def export_files(
    record: HeadRecord,
    format: str,
    *,
    target_spec: TargetSpec,
    target_lm_head: Tensor | None = None,
    dtype: torch.dtype | None = None,
    speculative_tokens: int = 3,
    verifier: str | None = None,
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(config.json dict, tensors) of ``record`` in ``format``, checked against ``target_spec``.

    target_lm_head V×H: needed only by a Medusa head that drafts through the target's lm_head.
    dtype: the floating-point dtype of the written weights (None: as trained).
    speculative_tokens / verifier: the speculators format's proposal depth (EAGLE-3; a DFlash
    block proposes ``block_size − 1``) and target path.
    """
    if format not in FORMATS:
        raise FormatError(f"unknown export format {format!r}; expected one of {sorted(FORMATS)}")
    if record.kind not in FORMATS[format].holds():
        fits = sorted(name for name, f in FORMATS.items() if record.kind in f.holds())
        raise FormatError(
            f"format {format} holds {'/'.join(FORMATS[format].holds())} heads, not {record.kind!r}; "
            f"a head of kind {record.kind} exports as one of {fits}"
        )
    check_target(record.spec, target_spec, f"export {format}")
    check_served(FORMATS[format], format, record)
    check_tensors(record.state, native_shapes(record), f"the {record.kind} head's weights")
    check_finite(record.state, f"the {record.kind} head")
    state = cast_floats(record.state, dtype)
    if dtype is not None:  # values beyond the dtype's range become Inf
        check_finite(state, f"the {record.kind} head cast to {dtype}")
    record = HeadRecord(record.kind, record.config, record.spec, state, record.provenance)
    weights_dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    dtype_name = str(weights_dtype).removeprefix("torch.")
    if format == "native":
        return native_files(record)
    if format == "medusa":
        lm_head = None if target_lm_head is None else target_lm_head.to(weights_dtype)
        config, tensors = medusa_files(record, dtype_name, lm_head)
        expected = medusa_shapes(
            record.spec, config["num_heads"], config["num_hidden_layers"], config["original_lm_head"]
        )
    elif record.kind == "dflash":
        config, tensors = dflash_files(record, format, dtype_name, verifier)
        expected = dflash_shapes(record.spec, int(record.config["num_layers"]))
    elif record.kind == "eagle":
        config, tensors = eagle_files(record, format, dtype_name)
        expected = eagle_shapes(record.spec, "fc.bias" in tensors)
    else:
        config, tensors = eagle3_files(record, format, dtype_name, speculative_tokens, verifier)
        expected = eagle3_shapes(record.spec, tensors["lm_head.weight"].shape[0], "d2t" in tensors)
    check_tensors(tensors, expected, f"format {format}")
    config[PROVENANCE_KEY] = {"format": format, "kind": record.kind, "head_config": dict(record.config)}
    return config, tensors


def serving_formats(record: HeadRecord) -> list[str]:
    """The formats that hold ``record``'s kind and whose engines serve its target (native last)."""
    fits = sorted(
        name
        for name, f in FORMATS.items()
        if name != "native" and record.kind in f.holds() and f.serves(record.spec)
    )
    return [*fits, "native"]


def check_served(served_by: Format, format: str, record: HeadRecord) -> None:
    """One line for a head whose target the format's engine does not serve."""
    if not served_by.serves(record.spec):
        raise FormatError(
            f"format {format}: {served_by.loaded_by} does not serve a {record.kind} head for a "
            f"{record.spec.architecture} target ({served_by.targets_why}); this head exports as "
            f"{' / '.join(serving_formats(record))}"
        )


def write_export(
    out_dir: str | os.PathLike, record: HeadRecord, format: str, *, overwrite: bool = False, **options: Any
) -> Path:
    """Export ``record`` into ``out_dir`` (config.json + model.safetensors), atomically; options as
    :func:`export_files`. An existing non-empty ``out_dir`` is replaced only with ``overwrite``,
    and only when it holds an export specdraft wrote (never a directory of the user's)."""
    config, tensors = export_files(record, format, **options)
    check_round_trip(record, config, tensors, format, options)
    return write_export_dir(out_dir, config, tensors, overwrite=overwrite)


def check_round_trip(
    record: HeadRecord,
    config: dict[str, Any],
    tensors: dict[str, Tensor],
    format: str,
    options: dict[str, Any],
) -> None:
    """Reading the files back must give the same head: kind, config, aux taps, every weight bit
    for bit (in the exported dtype). Run before anything is written."""
    back = record_from_files(
        config, tensors, options["target_spec"], target_lm_head=options.get("target_lm_head"), format=format
    )
    # The expectation is cast here, not by the cast the export used: an export that also cast the
    # integer vocabulary maps (d2t, t2d) must not pass by comparing against the same mistake.
    dtype = options.get("dtype")
    expected = {k: v.to(dtype) if dtype and v.is_floating_point() else v for k, v in record.state.items()}
    problems = []
    if back.kind != record.kind or head_config(back.kind, back.config) != head_config(
        record.kind, record.config
    ):
        problems.append(f"head {back.kind} {back.config} instead of {record.kind} {record.config}")
    if back.spec.aux_layer_ids != record.spec.aux_layer_ids:
        problems.append(
            f"aux layers {list(back.spec.aux_layer_ids)} instead of {list(record.spec.aux_layer_ids)}"
        )
    if set(back.state) != set(expected):
        problems.append(f"weights {sorted(set(back.state) ^ set(expected))} appear on one side only")
    else:
        problems += [
            f"weight {k} differs ({back.state[k].dtype} read back, {expected[k].dtype} expected)"
            for k in expected
            if back.state[k].dtype != expected[k].dtype or not torch.equal(back.state[k], expected[k])
        ]
    if problems:
        raise FormatError(f"format {format}: the export does not read back as the same head: {problems}")


def detect_format(config: dict[str, Any]) -> str:
    """The format a config.json was written in (by specdraft, or by another trainer)."""
    if is_native(config):
        return "native"
    written_by = config.get(PROVENANCE_KEY, {})
    if isinstance(written_by, dict) and written_by.get("format") in FORMATS:
        return written_by["format"]
    architectures = config.get("architectures") or []
    if DFLASH_ARCHITECTURE in architectures:
        return "dflash"  # z-lab's layout (vLLM loads it as it is)
    if "speculators_model_type" in config:
        return "speculators"
    if config.get("model_type") == "medusa":
        return "medusa"
    if SGLANG_EAGLE_ARCHITECTURE in architectures:
        return "sglang"
    if EAGLE3_ARCHITECTURE in architectures:
        return "sglang" if "eagle_config" in config else "vllm"
    if config.get("model_type") == "llama" and config.get("num_hidden_layers") == 1:
        return "eagle"
    raise FormatError("config.json: not a draft-head export specdraft can read (unknown layout)")


def read_export(
    path: str | os.PathLike,
    target_spec: TargetSpec,
    *,
    target_lm_head: Tensor | None = None,
    format: str | None = None,
) -> HeadRecord:
    """The head in export directory ``path``, for decoding with the target of ``target_spec``.

    Foreign layouts take the target's spec (they do not carry one) and their aux layer ids from
    their own config; every layout is checked name by name and shape by shape."""
    config, tensors = read_export_dir(path)
    return record_from_files(
        config, tensors, target_spec, target_lm_head=target_lm_head, format=format, where=str(path)
    )


def record_from_files(
    config: dict[str, Any],
    tensors: dict[str, Tensor],
    target_spec: TargetSpec,
    *,
    target_lm_head: Tensor | None = None,
    format: str | None = None,
    where: str = "export",
) -> HeadRecord:
    """:func:`read_export` on a config and tensors already in memory."""
    format = format or detect_format(config)
    where = f"{where} (format {format})"
    if format == "native":
        record = native_record(config, tensors, where)
    elif format == "medusa":
        record = medusa_record(config, tensors, target_spec, target_lm_head)
    elif format in ("dflash", "vllm", "speculators") and (format == "dflash" or is_dflash_config(config)):
        layer_config = config.get("transformer_layer_config", config)
        check_config_shapes(layer_config, target_spec, where)
        record = dflash_record(config, tensors, target_spec, format)
    elif format in ("eagle", "vllm", "sglang", "speculators"):
        layer_config = config.get("transformer_layer_config", config)
        architectures = layer_config.get("architectures") or []
        is_eagle3 = format == "speculators" or EAGLE3_ARCHITECTURE in architectures
        check_config_shapes(layer_config, target_spec, where)
        reader = eagle3_record if is_eagle3 else eagle_record
        record = reader(
            config, {k: v for k, v in tensors.items() if k != "embed_tokens.weight"}, target_spec, format
        )
    else:
        raise FormatError(f"unknown export format {format!r}; expected one of {sorted(FORMATS)}")
    check_target(record.spec, target_spec, where)
    check_tensors(record.state, native_shapes(record), where)
    check_finite(record.state, where)
    return record


def check_config_shapes(config: dict[str, Any], spec: TargetSpec, where: str) -> None:
    """A foreign draft config describes a layer of the target's shape."""
    fields = {
        "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size,
    }
    differing = {k: (config.get(k), v) for k, v in fields.items() if config.get(k) != v}
    if differing:
        shown = ", ".join(f"{k}: export {a} vs target {b}" for k, (a, b) in differing.items())
        raise FormatError(f"{where}: the export does not fit target {spec.name!r} ({shown})")


def native_shapes(record: HeadRecord) -> dict[str, tuple[int, ...]]:
    """The state_dict shapes of a head of this kind and config for this spec (built on the meta
    device: no memory, no weights)."""
    if record.kind not in HEAD_KINDS:
        raise FormatError(f"unknown head kind {record.kind!r}; expected one of {sorted(HEAD_KINDS)}")
    spec = record.spec
    with torch.device("meta"):
        weights = TargetWeights(
            torch.empty(spec.vocab_size, spec.hidden_size),
            torch.empty(spec.vocab_size, spec.hidden_size),
            torch.empty(spec.hidden_size),
        )
        try:
            head = build_head(record.kind, record.config, spec, weights)
        except (ValueError, NotImplementedError) as error:  # e.g. a rotary type no head implements
            raise FormatError(f"head {record.kind}: {error}") from None
    return {name: tuple(t.shape) for name, t in head.state_dict().items()}


def read_checkpoint(path: str | os.PathLike) -> HeadRecord:
    """The head in a specdraft training checkpoint (.ckpt), read with ``weights_only=True``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"head checkpoint {path} does not exist")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # torch's own message advises weights_only=False: arbitrary code execution for a file we
        # did not write. Say what the file is not, in one line.
        raise FormatError(
            f"{path}: not a specdraft checkpoint (it holds objects other than tensors and plain data)"
        ) from None
    except Exception as error:  # a truncated or foreign file: torch's first line says which
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise FormatError(f"{path}: not a specdraft checkpoint ({reason})") from None
    record = checkpoint.get(CHECKPOINT_KEY) if isinstance(checkpoint, dict) else None
    if not record or not {"kind", "config", "target_spec"} <= set(record) or "state_dict" not in checkpoint:
        raise FormatError(
            f"{path}: not a specdraft training checkpoint"
            f" (expected a {CHECKPOINT_KEY!r} record and a state_dict)"
        )
    state = {
        key.removeprefix(CHECKPOINT_STATE_PREFIX): value
        for key, value in checkpoint["state_dict"].items()
        if key.startswith(CHECKPOINT_STATE_PREFIX)
    }
    check_finite(state, str(path))
    provenance = {"checkpoint": str(path.resolve()), "tokens_seen": int(record.get("tokens_seen", 0))}
    spec = TargetSpec.from_dict(record["target_spec"])
    return HeadRecord(record["kind"], dict(record["config"]), spec, state, provenance)


def read_head(
    path: str | os.PathLike, target_spec: TargetSpec, *, target_lm_head: Tensor | None = None
) -> HeadRecord:
    """A training checkpoint (file) or an export (directory, any format), checked against the target."""
    path = Path(path)
    if path.is_dir():
        return read_export(path, target_spec, target_lm_head=target_lm_head)
    record = read_checkpoint(path)
    check_target(record.spec, target_spec, str(path))
    return record
