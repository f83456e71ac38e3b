"""The offline feature cache: safetensors shards + a JSON manifest.

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
or captured while the target regenerates the answers (:class:`CapturedCacheWriter`,
``specdraft-regen features.dir=…``): one shard per regeneration chunk, and plan.json written at
the end, when the samples are known. Both read back the same way.

Crash safety: a shard is written to a temporary file and renamed into place, then its sidecar is
written the same way; a shard counts as done only when its sidecar exists and matches the file.
The shard plan depends on the token ids alone, and each shard is computed in the same batches
whenever it is computed, so a run killed at any moment and started again ends with the same
files as an uninterrupted run. Ranks split the shards round-robin (shard i → rank i % world);
whichever rank finds every shard done writes the manifest (re-running any rank, or
``mode=validate``, also does).

Features of one sequence depend, at rounding level, on the other sequences in its batch (matmul
blocking follows the batch shape; measured on the tiny target: fp32 ≤ 6e-7, bf16 ≤ 1.6e-2 max abs
difference). "Cached == online" therefore holds bit for bit for the same batches.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from specdraft.data.chat import TokenizedConversation
from specdraft.data.conversations import is_heldout
from specdraft.data.features import FeatureBatch, collate, extract_features, length_batches, pad_token_id
from specdraft.data.target import Target
from specdraft.heads.spec import TargetSpec
from specdraft.system.files import (
    SettingsMismatch,
    check_or_store_settings,
    file_sha256,
    write_file_atomic,
    write_json_atomic,
)

log = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1


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
    try:
        check_or_store_settings(out_dir / "plan.json", plan)
    except SettingsMismatch as error:
        raise CacheError(f"{error}\nchoose another output directory or remove this one") from None
    mine = [i for i in range(len(plan["shards"])) if i % world_size == rank]
    for index in mine:  # temporary files of a killed run; only this rank writes these shards
        for stale in out_dir.glob(f".{plan['shards'][index]['name']}.*"):
            stale.unlink(missing_ok=True)
    todo = [i for i in mine if _sidecar_if_done(out_dir, plan["shards"][i]["name"]) is None]
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
            _write_shard(out_dir, plan["shards"][index]["name"], tensors, shard_samples)
    return finalize_manifest(out_dir)


@dataclass(frozen=True)
class CapturedSample:
    """One conversation's tokens (prompt + generated answer) and their captured features (T rows
    each, as :class:`~specdraft.data.capture.CapturedFeatures`)."""

    id: str
    input_ids: Sequence[int]
    loss_mask: Sequence[int]
    features: Any  # CapturedFeatures (data/capture.py)


class CapturedCacheWriter:
    """Feature caches written from features captured during regeneration, one per split: each
    regeneration chunk's samples become shard ``chunk`` of the train cache and of the held-out
    one (split by conversation id as :func:`~specdraft.data.conversations.is_heldout` does;
    a split with no sample in a chunk gets an empty shard, so a missing shard always means
    unfinished work). :meth:`finish` writes each cache's plan.json and manifest once every chunk's
    shards exist. A chunk written again (regeneration resumed after a kill) replaces its shards
    atomically."""

    def __init__(
        self,
        dirs: dict[str, str | Path],
        target: Target,
        fields: StoredFields,
        heldout_fraction: float,
        split_seed: int,
        source: dict[str, Any],
    ) -> None:
        if set(dirs) != {"train", "heldout"}:
            raise ValueError(f"captured features need a train and a heldout directory, got {sorted(dirs)}")
        if not 0.0 <= heldout_fraction < 1.0:
            raise ValueError(f"features.heldout_fraction must be in [0, 1), got {heldout_fraction}")
        self.dirs = {split: Path(d) for split, d in dirs.items()}
        self.spec, self.fields = target.spec, fields
        # what a reader needs to know: captured (top-k zero at the prompt's positions before its
        # last: a cache for training on answers only) and how the conversations were split
        split = {"heldout_fraction": heldout_fraction, "split_seed": split_seed}
        self.source = {"captured_by": "specdraft-regen", **source, "split": split}
        self.fingerprint = tokenizer_fingerprint(target.tokenizer)
        self.heldout_fraction, self.split_seed = heldout_fraction, split_seed

    def start(self) -> None:
        """Claim the directories for these settings (``capture.json``; other settings are refused,
        nothing touched) and remove the temporary files of a killed run."""
        settings = {
            "format_version": CACHE_FORMAT_VERSION,
            "target": self.spec.to_dict(),
            "source": self.source,
            "fields": self.fields.to_dict(),
            "heldout_fraction": self.heldout_fraction,
            "split_seed": self.split_seed,
        }
        for split, directory in self.dirs.items():
            if (directory / "plan.json").is_file() and not (directory / "capture.json").is_file():
                raise CacheError(
                    f"{directory} holds a feature cache that specdraft-cache wrote: choose another "
                    "features.dir (nothing was changed)"
                )
            try:
                check_or_store_settings(directory / "capture.json", {**settings, "cache_split": split})
            except SettingsMismatch as error:
                raise CacheError(f"{error}\nchoose another features.dir or remove this one") from None
            # A finished cache's manifest is written again by finish(); until then no reader
            # may take shards being rewritten for a finished cache.
            (directory / "manifest.json").unlink(missing_ok=True)
            for stale in directory.glob(".shard-*"):
                stale.unlink(missing_ok=True)

    def write_chunk(self, chunk_index: int, samples: Sequence[CapturedSample]) -> None:
        """Shard ``chunk_index`` of both caches, from this chunk's samples (in chunk order)."""
        for split, directory in self.dirs.items():
            chosen = [
                s
                for s in samples
                if is_heldout(s.id, self.heldout_fraction, self.split_seed) == (split == "heldout")
            ]
            tensors = self._pack(chosen)
            _write_shard(directory, shard_name(chunk_index), tensors, chosen)

    def _pack(self, samples: Sequence[CapturedSample]) -> dict[str, Tensor]:
        lengths = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.int64)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        dtype, hidden_size = getattr(torch, self.spec.dtype), self.spec.hidden_size

        def stacked(name: str, width: int, empty_dtype: torch.dtype) -> Tensor:
            parts = [getattr(s.features, name).cpu() for s in samples]
            return torch.cat(parts) if parts else torch.empty(0, width, dtype=empty_dtype)

        ids = [torch.tensor(s.input_ids, dtype=torch.int32) for s in samples]
        masks = [torch.tensor(s.loss_mask, dtype=torch.uint8) for s in samples]
        tensors = {
            "input_ids": torch.cat(ids) if ids else torch.empty(0, dtype=torch.int32),
            "loss_mask": torch.cat(masks) if masks else torch.empty(0, dtype=torch.uint8),
            "offsets": offsets,
            "hidden": stacked("hidden", hidden_size, dtype).to(dtype),
        }
        if self.fields.aux_layer_ids:
            width = len(self.fields.aux_layer_ids) * hidden_size
            tensors["aux"] = stacked("aux", width, dtype).to(dtype)
        if self.fields.top_k:
            tensors["topk_ids"] = stacked("topk_ids", self.fields.top_k, torch.int32).to(torch.int32)
            tensors["topk_probs"] = stacked("topk_probs", self.fields.top_k, torch.float32).float()
        return {name: t.contiguous() for name, t in tensors.items()}

    def finish(self, num_chunks: int) -> dict[str, dict[str, Any]]:
        """plan.json and manifest.json of both caches, once shards 0..num_chunks-1 all exist
        (raises :class:`CacheError` naming a missing one). Returns the manifests by split."""
        manifests = {}
        for split, directory in self.dirs.items():
            names = [shard_name(i) for i in range(num_chunks)]
            sidecars = [_sidecar_if_done(directory, name) for name in names]
            missing = [name for name, sidecar in zip(names, sidecars, strict=True) if sidecar is None]
            if missing:
                raise CacheError(f"{directory}: shards {missing[:3]} of the captured features are missing")
            samples, shards, first = [], [], 0
            for name, sidecar in zip(names, sidecars, strict=True):
                with safe_open(str(directory / f"{name}.safetensors"), "pt") as handle:
                    input_ids, loss_mask = handle.get_tensor("input_ids"), handle.get_tensor("loss_mask")
                offsets = sidecar["offsets"]
                for n, sample_id in enumerate(sidecar["sample_ids"]):
                    piece = slice(offsets[n], offsets[n + 1])
                    samples.append(
                        TokenizedConversation(
                            sample_id, tuple(input_ids[piece].tolist()), tuple(loss_mask[piece].tolist())
                        )
                    )
                shards.append(
                    {"name": name, "first_sample": first, "num_samples": len(sidecar["sample_ids"])}
                )
                first += len(sidecar["sample_ids"])
            plan = {
                "format_version": CACHE_FORMAT_VERSION,
                "target": self.spec.to_dict(),
                "tokenizer_fingerprint": self.fingerprint,
                "source": {**self.source, "cache_split": split},
                "fields": self.fields.to_dict(),
                "num_samples": len(samples),
                "num_tokens": sum(len(s.input_ids) for s in samples),
                "token_hash": token_hash(samples),
                "shards": shards,
            }
            write_json_atomic(directory / "plan.json", json.loads(json.dumps(plan)))
            manifests[split] = finalize_manifest(directory)
        return manifests


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
    """Write manifest.json if every planned shard is done; return it (None if shards are missing)."""
    out_dir = Path(out_dir)
    plan = _read_json(out_dir / "plan.json")
    sidecars = [_sidecar_if_done(out_dir, shard["name"]) for shard in plan["shards"]]
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
    if not manifest_path.is_file() or _read_json(manifest_path) != manifest:
        write_json_atomic(manifest_path, manifest)
    return manifest


def validate_cache(out_dir: str | Path) -> dict[str, Any]:
    """Check every shard against the manifest: size, SHA-256, tensor names, shapes and dtypes.
    Raises :class:`CacheError` naming every bad file; returns the manifest."""
    out_dir = Path(out_dir)
    manifest = _read_json(out_dir / "manifest.json")
    hidden_size = manifest["target"]["hidden_size"]
    problems = []
    for shard in tqdm(manifest["shards"], desc="validate", unit="shard"):
        path = out_dir / f"{shard['name']}.safetensors"
        try:
            _check_checksum(path, shard)
            with safe_open(str(path), "pt") as handle:
                _check_shapes(handle, shard, manifest["fields"], hidden_size)
        except (CacheError, OSError) as error:
            problems.append(str(error))
    if problems:
        raise CacheError(f"cache {out_dir} is damaged:\n  " + "\n  ".join(problems))
    return manifest


def stored_top_k(out_dir: str | Path) -> int | None:
    """How many of the target's top tokens a finished cache stores (0: none); None when
    ``out_dir`` holds no manifest (opening it as a :class:`FeatureCache` says why)."""
    manifest = Path(out_dir) / "manifest.json"
    return _read_json(manifest)["fields"]["top_k"] if manifest.is_file() else None


class FeatureCache(torch.utils.data.Dataset):
    """Random access to the samples of a finished cache.

    ``expect`` (the target training will use), ``expect_fields`` and ``expect_tokenizer`` (a
    :func:`tokenizer_fingerprint`) are checked against the manifest, and every shard's checksum
    is verified once when the cache is opened (``verify``). Shard files are memory-mapped lazily
    per process, so the dataset pickles to DataLoader workers.
    """

    def __init__(
        self,
        out_dir: str | Path,
        expect: TargetSpec | None = None,
        expect_fields: StoredFields | None = None,
        verify: bool = True,
        expect_tokenizer: str | None = None,
    ) -> None:
        self.dir = Path(out_dir)
        manifest_path = self.dir / "manifest.json"
        if not manifest_path.is_file():
            raise CacheError(
                f"{manifest_path} not found: the cache is unfinished or this is not a cache directory"
            )
        self.manifest = validate_cache(self.dir) if verify else _read_json(manifest_path)
        if expect is not None:
            check_target_matches(self.manifest, expect, str(manifest_path))
        if expect_fields is not None:
            _check_fields(self.manifest, expect_fields, str(manifest_path))
        if expect_tokenizer is not None and self.manifest["tokenizer_fingerprint"] != expect_tokenizer:
            raise CacheError(
                f"{manifest_path} was tokenized with another tokenizer or chat template: cache fingerprint "
                f"{self.manifest['tokenizer_fingerprint'][:16]}…, target's {expect_tokenizer[:16]}…"
            )
        self._locations: list[tuple[int, int, int]] = []  # (shard, start token, end token)
        for shard_index, shard in enumerate(self.manifest["shards"]):
            offsets = shard["offsets"]
            self._locations += [
                (shard_index, offsets[i], offsets[i + 1]) for i in range(shard["num_samples"])
            ]
        self._handles: dict[int, Any] = {}
        # Read only what training asked for: a cache written with more fields serves every head.
        self._skip: set[str] = set()
        self._top_k = None
        if expect_fields is not None:
            if not expect_fields.aux_layer_ids:
                self._skip.add("aux")
            if expect_fields.top_k == 0:
                self._skip |= {"topk_ids", "topk_probs"}
            else:
                self._top_k = expect_fields.top_k

    def __len__(self) -> int:
        return len(self._locations)

    @property
    def lengths(self) -> list[int]:
        return [end - start for _, start, end in self._locations]

    @property
    def sample_ids(self) -> list[str]:
        return [sample_id for shard in self.manifest["shards"] for sample_id in shard["sample_ids"]]

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        shard_index, start, end = self._locations[index]
        handle = self._handle(shard_index)
        names = handle.keys()  # safe_open handles are not iterable
        wanted = [name for name in names if name != "offsets" and name not in self._skip]
        sample = {name: handle.get_slice(name)[start:end] for name in wanted}
        if self._top_k is not None:
            sample["topk_ids"] = sample["topk_ids"][:, : self._top_k]
            sample["topk_probs"] = sample["topk_probs"][:, : self._top_k]
        sample["input_ids"] = sample["input_ids"].long()
        sample["loss_mask"] = sample["loss_mask"].long()
        if "topk_ids" in sample:
            sample["topk_ids"] = sample["topk_ids"].long()
        return sample

    def tokens(self, index: int) -> tuple[Tensor, Tensor]:
        """(input_ids, loss_mask) of one sample, without reading its features."""
        shard_index, start, end = self._locations[index]
        handle = self._handle(shard_index)
        return (
            handle.get_slice("input_ids")[start:end].long(),
            handle.get_slice("loss_mask")[start:end].long(),
        )

    def _handle(self, shard_index: int):
        if shard_index not in self._handles:
            path = self.dir / f"{self.manifest['shards'][shard_index]['name']}.safetensors"
            self._handles[shard_index] = safe_open(str(path), "pt")
        return self._handles[shard_index]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": {}}


class FeatureCaches(torch.utils.data.Dataset):
    """Several finished caches read as one dataset, in the order given: a training mixture (e.g.
    the target's own answers plus original ones). A cache named k times is read k times per epoch,
    which is how a small set is weighted up. Every cache is opened (and checked) as
    :class:`FeatureCache` with the same expectations; ``caches`` must not be empty."""

    def __init__(self, caches: Sequence[FeatureCache]) -> None:
        if not caches:
            raise CacheError("FeatureCaches needs at least one cache")
        self.caches = list(caches)
        self._owners = [(c, i) for c, cache in enumerate(self.caches) for i in range(len(cache))]

    def __len__(self) -> int:
        return len(self._owners)

    @property
    def lengths(self) -> list[int]:
        return [length for cache in self.caches for length in cache.lengths]

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        cache, local = self._owners[index]
        return self.caches[cache][local]

    def tokens(self, index: int) -> tuple[Tensor, Tensor]:
        """(input_ids, loss_mask) of one sample, without reading its features."""
        cache, local = self._owners[index]
        return self.caches[cache].tokens(local)


def collate_cached(samples: Sequence[dict[str, Tensor]], pad_token_id: int) -> FeatureBatch:
    """Right-pad cached samples into a :class:`FeatureBatch` (features zero at padding, as online)."""
    length = max(len(s["input_ids"]) for s in samples)

    def stack(name: str, fill: int = 0) -> Tensor:
        first = samples[0][name]
        out = torch.full((len(samples), length, *first.shape[1:]), fill, dtype=first.dtype)
        for row, sample in enumerate(samples):
            out[row, : len(sample[name])] = sample[name]
        return out

    attention_mask = torch.zeros(len(samples), length, dtype=torch.long)
    for row, sample in enumerate(samples):
        attention_mask[row, : len(sample["input_ids"])] = 1
    has = samples[0].keys()
    return FeatureBatch(
        input_ids=stack("input_ids", pad_token_id),
        attention_mask=attention_mask,
        loss_mask=stack("loss_mask"),
        hidden=stack("hidden"),
        aux=stack("aux") if "aux" in has else None,
        topk_ids=stack("topk_ids") if "topk_ids" in has else None,
        topk_probs=stack("topk_probs") if "topk_probs" in has else None,
    )


def check_target_matches(manifest: dict[str, Any], spec: TargetSpec, where: str) -> None:
    """The cache must come from the same target (identity and shapes) as ``spec``."""
    cached = manifest["target"]
    keys = ("name", "revision", "hidden_size", "num_layers", "vocab_size", "dtype")
    differences = [
        f"{k}: cache has {cached.get(k)!r}, target has {getattr(spec, k)!r}"
        for k in keys
        if cached.get(k) != getattr(spec, k)
    ]
    if differences:
        raise CacheError(f"{where} was computed for another target:\n  " + "\n  ".join(differences))


def _check_fields(manifest: dict[str, Any], fields: StoredFields, where: str) -> None:
    """The cache must hold the requested aux layers (exactly) and at least the requested top-k;
    fields it holds beyond those are fine (they are not read)."""
    cached = manifest["fields"]
    aux_mismatch = fields.aux_layer_ids and tuple(cached["aux_layer_ids"]) != fields.aux_layer_ids
    if aux_mismatch or cached["top_k"] < fields.top_k:
        raise CacheError(
            f"{where} stores aux_layer_ids={cached['aux_layer_ids']} top_k={cached['top_k']}, "
            f"but aux_layer_ids={list(fields.aux_layer_ids)} top_k={fields.top_k} are needed"
        )


def _write_shard(out_dir: Path, name: str, tensors: dict[str, Tensor], samples) -> None:
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


def _sidecar_if_done(out_dir: Path, name: str) -> dict[str, Any] | None:
    """The shard's sidecar if the shard is complete: the sidecar is written after the shard's
    atomic rename, so its presence plus a matching file size means the shard is whole."""
    sidecar_path, shard_path = out_dir / f"{name}.json", out_dir / f"{name}.safetensors"
    if not sidecar_path.is_file() or not shard_path.is_file():
        return None
    sidecar = _read_json(sidecar_path)
    return sidecar if shard_path.stat().st_size == sidecar["bytes"] else None


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


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CacheError(f"{path}: not valid JSON ({error})") from error
    except FileNotFoundError as error:
        raise CacheError(f"{path}: not found") from error
