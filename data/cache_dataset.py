"""A finished feature cache (:mod:`specdraft.data.cache`) read back as a torch Dataset: one
cache (:class:`FeatureCache`), several as one training mixture (:class:`FeatureCaches`), and
their samples padded into a :class:`~specdraft.data.features.FeatureBatch`
(:func:`collate_cached`). A cache is checked when opened against the target, the fields and the
tokenizer training will use, and its shards against their checksums; a shard whose features
hold a NaN or an Inf is refused, checked once per process (when the cache is verified, or when
the shard is first opened).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from specdraft.data.cache import (
    CacheError,
    StoredFields,
    check_finite_shard,
    check_manifest,
    read_json,
    validate_cache,
)
from specdraft.data.features import FeatureBatch
from specdraft.heads.spec import TargetSpec


class FeatureCache(torch.utils.data.Dataset):
    """Random access to the samples of a finished cache.

    ``expect`` (the target training will use), ``expect_fields`` and ``expect_tokenizer`` (a
    :func:`~specdraft.data.cache.tokenizer_fingerprint`) are checked against the manifest, and
    every shard's checksum is verified once when the cache is opened (``verify``). Shard files are
    memory-mapped lazily per process, so the dataset pickles to DataLoader workers. Every shard's
    features are checked finite once: by ``verify`` (which also covers the workers the dataset
    pickles to), else by each process when it first opens the shard.
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
        self.manifest = validate_cache(self.dir) if verify else read_json(manifest_path)
        if not verify:  # the cheap checks still (shard headers and offsets; validate_cache has them)
            check_manifest(self.dir, self.manifest)
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
        self._finite = set(range(len(self.manifest["shards"]))) if verify else set()  # checked shards
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
        shard_index = self._locations[index][0]
        try:
            return self._sample(index)
        except (KeyError, SafetensorError) as error:  # a truncated shard, or one missing a field
            raise self._shard_error(shard_index, error) from None

    def _shard_error(self, shard_index: int, error: Exception) -> CacheError:
        """A shard that cannot be read as the manifest says: name it and the key, or the reason."""
        path = self.dir / f"{self.manifest['shards'][shard_index]['name']}.safetensors"
        what = f"no tensor {error.args[0]!r}" if isinstance(error, KeyError) else str(error)
        return CacheError(f"{path}: {what} (expected a complete shard written by specdraft-cache)")

    def _sample(self, index: int) -> dict[str, Tensor]:
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
        try:
            handle = self._handle(shard_index)
            return (
                handle.get_slice("input_ids")[start:end].long(),
                handle.get_slice("loss_mask")[start:end].long(),
            )
        except (KeyError, SafetensorError) as error:
            raise self._shard_error(shard_index, error) from None

    def _handle(self, shard_index: int):
        if shard_index not in self._handles:
            path = self.dir / f"{self.manifest['shards'][shard_index]['name']}.safetensors"
            handle = safe_open(str(path), "pt")
            if shard_index not in self._finite:
                check_finite_shard(handle, path, self.manifest["shards"][shard_index], self._skip)
                self._finite.add(shard_index)
            self._handles[shard_index] = handle
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
