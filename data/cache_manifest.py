"""A feature cache's manifest checked against its shards (:mod:`specdraft.data.cache`): the counts,
totals and offsets it states must be the shards' own. Read cheaply — each shard's header and its
offsets tensor (S + 1 integers), never the features — so every reader checks them when it opens a
cache (:class:`~specdraft.data.cache_dataset.FeatureCache`), and ``specdraft-cache mode=validate``
reports a disagreement instead of rewriting the manifest."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from safetensors import safe_open


def manifest_problems(out_dir: Path, manifest: dict[str, Any]) -> list[str]:
    """The counts, totals and offsets a manifest states, checked cheaply (no feature is read): each
    shard's sample ids, ``first_sample`` and offsets against its counts, its ``offsets`` against
    the shard's own offsets tensor (S + 1 integers) and its ``num_tokens`` against the shard's
    header, and the totals against the shards'. Offsets that lie would train on misaligned samples."""
    problems, first_sample, num_tokens = [], 0, 0
    for shard in manifest["shards"]:
        name, samples, tokens, offsets = (
            shard["name"],
            shard["num_samples"],
            shard["num_tokens"],
            shard["offsets"],
        )
        if shard["first_sample"] != first_sample:
            problems.append(
                f"{name} first_sample: {shard['first_sample']}, the shards before it hold {first_sample}"
            )
        if len(shard["sample_ids"]) != samples:
            problems.append(f"{name} sample_ids: {len(shard['sample_ids'])} ids for num_samples {samples}")
        ordered = all(a <= b for a, b in itertools.pairwise(offsets))
        if len(offsets) != samples + 1 or offsets[0] != 0 or offsets[-1] != tokens or not ordered:
            problems.append(
                f"{name} offsets: {_excerpt(offsets)} are not num_samples + 1 = {samples + 1} ordered "
                f"positions from 0 to num_tokens {tokens}"
            )
        problems += _shard_header_problems(out_dir / f"{name}.safetensors", name, tokens, offsets)
        first_sample, num_tokens = first_sample + samples, num_tokens + tokens
    for field, total in (("num_samples", first_sample), ("num_tokens", num_tokens)):
        if manifest[field] != total:
            problems.append(f"manifest {field}: {manifest[field]}, its shards hold {total}")
    return problems


def _shard_header_problems(path: Path, name: str, tokens: int, offsets: list[int]) -> list[str]:
    """The shard's token count (its header) and offsets tensor against what the manifest says."""
    if not path.is_file():
        return [f"{name}: {path} is missing"]
    try:
        with safe_open(str(path), "pt") as handle:
            names = set(handle.keys())
            stored_tokens = handle.get_slice("input_ids").get_shape()[0] if "input_ids" in names else None
            stored = handle.get_tensor("offsets").tolist() if "offsets" in names else None
    except Exception as error:  # safetensors raises its own error for a damaged header
        return [f"{name}: {path} is not a readable safetensors file ({error})"]
    problems = []
    if stored_tokens != tokens:
        problems.append(f"{name} num_tokens: {tokens}, the shard holds {stored_tokens}")
    if stored != offsets:
        problems.append(
            f"{name} offsets in manifest.json (from {name}.json): {_excerpt(offsets)}, the shard's "
            f"are {_excerpt(stored or [])}"
        )
    return problems


def _excerpt(values: list[int], shown: int = 6) -> str:
    return (
        str(values) if len(values) <= shown else f"[{', '.join(map(str, values[:shown]))}, … ({len(values)})]"
    )


def manifest_differences(existing: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """The fields (``<shard> <field>`` for a shard's) where a stored manifest differs from the
    one its plan and shard sidecars make."""
    fields = [key for key in sorted(expected.keys() | existing.keys()) if key != "shards"]
    found = [key for key in fields if existing.get(key) != expected.get(key)]
    stored, made = existing.get("shards", []), expected["shards"]
    if len(stored) != len(made):
        found.append(f"shards ({len(stored)} listed, {len(made)} planned)")
    for old, new in zip(stored, made, strict=False):
        found += [
            f"{new['name']} {key}" for key in sorted(new.keys() | old.keys()) if old.get(key) != new.get(key)
        ]
    return found
