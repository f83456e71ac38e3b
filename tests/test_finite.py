"""Numbers that cannot be trusted stop the run (issue 62, item 3): NaN features refused when a cache
is written and read, a loss that turns NaN stops training at its step, a NaN head is not exported."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import compose_train
from safetensors import safe_open
from safetensors.torch import load_file
from test_cache import samples_for, write
from test_cli_errors import hydra_args, run_command
from test_export import save_checkpoint, trained_record
from test_regen import captured_run

from specdraft.data import cache as cache_module
from specdraft.data import cache_cli
from specdraft.data.cache import CacheError, StoredFields, validate_cache
from specdraft.data.cache_dataset import FeatureCache
from specdraft.data.captured_cache import CapturedCacheWriter, CapturedSample
from specdraft.data.conversations import is_heldout
from specdraft.data.regen import TargetResponder
from specdraft.heads.formats import FormatError, export_files, read_checkpoint, read_export, write_export
from specdraft.heads.formats.files import write_export_dir
from specdraft.train import cli as train_cli
from specdraft.train import export as export_cli
from specdraft.train import objective as objective_module
from specdraft.train.cli import train
from specdraft.train.fused import TERMS
from specdraft.train.module import NonFiniteLoss

NAN = float("nan")


def poison_samples(monkeypatch, ids_of_poisoned: list[list[int]], position: int = 1) -> None:
    """The target's features turn NaN at ``position`` of every sample whose token ids are listed
    (as a target with an overflowing layer would give them)."""
    real = cache_module.extract_features

    def extract(target, batch, *args, **kwargs):
        features = real(target, batch, *args, **kwargs)
        for row in range(batch.input_ids.shape[0]):
            length = int(batch.attention_mask[row].sum())
            if batch.input_ids[row, :length].tolist() in ids_of_poisoned:
                features.hidden[row, position] = NAN
        return features

    monkeypatch.setattr(cache_module, "extract_features", extract)


def poisoned_cache(tmp_path: Path, tiny_target, monkeypatch) -> tuple[Path, str]:
    """A cache whose shard 1 holds a NaN feature, written (checksums and all) by the cache's own
    writer with its finiteness check switched off; the poisoned sample's id."""
    samples = samples_for(tiny_target)
    manifest = write(tiny_target, samples, tmp_path / "probe")
    victim = manifest["shards"][1]["first_sample"] + 1
    with monkeypatch.context() as patch:
        poison_samples(patch, [list(samples[victim].input_ids)])
        patch.setattr(cache_module, "refuse_nonfinite_features", lambda *args: None)
        write(tiny_target, samples, tmp_path / "cache")
    return tmp_path / "cache", samples[victim].id


def test_nan_features_are_refused_before_their_shard_is_written(tmp_path, tiny_target, monkeypatch):
    samples = samples_for(tiny_target)
    clean = write(tiny_target, samples, tmp_path / "clean")
    assert len(clean["shards"]) >= 3
    victim = clean["shards"][1]["first_sample"] + 1
    out = tmp_path / "cache"
    with monkeypatch.context() as patch:
        poison_samples(patch, [list(samples[victim].input_ids)], position=2)
        with pytest.raises(CacheError) as refused:
            write(tiny_target, samples, out)
    message = str(refused.value)
    assert f"{out}: the target's features for shard-00001 are not finite" in message
    assert f"hidden, token 2 of sample 1 ({samples[victim].id!r})" in message
    # Shard 0 (finite) is done; nothing of shard 1 is, and no manifest.
    assert sorted(p.name for p in out.iterdir()) == [
        "plan.json",
        "shard-00000.json",
        "shard-00000.safetensors",
    ]
    # A target whose features are finite completes the same directory.
    assert write(tiny_target, samples, out) == clean


def test_specdraft_cache_refuses_nan_features_in_one_line(tmp_path, monkeypatch, capsys):
    def everything_nan(target, batch, *args, **kwargs):
        features = real(target, batch, *args, **kwargs)
        features.hidden[:, 0] = NAN
        return features

    real = cache_module.extract_features
    monkeypatch.setattr(cache_module, "extract_features", everything_nan)
    out = tmp_path / "cache"
    args = [
        "target=tiny_random",
        "data=tiny",
        "limit=8",
        "progress=false",
        f"out_dir={out}",
        *hydra_args(tmp_path),
    ]
    line = run_command(cache_cli.main, "specdraft-cache", *args, monkeypatch=monkeypatch, capsys=capsys)
    assert (
        f"{out}: the target's features for shard-00000 are not finite (NaN/Inf in hidden, token 0 of sample 0"
        in line
    )
    assert not list(out.glob("shard-*")) and not (out / "manifest.json").exists()


def test_captured_features_that_are_nan_leave_no_shard_in_either_split(tmp_path, tiny_target):
    dirs = {"train": tmp_path / "train", "heldout": tmp_path / "heldout"}
    writer = CapturedCacheWriter(dirs, tiny_target, StoredFields(), 0.5, 0, {"data": "synthetic"})
    writer.start()
    hidden_size = tiny_target.spec.hidden_size

    def sample(index: int, poisoned: bool) -> CapturedSample:
        hidden = torch.randn(5, hidden_size)
        if poisoned:
            hidden[3, 7] = float("inf")
        return CapturedSample(f"c{index}", list(range(5)), [0, 0, 1, 1, 1], SimpleNamespace(hidden=hidden))

    assert is_heldout("c5", 0.5, 0)  # the split written second: both are checked before either is written
    with pytest.raises(
        CacheError, match=r"shard-00000 are not finite \(NaN/Inf in hidden, token 3 of sample \d+ \('c5'\)"
    ):
        writer.write_chunk(0, [sample(i, poisoned=i == 5) for i in range(8)])
    assert not list(dirs["train"].glob("shard-*")) and not list(dirs["heldout"].glob("shard-*"))


class NanOnSecondCall(TargetResponder):
    """Captures NaN features for its second chunk's first answer (a target overflowing there)."""

    calls = 0

    def __call__(self, histories, seed):
        answers = super().__call__(histories, seed)
        self.calls += 1
        if self.calls == 2:
            self.captured[0][2].hidden[-1, 0] = NAN
        return answers


def test_regeneration_with_nan_features_records_nothing_of_that_chunk(tmp_path):
    with pytest.raises(CacheError, match=r"features for shard-00001 are not finite \(NaN/Inf in hidden"):
        captured_run(tmp_path, "run", NanOnSecondCall)
    records = (tmp_path / "run.jsonl").read_text().splitlines()
    assert len(records) == 2  # chunk 0 only: chunk 1 was not recorded as answered
    for split in ("train", "heldout"):
        assert not list((tmp_path / "run" / split).glob("shard-00001*"))


def test_a_poisoned_shard_on_disk_is_named_when_validated_and_read(
    tmp_path, tiny_target, monkeypatch, capsys
):
    cache, victim = poisoned_cache(tmp_path, tiny_target, monkeypatch)
    shard = cache / "shard-00001.safetensors"
    with safe_open(str(shard), "pt") as handle:  # the writer's own checksums: only the values are wrong
        assert torch.isnan(handle.get_tensor("hidden")).any()
    expected = (
        f"{shard}: the cached features are not finite (NaN/Inf in hidden, token 1 of sample 1 ({victim!r}))"
    )
    with pytest.raises(CacheError) as damaged:
        validate_cache(cache)
    assert expected in str(damaged.value) and "shard-00000" not in str(damaged.value)
    # Read without verifying: the shard is checked when first opened; the others read as ever.
    unverified = FeatureCache(cache, verify=False)
    unverified[0]
    with pytest.raises(CacheError, match=r"shard-00001\.safetensors: the cached features are not finite"):
        unverified[unverified.manifest["shards"][1]["first_sample"]]
    line = run_command(
        cache_cli.main, "specdraft-cache", "target=tiny_random", "mode=validate", f"out_dir={cache}",
        *hydra_args(tmp_path), monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    assert expected in line


def test_specdraft_train_refuses_a_cache_with_nan_features(tmp_path, monkeypatch, capsys):
    common = ["target=tiny_random", "data=tiny", "progress=false", "shard_tokens=1000", *hydra_args(tmp_path)]
    caches = {split: tmp_path / split for split in ("train", "heldout")}
    with monkeypatch.context() as patch:
        patch.setattr(cache_module, "refuse_nonfinite_features", lambda *args: None)
        real = cache_module.extract_features

        def poisoned(target, batch, *args, **kwargs):  # the train split's second batch
            features = real(target, batch, *args, **kwargs)
            calls.append(1)
            if len(calls) == 2:
                features.hidden[0, 0] = NAN
            return features

        calls = []
        patch.setattr(cache_module, "extract_features", poisoned)
        for split, out in caches.items():
            patch.setattr("sys.argv", ["specdraft-cache", *common, f"split={split}", f"out_dir={out}"])
            cache_cli.main()
    bad = [
        p.name
        for p in sorted(caches["train"].glob("shard-*.safetensors"))
        if torch.isnan(load_file(p)["hidden"]).any()
    ]
    assert len(bad) == 1
    line = run_command(
        train_cli.main, "specdraft-train", "experiment=eagle", "debug=smoke", "datamodule=cached",
        f"datamodule.train_cache={caches['train']}", f"datamodule.val_cache={caches['heldout']}",
        f"paths.output_dir={tmp_path / 'run'}", *hydra_args(tmp_path), monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    assert (
        f"{caches['train'] / bad[0]}: the cached features are not finite (NaN/Inf in hidden, token 0" in line
    )
    assert not (tmp_path / "run" / "checkpoints").exists()


def poison_loss_term(
    monkeypatch, term: str, train_step: int | None = None, validation_after: int | None = None
):
    """Loss term ``term`` of rollout step 1 turns NaN at training step ``train_step`` (1-based),
    or in every validation once ``validation_after`` training steps ran."""
    real_call, real_fused = objective_module.DraftObjective.__call__, objective_module.fused_vocab_losses
    state = {"train_steps": 0, "poison": False}

    def call(self, head, batch, train=True):
        state["train_steps"] += bool(train)
        if train:
            state["poison"] = train_step is not None and state["train_steps"] == train_step
        else:
            state["poison"] = validation_after is not None and state["train_steps"] >= validation_after
        return real_call(self, head, batch, train)

    def fused(*args, **kwargs):
        out = real_fused(*args, **kwargs)
        if state["poison"]:
            out.terms = out.terms.clone()
            out.terms[0, TERMS.index(term)] = NAN
            out.loss = out.loss * NAN
        return out

    monkeypatch.setattr(objective_module.DraftObjective, "__call__", call)
    monkeypatch.setattr(objective_module, "fused_vocab_losses", fused)


def test_a_loss_that_turns_nan_stops_training_at_its_step_and_the_run_resumes(tmp_path, monkeypatch, capsys):
    args = [
        "experiment=eagle",
        "debug=smoke",
        "trainer.precision=32-true",
        f"paths.output_dir={tmp_path / 'run'}",
    ]
    with monkeypatch.context() as patch:
        poison_loss_term(patch, "soft_ce", train_step=3)
        line = run_command(
            train_cli.main, "specdraft-train", *args, *hydra_args(tmp_path), monkeypatch=patch, capsys=capsys
        )
    assert line.startswith("specdraft-train: error: step 3: loss term soft_ce (rollout step 1) is nan: ")
    run = tmp_path / "run"
    assert not (run / "summary.json").exists()
    last = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == 2  # the last good step's, kept
    assert all(torch.isfinite(t).all() for t in last["state_dict"].values() if t.is_floating_point())
    # The same command, with finite losses, resumes from it and finishes.
    summary = train(compose_train(run, *args[:2]))
    assert summary["resumed_from"].endswith("last.ckpt") and summary["global_step"] == 6


def test_a_validation_loss_that_turns_nan_is_never_recorded(tmp_path, monkeypatch):
    cfg = compose_train(tmp_path, "experiment=eagle", "debug=smoke")
    poison_loss_term(monkeypatch, "soft_ce", validation_after=3)
    with pytest.raises(NonFiniteLoss, match=r"validation after step 3: val/loss is nan \(loss term soft_ce"):
        train(cfg)
    assert not (tmp_path / "summary.json").exists()
    assert not list((tmp_path / "checkpoints").glob("best-*"))  # no checkpoint chosen by a NaN


def test_weights_that_are_not_finite_are_never_checkpointed(tmp_path, monkeypatch):
    import lightning as L

    class Poison(L.Callback):  # a step whose finite loss still left a NaN in the weights
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 4:
                with torch.no_grad():
                    module.head.fc.weight[0, 0] = NAN

    cfg = compose_train(tmp_path, "experiment=eagle", "debug=smoke")
    monkeypatch.setattr(train_cli, "instantiate", wrap_instantiate(train_cli.instantiate, Poison()))
    with pytest.raises(
        NonFiniteLoss, match=r"step 4: the head's weights are not finite \(NaN/Inf values in fc.weight: 1\)"
    ):
        train(cfg)
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == 2


def wrap_instantiate(real, extra_callback):
    """Hydra's instantiate, adding ``extra_callback`` to the Trainer's callbacks."""

    def instantiate(config, *args, **kwargs):
        if "callbacks" in kwargs:
            kwargs["callbacks"] = [*kwargs["callbacks"], extra_callback]
        return real(config, *args, **kwargs)

    return instantiate


def test_a_nan_head_is_refused_naming_its_tensors(tmp_path, monkeypatch, capsys, tiny_target):
    record = trained_record(tiny_target, "eagle", {"fc_bias": False})
    record.state["fc.weight"][0, :3] = NAN
    record.state["layer.post_attention_layernorm.weight"][1] = float("inf")
    size = record.state["fc.weight"].numel()
    named = rf"NaN/Inf values in fc.weight: 3 of {size}, layer.post_attention_layernorm.weight: 1 of 64\)"
    with pytest.raises(FormatError, match=named):
        write_export(tmp_path / "out", record, "vllm", target_spec=tiny_target.spec)
    assert not (tmp_path / "out").exists()
    checkpoint = save_checkpoint(tmp_path / "nan.ckpt", record)
    with pytest.raises(FormatError, match=f"{checkpoint}: weights that are not finite"):
        read_checkpoint(checkpoint)
    line = run_command(
        export_cli.main, "specdraft-export", "target=tiny_random", f"checkpoint={checkpoint}",
        f"out={tmp_path / 'cli'}", *hydra_args(tmp_path), monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    assert "weights that are not finite" in line and "fc.weight: 3 of" in line
    # An export directory holding NaN weights (written by something else) is refused when read.
    config, tensors = export_files(
        trained_record(tiny_target, "eagle", {"fc_bias": False}), "vllm", target_spec=tiny_target.spec
    )
    tensors["fc.weight"] = tensors["fc.weight"].clone()
    tensors["fc.weight"][2, 2] = NAN
    out = write_export_dir(tmp_path / "foreign", config, tensors)
    with pytest.raises(
        FormatError, match=r"foreign \(format vllm\): weights that are not finite .*fc.weight: 1 of"
    ):
        read_export(out, tiny_target.spec)


def test_a_head_whose_weights_overflow_the_export_dtype_is_refused(tmp_path, tiny_target):
    record = trained_record(tiny_target, "eagle", {"fc_bias": False})
    record.state["fc.weight"][0, 0] = 1e6  # finite in fp32, Inf in fp16
    write_export(tmp_path / "fp32", record, "native", target_spec=tiny_target.spec)
    with pytest.raises(
        FormatError, match=r"cast to torch.float16: weights that are not finite .*fc.weight: 1 of"
    ):
        write_export(tmp_path / "fp16", record, "native", target_spec=tiny_target.spec, dtype=torch.float16)
    assert json.loads((tmp_path / "fp32" / "config.json").read_text())
