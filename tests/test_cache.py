"""The feature cache: cached == online, resume after a crash or SIGKILL, ranks, bad input."""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specdraft.data import cache as cache_module
from specdraft.data.cache import (
    CacheError,
    StoredFields,
    plan_shards,
    tokenizer_fingerprint,
    validate_cache,
    write_cache,
)
from specdraft.data.cache_dataset import FeatureCache, collate_cached
from specdraft.data.chat import tokenize_conversation
from specdraft.data.conversations import Conversation, Message
from specdraft.data.features import collate, extract_features, length_batches
from specdraft.data.tiny import tiny_random_target, tiny_tokenizer

FIELDS = StoredFields(aux_layer_ids=(1, 2, 3), top_k=4)
SOURCE = {"data": "synthetic"}
SHARD_TOKENS, BATCH_TOKENS = 600, 400


def samples_for(target, count=24):
    generator = torch.Generator().manual_seed(0)
    conversations = []
    for i in range(count):
        words = torch.randint(
            0, 1000, (int(torch.randint(3, 40, (1,), generator=generator)),), generator=generator
        )
        answer = " ".join(str(w) for w in words.tolist())
        conversations.append(Conversation(f"s{i}", (Message("user", f"q{i}"), Message("assistant", answer))))
    return [tokenize_conversation(target.tokenizer, c) for c in conversations]


def write(target, samples, out_dir, **kwargs):
    return write_cache(
        target, samples, out_dir, FIELDS, SOURCE, SHARD_TOKENS, BATCH_TOKENS, progress=False, **kwargs
    )


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cached_features_equal_online_features_bit_for_bit(tmp_path, dtype):
    target = tiny_random_target(dtype=dtype)
    samples = samples_for(target)
    manifest = write(target, samples, tmp_path)
    assert len(manifest["shards"]) > 2
    cache = FeatureCache(tmp_path, expect=target.spec, expect_fields=FIELDS)
    assert len(cache) == len(samples) and cache.sample_ids == [s.id for s in samples]
    # online: the same extraction over the same batches (the cache's own length buckets per shard)
    for start, end in plan_shards([len(s.input_ids) for s in samples], SHARD_TOKENS):
        shard = samples[start:end]
        for indices in length_batches([len(s.input_ids) for s in shard], BATCH_TOKENS):
            batch = collate([shard[i] for i in indices], target.spec.pad_token_id)
            online = extract_features(target, batch, FIELDS.aux_layer_ids, top_k=FIELDS.top_k)
            cached = collate_cached([cache[start + i] for i in indices], target.spec.pad_token_id)
            for name in (
                "input_ids",
                "attention_mask",
                "loss_mask",
                "hidden",
                "aux",
                "topk_ids",
                "topk_probs",
            ):
                assert torch.equal(getattr(cached, name), getattr(online, name)), name
            assert cached.hidden.dtype == target.dtype


def test_plan_shards_covers_every_sample_in_order():
    assert plan_shards([5, 5, 5, 20, 1], 10) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert plan_shards([], 10) == []


def test_resume_after_a_crash_equals_an_uninterrupted_run(tmp_path, tiny_target, monkeypatch):
    samples = samples_for(tiny_target)
    write(tiny_target, samples, tmp_path / "reference")
    real_write_shard, written = cache_module.write_shard, []

    def crash_after_two(out_dir, name, tensors, shard_samples):
        if len(written) == 2:
            # die half way: shard file renamed into place, sidecar never written
            (out_dir / f"{name}.safetensors").write_bytes(b"partial")
            (out_dir / f".{name}.safetensors.tmp123").write_bytes(b"staging")
            raise KeyboardInterrupt
        written.append(name)
        real_write_shard(out_dir, name, tensors, shard_samples)

    monkeypatch.setattr(cache_module, "write_shard", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        write(tiny_target, samples, tmp_path / "resumed")
    assert not (tmp_path / "resumed" / "manifest.json").exists()
    with pytest.raises(CacheError, match=r"manifest\.json not found"):
        FeatureCache(tmp_path / "resumed")
    monkeypatch.undo()
    write(tiny_target, samples, tmp_path / "resumed")
    assert files_of(tmp_path / "resumed") == files_of(tmp_path / "reference")


def test_sigkill_then_rerun_gives_identical_files(tmp_path):
    lines = [
        json.dumps(
            {
                "id": f"c{i}",
                "messages": [
                    {"role": "user", "content": f"question {i}"},
                    {"role": "assistant", "content": f"answer {i} " * (20 + i % 30)},
                ],
            }
        )
        for i in range(160)
    ]
    (tmp_path / "chats.jsonl").write_text("\n".join(lines))

    def command(out_dir):
        return [
            sys.executable,
            "-m",
            "specdraft.data.cache_cli",
            "target=tiny_random",
            "data=jsonl",
            f"data.source.path={tmp_path / 'chats.jsonl'}",
            "data.heldout_fraction=0",
            f"out_dir={out_dir}",
            "aux_layers=true",
            "top_k=3",
            "shard_tokens=2000",
            "batch_tokens=1000",
            "progress=false",
            f"hydra.run.dir={tmp_path / 'logs'}",
        ]

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    subprocess.run(command(tmp_path / "reference"), check=True, capture_output=True, env=env, timeout=300)
    process = subprocess.Popen(
        command(tmp_path / "killed"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
    )
    first_sidecar = tmp_path / "killed" / "shard-00000.json"
    deadline = time.monotonic() + 120
    while not first_sidecar.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_part_way = not (tmp_path / "killed" / "manifest.json").exists()
    subprocess.run(command(tmp_path / "killed"), check=True, capture_output=True, env=env, timeout=300)
    assert files_of(tmp_path / "killed") == files_of(tmp_path / "reference")
    assert killed_part_way, "the run finished before it could be killed; the test proved nothing"


def test_ranks_split_the_shards_and_the_last_one_writes_the_manifest(tmp_path, tiny_target):
    samples = samples_for(tiny_target)
    write(tiny_target, samples, tmp_path / "single")
    assert write(tiny_target, samples, tmp_path / "split", rank=1, world_size=2) is None
    shards = sorted(p.name for p in (tmp_path / "split").glob("shard-*.safetensors"))
    assert shards == sorted(p.name for p in (tmp_path / "single").glob("shard-*.safetensors"))[1::2]
    assert write(tiny_target, samples, tmp_path / "split", rank=0, world_size=2) is not None
    assert files_of(tmp_path / "split") == files_of(tmp_path / "single")
    with pytest.raises(ValueError, match=r"rank 2 is not in 0\.\.1"):
        write(tiny_target, samples, tmp_path / "split", rank=2, world_size=2)


def test_another_target_into_the_same_directory_is_refused_untouched(tmp_path, tiny_target):
    samples = samples_for(tiny_target)
    write(tiny_target, samples, tmp_path)
    before = files_of(tmp_path)
    other = tiny_random_target(seed=1, num_layers=4, hidden_size=32, num_attention_heads=2, num_kv_heads=1)
    with pytest.raises(
        CacheError,
        match=r"other settings \(nothing was changed\):[\s\S]*target\.hidden_size: stored 64, now 32",
    ):
        write(other, samples_for(other), tmp_path)
    assert files_of(tmp_path) == before


def test_other_conversations_of_the_same_lengths_do_not_resume_a_cache(tmp_path, tiny_target):
    """The plan's token hash binds a cache to its tokens: conversations with the same lengths but
    other tokens (an edited data file) are refused, not appended to shards of the old ones."""
    samples = samples_for(tiny_target)
    write(tiny_target, samples[:12], tmp_path)
    (tmp_path / "manifest.json").unlink()  # an unfinished cache: shards without a manifest
    before = files_of(tmp_path)
    edited = [
        replace(sample, input_ids=tuple((t + 1) % tiny_target.spec.vocab_size for t in sample.input_ids))
        for sample in samples[:12]
    ]
    assert [len(s.input_ids) for s in edited] == [len(s.input_ids) for s in samples[:12]]
    with pytest.raises(CacheError, match=r"token_hash: stored"):
        write(tiny_target, edited, tmp_path)
    assert files_of(tmp_path) == before


def test_a_shard_whose_file_lost_bytes_is_written_again(tmp_path, tiny_target):
    """A shard counts as done only when its file has the size its sidecar records: a shard file
    cut short (a disk that lost its tail) is computed again on resume, to the same bytes."""
    samples = samples_for(tiny_target)
    write(tiny_target, samples, tmp_path / "reference")
    write(tiny_target, samples, tmp_path / "resumed")
    shard = tmp_path / "resumed" / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    (tmp_path / "resumed" / "manifest.json").unlink()
    write(tiny_target, samples, tmp_path / "resumed")
    assert files_of(tmp_path / "resumed") == files_of(tmp_path / "reference")


def test_reading_a_cache_for_another_target_names_both(tmp_path, tiny_target):
    write(tiny_target, samples_for(tiny_target), tmp_path)
    other = tiny_random_target(seed=5, dtype="bfloat16")
    with pytest.raises(
        CacheError,
        match=r"another target:[\s\S]*name: cache has 'tiny-random-llama-seed0', target has "
        r"'tiny-random-llama-seed5'[\s\S]*dtype: cache has 'float32', target has",
    ):
        FeatureCache(tmp_path, expect=other.spec)
    with pytest.raises(CacheError, match="another tokenizer or chat template: cache fingerprint"):
        FeatureCache(
            tmp_path, expect_tokenizer=tokenizer_fingerprint(tiny_tokenizer(chat_template="{{ 'x' }}"))
        )
    with pytest.raises(CacheError, match=r"top_k=4, but aux_layer_ids=\[1, 2, 3\] top_k=10 are needed"):
        FeatureCache(tmp_path, expect_fields=StoredFields((1, 2, 3), 10))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_shard_is_named_and_nothing_else_is_touched(tmp_path, tiny_target, damage):
    write(tiny_target, samples_for(tiny_target), tmp_path)
    shard = tmp_path / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[-5] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(bytes(data[: len(data) // 2]))
    else:
        shard.unlink()
    before = files_of(tmp_path)
    with pytest.raises(CacheError, match=r"shard-00001\.safetensors: (SHA-256|\d+ bytes|missing)") as error:
        validate_cache(tmp_path)
    assert "shard-00000" not in str(error.value)
    with pytest.raises(CacheError, match="shard-00001"):
        FeatureCache(tmp_path)
    assert files_of(tmp_path) == before


def test_cache_dataset_pickles_for_workers(tmp_path, tiny_target):
    import pickle

    write(tiny_target, samples_for(tiny_target), tmp_path)
    cache = FeatureCache(tmp_path)
    first = cache[3]
    clone = pickle.loads(pickle.dumps(cache))
    assert all(torch.equal(first[k], clone[3][k]) for k in first)


def test_a_cache_with_more_fields_serves_a_head_that_needs_fewer(tmp_path, tiny_target):
    write(tiny_target, samples_for(tiny_target), tmp_path)
    full = FeatureCache(tmp_path, expect_fields=FIELDS)[0]
    fewer = FeatureCache(tmp_path, expect_fields=StoredFields((), 2), verify=False)[0]
    assert "aux" not in fewer and fewer["topk_ids"].shape[-1] == 2
    assert torch.equal(fewer["topk_ids"], full["topk_ids"][:, :2])
    assert torch.equal(fewer["hidden"], full["hidden"])
    assert "topk_ids" not in FeatureCache(tmp_path, expect_fields=StoredFields((), 0), verify=False)[0]
