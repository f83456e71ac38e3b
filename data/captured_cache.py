"""Feature caches written from the features the target captured while regenerating answers
(``specdraft-regen features.dir=…``): one shard per regeneration chunk in a train cache and a
held-out one, and each cache's plan.json written at the end, when the samples are known. The
format is :mod:`specdraft.data.cache`'s; the caches read back as any other
(:class:`~specdraft.data.cache_dataset.FeatureCache`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from specdraft.data.cache import (
    CACHE_FORMAT_VERSION,
    CacheError,
    StoredFields,
    finalize_manifest,
    refuse_nonfinite_features,
    shard_name,
    sidecar_if_done,
    token_hash,
    tokenizer_fingerprint,
    write_shard,
)
from specdraft.data.chat import TokenizedConversation
from specdraft.data.conversations import is_heldout
from specdraft.data.target import Target
from specdraft.system.files import SettingsMismatch, check_or_store_settings, write_json_atomic


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
        nothing touched, once a shard exists) and remove the temporary files of a killed run."""
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
                check_or_store_settings(
                    directory / "capture.json",
                    {**settings, "cache_split": split},
                    outputs_exist=any(directory.glob("shard-*")),  # binds once a shard is written
                )
            except SettingsMismatch as error:
                raise CacheError(f"{error}\nchoose another features.dir or remove this one") from None
            # A finished cache's manifest is written again by finish(); until then no reader
            # may take shards being rewritten for a finished cache.
            (directory / "manifest.json").unlink(missing_ok=True)
            for stale in directory.glob(".shard-*"):
                stale.unlink(missing_ok=True)

    def write_chunk(self, chunk_index: int, samples: Sequence[CapturedSample]) -> None:
        """Shard ``chunk_index`` of both caches, from this chunk's samples (in chunk order). Both
        are checked before either is written: features that are not finite leave no shard."""
        packed = {}
        for split in self.dirs:
            chosen = [
                s
                for s in samples
                if is_heldout(s.id, self.heldout_fraction, self.split_seed) == (split == "heldout")
            ]
            packed[split] = (chosen, self._pack(chosen))
        for split, (chosen, tensors) in packed.items():
            refuse_nonfinite_features(self.dirs[split], shard_name(chunk_index), tensors, chosen)
        for split, (chosen, tensors) in packed.items():
            write_shard(self.dirs[split], shard_name(chunk_index), tensors, chosen)

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
            sidecars = [sidecar_if_done(directory, name) for name in names]
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
