"""The offline feature cache: safetensors shards + a JSON manifest. This module holds the format
(plan, shards, sidecars, manifest, their validation) and computes a cache from tokenized
conversations; :mod:`specdraft.data.captured_cache` writes one from features captured during
regeneration, and :mod:`specdraft.data.cache_dataset` reads a finished one back.

Layout of a cache directory::

    plan.json                 what will be stored: header (target spec, tokenizer fingerprint, data
                              source, split, token-id hash, stored fields) + the shard plan
    shard-00000.safetensors   samples packed back to back, no padding:
                                input_ids [N] int32, loss_mask [N] uint8, offsets [S+1] int64,
                                hidden [N, H] target dtype, aux [N, k·H] (optional),
                                topk_ids [N, K] int32 + topk_probs [N, K] fp32 (optional)
    shard-00000.json          sidecar: sample ids, counts, size and SHA-256 of the shard file
    manifest.json             plan + every sidecar, written once all shards exist

A cache is computed here from tokenized conversations (:func:`write_cache`, ``specdraft-cache``),
or captured while the target regenerates the answers
(:class:`~specdraft.data.captured_cache.CapturedCacheWriter`, ``specdraft-regen features.dir=…``):
one shard per regeneration chunk, and plan.json written at the end, when the samples are known.
Both read back the same way.

Crash safety: a shard is written to a temporary file and renamed into place, then its sidecar is
written the same way; a shard counts as done only when its sidecar exists and matches the file.
The shard plan depends on the token ids alone, and each shard is computed in the same batches
whenever it is computed, so a run killed at any moment and started again ends with the same
files as an uninterrupted run. Ranks split the shards round-robin (shard i → rank i % world);
whichever rank finds every shard done writes the manifest (re-running any rank, or
``mode=validate``, also does).

Numbers that cannot be trusted are refused (docs/architecture.md §2): a shard whose features hold
a NaN or an Inf is not written (:func:`refuse_nonfinite_features`, naming the sample), and a
finished one that holds them is named by ``mode=validate`` and refused when read
(:func:`check_finite_shard`), before a head trains into NaN weights.

Features of one sequence depend, at rounding level, on the other sequences in its batch (matmul
blocking follows the batch shape; measured on the tiny target: fp32 ≤ 6e-7, bf16 ≤ 1.6e-2 max abs
difference). "Cached == online" therefore holds bit for bit for the same batches.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from specdraft.data.cache_manifest import manifest_differences, manifest_problems
from specdraft.data.chat import TokenizedConversation
from specdraft.data.features import collate, extract_features, length_batches, pad_token_id
from specdraft.data.finite import nonfinite_feature
from specdraft.data.target import Target
from specdraft.system.files import (
    SettingsMismatch,
    check_or_store_settings,
    file_sha256,
    write_file_atomic,
    write_json_atomic,
)
from specdraft.system.locks import live_holders

log = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1
FLOAT_FIELDS = ("hidden", "aux", "topk_probs")  # the stored tensors that must hold finite numbers


class CacheError(ValueError):
    """A cache that does not match what was asked for, or that is damaged."""


@dataclass(frozen=True)
class StoredFields:
    """What a cache holds besides tokens and the last hidden state."""

    aux_layer_ids: tuple[int, ...] = ()
    top_k: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"aux_layer_ids": list(self.aux_layer_ids), "top_k": self.top_k}


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 of everything that decides the token ids: the tokenizer model, its special
    tokens and the chat template."""
    digest = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode())
    digest.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    digest.update((tokenizer.chat_template or "").encode())
    return digest.hexdigest()


def token_hash(samples: Sequence[TokenizedConversation]) -> str:
    """SHA-256 over every sample's id, token ids and loss mask, in order."""
    digest = hashlib.sha256()
    for sample in samples:
        digest.update(sample.id.encode() + b"\0")
        digest.update(torch.tensor(sample.input_ids, dtype=torch.int32).numpy().tobytes())
        digest.update(bytes(sample.loss_mask))
    return digest.hexdigest()


def plan_shards(lengths: Sequence[int], shard_tokens: int) -> list[tuple[int, int]]:
    """Consecutive [start, end) sample ranges of at most ``shard_tokens`` tokens (a longer
    sample gets a shard of its own)."""
    shards, start, tokens = [], 0, 0
    for index, length in enumerate(lengths):
        if index > start and tokens + length > shard_tokens:
            shards.append((start, index))
            start, tokens = index, 0
        tokens += length
    if start < len(lengths):
        shards.append((start, len(lengths)))
    return shards


def cache_plan(
    target: Target,
    samples: Sequence[TokenizedConversation],
    fields: StoredFields,
    source: dict[str, Any],
    shard_tokens: int,
    batch_tokens: int,
) -> dict[str, Any]:
    """The plan.json content: identical for every run (and rank) over the same inputs."""
    shards = plan_shards([len(s.input_ids) for s in samples], shard_tokens)
    plan = {
        "format_version": CACHE_FORMAT_VERSION,
        "target": target.spec.to_dict(),
        "tokenizer_fingerprint": tokenizer_fingerprint(target.tokenizer),
        "source": source,
        "fields": fields.to_dict(),
        "num_samples": len(samples),
        "num_tokens": sum(len(s.input_ids) for s in samples),
        "token_hash": token_hash(samples),
        "batch_tokens": batch_tokens,
        "shards": [
            {"name": shard_name(i), "first_sample": start, "num_samples": end - start}
            for i, (start, end) in enumerate(shards)
        ],
    }
    return json.loads(json.dumps(plan))  # the form it has when read back (tuples become lists)


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def write_cache(
    target: Target,
    samples: Sequence[TokenizedConversation],
    out_dir: str | Path,
    fields: StoredFields,
    source: dict[str, Any],
    shard_tokens: int = 1 << 18,
    batch_tokens: int = 8192,
    rank: int = 0,
    world_size: int = 1,
    progress: bool = True,
) -> dict[str, Any] | None:
    """Compute and write this rank's missing shards; return the manifest once every shard exists."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    out_dir = Path(out_dir)
    plan = cache_plan(target, samples, fields, source, shard_tokens, batch_tokens)
    # The plan binds once a shard exists, or while another rank (system/locks.py) may write one.
    written = any(out_dir.glob("shard-*")) or bool(live_holders(out_dir))
    try:
        check_or_store_settings(out_dir / "plan.json", plan, outputs_exist=written)
    except SettingsMismatch as error:
        raise CacheError(f"{error}\nchoose another output directory or remove this one") from None
    mine = [i for i in range(len(plan["shards"])) if i % world_size == rank]
    for index in mine:  # temporary files of a killed run; only this rank writes these shards
        for stale in out_dir.glob(f".{plan['shards'][index]['name']}.*"):
            stale.unlink(missing_ok=True)
    todo = [i for i in mine if sidecar_if_done(out_dir, plan["shards"][i]["name"]) is None]
    shard_ranges = [(s["first_sample"], s["first_sample"] + s["num_samples"]) for s in plan["shards"]]
    todo_tokens = sum(len(samples[j].input_ids) for i in todo for j in range(*shard_ranges[i]))
    log.info(
        "cache %s: %d shards, rank %d/%d owns %d, %d to write",
        out_dir,
        len(shard_ranges),
        rank,
        world_size,
        len(mine),
        len(todo),
    )
    with tqdm(
        total=todo_tokens, desc=f"cache rank {rank}", unit="tok", unit_scale=True, disable=not progress
    ) as bar:
        for index in todo:
            start, end = shard_ranges[index]
            shard_samples = samples[start:end]
            tensors = compute_shard(target, shard_samples, fields, batch_tokens, bar.update)
            refuse_nonfinite_features(out_dir, plan["shards"][index]["name"], tensors, shard_samples)
            write_shard(out_dir, plan["shards"][index]["name"], tensors, shard_samples)
    return finalize_manifest(out_dir)


def compute_shard(
    target: Target,
    samples: Sequence[TokenizedConversation],
    fields: StoredFields,
    batch_tokens: int,
    on_batch_tokens: Callable[[int], object] = lambda n: None,
) -> dict[str, Tensor]:
    """Features for one shard's samples, packed in sample order. Batches are length-bucketed,
    and each batch's rows are copied into the packed tensors at once, so memory holds one shard
    plus one batch."""
    lengths = torch.tensor([len(s.input_ids) for s in samples])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    tokens, hidden_size = int(offsets[-1]), target.spec.hidden_size
    tensors = {
        "input_ids": torch.cat([torch.tensor(s.input_ids, dtype=torch.int32) for s in samples]),
        "loss_mask": torch.cat([torch.tensor(s.loss_mask, dtype=torch.uint8) for s in samples]),
        "offsets": offsets,
        "hidden": torch.empty(tokens, hidden_size, dtype=target.dtype),
    }
    if fields.aux_layer_ids:
        tensors["aux"] = torch.empty(tokens, len(fields.aux_layer_ids) * hidden_size, dtype=target.dtype)
    if fields.top_k:
        tensors["topk_ids"] = torch.empty(tokens, fields.top_k, dtype=torch.int32)
        tensors["topk_probs"] = torch.empty(tokens, fields.top_k, dtype=torch.float32)
    feature_names = [name for name in ("hidden", "aux", "topk_ids", "topk_probs") if name in tensors]

    pad_id = pad_token_id(target.spec)
    for indices in length_batches(lengths.tolist(), batch_tokens):
        batch = collate([samples[i] for i in indices], pad_id)
        features = extract_features(target, batch, fields.aux_layer_ids, top_k=fields.top_k)
        for row, index in enumerate(indices):
            start, end = int(offsets[index]), int(offsets[index + 1])
            for name in feature_names:
                tensors[name][start:end] = getattr(features, name)[row, : end - start].to(
                    tensors[name].device
                )
        on_batch_tokens(batch.num_tokens)
    return tensors


def finalize_manifest(out_dir: str | Path) -> dict[str, Any] | None:
    """Write manifest.json if every planned shard is done; return it (None if shards are missing).
    The manifest plan.json and the sidecars make is checked against the shards first, and an
    existing manifest.json that differs from it is reported (:func:`check_manifest`), not rewritten."""
    out_dir = Path(out_dir)
    plan = read_json(out_dir / "plan.json")
    sidecars = [sidecar_if_done(out_dir, shard["name"]) for shard in plan["shards"]]
    missing = [s["name"] for s, sidecar in zip(plan["shards"], sidecars, strict=True) if sidecar is None]
    if missing:
        log.info(
            "cache %s: %d of %d shards still missing (e.g. %s)",
            out_dir,
            len(missing),
            len(sidecars),
            missing[0],
        )
        return None
    manifest = {
        **plan,
        "shards": [{**s, **sidecar} for s, sidecar in zip(plan["shards"], sidecars, strict=True)],
    }
    manifest_path = out_dir / "manifest.json"
    check_manifest(out_dir, manifest, stored=read_json(manifest_path) if manifest_path.is_file() else None)
    if not manifest_path.is_file():
        write_json_atomic(manifest_path, manifest)
    return manifest


def validate_cache(out_dir: str | Path) -> dict[str, Any]:
    """Check every shard against the manifest: its counts, totals and offsets, size, SHA-256,
    tensor names, shapes and dtypes.
    Raises :class:`CacheError` naming every bad file; returns the manifest."""
    out_dir = Path(out_dir)
    manifest = read_json(out_dir / "manifest.json")
    hidden_size = manifest["target"]["hidden_size"]
    problems = manifest_problems(out_dir, manifest)  # counts, totals, offsets (data/cache_manifest.py)
    for shard in tqdm(manifest["shards"], desc="validate", unit="shard"):
        path = out_dir / f"{shard['name']}.safetensors"
        try:
            _check_checksum(path, shard)
            with safe_open(str(path), "pt") as handle:
                _check_shapes(handle, shard, manifest["fields"], hidden_size)
                check_finite_shard(handle, path, shard)
        except (CacheError, OSError) as error:
            problems.append(str(error))
    if problems:
        raise CacheError(f"cache {out_dir} is damaged:\n  " + "\n  ".join(problems))
    return manifest


def stored_top_k(out_dir: str | Path) -> int | None:
    """How many of the target's top tokens a finished cache stores (0: none); None when
    ``out_dir`` holds no manifest (opening it as a
    :class:`~specdraft.data.cache_dataset.FeatureCache` says why)."""
    manifest = Path(out_dir) / "manifest.json"
    return read_json(manifest)["fields"]["top_k"] if manifest.is_file() else None


def write_shard(out_dir: Path, name: str, tensors: dict[str, Tensor], samples: Sequence[Any]) -> None:
    """Shard ``name`` of ``out_dir`` (its packed ``tensors``), then its sidecar naming ``samples``
    (anything with an ``id``), each written atomically: the shard is done once the sidecar exists."""
    # One metadata key only: safetensors writes the metadata map in hash order, so two keys
    # would make identical shards differ byte for byte between runs (the version is in plan.json).
    # Written by safetensors straight to the file: serialising to bytes first took 3-5× as long
    # (4.4-5.1 s against 1.3-1.7 s with the hash, 790 MB of SmolLM2 features with aux layers,
    # 2-core EPYC), and the same bytes.
    path = out_dir / f"{name}.safetensors"
    write_file_atomic(path, lambda staging: save_file(tensors, staging, metadata={"format": "pt"}))
    sidecar = {
        "sample_ids": [s.id for s in samples],
        "num_tokens": int(tensors["input_ids"].numel()),
        "offsets": tensors["offsets"].tolist(),
        "bytes": path.stat().st_size,
        "sha256": file_sha256(path),
    }
    write_json_atomic(out_dir / f"{name}.json", sidecar)


def sidecar_if_done(out_dir: Path, name: str) -> dict[str, Any] | None:
    """The shard's sidecar if the shard is complete: the sidecar is written after the shard's
    atomic rename, so its presence plus a matching file size means the shard is whole."""
    sidecar_path, shard_path = out_dir / f"{name}.json", out_dir / f"{name}.safetensors"
    if not sidecar_path.is_file() or not shard_path.is_file():
        return None
    sidecar = read_json(sidecar_path, SIDECAR_KEYS)
    return sidecar if shard_path.stat().st_size == sidecar["bytes"] else None


def refuse_nonfinite_features(
    out_dir: Path, name: str, tensors: dict[str, Tensor], samples: Sequence[Any]
) -> None:
    """Refuse to write shard ``name`` of ``out_dir`` when the features the target gave for its
    ``samples`` (anything with an ``id``) hold a NaN or an Inf: a head trained on them has NaN
    weights. Called before the shard is written, so nothing of it is recorded as done."""
    fields = {field: len(tensors[field]) for field in FLOAT_FIELDS if field in tensors}
    where = nonfinite_feature(
        lambda field, start, end: tensors[field][start:end],
        fields,
        tensors["offsets"].tolist(),
        [s.id for s in samples],
    )
    if where is not None:
        raise CacheError(
            f"{out_dir}: the target's features for {name} are not finite (NaN/Inf in {where}); "
            "nothing of this shard was written (shards written before it are kept): check the "
            "target's weights and dtype (float16 overflows where bfloat16 does not)"
        )


def check_finite_shard(handle, path: Path, shard: dict[str, Any], skip: Collection[str] = ()) -> None:
    """Refuse a stored shard (open as ``handle``, described by its manifest entry ``shard``)
    whose features, those of FLOAT_FIELDS not in ``skip``, hold a NaN or an Inf, naming the file
    and the first sample concerned."""
    names = handle.keys()  # safe_open handles are not iterable
    fields = [field for field in FLOAT_FIELDS if field in names and field not in skip]
    slices = {field: handle.get_slice(field) for field in fields}
    where = nonfinite_feature(
        lambda field, start, end: slices[field][start:end],
        {field: piece.get_shape()[0] for field, piece in slices.items()},
        shard["offsets"],
        shard["sample_ids"],
    )
    if where is not None:
        raise CacheError(
            f"{path}: the cached features are not finite (NaN/Inf in {where}); a head trained on "
            "them gets NaN weights: write this cache again (specdraft-cache) from a target whose "
            "features are finite"
        )


def _check_checksum(path: Path, shard: dict[str, Any]) -> None:
    if not path.is_file():
        raise CacheError(f"{path}: missing")
    if path.stat().st_size != shard["bytes"]:
        raise CacheError(
            f"{path}: {path.stat().st_size} bytes, the manifest says {shard['bytes']} (truncated?)"
        )
    if file_sha256(path) != shard["sha256"]:
        raise CacheError(f"{path}: SHA-256 does not match the manifest (corrupt)")


def _check_shapes(handle, shard: dict[str, Any], fields: dict[str, Any], hidden_size: int) -> None:
    tokens = shard["num_tokens"]
    expected = {
        "input_ids": [tokens],
        "loss_mask": [tokens],
        "offsets": [shard["num_samples"] + 1],
        "hidden": [tokens, hidden_size],
    }
    if fields["aux_layer_ids"]:
        expected["aux"] = [tokens, len(fields["aux_layer_ids"]) * hidden_size]
    if fields["top_k"]:
        expected["topk_ids"] = expected["topk_probs"] = [tokens, fields["top_k"]]
    names = handle.keys()  # safe_open handles are not iterable
    actual = {name: handle.get_slice(name).get_shape() for name in names}
    if actual != expected:
        raise CacheError(f"{shard['name']}.safetensors: tensors {actual}, expected {expected}")


# The keys a cache's JSON files must hold to be read (a damaged or foreign file is named, not a
# KeyError): plan.json and manifest.json, and each shard's sidecar.
PLAN_KEYS = ("format_version", "target", "fields", "num_samples", "num_tokens", "shards")
SIDECAR_KEYS = ("sample_ids", "num_tokens", "offsets", "bytes", "sha256")


def read_json(path: Path, required: Sequence[str] = PLAN_KEYS) -> dict[str, Any]:
    """A cache's JSON file, an object holding the ``required`` keys; a missing, unreadable or
    damaged one is a :class:`CacheError` naming it."""
    try:
        loaded = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CacheError(f"{path}: not valid JSON ({error})") from error
    except UnicodeDecodeError as error:
        raise CacheError(f"{path}: not UTF-8 JSON (byte {error.start}: {error.reason})") from error
    except FileNotFoundError as error:
        raise CacheError(f"{path}: not found") from error
    missing = [key for key in required if key not in loaded] if isinstance(loaded, dict) else required
    if missing:
        raise CacheError(
            f"{path}: not a cache file of ours (expected a JSON object with {', '.join(missing)})"
        )
    return loaded


def check_manifest(
    out_dir: str | Path, manifest: dict[str, Any], stored: dict[str, Any] | None = None
) -> None:
    """Raise :class:`CacheError` where ``manifest`` disagrees with itself or with its shards
    (:mod:`specdraft.data.cache_manifest`), or where a ``stored`` manifest.json differs from it
    (``manifest`` then being what plan.json and the sidecars make): a lying manifest is reported,
    never rewritten. One ``<shard> <field>: …`` per problem."""
    problems = manifest_problems(Path(out_dir), manifest)
    if problems:
        raise CacheError(f"cache {out_dir}: the manifest disagrees with its shards: " + "; ".join(problems))
    differences = manifest_differences(stored, manifest) if stored is not None else []
    if differences:
        raise CacheError(
            f"cache {out_dir}: manifest.json disagrees with plan.json and the shards' sidecars in "
            f"{', '.join(differences[:8])}; remove manifest.json to have it written again"
        )
