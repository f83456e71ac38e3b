"""specdraft-train on the tiny target: every experiment, checkpoints, exact resume, DDP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import lightning as L
import pytest
import torch
from conftest import assert_validated, compose_train
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch.distributed.fsdp import FullyShardedDataParallel

from specdraft.data.features import TokenBatch, extract_features
from specdraft.data.target import target_weights
from specdraft.heads import EagleConfig, EagleHead
from specdraft.heads.formats import read_checkpoint
from specdraft.system.hardware import resolve_precision
from specdraft.train.callbacks import TrainingDeadline
from specdraft.train.cli import prefer_final_weights, train
from specdraft.train.losses import LossWeights
from specdraft.train.module import DraftHeadModule
from specdraft.train.objective import DraftObjective, RolloutConfig
from specdraft.train.run_dir import RunDirError

EXPERIMENTS = ["medusa", "eagle", "eagle3", "hass", "hass_eagle3", "dflash"]


def checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_trains_validates_and_checkpoints(tmp_path, experiment):
    cfg = compose_train(tmp_path, f"experiment={experiment}", "debug=smoke")
    summary = train(cfg)
    assert summary["global_step"] == cfg.trainer.max_steps
    assert set(summary["last_val"]) >= {"val/loss", "val/sim_tau", "val/acc_1", "val/acc_4"}
    assert_validated(summary)
    assert json.loads((tmp_path / "summary.json").read_text())["global_step"] == cfg.trainer.max_steps
    ckpt = checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    record = ckpt["specdraft"]
    assert record["kind"] == cfg.head.kind
    assert record["target_spec"]["hidden_size"] == cfg.target.hidden_size
    # Only the head's own weights: no frozen target tensor enters the checkpoint.
    state = ckpt["state_dict"]
    assert all(name.startswith("head.") for name in state)
    assert not any("target_" in name for name in state)
    metrics = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"train/loss", "val/sim_tau", "train/tokens_per_s", "train/acc_1"} <= set(metrics)
    if experiment in ("eagle3", "hass_eagle3"):
        # The tiny vocabulary (259) is smaller than the default 32k draft vocab: the full vocab is used.
        assert record["config"]["draft_vocab_size"] is None
        assert state["head.d2t"].numel() == 259


def test_the_final_weights_are_the_best_checkpoint_unless_a_validation_beat_them(tmp_path):
    """A run stopped by max_time, or whose last steps came after its last validation, would export
    older weights: validated at the end on the whole set, the final weights become the best
    checkpoint (what the export and the bench read) unless a periodic validation scored higher."""
    saved: list[Path] = []
    tied = {"global_step": 7, "best_sim_tau": 1.5, "best_checkpoint": "old"}
    tied["final_val"] = {"val/sim_tau": 1.5}
    prefer_final_weights(tied, tmp_path, saved.append)
    assert saved == [tmp_path / "checkpoints" / "final-step=7.ckpt"]
    assert (tied["best_checkpoint"], tied["best_sim_tau"]) == (str(saved[0]), 1.5)
    beaten = {**tied, "best_checkpoint": "old", "final_val": {"val/sim_tau": 1.4}}
    prefer_final_weights(beaten, tmp_path, saved.append)
    assert len(saved) == 1 and (beaten["best_checkpoint"], beaten["best_sim_tau"]) == ("old", 1.5)

    # no validation during the run: the final weights are the best, saved where export finds them
    no_periodic = ["validate_at_end=true", "trainer.val_check_interval=100"]
    summary = train(compose_train(tmp_path / "run", "experiment=eagle", "debug=smoke", *no_periodic))
    best = Path(summary["best_checkpoint"])
    assert best == tmp_path / "run" / "checkpoints" / "final-step=6.ckpt"
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["best_checkpoint"] == str(best)
    assert summary["best_sim_tau"] == summary["final_val"]["val/sim_tau"]
    final, last = read_checkpoint(best), read_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert final.kind == last.kind == "eagle"
    assert final.state.keys() == last.state.keys()
    for name, tensor in last.state.items():
        torch.testing.assert_close(final.state[name], tensor, rtol=0, atol=0, msg=name)


def test_eagle3_reduced_draft_vocab_from_assistant_tokens(tmp_path):
    cfg = compose_train(tmp_path, "experiment=eagle3", "debug=smoke", "head.config.draft_vocab_size=64")
    train(cfg)
    state = checkpoint(tmp_path / "checkpoints" / "last.ckpt")["state_dict"]
    assert state["head.d2t"].numel() == 64 and int(state["head.t2d"].sum()) == 64
    assert state["head.lm_head.weight"].shape == (64, 64)
    # The synthetic answers are full of digits and commas: their tokens must be in the vocab.
    from specdraft.data.tiny import tiny_random_target

    tokenizer = tiny_random_target().tokenizer
    draft_ids = (torch.arange(64) + state["head.d2t"]).tolist()
    for text in ("1", ","):
        (token,) = tokenizer.encode(text, add_special_tokens=False)
        assert token in draft_ids, text


def test_a_rollout_vocabulary_trains_within_the_training_one(tmp_path):
    """loss.rollout_vocab_size end to end (the objective's golden tests: test_losses.py): HASS over
    the whole vocabulary, EAGLE-3 inside its own reduced one; one no smaller than the training
    vocabulary changes nothing."""
    summary = train(
        compose_train(tmp_path / "hass", "experiment=hass", "debug=smoke", "loss.rollout_vocab_size=64")
    )
    assert summary["global_step"] > 0
    eagle3 = [
        "experiment=eagle3",
        "debug=smoke",
        "head.config.draft_vocab_size=64",
        "loss.rollout_vocab_size=32",
    ]
    assert train(compose_train(tmp_path / "eagle3", *eagle3))["global_step"] > 0
    larger = ["experiment=hass", "debug=smoke", "loss.draft_vocab_size=32", "loss.rollout_vocab_size=64"]
    assert train(compose_train(tmp_path / "larger", *larger))["global_step"] > 0

    from omegaconf import OmegaConf

    from specdraft.data.tiny import tiny_random_target
    from specdraft.train.cli import build_objective

    target = tiny_random_target()
    counts = torch.arange(target.spec.vocab_size).float()

    def objective(**sizes):
        loss = OmegaConf.create({"weights": {}, "rollout": {}, "eval_steps": 4, "chunk_size": 128, **sizes})
        return build_objective(loss, target, None, counts)

    assert objective(draft_vocab_size=32, rollout_vocab_size=64).rollout_vocab is None
    assert objective(draft_vocab_size=32, rollout_vocab_size=32).rollout_vocab is None
    assert objective(rollout_vocab_size=64).rollout_vocab.tolist() == list(
        range(target.spec.vocab_size - 64, target.spec.vocab_size)
    )
    assert objective(draft_vocab_size=64, rollout_vocab_size=16).rollout_vocab.numel() == 16


@pytest.mark.parametrize("experiment", ["hass", "dflash"])
def test_resume_continues_exactly(tmp_path, experiment):
    """Stopping after 3 steps and re-running to 6 gives the same weights as 6 steps in one go:
    same step, same batches (mid-epoch), same noise and DFlash anchors, same optimiser and
    schedule state."""
    common = [
        f"experiment={experiment}",
        "debug=smoke",
        "callbacks.last_checkpoint.every_n_train_steps=1",
        "scheduler.total_steps=6",  # the same schedule for both (it follows max_steps by default)
    ]
    straight = compose_train(tmp_path / "straight", *common, "trainer.max_steps=6")
    train(straight)
    first = compose_train(tmp_path / "resumed", *common, "trainer.max_steps=3")
    assert train(first)["global_step"] == 3
    second = compose_train(tmp_path / "resumed", *common, "trainer.max_steps=6")
    summary = train(second)
    assert summary["resumed_from"].endswith("last.ckpt") and summary["global_step"] == 6
    a = checkpoint(tmp_path / "straight" / "checkpoints" / "last.ckpt")
    b = checkpoint(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    assert a["global_step"] == b["global_step"] == 6
    for name, tensor in a["state_dict"].items():
        torch.testing.assert_close(b["state_dict"][name], tensor, rtol=0, atol=0, msg=name)


def test_a_run_killed_mid_training_resumes_to_the_weights_of_an_uninterrupted_one(tmp_path):
    """kill -9 of a DFlash training once it has checkpointed, then the same command again: it
    resumes from its last checkpoint and ends with the weights of a run never interrupted."""
    steps = 24
    common = [
        "experiment=dflash",
        "debug=smoke",
        "trainer.precision=32-true",
        f"trainer.max_steps={steps}",
        f"scheduler.total_steps={steps}",
        "callbacks.last_checkpoint.every_n_train_steps=1",
        "trainer.val_check_interval=100",
    ]
    straight = run_cli(*common, f"paths.log_dir={tmp_path / 'straight'}", cwd=tmp_path)
    assert straight.returncode == 0, straight.stderr[-3000:]
    log_dir = tmp_path / "killed"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "specdraft.train.cli", *common, f"paths.log_dir={log_dir}"]
    process = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    last = log_dir / "train" / "smoke-dflash-dflash" / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 240
    while process.poll() is None and time.monotonic() < deadline:
        if last.exists() and checkpoint(last)["global_step"] >= 3:
            break
        time.sleep(0.05)
    assert process.poll() is None, "the run ended before it could be killed: raise its steps"
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed_at = checkpoint(last)["global_step"]
    assert 3 <= killed_at < steps
    resumed = run_cli(*common, f"paths.log_dir={log_dir}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = checkpoint(tmp_path / "straight" / "train" / "smoke-dflash-dflash" / "checkpoints" / "last.ckpt")
    b = checkpoint(last)
    assert a["global_step"] == b["global_step"] == steps
    for name, tensor in a["state_dict"].items():
        torch.testing.assert_close(b["state_dict"][name], tensor, rtol=0, atol=0, msg=name)


def test_a_finished_run_run_again_changes_nothing(tmp_path):
    """Re-running a finished run (a sweep or a results stage re-run) returns its summary and
    leaves every file as it was: resuming the fit would rewrite the summary with a zero-second fit
    and a stale best."""
    cfg = compose_train(tmp_path, "experiment=eagle", "debug=smoke", "trainer.max_steps=2")
    summary = train(cfg)
    files = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    with mock.patch.object(L.Trainer, "fit", side_effect=AssertionError("fitted again")):
        assert train(cfg) == summary
    assert {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()} == files
    # Asked for more steps (max_steps is resume_ignore'd), it goes on.
    assert (
        train(compose_train(tmp_path, "experiment=eagle", "debug=smoke", "trainer.max_steps=3"))[
            "global_step"
        ]
        == 3
    )


class PacedDeadline(TrainingDeadline):
    """The deadline on a clock of its own: every optimizer step takes ``step_s`` seconds, and
    ``1 + rank_slowdown × rank`` times that on a DDP rank (each process starts its clock at 0, as
    perf_counter's origin differs between processes)."""

    def __init__(self, minutes: float, every_n_steps: int, step_s: float, rank_slowdown: float = 0.0) -> None:
        super().__init__(minutes, every_n_steps)
        self.step_s, self.rank_slowdown, self.clock = step_s, rank_slowdown, 0.0

    def now(self) -> float:
        return self.clock

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.clock += self.step_s * (1 + self.rank_slowdown * trainer.global_rank)
        super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)


class StopAt(L.Callback):
    """Ends a run's fit at ``step`` as a kill would (its last checkpoint is that step's)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def deadline(minutes: float, step_s: float, every: int = 2, rank_slowdown: float = 0.0) -> str:
    paced = f"minutes:{minutes},every_n_steps:{every},step_s:{step_s},rank_slowdown:{rank_slowdown}"
    return f"callbacks.deadline={{_target_:test_train.PacedDeadline,{paced}}}"


# A run in another process finds PacedDeadline (test_train) on its path.
TESTS_ON_PATH = {
    "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
}


@pytest.mark.parametrize(
    ("planned", "step_s", "expected"),
    [(4, 1.5, 10), (20, 3.0, 5)],  # a machine faster than planned, then a slower one
    ids=["faster", "slower"],
)
def test_a_deadline_resizes_the_steps_and_the_lr_decay_to_end_on_time(tmp_path, planned, step_s, expected):
    """15 s of training at ``step_s`` per step, checked every 2 steps: the steps the time holds,
    whatever max_steps planned, with the cosine decay ending there (the last lr is the floor)."""
    cfg = compose_train(
        tmp_path, "experiment=eagle", "debug=smoke", f"trainer.max_steps={planned}", deadline(0.25, step_s),
        "scheduler.min_lr_ratio=0.1", "callbacks.last_checkpoint.every_n_train_steps=1",
    )  # fmt: skip
    summary = train(cfg)
    assert summary["global_step"] == expected
    assert summary["deadline"] == {"minutes": 0.25, "spent_s": expected * step_s, "max_steps": expected}
    last = checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    (scheduler,) = last["lr_schedulers"]
    assert "_total_steps" not in scheduler  # the end comes from the config or the deadline
    torch.testing.assert_close(scheduler["_last_lr"][0], 0.1 * cfg.optim.lr)
    # Finished at its deadline's steps (fewer than max_steps when slower): re-running changes nothing.
    with mock.patch.object(L.Trainer, "fit", side_effect=AssertionError("fitted again")):
        assert train(cfg) == summary


def test_a_resumed_run_keeps_the_time_its_deadline_spent(tmp_path):
    """Killed at step 6 of a 15 s deadline at 1.5 s a step, the re-run has 6 s left: it ends at
    step 10 as one run would (forgetting the 9 s spent, it would run to step 16)."""
    common = ["experiment=eagle", "debug=smoke", "trainer.max_steps=4", deadline(0.25, 1.5),
              "callbacks.last_checkpoint.every_n_train_steps=1"]  # fmt: skip
    stopped = compose_train(tmp_path, *common, "+callbacks.stop={_target_:test_train.StopAt,step:6}")
    assert train(stopped)["global_step"] == 6
    (tmp_path / "summary.json").unlink()  # as a kill leaves it: no summary yet
    summary = train(compose_train(tmp_path, *common))
    assert summary["resumed_from"].endswith("last.ckpt")
    assert summary["global_step"] == 10 and summary["deadline"]["spent_s"] == 15.0


def test_a_changed_config_never_continues_an_old_run(tmp_path):
    train(compose_train(tmp_path, "experiment=eagle", "debug=smoke", "trainer.max_steps=2"))
    before = (tmp_path / "checkpoints" / "last.ckpt").read_bytes()
    with pytest.raises(
        RunDirError, match=r"different config:\n  loss\.weights\.soft_ce: stored 0\.1, now 0\.5"
    ):
        train(compose_train(tmp_path, "experiment=eagle", "debug=smoke", "loss.weights.soft_ce=0.5"))
    with pytest.raises(RunDirError, match="resume=false"):
        train(compose_train(tmp_path, "experiment=eagle", "debug=smoke", "resume=false"))
    assert (tmp_path / "checkpoints" / "last.ckpt").read_bytes() == before


def run_cli(*args: str, cwd: Path, env_extra: dict | None = None, timeout: int = 300):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "specdraft.train.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_cli_smoke(tmp_path):
    result = run_cli("experiment=eagle3", "debug=smoke", f"paths.log_dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "train" / "smoke-eagle3-eagle3" / "summary.json").read_text())
    assert summary["global_step"] == 6
    # precision auto followed this machine, and the start-up line says what was chosen and why
    assert summary["precision"] == resolve_precision("auto", "cpu")
    assert f"precision auto → {summary['precision']};" in result.stdout  # Hydra logs to stdout


def test_ddp_two_processes_on_cpu_stop_together_at_their_deadline(tmp_path):
    """Two CPU processes whose clocks disagree (rank 1 trains at half rank 0's pace: 6 s hold 8
    of rank 0's steps, 4 of its own) both stop at rank 0's step 8. A rank deciding for itself
    would stop at its own step 4 and break rank 0's next gradient all-reduce."""
    result = run_cli(
        "experiment=hass",
        "debug=smoke",
        "trainer=ddp",
        "trainer.precision=32-true",
        deadline(0.1, 0.75, rank_slowdown=1.0),
        f"paths.log_dir={tmp_path}",
        cwd=tmp_path,
        env_extra={"OMP_NUM_THREADS": "1", **TESTS_ON_PATH},
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "train" / "smoke-eagle-hass" / "summary.json").read_text())
    assert summary["global_step"] == 8 and summary["deadline"]["max_steps"] == 8
    assert "world_size=2" in result.stderr or "distributed_backend=gloo" in result.stderr


@pytest.mark.parametrize(
    "preset, strategy, accelerator",
    [
        ("cpu", None, "cpu"),
        ("gpu", None, "gpu"),
        ("ddp", "DDPStrategy", "auto"),
        ("fsdp", "FSDPStrategy", "gpu"),
        ("deepspeed_zero2", "DeepSpeedStrategy", "gpu"),
        ("deepspeed_zero3", "DeepSpeedStrategy", "gpu"),
    ],
)
def test_trainer_presets_compose_and_validate(tmp_path, preset, strategy, accelerator):
    """Every preset composes with every experiment and names a real strategy; FSDP / DeepSpeed
    cannot run on a CPU (Lightning refuses), so their objects are built and checked here and run
    in the GPU-only test below."""
    from hydra.utils import get_class, instantiate

    cfg = compose_train(tmp_path, "experiment=hass", f"trainer={preset}", "trainer.num_nodes=2")
    assert cfg.trainer.accelerator == accelerator and cfg.trainer.num_nodes == 2
    assert cfg.trainer.use_distributed_sampler is False  # our sampler splits batches over ranks
    if strategy is None:
        assert "strategy" not in cfg.trainer
        return
    assert get_class(cfg.trainer.strategy._target_).__name__ == strategy
    if strategy == "DeepSpeedStrategy":
        assert cfg.trainer.strategy.stage == int(preset[-1])
        pytest.importorskip("deepspeed")
    built = instantiate(cfg.trainer.strategy)
    assert type(built).__name__ == strategy
    if strategy == "DDPStrategy":
        assert built._ddp_kwargs["broadcast_buffers"] is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("preset", ["gpu", "ddp", "fsdp", "deepspeed_zero2", "deepspeed_zero3"])
def test_gpu_presets_train(tmp_path, preset):
    """Every GPU strategy trains HASS on online features, its steps sized by a deadline (6 s at
    0.75 s a step: 8, where max_steps said 6) as the quickstart sizes them."""
    if preset.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    devices = min(2, torch.cuda.device_count())
    result = run_cli(
        "experiment=hass",
        "debug=smoke",
        f"trainer={preset}",
        "trainer.accelerator=gpu",
        f"trainer.devices={devices if preset != 'gpu' else 1}",
        "trainer.precision=bf16-mixed",
        deadline(0.1, 0.75),
        f"paths.log_dir={tmp_path}",
        cwd=tmp_path,
        env_extra=TESTS_ON_PATH,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "train" / "smoke-eagle-hass" / "summary.json").read_text())
    assert summary["global_step"] == 8


def test_runs_without_a_logger(tmp_path):
    summary = train(compose_train(tmp_path, "experiment=medusa", "debug=smoke", "logger=none"))
    assert summary["global_step"] == 6 and not (tmp_path / "csv").exists()


def test_a_batch_on_another_device_than_the_head_is_one_clear_error(tiny_target):
    """What the GPU bug looked like (online features on the CPU, the head on cuda:0), on any
    machine: a field of the batch on another device (meta here) fails before any matmul."""
    ids = torch.randint(3, 50, (2, 8))
    batch = extract_features(tiny_target, TokenBatch(ids, torch.ones_like(ids), torch.ones_like(ids)))
    objective = DraftObjective(LossWeights(feature=1.0), RolloutConfig(), eval_steps=4, chunk_size=128)
    module = DraftHeadModule(
        EagleHead(tiny_target.spec, target_weights(tiny_target), EagleConfig(fc_bias=False)),
        objective,
        torch.optim.AdamW,
    )
    assert torch.isfinite(module.training_step(batch, 0))  # same device: trains (no trainer to log to)
    batch.hidden = batch.hidden.to("meta")
    with pytest.raises(RuntimeError, match="batch field 'hidden' is on meta but the head is on cpu"):
        module.training_step(batch, 0)


def test_fsdp_gradients_are_clipped_by_norm_through_the_fsdp_module(tiny_target):
    """Lightning raises for clipping FSDP gradients by norm, the trainer's default (seen on an
    H100: `trainer=fsdp` failed at its first step); the module clips through FSDP's own
    clip_grad_norm_ (a collective over the shards) and leaves every other case to Lightning."""
    objective = DraftObjective(LossWeights(feature=1.0), RolloutConfig(), eval_steps=4, chunk_size=128)
    module = DraftHeadModule(
        EagleHead(tiny_target.spec, target_weights(tiny_target), EagleConfig(fc_bias=False)),
        objective,
        torch.optim.AdamW,
    )
    optimizer = torch.optim.AdamW(module.parameters())
    fsdp = mock.create_autospec(FullyShardedDataParallel, instance=True)
    module._trainer = SimpleNamespace(model=fsdp, precision_plugin=Precision())
    with mock.patch.object(L.LightningModule, "configure_gradient_clipping") as lightning:
        module.configure_gradient_clipping(optimizer, 0.5, None)
        module.configure_gradient_clipping(optimizer, 0.5, "norm")
        assert fsdp.clip_grad_norm_.call_args_list == [mock.call(0.5), mock.call(0.5)]
        lightning.assert_not_called()
        module.configure_gradient_clipping(optimizer, 0.5, "value")  # by value: Lightning's own
        module._trainer = SimpleNamespace(model=module, precision_plugin=Precision())  # Lightning's own
        module.configure_gradient_clipping(optimizer, 0.5, None)
        assert lightning.call_count == 2 and fsdp.clip_grad_norm_.call_count == 2


def test_a_fused_optimizer_under_bf16_mixed_is_clipped_by_norm(tiny_target):
    """conf/optim/adamw.yaml's fused AdamW: Lightning's mixed-precision plugin refuses to clip
    for it (a GradScaler's gradients would be unscaled inside its step); bf16 has no scaler, so
    the module clips by norm as in full precision."""
    objective = DraftObjective(LossWeights(feature=1.0), RolloutConfig(), eval_steps=4, chunk_size=128)
    module = DraftHeadModule(
        EagleHead(tiny_target.spec, target_weights(tiny_target), EagleConfig(fc_bias=False)),
        objective,
        torch.optim.AdamW,
    )
    optimizer = torch.optim.AdamW(module.parameters(), fused=True)
    plugin = MixedPrecision("bf16-mixed", "cpu")
    for parameter in module.parameters():
        parameter.grad = torch.full_like(parameter, 3.0)
    with pytest.raises(RuntimeError, match="fused"):
        plugin.clip_gradients(optimizer, 0.5)
    module._trainer = SimpleNamespace(model=module, precision_plugin=plugin)
    module.configure_gradient_clipping(optimizer, 0.5, None)
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in module.parameters()]))
    assert norm == pytest.approx(0.5, rel=1e-4)


def test_init_from_starts_from_a_trained_heads_weights_and_refuses_another_head(tmp_path):
    """HASS's second stage starts from the first stage's weights: with a zero learning rate the
    fine-tuned head IS the trained one, vocabulary maps included (its own data would choose other
    maps), while a fresh head is not; a trained head of another kind, config or target layers is
    refused before training."""
    common = ["experiment=eagle3", "debug=smoke", "head.config.draft_vocab_size=64"]
    train(compose_train(tmp_path / "stage1", *common, "trainer.max_steps=2"))
    trained = checkpoint(tmp_path / "stage1" / "checkpoints" / "last.ckpt")["state_dict"]
    # another split of the data: a fresh head chooses another vocabulary from it
    frozen = [*common, "data.split_seed=1", "trainer.max_steps=1", "optim.lr=0.0"]
    init = f"init_from={tmp_path / 'stage1' / 'checkpoints' / 'last.ckpt'}"
    train(compose_train(tmp_path / "stage2", *frozen, init))
    started = checkpoint(tmp_path / "stage2" / "checkpoints" / "last.ckpt")["state_dict"]
    train(compose_train(tmp_path / "fresh", *frozen))
    fresh = checkpoint(tmp_path / "fresh" / "checkpoints" / "last.ckpt")["state_dict"]
    assert started.keys() == trained.keys()
    for name, tensor in trained.items():
        torch.testing.assert_close(started[name], tensor, rtol=0, atol=0, msg=name)
    assert not torch.equal(fresh["head.d2t"], trained["head.d2t"])
    assert not torch.equal(fresh["head.fc.weight"], trained["head.fc.weight"])

    experiment_and_debug = common[:2]
    with pytest.raises(ValueError, match=r"the trained head is eagle3, this run trains eagle"):
        train(compose_train(tmp_path / "kind", "experiment=eagle", "debug=smoke", init))
    with pytest.raises(ValueError, match=r"differs from this run's \(draft_vocab_size: 64 there, 32 here\)"):
        smaller = [*experiment_and_debug, "head.config.draft_vocab_size=32", init]
        train(compose_train(tmp_path / "config", *smaller))
    with pytest.raises(ValueError, match=r"target layers: \[1, 2, 3\] there, \[0, 1, 3\] here"):
        layers = [*common, "target.aux_layer_ids=[0,1,3]", init]
        train(compose_train(tmp_path / "layers", *layers))
    assert not (tmp_path / "kind" / "checkpoints").exists()


def test_a_reduced_training_vocab_asks_for_the_cached_top1_only_where_every_cache_has_it(
    tmp_path, tiny_target
):
    from omegaconf import OmegaConf

    from specdraft.data.cache import StoredFields, write_cache
    from specdraft.data.chat import tokenize_conversation
    from specdraft.data.conversations import Conversation, Message
    from specdraft.train.cli import features_for_objective

    sample = tokenize_conversation(
        tiny_target.tokenizer, Conversation("c0", (Message("user", "q"), Message("assistant", "1 2 3")))
    )
    for name, top_k in (("with", 1), ("without", 0), ("with4", 4)):
        write_cache(tiny_target, [sample], tmp_path / name, StoredFields((), top_k), {"d": 1}, progress=False)

    def asked_top_k(train, val, setting="loss.draft_vocab_size", weights=None) -> int:
        cfg = OmegaConf.create(
            {
                "loss": {"weights": weights or {}},
                "datamodule": {"mode": "cached", "top_k": 0, "train_cache": train, "val_cache": val},
            }
        )
        OmegaConf.update(cfg, setting, 100)
        features_for_objective(cfg)
        return cfg.datamodule.top_k

    with_top1, without = str(tmp_path / "with"), str(tmp_path / "without")
    assert asked_top_k(with_top1, with_top1) == 1
    assert asked_top_k([with_top1, without], with_top1) == 0  # the argmax comes from the full logits
    assert asked_top_k(with_top1, [without]) == 0
    assert asked_top_k(with_top1, with_top1, "loss.rollout_vocab_size") == 1
    assert asked_top_k(with_top1, with_top1, "head.config.draft_vocab_size") == 1  # EAGLE-3's own
    # A Top-K term reads K: asked for where every cache stores them, else recomputed (0).
    top4 = {"topk": 1.0, "topk_k": 4}
    with4 = str(tmp_path / "with4")
    assert asked_top_k(with4, with4, "loss.rollout_vocab_size", top4) == 4
    assert asked_top_k(with4, with_top1, "loss.rollout_vocab_size", top4) == 0
