"""scripts/results.py's doc stage: runs → committed snapshots → docs/results.md, and nothing measured
is lost when the runs' outputs are gone."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import compose_train

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "results.py"


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location("results_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    log_dir = tmp_path / "outputs"
    monkeypatch.setattr(module, "LOG_DIR", log_dir)
    monkeypatch.setattr(module, "RESULTS", log_dir / "results")
    monkeypatch.setattr(module, "DOCS", tmp_path / "docs")
    monkeypatch.setattr(module, "SNAPSHOTS", tmp_path / "docs" / "results")
    return module


def write(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


MACHINE = {
    "time": "2026-11-24T08:00:00",
    "processor": "x86_64",
    "hardware": {"name": "AMD EPYC", "cpu_flags": ["avx2"]},
    "cpu_count": 2,
    "threads": 2,
    "torch": "2.13.0+cpu",
    "platform": "Linux",
}


def turn(method: str, question: str, category: str, committed: int, forwards: int, seconds: float) -> dict:
    """One answer: ``forwards`` verify steps committing ``committed`` tokens after the first."""
    tokens = list(range(committed + 1))
    return {
        "method": method,
        "question_id": question,
        "category": category,
        "turn": 0,
        "temperature": 0.0,
        "tokens": tokens,
        "total_s": seconds,
        "prefill_s": 0.1,
        "stop": "length",
        "steps": [[4, 3, 1, 0.01, 0.05, 0.001]] * forwards,
    }


def fake_ablation_outputs(results) -> None:
    """The equal-token ablation's outputs: two trained heads, their bench (one MT-bench question and
    one HumanEval problem at T=0) and the depth measurement."""
    bench = results.RESULTS / "bench" / results.ABLATION_BENCH
    write(bench / "report.json", {"machine": MACHINE, "config": {"max_new_tokens": 128}, "results": {}})
    units = []
    for question, category in (("81", "writing"), ("HumanEval/0", "humaneval")):
        records = [
            turn("plain", question, category, 40, 40, 4.0),
            turn("eagle_tree", question, category, 40, 20, 2.5),  # τ 2
            turn("hass_tree", question, category, 40, 10, 2.0),  # τ 4: twice EAGLE-2's on every prompt
        ]
        units.append({"question_id": question, "temperature": 0.0, "records": records})
    (bench / "records.jsonl").write_text("".join(json.dumps(u) + "\n" for u in units))
    final = {"val/acc_1": 0.4, "val/acc_2": 0.3, "val/acc_3": 0.25, "val/acc_4": 0.2, "val/sim_tau": 1.6}
    features = results.LOG_DIR / "quickstart" / "features" / "regen-378"
    write(features / "train" / "manifest.json", {"num_samples": 303, "num_tokens": 88435})
    for name in ("eagle", "hass"):
        run = results.RESULTS / "train" / name
        summary = {"global_step": 300, "tokens_seen": 1105999, "fit_seconds": 600.0, "best_sim_tau": 1.61}
        write(
            run / "summary.json",
            {**summary, "final_val": final, "precision": "32-true", "best_checkpoint": "/x.ckpt"},
        )
        (run / "run_config.yaml").write_text(f"datamodule:\n  train_cache: {features / 'train'}\n")
        metrics = run / "csv" / "version_0" / "metrics.csv"
        metrics.parent.mkdir(parents=True)
        rows = [
            "step,train/loss,val/acc_1,val/sim_tau",
            "10,1.0,,",
            "49,,0.25,1.3",
            "99,,0.35,1.5",
            "124,,0.36,1.5",
        ]
        metrics.write_text("\n".join(rows) + "\n")

    def measured(name: str, accepted: list[list[int]]) -> dict:
        """A depth measurement over two held-out conversations (depth 2 shown, chains of 10 / 5)."""
        per_conversation = {
            "attempts_per_conversation": [[10, 4], [5, 2]],
            "accepted_per_conversation": accepted,
        }
        return {
            "checkpoint": str(results.RESULTS / "train" / name / "checkpoints" / "last.ckpt"),
            "conversations": ["c1", "c2"],
            "own_features": {
                "acceptance_per_depth": [0.36, 0.35, 0.27, None],
                "chain_tau": 1.55,
                **per_conversation,
            },
            "target_features": {
                "acceptance_per_depth": [0.36, 0.45, 0.38, None],
                "chain_tau": 1.62,
                **per_conversation,
            },
            "gap_per_depth": [0.0, 0.1, 0.11, None],
        }

    runs = {"eagle": measured("eagle", [[4, 2], [2, 1]]), "hass": measured("hass", [[4, 3], [2, 2]])}
    write(results.RESULTS / results.DEPTH_JSON, {"depth": 4, "runs": runs})


def test_doc_renders_from_snapshots_and_keeps_what_it_cannot_reread(results, tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    measured_earlier = "a quickstart table measured on a machine that is gone"
    (docs / "results.md").write_text(f"# Results\n\n{results.QUICKSTART_TITLE}\n\n{measured_earlier}\n\n")
    fake_ablation_outputs(results)

    results.doc()
    text = (docs / "results.md").read_text()
    snapshot = json.loads((docs / "results" / results.ABLATION_SNAPSHOT).read_text())
    assert snapshot["data"] == {"num_samples": 303, "num_tokens": 88435}
    assert snapshot["prompts"] == {"MT-bench": 1, "HumanEval": 1}
    assert snapshot["depth"]["runs"]["eagle"]["checkpoint"] == "last.ckpt"  # no local paths committed
    assert snapshot["training"]["eagle"]["curve"] == [[49, 0.25, 1.3], [99, 0.35, 1.5], [124, 0.36, 1.5]]
    assert "(303 conversations, 88,435 tokens;" in text
    assert "| eagle | 300 | 1,105,999 | 32-true | 0.400 / 0.300 / 0.250 / 0.200 | 1.600 | 0.25 0.35 |" in text
    # each suite gets its own table; the reference's row, then HASS against it, paired per prompt
    assert text.count("| head | τ | α per depth | τ ÷ EAGLE-2 [95% CI]") == 2
    assert text.index("MT-bench, T=0 (1 prompts):") < text.index("HumanEval, T=0 (1 prompts):")
    assert "| eagle | 2.000 | 1.00 / 0.00 | 1 (reference) | – | 1.60× | 1/1 |" in text
    assert (
        "| hass | 4.000 | 1.00 / 0.00 | 2.000 [2.000, 2.000] | +2.000 [+2.000, +2.000] | 2.00× | 1/1 |"
        in text
    )
    own, target = "0.360 / 0.350 / 0.270 / –", "0.360 / 0.450 / 0.380 / –"
    assert f"| eagle | {own} | {target} | 0.100 / 0.110 / – | 1.550 / 1.620 | 1 (reference) |" in text
    # own chain τ from the per-conversation counts: EAGLE 1 + 6/15 + 6/15 · 3/6 = 1.6, HASS 1.733
    # (it accepts more at depth 2 in both conversations, so every resample agrees)
    versus = snapshot["depth"]["runs"]["hass"]["against_reference"]
    assert versus["conversations"] == 2 and versus["chain_tau_reference"] == pytest.approx(1.6)
    assert f"1.550 / 1.620 | {versus['ratio']['estimate']:.3f} [" in text
    assert versus["ratio"]["estimate"] == pytest.approx((1 + 0.4 + 0.4 * 5 / 6) / 1.6)
    assert versus["ratio"]["low"] > 1
    assert "bootstrap over the 2 held-out conversations" in text
    for run in snapshot["depth"]["runs"].values():  # the counts the interval rests on stay local
        assert "conversations" not in run and "attempts_per_conversation" not in run["own_features"]
    assert measured_earlier in text  # no snapshot for the quickstart: its section is kept as it was
    assert "_Not run yet: `python scripts/results.py --stages curve doc`._" in text

    # The machine's outputs are gone: the committed snapshots alone give the same document.
    shutil.rmtree(results.LOG_DIR)
    results.doc()
    assert (docs / "results.md").read_text() == text


def test_ablation_section_before_its_bench_shows_training_and_the_mechanism(results, tmp_path: Path) -> None:
    fake_ablation_outputs(results)
    depth = json.loads((results.RESULTS / results.DEPTH_JSON).read_text())
    write(results.RESULTS / results.DEPTH_JSON, {**depth, "machine": MACHINE})
    shutil.rmtree(results.RESULTS / "bench")
    results.doc()
    text = (tmp_path / "docs" / "results.md").read_text()
    assert "Machine: 2026-11-24, AMD EPYC (avx2)" in text  # the depth measurement's
    assert "not benched yet (`--stages bench`)" in text and "| head | τ | α per depth |" not in text
    assert "Not trained yet: hass_topk, hass_align, hass_beta1, hass_2stage, eagle3, hass_eagle3." in text
    assert "| hass | 300 | 1,105,999 |" in text and "| eagle | 0.360 / 0.350" in text


def test_decoder_section_reports_overheads_against_the_plain_step_and_the_auto_choice(results, tmp_path):
    step = {"draft_ms": 15.0, "verify_ms": 120.0, "bookkeeping_ms": 5.0, "plain_step_ms": 80.0}
    report = {
        "machine": {**MACHINE, "time": "2026-11-23T19:00:00"},
        "config": {
            "prompts": {"per_category": 2, "max_turns": 1, "path": "/somewhere"},
            "max_new_tokens": 128,
            "checkpoint": "/tmp/heads/eagle-step300.ckpt",
        },
        "methods": {
            "plain": {"type": "plain", "lossless": True},
            "head_auto": {
                "type": "head",
                "lossless": True,
                "auto_shape": {
                    "chosen": {"kind": "chain", "depth": 1},
                    "predicted_tokens_per_s": 14.4,
                    "measured_tokens_per_s": 12.5,
                    "latency": {"plain_ms": 78.0, "verify_ms": {"12": 117.0, "2": 81.0}},
                    "predictions": [
                        {
                            "shape": {"kind": "chain", "depth": 1},
                            "predicted_tokens_per_s": 14.4,
                            "measured_tokens_per_s": 12.5,
                            "tokens_per_step": 1.25,
                        },
                        {"shape": {"kind": "plain"}, "predicted_tokens_per_s": 12.8, "tokens_per_step": 1.0},
                    ],
                },
            },
        },
        "results": {
            "T=0": {
                "plain": {"overall": {"tokens_per_s": 12.0, "verify_ms": 80.0}},
                "head_dynamic": {
                    "overall": {"tokens_per_s": 9.0, "speedup": 0.75, "tau": 1.5, "mean_nodes": 12.0, **step},
                    "lossless": {"exact_turns": 16, "turns_compared": 16},
                },
                "head_auto": {
                    "overall": {"tokens_per_s": 12.3, "speedup": 1.025, "tau": 1.2, "mean_nodes": 2.0, **step}
                },
            }
        },
    }
    write(results.RESULTS / "bench" / "decoder" / "report.json", report)
    docs = tmp_path / "docs"
    results.doc("300 EAGLE steps on ShareGPT")
    text = (docs / "results.md").read_text()
    assert "| head_dynamic | 9.00 | 0.750× | 1.50 | 12.0 | 15.0 | 120.0 | 5.0 | 0.25 | 16/16 |" in text
    assert "| plain | 12.00 | 1× | – | – | – | 80.0 | – | – | – |" in text
    assert "`head_auto` (`shape: auto`) chose `{kind: chain, depth: 1}`: predicted 14.40 tok/s" in text
    assert "12.50 tok/s decoding the calibration prompts, 12.30 tok/s in this benchmark. " in text
    assert "2 nodes 81.0, 12 nodes 117.0 ms" in text  # sorted by node count
    assert "`eagle-step300.ckpt` — 300 EAGLE steps on ShareGPT" in text
    snapshot = json.loads((docs / "results" / "decoder.json").read_text())
    assert (
        snapshot["head"]["checkpoint"] == "eagle-step300.ckpt" and "path" not in snapshot["config"]["prompts"]
    )

    shutil.rmtree(results.LOG_DIR)  # the outputs are gone; the snapshot keeps the provenance too
    results.doc()
    assert (docs / "results.md").read_text() == text


def test_a_decoder_bench_on_a_bf16_cpu_gets_its_own_snapshot_and_keeps_the_avx2_one(results, tmp_path):
    def report(hardware: dict, plain_tokens_per_s: float) -> dict:
        return {
            "machine": {**MACHINE, "hardware": hardware},
            "config": {
                "prompts": {"per_category": 2, "max_turns": 1},
                "max_new_tokens": 128,
                "checkpoint": "h",
            },
            "methods": {"plain": {"type": "plain", "lossless": True}},
            "results": {
                "T=0": {"plain": {"overall": {"tokens_per_s": plain_tokens_per_s, "verify_ms": 30.0}}}
            },
        }

    avx2 = {"name": "AMD EPYC", "cpu_flags": ["avx2"], "device_type": "cpu", "fast_bf16": False}
    amx = {
        "name": "Intel Xeon",
        "cpu_flags": ["avx512f", "amx_bf16"],
        "device_type": "cpu",
        "fast_bf16": True,
    }
    bench = results.RESULTS / "bench" / "decoder" / "report.json"
    write(bench, report(avx2, 11.0))
    results.doc("an AVX2 run")
    write(bench, report(amx, 32.0))  # the same run name on another machine
    results.doc("an AMX run")
    snapshots = tmp_path / "docs" / "results"
    assert json.loads((snapshots / "decoder.json").read_text())["results"]["T=0"]["plain"]["overall"] == {
        "tokens_per_s": 11.0,
        "verify_ms": 30.0,
    }
    assert (
        json.loads((snapshots / results.DECODER_BF16_SNAPSHOT).read_text())["head"]["provenance"]
        == "an AMX run"
    )
    sections = results.sections(tmp_path / "docs" / "results.md")
    assert "| plain | 11.00 |" in "\n".join(sections[results.DECODER_TITLE])
    assert "| plain | 32.00 |" in "\n".join(sections[results.DECODER_BF16_TITLE])
    write(bench, report({**amx, "device_type": "cuda"}, 300.0))  # a GPU run replaces neither
    results.doc()
    assert (snapshots / "decoder_cuda.json").is_file()
    assert "| plain | 32.00 |" in "\n".join(
        results.sections(tmp_path / "docs" / "results.md")[results.DECODER_BF16_TITLE]
    )
    epyc = {**amx, "name": "AMD EPYC", "cpu_flags": ["avx512f", "avx512_bf16"]}  # bf16, no AMX
    write(bench, report(epyc, 47.0))
    results.doc()
    sections = results.sections(tmp_path / "docs" / "results.md")
    assert "| plain | 47.00 |" in "\n".join(sections[results.DECODER_AVX512BF16_TITLE])
    assert "| plain | 32.00 |" in "\n".join(sections[results.DECODER_BF16_TITLE])


def test_training_speed_gets_one_snapshot_per_class_of_cpu(results, tmp_path):
    """AVX2-only (fp32), AMX-bf16 and AVX-512-bf16 without AMX: no class replaces another's."""

    def checkout(commit: str, flags: list[str], eagle: float, tmp_name: str) -> Path:
        fast_bf16 = any(flag.endswith("bf16") for flag in flags)
        machine = {"name": "cpu", "cpu_flags": flags, "fast_bf16": fast_bf16, "threads": 2, "torch": "2"}
        variant = {"train_tokens_per_s": eagle, "val_tokens_per_s": 2 * eagle}
        path = tmp_path / tmp_name
        write(path, {"label": commit, "commit": commit * 8, "machine": machine, "precision": "p",
                     "batch_tokens": 2048, "variants": {"eagle": variant}})  # fmt: skip
        return path

    for flags, (old, new) in (
        (["avx2"], (500, 600)),
        (["avx2", "avx512f", "amx_bf16", "avx512_bf16"], (1400, 1500)),
        (["avx2", "avx512f", "avx512_bf16"], (2000, 2500)),
    ):
        runs = [checkout("a", flags, old, f"a-{old}.json"), checkout("b", flags, new, f"b-{new}.json")]
        results.train_speed(runs, None, None, "")
    results.doc()
    sections = results.sections(tmp_path / "docs" / "results.md")
    assert "| `eagle` | 500 | 600 | 1.20× |" in "\n".join(sections[results.TRAIN_SPEED_TITLE])
    assert "| `eagle` | 1400 | 1500 | 1.07× |" in "\n".join(sections[results.TRAIN_SPEED_BF16_TITLE])
    assert "| `eagle` | 2000 | 2500 | 1.25× |" in "\n".join(sections[results.TRAIN_SPEED_AVX512BF16_TITLE])


def test_a_regeneration_measurement_alone_joins_this_machines_training_speed_snapshot(
    results, tmp_path, monkeypatch
):
    class Avx2:
        def record(self) -> dict:
            return {"name": "cpu", "cpu_flags": ["avx2"], "fast_bf16": False, "device_type": "cpu"}

    monkeypatch.setattr(results, "detect_hardware", lambda: Avx2())
    logs = []
    for label, rows, tokens, seconds, rate in (("before", 32, 1000, 10, 100.0), ("after", 64, 990, 6, 165.0)):
        log = tmp_path / f"{label}.log"
        throughput = f"9 turns answered, 0 dropped; {tokens} tokens in {seconds} s = {rate} tokens/s"
        log.write_text(f"regen: {rows} rows per batch\nout.jsonl: 9 written this run ({throughput})")
        logs.append(log)
    with pytest.raises(SystemExit, match=r"no .*train_speed\.json"):  # nothing to join yet
        results.regen_speed(logs, ["a" * 40, "b" * 40], "how")
    machine = {"name": "cpu", "cpu_flags": ["avx2"], "fast_bf16": False, "threads": 2, "torch": "2"}
    for commit in "ab":
        write(tmp_path / f"{commit}.json", {"label": commit, "commit": commit * 40, "machine": machine,
              "precision": "p", "batch_tokens": 2048, "variants": {"eagle": {"train_tokens_per_s": 5,
              "val_tokens_per_s": 9}}})  # fmt: skip
    results.train_speed([tmp_path / "a.json", tmp_path / "b.json"], None, None, "")
    results.regen_speed(logs, ["c" * 40, "d" * 40], "how")
    snapshot = json.loads((tmp_path / "docs" / "results" / results.TRAIN_SPEED_SNAPSHOT).read_text())
    assert [run["commit"] for run in snapshot["checkouts"]] == ["a" * 40, "b" * 40]  # kept
    assert snapshot["regen"][0]["after"] == {"tokens": 990, "seconds": 6, "tokens_per_s": 165.0, "rows": 64}
    results.regen_speed(logs[::-1], ["e" * 40, "f" * 40], "again")  # a later one joins, oldest first
    results.doc()
    text = "\n".join(results.sections(tmp_path / "docs" / "results.md")[results.TRAIN_SPEED_TITLE])
    first = text.index("greedy at 32 → 64 rows): 100.0 tokens/s before, 165.0 after (1.65×")
    assert first < text.index("commits ccccccc → ddddddd; `how`")
    assert first < text.index("greedy at 64 → 32 rows): 165.0 tokens/s before, 100.0 after (0.61×")
    assert "commits eeeeeee → fffffff; `again`" in text


def summary(steps: int, tau: float, accs: tuple[float, ...]) -> dict:
    final = {"val/sim_tau": tau, **{f"val/acc_{k}": acc for k, acc in enumerate(accs, 1)}}
    return {"global_step": steps, "tokens_seen": 100 * steps, "fit_seconds": 1.0, "best_sim_tau": tau,
            "final_val": final}  # fmt: skip


def test_recipe_variants_are_snapshotted_in_their_order_and_refused_at_other_steps(
    results, tmp_path, monkeypatch
):
    runs = {"base": ("–", 4), "seed1": ("datamodule.seed=1", 4), "seed2": ("datamodule.seed=2", 4),
            "more": ("trainer.max_steps=6", 6)}  # fmt: skip
    monkeypatch.setattr(results, "RECIPE_RUNS", runs)
    root = tmp_path / "outputs" / "recipe-gpu"
    for name, steps, tau in (("base", 4, 1.5), ("seed1", 4, 1.4), ("seed2", 4, 1.6), ("more", 5, 1.7)):
        write(root / name / "summary.json", summary(steps, tau, (0.25, 0.125)))
    with pytest.raises(SystemExit, match="run more trained 5 steps, not 6"):
        results.recipe()
    (root / "more" / "summary.json").unlink()
    with pytest.raises(SystemExit, match=r"no .*more/summary\.json"):
        results.recipe()
    runs["more"] = ("trainer.max_steps=5", 5)
    write(root / "more" / "summary.json", summary(5, 1.7, (0.5,)))
    results.recipe()
    results.doc()
    text = "\n".join(results.sections(tmp_path / "docs" / "results.md")[results.RECIPE_TITLE])
    rows = [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows == ["| run", "| base", "| seed1", "| seed2", "| more"]
    assert "| more | trainer.max_steps=5 | 5 | 500 | 1.700 | 0.500 |" in text
    assert "Three batch orders of the same recipe: 1.400–1.600." in text


def test_a_gpu_test_log_becomes_one_run_per_commit_with_each_outcome_and_call_time(results, tmp_path):
    log = tmp_path / "pytest_gpu.log"
    log.write_text(
        "tests/test_a.py::test_x[cuda] PASSED [ 50%]\n"
        "tests/test_b.py::test_y FAILED      [100%]\n"
        "E   AssertionError: 1 == 0\n"
        "12.50s call     tests/test_b.py::test_y\n"
        "0.01s setup    tests/test_a.py::test_x[cuda]\n"
        "========= 1 failed, 1 passed, 9 deselected in 13.00s =========\n"
    )
    other = tmp_path / "other.log"
    other.write_text("tests/test_a.py::test_x[cuda]\n")  # collected only: no outcome, no summary
    with pytest.raises(SystemExit, match="no `pytest -v` outcomes"):
        results.gpu_tests(other, "abc1234", "GPU")
    for machine in ("first", "second"):  # the same commit again replaces its run
        results.gpu_tests(log, "abc1234", machine)
    results.gpu_tests(log, "def5678", "H100")
    runs = json.loads((tmp_path / "docs" / "results" / results.GPU_TESTS_SNAPSHOT).read_text())["runs"]
    assert [(run["commit"], run["machine"]) for run in runs] == [("abc1234", "second"), ("def5678", "H100")]
    assert runs[0]["tests"] == {
        "tests/test_a.py::test_x[cuda]": {"outcome": "PASSED"},  # no call time listed
        "tests/test_b.py::test_y": {"outcome": "FAILED", "call_s": 12.5},
    }
    assert runs[0]["summary"] == "1 failed, 1 passed, 9 deselected in 13.00s"
    results.doc()
    text = "\n".join(results.sections(tmp_path / "docs" / "results.md")[results.GPU_TESTS_TITLE])
    assert "| `test_b.py::test_y` | FAILED | 12.5 |" in text and "commit def5678**, H100" in text


def test_gpu_regeneration_runs_are_compared_with_the_oldest_listed_last(results, tmp_path):
    logs = {}
    for name, rows, tokens, seconds, rate in (("new", 1024, 990, 2, 495.0), ("old", None, 1000, 10, 100.0)):
        batch = f"regen: {rows} rows per batch (batch_size auto)\n" if rows else ""
        logs[name] = tmp_path / f"{name}.log"
        throughput = f"{tokens} tokens in {seconds} s = {rate} tokens/s"
        logs[name].write_text(f"{batch}out.jsonl: 9 written ({throughput})\n")
    (tmp_path / "silent.log").write_text("Loading weights\n")
    with pytest.raises(SystemExit, match=r"silent\.log has no specdraft-regen throughput line"):
        results.gpu_regen([f"x:abc:{tmp_path / 'silent.log'}"], None, "H100", "how")
    compare = tmp_path / "compare.json"
    write(compare, {"samples": 4, "answer_positions": 1200, "dtype": "torch.bfloat16",
          "hidden_rel_err_median": 0.0, "hidden_rel_err_p99": 0.024, "top1_agree": 0.995})  # fmt: skip
    runs = [f"auto rows:abc1234:{logs['new']}", f"before:def5678:{logs['old']}"]  # the oldest last
    results.gpu_regen(runs, compare, "H100", "how")
    snapshot = json.loads((tmp_path / "docs" / "results" / results.GPU_REGEN_SNAPSHOT).read_text())
    assert snapshot["runs"][1] == {"label": "before", "commit": "def5678", "tokens": 1000, "seconds": 10,
                                   "tokens_per_s": 100.0, "rows": None}  # fmt: skip
    results.doc()
    text = "\n".join(results.sections(tmp_path / "docs" / "results.md")[results.GPU_REGEN_TITLE])
    assert "| auto rows | abc1234 | 1024 | 990 | 2 | 495 | 4.95× |" in text
    assert "| before | def5678 | – | 1,000 | 10 | 100 | 1.00× |" in text and "× def5678 |" in text
    assert "median 0.00%, p99 2.40%; the same top-1 at 99.5% of positions" in text


def test_batch_section_reports_throughput_per_size_and_the_crossover(results, tmp_path):
    def entry(rate, speedup, tau=None, identical=None):
        row = {"rows": 4, "tokens": 512, "wall_s": 512 / rate, "tokens_per_s": rate, "speedup": speedup}
        row |= {"row_ms_per_token": 1000 / rate, "tau": tau}
        return row | ({"identical_to_plain": identical} if identical else {})

    report = {
        "machine": MACHINE,
        "config": {
            "prompts": {"per_category": 2, "max_turns": 1, "path": "/somewhere"},
            "max_new_tokens": 128,
            "checkpoint": "/x/smollm2-135m-eagle",
            "batch_sizes": [1, 4],
            "methods": {
                "head_dynamic": {
                    "type": "head",
                    "checkpoint": "/x/smollm2-135m-eagle",
                    "shape": {"kind": "dynamic", "depth": 3, "top_k": 4, "total_tokens": 12},
                }
            },
        },
        "methods": {
            "plain": {"type": "plain", "lossless": True},
            "head_dynamic": {"type": "head", "lossless": True},
        },
        "batch": {
            "T=0": {
                "sizes": {
                    "1": {"plain": entry(20.0, 1.0), "head_dynamic": entry(25.0, 1.25, 2.0, "16/16")},
                    "4": {"plain": entry(50.0, 1.0), "head_dynamic": entry(40.0, 0.8, 2.0, "16/16")},
                },
                "crossover": {"head_dynamic": 4},
            }
        },
    }
    write(results.RESULTS / "bench" / "batch" / "report.json", report)
    results.doc()
    text = (tmp_path / "docs" / "results.md").read_text()
    assert "| 1 | head_dynamic | 25.00 | 1.250× | 40.0 | 2.00 | 16/16 |" in text
    assert "| 4 | plain | 50.00 | 1.000× | 20.0 | – | – |" in text
    assert "no faster than plain decoding at batch size 4" in text
    assert "{kind: dynamic, depth: 3, top_k: 4, total_tokens: 12}" in text
    assert (tmp_path / "docs" / "results" / "batch_throughput.png").is_file()
    snapshot = json.loads((tmp_path / "docs" / "results" / "batch.json").read_text())
    assert (
        "checkpoint" not in snapshot["methods"]["head_dynamic"]
        and "path" not in snapshot["config"]["prompts"]
    )


def test_the_prompts_line_names_the_prompts_a_report_read(results) -> None:
    """A quickstart without the MT-bench file evaluates on held-out ShareGPT: two runs were once
    rendered as MT-bench's, their τ compared with MT-bench runs."""

    def report(prompts: dict) -> dict:
        return {"machine": {}, "config": {"prompts": prompts, "max_new_tokens": 128}, "results": {}}

    fallback = {"_target_": "specdraft.eval.prompts.sharegpt_heldout", "limit": 16, "max_turns": 1}
    mt_bench = {"_target_": "specdraft.eval.prompts.read_spec_bench", "path": "/x/q.jsonl"}
    mt_bench |= {"per_category": 2, "max_turns": 1}
    assert results.prompts_line(results.compact(report(fallback))) == (
        "held-out ShareGPT (no MT-bench file), the first 16 prompts, first turns, 128 new tokens per turn"
    )
    assert results.prompts_line(results.compact(report(mt_bench))) == (
        "MT-bench, 2 per category, first turns, 128 new tokens per turn"
    )
    older = {"per_category": 2, "max_turns": 1}  # snapshots from before the reader was kept
    assert results.prompts_line(report(older)) == results.prompts_line(results.compact(report(mt_bench)))


def test_quickstart_runs_without_a_snapshot_keep_their_text_and_get_their_machine(results) -> None:
    previous = [
        "Machine: 2026-11-22, x86_64 × 2 cores.",
        "",
        "### `make run` (run `quickstart`)",
        "",
        "- data: 639 conversations",
        "",
        "### `another` (run `fresh`)",
        "",
        "- data: 1 conversation",
        "",
    ]
    kept = results.kept_runs(previous, snapshotted={"fresh"})  # `fresh` is re-rendered from its snapshot
    assert kept == [
        "### `make run` (run `quickstart`)",
        "",
        "- machine: 2026-11-22, x86_64 × 2 cores",
        "- data: 639 conversations",
        "",
    ]
    assert results.kept_runs(["", *kept], snapshotted=set()) == kept  # idempotent on the next render


def test_every_ablation_head_composes_with_the_shared_overrides(results, tmp_path: Path) -> None:
    for name in results.ABLATION:
        cfg = compose_train(tmp_path / name, *results.ablation_overrides(name, 300, tmp_path / "features"))
        assert cfg.trainer.max_steps == 300 and cfg.scheduler.total_steps == 300
        assert cfg.datamodule.max_batch_tokens == results.ABLATION_BATCH_TOKENS
        assert cfg.trainer.precision == results.ABLATION_PRECISION  # not `auto`: the same on every machine
        own_vocab = cfg.head.kind == "eagle3"
        assert (name in results.OWN_VOCAB) == own_vocab  # EAGLE-3 heads draft over their own vocabulary
        vocab = cfg.head.config.draft_vocab_size if own_vocab else cfg.loss.draft_vocab_size
        assert vocab == results.ABLATION_VOCAB
    hass = compose_train(tmp_path / "h", *results.ablation_overrides("hass_beta1", 300, tmp_path))
    assert hass.loss.rollout.step_weight_base == 1.0 and hass.loss.rollout.steps == 3
    assert hass.trainer.accelerator == "cpu" and hass.target.device == "cpu"


def test_a_gpu_placement_moves_every_head_alike(results, tmp_path: Path) -> None:
    """`--device cuda --precision bf16-mixed --batch-tokens 16384`: every head trains on the GPU
    with the target there, in one precision and batch size; the bench loads the target there."""
    placement = results.Placement("cuda", "bf16-mixed", 16384)
    for name in ("eagle", "eagle3"):
        cfg = compose_train(tmp_path / name, *results.ablation_overrides(name, 300, tmp_path, placement))
        assert cfg.trainer.accelerator == "gpu" and cfg.target.device == "cuda"
        assert cfg.trainer.precision == "bf16-mixed" and cfg.datamodule.max_batch_tokens == 16384
    assert placement.target() == ["target.device=cuda"] and results.Placement().target() == []


def test_training_curves_join_a_resumed_runs_logs_and_drop_the_repeated_final_validation(results) -> None:
    run = results.RESULTS / "train" / "eagle"
    first = ["step,val/acc_1,val/sim_tau", "24,0.1,1.1", "49,0.2,1.2", "74,0.25,1.25"]  # killed after 74
    resumed = [
        "step,val/acc_1,val/sim_tau",
        "74,0.26,1.26",
        "99,0.3,1.3",
        "100,0.3,1.3",
    ]  # 100: the final one
    for version, rows in ((0, first), (1, resumed)):
        path = run / "csv" / f"version_{version}" / "metrics.csv"
        path.parent.mkdir(parents=True)
        path.write_text("\n".join(rows) + "\n")
    assert results.val_curve(run) == [[24, 0.1, 1.1], [49, 0.2, 1.2], [74, 0.26, 1.26], [99, 0.3, 1.3]]


def test_ablation_section_with_trained_heads_only(results, tmp_path: Path) -> None:
    fake_ablation_outputs(results)
    shutil.rmtree(results.RESULTS / "bench")
    (results.RESULTS / results.DEPTH_JSON).unlink()
    results.doc()
    text = (tmp_path / "docs" / "results.md").read_text()
    assert "Machine: not recorded (no bench, no depth run yet)." in text
    assert "| eagle | 300 | 1,105,999 |" in text and "The mechanism" not in text


def test_sweep_section_from_the_sweep_report(results, tmp_path: Path) -> None:
    sweep = results.RESULTS / "sweeps" / results.SWEEP_NAME
    rows = []
    cache = tmp_path / "features" / "train"
    write(cache / "manifest.json", {"num_samples": 1298, "num_tokens": 370123})
    for topk, best in ((0.5, 1.41), (2.0, 1.45)):
        run = sweep / f"loss.weights.topk={topk}"
        final = {"val/acc_1": 0.35, "val/acc_2": 0.27, "val/sim_tau": best - 0.01}
        write(run / "summary.json", {"final_val": final, "tokens_seen": 1105999})
        loss = {"weights": {"topk": topk, "topk_k": 10}, "rollout": {"steps": 3, "step_weight_base": 0.5}}
        config = {
            "trainer": {"max_steps": 300, "precision": "bf16-mixed"},
            "datamodule": {"max_batch_tokens": 4096, "train_cache": str(cache)},
            "loss": loss,
        }
        (run / "run_config.yaml").write_text(json.dumps(config))
        rows.append({"run": str(run), "loss.weights.topk": topk, "val/sim_tau": best})
    reference = {
        "best_sim_tau": 1.43,
        "final_val": {"val/acc_1": 0.33, "val/acc_2": 0.2, "val/sim_tau": 1.42},
    }
    write(results.RESULTS / "train" / results.SWEEP_REFERENCE / "summary.json", reference)
    report = {"metric": "val/sim_tau", "swept": ["loss.weights.topk"], "runs": rows[::-1]}
    write(sweep / "report" / "runs.json", report)
    write(sweep / "report" / "machine.json", MACHINE)
    results.doc()
    text = (tmp_path / "docs" / "results.md").read_text()
    assert "Machine: 2026-11-24, AMD EPYC (avx2)" in text
    assert (
        "300 steps of ≤ 4,096 positions in bf16-mixed over the features of 1298 conversations, "
        "370,123 tokens" in text
    )
    assert "| loss.weights.topk | best simulated τ | final simulated τ | final acc_1..4 |" in text
    assert "| 2.0 | 1.450 | 1.440 | 0.350 / 0.270 |" in text
    assert "| EAGLE (no Top-K, no alignment) | 1.430 | 1.420 | 0.330 / 0.200 |" in text
    assert (tmp_path / "docs" / "results_sweep_loss_weights_topk.png").read_bytes()[:4] == b"\x89PNG"
    shutil.rmtree(results.LOG_DIR)  # the snapshot alone renders the same section
    results.doc()
    assert (tmp_path / "docs" / "results.md").read_text() == text


def test_the_two_stage_hass_head_trains_alignment_then_topk_from_its_weights_at_equal_tokens(
    results, tmp_path: Path, monkeypatch
) -> None:
    """HASS's reference schedule: the first stage is hass_align's recipe, the second the head's own
    from the first's final weights at a third of the learning rate for the last fifth (in whole
    checkpoint intervals); the steps add up to every other head's, and the snapshot counts both
    stages on one step axis. A finished first stage is not trained again."""
    calls: list[list[str]] = []
    monkeypatch.setattr(results, "command", lambda name, *overrides, log=None: calls.append(list(overrides)))
    results.ablation(300, tmp_path / "features", results.Placement(), heads=["hass_2stage"])
    first, second = (compose_train(tmp_path / f"s{i}", *call) for i, call in enumerate(calls))
    assert first.loss.weights.topk == 0 and first.loss.rollout.steps == 3 and first.init_from is None
    assert second.loss.weights.topk == 1.0 and second.loss.rollout.steps == 3
    assert (first.trainer.max_steps, second.trainer.max_steps, second.scheduler.total_steps) == (250, 50, 50)
    assert (first.scheduler.warmup_steps, second.scheduler.warmup_steps) == (results.ABLATION_WARMUP, 3)
    # (compose_train moves every run's output dir to tmp_path; the script's runs go under its log dir)
    assert first.paths.log_dir == str(results.RESULTS)
    assert second.init_from == str(results.RESULTS / "train" / first.run_name / "checkpoints" / "last.ckpt")
    assert second.optim.lr == pytest.approx(first.optim.lr / 3, rel=1e-5)
    for cfg in (first, second):
        assert cfg.loss.draft_vocab_size == results.ABLATION_VOCAB

    for name, steps, rows in (
        ("hass_2stage_stage1", 250, ["step,val/acc_1,val/sim_tau", "199,0.3,1.4", "249,0.35,1.5"]),
        ("hass_2stage", 50, ["step,val/acc_1,val/sim_tau", "24,0.36,1.52", "49,0.37,1.55"]),
    ):
        run = results.RESULTS / "train" / name
        summary = {"global_step": steps, "tokens_seen": steps * 10, "fit_seconds": 1.0, "best_sim_tau": 1.5}
        write(run / "summary.json", summary)
        (run / "csv" / "version_0").mkdir(parents=True)
        (run / "csv" / "version_0" / "metrics.csv").write_text("\n".join(rows) + "\n")
    training = results.ablation_training("hass_2stage")
    assert (training["global_step"], training["tokens_seen"], training["fit_seconds"]) == (300, 3000, 2.0)
    assert training["curve"] == [[199, 0.3, 1.4], [249, 0.35, 1.5], [274, 0.36, 1.52], [299, 0.37, 1.55]]
    assert training["stages"] == [250, 50]

    calls.clear()
    (results.RESULTS / "train" / "hass_2stage" / "summary.json").unlink()  # the second stage was killed
    results.ablation(300, tmp_path / "features", results.Placement(), heads=["hass_2stage"])
    assert len(calls) == 1 and any(o.startswith("init_from=") for o in calls[0])


def test_mixture_section_compares_the_tuned_head_with_its_base_per_turn(results, tmp_path):
    bench = results.RESULTS / "bench" / results.MIXTURE_RUN
    amx = {"name": "Intel Xeon", "cpu_flags": ["amx_bf16"], "device_type": "cpu", "fast_bf16": True}
    methods = {
        "plain": {"type": "plain"},
        "hf_prompt_lookup": {"type": "hf"},
        results.MIXTURE_BASE: {"type": "head", "checkpoint": "/x/base-head"},
        results.MIXTURE_TUNED: {"type": "head", "checkpoint": "/x/tuned-head"},
    }
    config = {"prompts": {"per_category": 1, "max_turns": 2}, "max_new_tokens": 128}
    machine = {**MACHINE, "hardware": amx}
    write(bench / "report.json", {"machine": machine, "config": config, "methods": {}})
    write(bench / "run_config.json", {"methods": methods})
    units = []
    for question, category in (("81", "writing"), ("91", "roleplay")):
        records = []
        for number in (0, 1):
            records += [
                {**turn("plain", question, category, 40, 40, 4.0), "turn": number},
                {**turn("hf_prompt_lookup", question, category, 40, 40, 2.0), "turn": number, "steps": None},
                {**turn(results.MIXTURE_BASE, question, category, 40, 20, 2.5), "turn": number},  # τ 2
                {**turn(results.MIXTURE_TUNED, question, category, 40, 16, 2.0), "turn": number},  # τ 2.5
            ]
        units.append({"question_id": question, "temperature": 0.0, "records": records})
    (bench / "records.jsonl").write_text("".join(json.dumps(u) + "\n" for u in units))
    results.doc()
    snapshot = json.loads((tmp_path / "docs" / "results" / "mixture_bf16.json").read_text())
    first = snapshot["per_turn"]["first turns"]
    assert first["turns"] == 2 and snapshot["heads"][results.MIXTURE_TUNED] == "tuned-head"
    assert first["methods"][results.MIXTURE_TUNED] == {"tokens_per_s": 20.5, "tau": 2.5}
    assert first["tuned_vs_base"]["ratio"]["estimate"] == pytest.approx(1.25)
    text = "\n".join(results.sections(tmp_path / "docs" / "results.md")[results.MIXTURE_TITLE])
    # 41 tokens in 2 s against plain's 41 in 4 s and prompt lookup's 41 in 2 s
    assert f"| first turns (2) | {results.MIXTURE_TUNED} | 20.50 | 2.000× | 1.000× | 2.500 |" in text
    assert "second turns: τ of" in text and "[1.250, 1.250]" in text


def test_heads_train_side_by_side_and_travel_as_exports_which_the_bench_and_depth_read(
    results, tmp_path: Path, monkeypatch
) -> None:
    """On a GPU the heads train side by side (each logging to its own file), then travel to the
    machine that benches them as native exports: final_checkpoint prefers a run's export."""
    calls: list[tuple[str, list[str], Path | None]] = []
    monkeypatch.setattr(
        results, "command", lambda name, *overrides, log=None: calls.append((name, list(overrides), log))
    )
    results.ablation(100, tmp_path / "features", results.Placement(), heads=["eagle", "hass"], parallel=2)
    assert sorted(log.name for _, _, log in calls) == ["eagle.log", "hass.log"]
    assert {f"run_name={n}" for n in ("eagle", "hass")} <= {o for _, overrides, _ in calls for o in overrides}

    run = results.RESULTS / "train" / "eagle"
    with pytest.raises(SystemExit, match="has not finished"):
        results.final_checkpoint(run)
    write(run / "summary.json", {"global_step": 100})
    assert results.final_checkpoint(run) == run / "checkpoints" / "last.ckpt"
    calls.clear()
    results.export_heads("bfloat16")
    ((name, overrides, _),) = calls  # only the finished head
    assert name == "specdraft-export"
    assert f"out={run / results.EXPORT_DIR}" in overrides and "dtype=bfloat16" in overrides
    write(run / results.EXPORT_DIR / "config.json", {})
    assert results.final_checkpoint(run) == run / results.EXPORT_DIR

    def depth_tool(name: str, *overrides: str, log: Path | None = None) -> None:
        calls.append((name, list(overrides), log))
        out = next(o.removeprefix("--out=") for o in overrides if o.startswith("--out="))
        write(Path(out), {"runs": {"eagle": {"conversations": ["a"]}}})

    calls.clear()
    monkeypatch.setattr(results, "command", depth_tool)
    results.depth("cpu")
    ((name, overrides, _),) = calls
    assert name == "specdraft-depth-acceptance"
    assert f"--checkpoint={run / results.EXPORT_DIR}" in overrides and "--device=cpu" in overrides
    assert json.loads((results.RESULTS / results.DEPTH_JSON).read_text())["runs"]["eagle"]


def test_the_ablation_names_where_its_heads_trained_and_what_its_features_were_made_of(results, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "cli.log").write_text(
        "[t][specdraft.system.hardware][INFO] - specdraft-train on NVIDIA H200 (bf16 supported); dtype auto\n"
    )
    assert results.training_device(run) == "NVIDIA H200 (bf16 supported)"
    assert results.training_device(tmp_path / "none") is None
    cache = tmp_path / "cache"
    write(
        cache / "plan.json",
        {
            "source": {
                "data": {
                    "source": {"_target_": "specdraft.data.conversations.read_jsonl", "path": "/x/c.jsonl"}
                },
                "split": "train",
                "limit": 2400,
            }
        },
    )
    source = results.cache_source(cache)
    assert source == {"reader": "read_jsonl", "file": "c.jsonl", "split": "train", "limit": 2400}
    assert results.features_text(source) == (
        "the target's features over the first 2,400 conversations of the train split of `c.jsonl`"
    )
    assert results.features_text(None) == "the quickstart's self-distilled features"


def test_the_training_vocabulary_of_captured_features_counts_their_answers(results, tmp_path):
    """A cache captured during regeneration names its answers and their split, not a source."""
    cache = tmp_path / "features" / "train"
    write(
        cache / "plan.json",
        {
            "source": {
                "captured_by": "specdraft-regen",
                "regen": "outputs/quickstart/regen-9.jsonl",
                "conversations": {"data": {"max_length": 2048, "heldout_fraction": 0.02, "split_seed": 0}},
                "split": {"heldout_fraction": 0.05, "split_seed": 1},
                "cache_split": "train",
            }
        },
    )
    overrides = results.training_vocab_shortlist(cache)
    assert any("read_jsonl" in o and "regen-9.jsonl" in o for o in overrides)
    assert "shortlist.heldout_fraction=0.05" in overrides and "shortlist.split_seed=1" in overrides
    assert "shortlist.split_limit=null" in overrides
    assert results.cache_source(cache) == {
        "reader": "specdraft-regen", "file": "regen-9.jsonl", "split": "train", "limit": None
    }  # fmt: skip
