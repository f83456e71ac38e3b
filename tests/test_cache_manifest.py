"""A cache manifest checked against its shards (data/cache_manifest.py): counts, totals and offsets
that lie are refused when the cache is read, validated or finalised, naming the shard and the
field — and a lying manifest is reported, never rewritten."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from specdraft.data import cache_cli
from specdraft.data.cache import CacheError, finalize_manifest, validate_cache
from specdraft.data.cache_dataset import FeatureCache
from tests.test_cache import files_of, samples_for, write
from tests.test_cli_errors import hydra_args, run_command


@pytest.fixture(scope="module")
def written(tmp_path_factory, tiny_target) -> Path:
    out = tmp_path_factory.mktemp("written") / "cache"
    manifest = write(tiny_target, samples_for(tiny_target, count=12), out)
    assert len(manifest["shards"]) >= 2
    return out


@pytest.fixture
def cache(written, tmp_path) -> Path:
    """A copy of one small cache of several shards, for each test to damage."""
    return Path(shutil.copytree(written, tmp_path / "cache"))


def edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def shift_second_offset(record: dict) -> None:
    """Sample 0 one token longer, sample 1 one shorter: the same ends, misaligned samples."""
    shard = record["shards"][0] if "shards" in record else record
    shard["offsets"][1] += 1


def test_lying_offsets_are_refused_on_read_and_on_validate_naming_the_shard(cache):
    edit_json(cache / "manifest.json", shift_second_offset)
    before = files_of(cache)
    lying = r"shard-00000 offsets in manifest.json \(from shard-00000.json\): \[0, \d+, .*shard.s are \[0, "
    with pytest.raises(CacheError, match=lying):
        validate_cache(cache)
    with pytest.raises(CacheError, match=r"shard-00000 offsets") as error:
        FeatureCache(cache, verify=False)  # checked without the SHA-256 pass too
    assert "shard-00001" not in str(error.value)
    assert files_of(cache) == before


@pytest.mark.parametrize("field", ["num_tokens", "num_samples"])
def test_lying_totals_are_refused_on_read(cache, field):
    edit_json(cache / "manifest.json", lambda m: m.update({field: m[field] + 7}))
    with pytest.raises(CacheError, match=rf"manifest {field}: \d+, its shards hold \d+"):
        FeatureCache(cache, verify=False)


def test_mode_validate_reports_a_manifest_whose_totals_lie_instead_of_rewriting_it(
    cache, tmp_path, monkeypatch, capsys
):
    edit_json(cache / "manifest.json", lambda m: m.update({"num_tokens": m["num_tokens"] + 7}))
    before = files_of(cache)
    args = ["target=tiny_random", "data=tiny", "mode=validate", f"out_dir={cache}", "progress=false"]
    line = run_command(
        cache_cli.main,
        "specdraft-cache",
        *args,
        *hydra_args(tmp_path),
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    assert "manifest.json disagrees with plan.json and the shards' sidecars in num_tokens" in line, line
    assert files_of(cache) == before  # reported, not rewritten


def test_a_sidecar_whose_offsets_lie_is_refused_before_a_manifest_is_written(cache):
    (cache / "manifest.json").unlink()
    edit_json(cache / "shard-00001.json", shift_second_offset)
    with pytest.raises(CacheError, match=r"shard-00001 offsets"):
        finalize_manifest(cache)
    assert not (cache / "manifest.json").exists()


def test_a_true_manifest_validates_and_is_written_again_when_removed(cache):
    manifest = validate_cache(cache)
    (cache / "manifest.json").unlink()
    assert finalize_manifest(cache) == manifest
    assert len(FeatureCache(cache, verify=False)) == manifest["num_samples"]
