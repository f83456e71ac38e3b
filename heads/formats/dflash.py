"""DFlash block drafters in the layouts of the official z-lab code, vLLM and vLLM's speculators.

specdraft's DFlash head has the reference's weight names already (``layers.{i}.self_attn.{q,k,v,o}
_proj``, ``…{q,k}_norm``, ``…{input,post_attention}_layernorm``, ``…mlp.{gate,up,down}_proj``,
``fc``, ``hidden_norm``, ``norm``), so every layout holds the same tensors under the same names and
no embedding or lm_head (the draft reads the target's). The layouts differ in their config:

* ``dflash`` (z-lab/dflash ``DFlashDraftModel``): a Qwen3 config with ``num_hidden_layers`` = the
  draft layers, ``block_size``, ``num_target_layers`` and ``dflash_config: {mask_token_id,
  target_layer_ids}``. z-lab's ``target_layer_ids`` name layer OUTPUTS (it reads
  ``hidden_states[id + 1]``); specdraft's taps name the stream ENTERING a layer
  (``hidden_states[id]``), so z-lab id = specdraft id − 1 and specdraft's tap 0 (the embedding
  output) has no z-lab name.
* ``vllm``: vLLM's ``DFlashDraftModel`` (``qwen3_dflash.py``) loads z-lab's layout as it is (it adds
  1 to ``target_layer_ids``); the export adds ``eagle_aux_hidden_state_layer_ids`` (vLLM's own
  convention = specdraft's), which vLLM reads first, so every vLLM release taps the same layers.
* ``speculators``: ``speculators_model_type: dflash`` with a nested ``transformer_layer_config`` and
  ``aux_hidden_state_layer_ids`` in specdraft's convention (vLLM derives both of the above from it).

Every layout says the block attention is not causal (``dflash_config.causal: false``,
``sliding_window_non_causal: true``, no sliding layers): a draft that an engine ran causally would
lose acceptance without an error.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import Tensor

from specdraft.heads.formats.eagle import llama_draft_config
from specdraft.heads.formats.files import PROVENANCE_KEY
from specdraft.heads.formats.record import FormatError, HeadRecord
from specdraft.heads.spec import TargetSpec

DFLASH_ARCHITECTURE = "DFlashDraftModel"  # z-lab's class, and vLLM's registry name for it
SPECULATORS_DFLASH_ARCHITECTURE = "DFlashSpeculator"
SPECULATORS_VERSION = "0.1.0"
FULL_ATTENTION = "full_attention"
# A foreign checkpoint does not record the share of positions its training anchored blocks at;
# decoding never reads it, so any valid value rebuilds the same drafter: every position.
FOREIGN_ANCHOR_FRACTION = 1.0
ENGINES = ("dflash", "vllm", "speculators")


def is_dflash_config(config: dict[str, Any]) -> bool:
    """Whether a foreign config.json describes a DFlash draft (any of the three layouts)."""
    return (
        DFLASH_ARCHITECTURE in (config.get("architectures") or [])
        or config.get("speculators_model_type") == "dflash"
    )


def zlab_layer_ids(aux_layer_ids: tuple[int, ...]) -> list[int]:
    """z-lab's ``target_layer_ids`` (layer outputs) of specdraft taps (streams entering a layer)."""
    if min(aux_layer_ids) < 1:
        raise FormatError(
            f"a DFlash head tapping layer 0 (the embedding output) has no z-lab/vLLM name (they name "
            f"layer outputs: id − 1); this head taps {list(aux_layer_ids)}: retrain with taps >= 1"
        )
    return [i - 1 for i in aux_layer_ids]


def dflash_shapes(spec: TargetSpec, num_layers: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of a DFlash draft of ``num_layers`` layers over the target's taps."""
    hidden, inter, head_dim = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q_out, kv_out = spec.num_attention_heads * head_dim, spec.num_kv_heads * head_dim
    shapes = {
        "fc.weight": (hidden, len(spec.aux_layer_ids) * hidden),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
    }
    for i in range(num_layers):
        prefix = f"layers.{i}."
        shapes.update(
            {
                f"{prefix}input_layernorm.weight": (hidden,),
                f"{prefix}self_attn.q_proj.weight": (q_out, hidden),
                f"{prefix}self_attn.k_proj.weight": (kv_out, hidden),
                f"{prefix}self_attn.v_proj.weight": (kv_out, hidden),
                f"{prefix}self_attn.o_proj.weight": (hidden, q_out),
                f"{prefix}self_attn.q_norm.weight": (head_dim,),
                f"{prefix}self_attn.k_norm.weight": (head_dim,),
                f"{prefix}post_attention_layernorm.weight": (hidden,),
                f"{prefix}mlp.gate_proj.weight": (inter, hidden),
                f"{prefix}mlp.up_proj.weight": (inter, hidden),
                f"{prefix}mlp.down_proj.weight": (hidden, inter),
            }
        )
    return shapes


def qwen3_draft_config(
    spec: TargetSpec, num_layers: int, architectures: list[str], dtype: str
) -> dict[str, Any]:
    """The Qwen3 config the draft layers are built from: the target's shapes, full (not sliding)
    attention in every layer, no attention bias. Refuses a target whose rotary embedding is not
    the plain one (the layouts have no field for another)."""
    config = llama_draft_config(spec, architectures, dtype)
    del config["mlp_bias"]  # Qwen3 has none
    config.update(
        {
            "model_type": "qwen3",
            "num_hidden_layers": num_layers,
            "rope_scaling": None,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": num_layers,
            "layer_types": [FULL_ATTENTION] * num_layers,
        }
    )
    return config


def dflash_files(
    record: HeadRecord, engine: str, dtype: str, verifier: str | None = None
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(config, tensors) of a DFlash head; engine: one of :data:`ENGINES`."""
    spec, head = record.spec, record.config
    num_layers, block_size = int(head["num_layers"]), int(head["block_size"])
    mask_token_id = int(head["mask_token_id"])  # resolved by the head, as its record keeps it
    aux = list(spec.aux_layer_ids)
    zlab_ids = zlab_layer_ids(spec.aux_layer_ids)
    if engine in ("dflash", "vllm"):
        config = qwen3_draft_config(spec, num_layers, [DFLASH_ARCHITECTURE], dtype)
        config.update(
            {
                "block_size": block_size,
                "num_target_layers": spec.num_layers,
                "dflash_config": {
                    "mask_token_id": mask_token_id,
                    "target_layer_ids": zlab_ids,
                    "causal": False,
                },
            }
        )
        if engine == "vllm":
            config["eagle_aux_hidden_state_layer_ids"] = aux
    elif engine == "speculators":
        config = {
            "architectures": [SPECULATORS_DFLASH_ARCHITECTURE],
            "speculators_model_type": "dflash",
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": qwen3_draft_config(spec, num_layers, ["Qwen3ForCausalLM"], dtype),
            "draft_vocab_size": spec.vocab_size,
            "target_hidden_size": spec.hidden_size,
            "block_size": block_size,
            "aux_hidden_state_layer_ids": aux,
            "mask_token_id": mask_token_id,
            "sliding_window_non_causal": True,
            "sample_from_anchor": False,
            "speculators_config": {
                "algorithm": "dflash",
                "default_proposal_method": "greedy",
                # The anchor is the last committed token: a block proposes block_size − 1 drafts.
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": block_size - 1}],
                "verifier": {"name_or_path": verifier or spec.name, "architectures": [spec.architecture]},
            },
            "torch_dtype": dtype,
        }
    else:
        raise FormatError(f"DFlash engine {engine!r} is not one of {', '.join(ENGINES)}")
    return config, dict(record.state)


def check_rope(layer_config: dict[str, Any], spec: TargetSpec, engine: str) -> None:
    """The draft rotates its queries and keys with ITS config's rotary embedding, which specdraft's
    head takes from the target: refuse a draft whose rotary differs (scaled, or another theta)."""
    theirs = dict(layer_config.get("rope_parameters") or layer_config.get("rope_scaling") or {})
    theirs.setdefault("rope_theta", layer_config.get("rope_theta", theirs.get("rope_theta")))
    ours = dict(spec.rope_parameters)
    plain = theirs.get("rope_type", theirs.get("type", "default")) == "default"
    if not plain or float(theirs["rope_theta"] or 0) != float(ours.get("rope_theta", 0)):
        raise FormatError(
            f"{engine} config: the draft's rotary embedding {theirs} is not the plain one of target "
            f"{spec.name!r} ({ours}), the only one specdraft's DFlash head implements"
        )


def dflash_record(
    config: dict[str, Any], tensors: dict[str, Tensor], spec: TargetSpec, engine: str
) -> HeadRecord:
    """The DFlash head in a config + tensors of any of the layouts; specdraft's taps from the
    config's layer ids, the training-only anchor share from our provenance when we wrote it."""
    if engine == "speculators":
        layer_config = config.get("transformer_layer_config") or {}
        if config.get("sample_from_anchor"):
            raise FormatError(
                "speculators config: sample_from_anchor=true (the anchor position drafts too), which "
                "specdraft's DFlash head does not implement"
            )
        aux, mask_token_id = config.get("aux_hidden_state_layer_ids"), config.get("mask_token_id")
        block_size = config.get("block_size")
    else:
        layer_config, dflash = config, config.get("dflash_config") or {}
        zlab_ids = dflash.get("target_layer_ids")
        aux = None if zlab_ids is None else [int(i) + 1 for i in zlab_ids]
        vllm_ids = config.get("eagle_aux_hidden_state_layer_ids")
        if vllm_ids and aux is not None and [int(i) for i in vllm_ids] != aux:
            raise FormatError(
                f"{engine} config: eagle_aux_hidden_state_layer_ids {list(vllm_ids)} do not name the layers "
                f"of dflash_config.target_layer_ids {list(zlab_ids)} (expected each + 1)"
            )
        aux = aux or vllm_ids
        mask_token_id = dflash.get("mask_token_id")
        block_size = config.get("block_size") or dflash.get("block_size")
        if dflash.get("causal") or config.get("is_causal"):
            raise FormatError(
                f"{engine} config: causal block attention, which specdraft's DFlash head does not implement"
            )
    missing = [
        name
        for name, value in (("layer ids", aux), ("mask_token_id", mask_token_id), ("block_size", block_size))
        if value is None
    ]
    if missing:
        raise FormatError(f"{engine} config: no DFlash {', '.join(missing)}")
    if any(kind != FULL_ATTENTION for kind in layer_config.get("layer_types") or []):
        raise FormatError(
            f"{engine} config: sliding-window draft layers ({layer_config['layer_types']}), which "
            "specdraft's DFlash head does not implement"
        )
    check_rope(layer_config, spec, engine)
    num_target_layers = config.get("num_target_layers")
    if num_target_layers is not None and num_target_layers != spec.num_layers:
        raise FormatError(
            f"{engine} config: num_target_layers {num_target_layers}, but target {spec.name!r} has "
            f"{spec.num_layers} layers"
        )
    written_by = config.get(PROVENANCE_KEY)
    ours = written_by.get("head_config", {}) if isinstance(written_by, dict) else {}
    head_config = {
        "num_layers": int(layer_config.get("num_hidden_layers", 0)),
        "block_size": int(block_size),
        "mask_token_id": int(mask_token_id),
        "anchor_fraction": ours.get("anchor_fraction", FOREIGN_ANCHOR_FRACTION),
        "kind": "dflash",
    }
    return HeadRecord("dflash", head_config, replace(spec, aux_layer_ids=tuple(int(i) for i in aux)), tensors)
