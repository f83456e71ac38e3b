"""specdraft-quickstart: its stages fit together, and the whole chain runs (and resumes) on the
tiny target."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from specdraft.eval.prompts import MT_BENCH_CATEGORIES
from specdraft.recipes.budget import Plan
from specdraft.recipes.plan import load_or_make_plan, plan_path
from specdraft.recipes.probe import Throughput
from specdraft.recipes.quickstart import prompt_set, run_stages
from specdraft.recipes.stages import stages

PLAN = Plan(45, 700, 321, 9.0, {"probe": 60.0, "regen": 600.0, "cache train": 100.0,
            "cache heldout": 10.0, "train": 900.0, "export": 10.0, "eval": 540.0}, 81, 870.0)  # fmt: skip


def compose_quickstart(*overrides: str):
    with initialize_config_module("specdraft.conf", version_base="1.3"):
        return compose("quickstart", overrides=list(overrides))


def value(stage, key: str) -> str:
    return [o.split("=", 1)[1] for o in stage.overrides if o.startswith(key + "=")][-1]


def stage_overrides(stage: str, *overrides: str) -> str:
    """``overrides.<stage>=['a=1','b=2']``: Hydra needs list items with '=' quoted."""
    return f"overrides.{stage}=[{','.join(repr(o) for o in overrides)}]"


def test_regeneration_captures_the_features_training_reads(tmp_path):
    cfg = compose_quickstart(f"paths.log_dir={tmp_path}")
    by_name = {stage.name: stage for stage in stages(cfg, PLAN)}
    assert list(by_name) == ["regen", "train", "export", "eval"]  # no cache stages
    regen, train = by_name["regen"], by_name["train"]
    features = f"{tmp_path}/quickstart/features/regen-700-captured"
    assert value(regen, "features.dir") == features
    assert value(train, "datamodule.train_cache") == f"{features}/train"
    assert value(train, "datamodule.val_cache") == f"{features}/heldout"
    assert value(regen, "features.top_k") == str(cfg.top_k)
    assert value(regen, "features.aux_layers") == str(cfg.aux_layers)
    assert value(regen, "features.heldout_fraction") == str(cfg.heldout_fraction)
    assert value(regen, "features.split_seed") == str(cfg.split_seed)
    # answers with their features are this quickstart's own, not shared through regen.dir
    assert value(regen, "out_path") == f"{tmp_path}/quickstart/regen-700.jsonl"


def test_each_stage_reads_what_the_previous_one_wrote(tmp_path):
    cfg = compose_quickstart(
        f"paths.log_dir={tmp_path}", f"eval.mt_bench={tmp_path}/missing.jsonl", "capture_features=false"
    )
    by_name = {stage.name: stage for stage in stages(cfg, PLAN)}
    assert not any(o.startswith("features.") for o in by_name["regen"].overrides)
    assert list(by_name) == ["regen", "cache train", "cache heldout", "train", "export", "eval"]
    assert value(by_name["cache train"], "data.source.path") == value(by_name["regen"], "out_path")
    assert value(by_name["regen"], "max_turns") == "1"
    for cache, split in (("train_cache", "train"), ("val_cache", "heldout")):
        assert value(by_name["train"], f"datamodule.{cache}") == value(by_name[f"cache {split}"], "out_dir")
    assert value(by_name["export"], "checkpoint") == f"{tmp_path}/train/quickstart"
    assert value(by_name["eval"], "checkpoint") == value(by_name["export"], "out")
    assert value(by_name["eval"], "prompts") == "sharegpt_heldout"  # no MT-bench file
    eval_overrides = dict(o.split("=", 1) for o in by_name["eval"].overrides)
    assert prompt_set(eval_overrides).startswith("sharegpt_heldout prompts, their first turns: no MT-bench")
    # the plan's sizes reach the stages
    assert value(by_name["regen"], "limit") == "700"
    assert value(by_name["regen"], "out_path").endswith("quickstart-train-700.jsonl")
    assert value(by_name["train"], "trainer.max_steps") == "321"
    assert value(by_name["train"], "trainer.max_time") == "00:00:18:45"  # 1.25 × the ETA: a guard
    assert value(by_name["train"], "trainer.val_check_interval") == "81"
    assert value(by_name["train"], "callbacks.deadline") == (
        "{_target_:specdraft.train.callbacks.TrainingDeadline,minutes:14.500}"  # 870 s: steps + validations
    )
    assert value(by_name["eval"], "max_minutes") == "9.00"

    original = stages(compose_quickstart(f"paths.log_dir={tmp_path}", "self_distill=false"), PLAN)
    assert original[0].name == "cache train"
    assert "data=jsonl" not in original[0].overrides
    assert value(original[2], "run_name") == "quickstart-sharegpt"  # never resumes the other run
    assert value(original[0], "out_dir") != value(by_name["cache train"], "out_dir")


@pytest.mark.parametrize("key", ["trainer.max_steps", "trainer.val_check_interval", "callbacks.deadline"])
def test_the_plan_owns_the_training_length_and_its_validations(tmp_path, key):
    cfg = compose_quickstart(f"paths.log_dir={tmp_path}", stage_overrides("train", f"{key}=800"))
    with pytest.raises(SystemExit, match=rf"overrides.train sets {key}.*pass train_steps=N"):
        load_or_make_plan(cfg)  # refused before probing anything


def run_with_instant_stages(cfg, planned_now: bool) -> tuple[Plan, list[list[str]]]:
    """run_stages over PLAN with every stage finishing at once; returns the plan as run and the
    commands run."""
    path = plan_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"request": {}, "plan": PLAN.record()}))
    throughput = Throughput(
        startup_s=10.0, regen_rows=64, regen_prefill_s=0.1, regen_step_s=0.2, answered_fraction=1.0,
        prompt_tokens=100.0, conversation_tokens=300.0, source_conversations=3000,
        cache_tokens_per_s=1000.0, train_step_s=2.0, train_batch_positions=4096,
        val_positions_per_s=5000.0, probe_s=60.0,
    )  # fmt: skip
    commands = []

    def instant(argv, check):
        commands.append(argv)
        return subprocess.CompletedProcess(argv, 0)

    timings = {"probe": 60.0}
    ran, _ = run_stages(cfg, PLAN, throughput, planned_now, timings, 0.0, run=instant)
    assert set(timings) == set(PLAN.eta_s)  # every stage ran and was timed
    return ran, commands


def test_training_gets_the_time_the_stages_before_it_saved_once(tmp_path):
    cfg = compose_quickstart(
        f"paths.log_dir={tmp_path}", f"eval.mt_bench={tmp_path}/missing.jsonl", "capture_features=false"
    )
    ran, commands = run_with_instant_stages(cfg, planned_now=True)
    # regen, cache train and cache heldout took ~0 s of their 710 s of ETA: 2 s per step
    assert 321 + 354 <= ran.train_steps <= 321 + 355
    train = next(c for c in commands if c[0].endswith("specdraft-train"))
    assert f"trainer.max_steps={ran.train_steps}" in train
    assert f"trainer.val_check_interval={ran.val_check_interval}" in train
    stored = json.loads(plan_path(cfg).read_text())
    assert stored["plan"]["train_steps"] == ran.train_steps  # a resumed quickstart trains the same run
    assert stored["retimed"]["planned_train_steps"] == 321
    # A resumed quickstart (the plan made earlier: the stages before training may have been
    # skipped as finished) and steps the user fixed are not resized.
    assert run_with_instant_stages(cfg, planned_now=False)[0] == PLAN
    fixed = compose_quickstart(f"paths.log_dir={tmp_path}", "train_steps=321", "capture_features=false")
    fixed_plan, fixed_commands = run_with_instant_stages(fixed, planned_now=True)
    assert fixed_plan == PLAN
    # Sized steps end at their deadline (the plan's, resized with them); fixed ones run as given.
    deadline = f"_target_:specdraft.train.callbacks.TrainingDeadline,minutes:{ran.train_fit_s / 60:.3f}"
    assert f"callbacks.deadline={{{deadline}}}" in train
    assert ran.train_fit_s == pytest.approx(870.0 + 2.0 * (ran.train_steps - 321))
    fixed_train = next(c for c in fixed_commands if c[0].endswith("specdraft-train"))
    assert not any(o.startswith("callbacks.deadline") for o in fixed_train)


def test_the_quickstart_runs_end_to_end_and_resumes_on_the_tiny_target(tmp_path):
    bench_file = tmp_path / "mt_bench.jsonl"
    questions = [
        {"question_id": i, "category": c, "turns": [f"Count to {i + 3}.", "Again, backwards."]}
        for i, c in enumerate([*MT_BENCH_CATEGORIES, "writing"])
    ]
    bench_file.write_text("".join(json.dumps(q) + "\n" for q in questions))
    tiny = "target=tiny_random"
    talkative = "+target.initializer_range=0.5"  # the default init answers with an empty string
    command = [
        str(Path(sys.executable).parent / "specdraft-quickstart"),
        f"paths.log_dir={tmp_path}",
        f"eval.mt_bench={bench_file}",
        "eval.per_category=1",
        "eval.max_new_tokens=8",
        "conversations=30",
        "train_steps=4",
        "heldout_fraction=0.2",
        "budget.validations=1",
        stage_overrides(
            "regen", tiny, talkative, "data=tiny", "generation.max_new_tokens=12", "progress=false"
        ),
        stage_overrides("cache", tiny, talkative, "progress=false"),
        stage_overrides(
            "train",
            tiny,
            talkative,
            "trainer.precision=32-true",
            "datamodule.max_batch_tokens=1024",
            "callbacks.progress.refresh_rate=0",
            "callbacks.curve_checkpoint.every_n_train_steps=2",
        ),
        stage_overrides("export", tiny, talkative),
        stage_overrides("eval", tiny, talkative, "shortlist.size=null", "progress=false"),
    ]
    first = subprocess.run(command, capture_output=True, text=True, check=False)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "T=0 head_tree (" in first.stdout and "head (native export)" in first.stdout
    assert f"evaluated on MT-bench ({bench_file})" in first.stdout
    assert "quickstart plan: budget 45 min" in first.stdout  # the plan, with its ETAs, comes first
    out = tmp_path / "quickstart"
    plan = json.loads((out / "plan-quickstart.json").read_text())
    assert (plan["plan"]["conversations"], plan["plan"]["train_steps"]) == (30, 4)  # as asked
    assert plan["plan"]["val_check_interval"] == 2  # 1 mid-run (step 2); 4 = 2 × 2 validates too
    with next((tmp_path / "train" / "quickstart").rglob("metrics.csv")).open() as metrics:
        validated = {int(row["step"]) for row in csv.DictReader(metrics) if row.get("val/sim_tau")}
    assert {1, 3} <= validated  # Lightning logs the validation after step k at step k − 1
    assert plan["throughput"]["train_step_s"] > 0 and plan["throughput"]["regen_step_s"] > 0
    # the eval's box: what the probed decoding of its trees needs, within [1, 0.2 × 45] minutes
    assert plan["throughput"]["eval_plain_s"] > 0
    assert sorted(n for n, _ in plan["throughput"]["eval_verify_s"]) == [12, 24, 60]
    assert plan["plan"]["eval_minutes"] == 1.0  # the tiny target decodes in no time
    assert set(json.loads((out / "timings-quickstart.json").read_text())) >= {"regen", "train", "total"}
    assert json.loads((out / "head" / "config.json").read_text())["format"] == "specdraft-head"
    assert sorted(p.name for p in (tmp_path / "train/quickstart/checkpoints/curve").iterdir()) == [
        "step=2.ckpt",
        "step=4.ckpt",
    ]
    report = tmp_path / "bench" / "quickstart" / "report.json"
    assert set(json.loads(report.read_text())["results"]["T=0"]) == {
        "plain",
        "head_tree",
        "head_tree_small",
        "head_tree_eagle2",
    }
    regen = out / "regen-30.jsonl"  # with the features captured as it answered
    assert (out / "features" / "regen-30-captured" / "train" / "manifest.json").is_file()
    regen_bytes, report_bytes = regen.read_bytes(), report.read_bytes()

    second = subprocess.run(command, capture_output=True, text=True, check=False)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert regen.read_bytes() == regen_bytes  # reused, not regenerated or appended to
    assert json.loads(report.read_bytes())["results"] == json.loads(report_bytes)["results"]
    assert "0 conversations written this run" in second.stdout
    assert "resuming the plan" in second.stdout and "probing" not in second.stdout

    other_budget = subprocess.run(
        [*command, "budget_minutes=30"], capture_output=True, text=True, check=False
    )
    assert other_budget.returncode != 0
    assert "['budget_minutes'] differ now" in other_budget.stderr + other_budget.stdout
