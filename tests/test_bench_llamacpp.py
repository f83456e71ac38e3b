"""scripts/interop/bench_llamacpp.py's arithmetic (τ, α per position, step and draft ms, answers
identical to plain, × llama.cpp plain per round) on llama.cpp results written by hand, and its
output recorded into docs/results.md by scripts/results.py."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_script(path: Path, monkeypatch):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def bench(monkeypatch):
    return load_script(ROOT / "scripts" / "interop" / "bench_llamacpp.py", monkeypatch)


@pytest.fixture
def results(monkeypatch):
    return load_script(ROOT / "scripts" / "results.py", monkeypatch)


def served(
    outputs: list[list[int]], accepted: list[int], per_position: list[list[int]], draft_ms: float
) -> dict:
    """One llama.cpp job's result as llamacpp_generate.py writes it (plus the bench's draft_ms):
    each answer 1 s of prompt, 1 s of decoding."""
    return {
        "outputs": outputs,
        "timings": [{"predicted_n": len(o), "predicted_ms": 1000.0, "prompt_ms": 1000.0} for o in outputs],
        "speculation": [
            {
                "num_drafts": len(o) - 1 - a,
                "num_accepted_tokens": a,
                **{f"num_accepted_tokens_per_pos/{i}": n for i, n in enumerate(positions)},
            }
            for o, a, positions in zip(outputs, accepted, per_position, strict=True)
        ],
        "draft_ms": draft_ms,
    }


def test_llamacpp_tau_acceptance_and_step_times_count_every_forward(bench) -> None:
    # Two answers of 9 tokens: after each first token, 8 more from 8 − accepted forwards.
    plain = served([[1] * 9, [2] * 9], [0, 0], [[], []], 0.0)
    head = served([[1] * 9, [2] * 8 + [3]], [4, 2], [[3, 1], [2, 0]], 30.0)
    entry = bench.llamacpp_metrics([head], [plain])
    forwards = (8 - 4) + (8 - 2)
    assert entry["tau"] == pytest.approx(16 / forwards)
    # drafting steps 4 + 6; position 1 kept in 3 + 2 of them, position 2 in 1 + 0 of those
    assert entry["acceptance_per_position"] == pytest.approx([5 / 10, 1 / 5])
    assert entry["step_ms"] == pytest.approx(2000 / forwards)
    assert entry["draft_ms_per_step"] == pytest.approx(30 / forwards)
    assert entry["identical_to_plain"] == "1/2"
    assert entry["tokens_per_s_per_round"] == [pytest.approx(18 / 4)]
    assert bench.llamacpp_metrics([plain], [plain])["tau"] == 1


def test_positions_no_draft_reached_are_left_off(bench) -> None:
    ngram = served([[1] * 9], [2], [[1, 1, 0, 0, 0]], 0.0)  # drafts of up to 5, two positions ever kept
    assert bench.llamacpp_metrics([ngram], [ngram])["acceptance_per_position"] == [1 / 6, 1.0, 0.0]


def test_speed_is_a_median_over_rounds_and_its_ratio_a_median_of_per_round_ratios(bench) -> None:
    methods = {
        "llamacpp_plain": {"tokens_per_s_per_round": [100.0, 50.0, 80.0], "step_ms": 8.0},
        "head": {"tokens_per_s_per_round": [110.0, 60.0, 40.0], "step_ms": 20.0, "draft_length": 3},
    }
    summary = bench.summarize(methods)
    assert summary["head"]["tokens_per_s"] == 60.0
    assert summary["head"]["x_llamacpp_plain"] == pytest.approx(1.1)  # of 1.1, 1.2, 0.5
    assert summary["llamacpp_plain"]["x_llamacpp_plain"] == 1.0
    # every draft accepted: 4 tokens per 20 ms step against 1 per 8 ms
    assert summary["head"]["ceiling_x_llamacpp_plain"] == pytest.approx(4 * 8 / 20)
    assert "ceiling_x_llamacpp_plain" not in summary["llamacpp_plain"]


def test_a_bench_output_is_recorded_and_rendered_with_its_forward_costs(results, tmp_path) -> None:
    method = {
        "engine": "llama.cpp",
        "tokens_per_s": 120.5,
        "x_llamacpp_plain": 1.0,
        "identical_to_plain": "8/8",
    }
    measured = {
        "machine": {
            "time": "2026-11-29T04:00:00",
            "hardware": {"name": "AMD EPYC", "cpu_flags": ["avx2"]},
            "cpu_count": 2,
            "threads": 2,
            "torch": "2.13.0+cpu",
            "llamacpp": "CPU : SSE3 = 1 | AVX2 = 1 | F16C = 1 |",
        },
        "settings": {"rounds": 2},
        "forward_ms": {"1": 8.4, "2": 14.0},
        "methods": {
            "llamacpp_plain": {**method, "tau": 1.0, "step_ms": 7.1, "draft_ms_per_step": 0.0},
            "specdraft_head": {
                **method,
                "engine": "specdraft (PyTorch)",
                "tau": 1.9,
                "acceptance_per_depth": [0.6, 0.4],
                "draft_ms": 4.0,
                "verify_ms": 30.0,
                "bookkeeping_ms": 1.0,
            },
        },
    }
    (tmp_path / "llamacpp.json").write_text(json.dumps(measured))
    entry = results.RECORDERS["llamacpp"]([str(tmp_path)])
    assert set(entry) == {"settings", "forward_ms", "methods"}
    machine = results.llamacpp_machine_line(measured["machine"])
    assert machine.endswith("llama.cpp's kernels: SSE3, AVX2, F16C")
    run = {"machine": machine, "command": "bench_llamacpp.py", "conditions": "alone"}
    lines = results.sections.llamacpp_section({"about": "Why.", **entry, "run": run})
    assert "| llamacpp_plain | llama.cpp | 120.5 | 1.00× | 1.00 | – | 7.1 (0.0) | – | 8/8 |" in lines
    assert (
        "| specdraft (head) | specdraft (PyTorch) | 120.5 | 1.00× | 1.90 | 0.60 / 0.40 | 35.0 (4.0) | – "
        "| 8/8 |" in lines
    )
    assert any("costs): 1: 8.4, 2: 14.0. Why." in line for line in lines)


def test_variants_of_one_method_share_a_row(results) -> None:
    def drafted(rate: float, step_ms: float) -> dict:
        return {
            "engine": "llama.cpp",
            "tokens_per_s": rate,
            "x_llamacpp_plain": rate / 100,
            "tau": 1.5,
            "acceptance_per_position": [0.3, 0.2],
            "step_ms": step_ms,
            "draft_ms_per_step": 2.0,
            "draft_length": 2,
            "ceiling_x_llamacpp_plain": 1.1,
            "identical_to_plain": "8/8",
        }

    methods = {
        "llamacpp_eagle3_q8_0_n2": drafted(48.0, 26.0),
        "llamacpp_eagle3_f16_n2": drafted(50.0, 25.0),
        "llamacpp_dflash_f16_n2": drafted(40.0, 30.0),
        "llamacpp_plain": {
            "engine": "llama.cpp",
            "tokens_per_s": 100.0,
            "x_llamacpp_plain": 1.0,
            "identical_to_plain": "8/8",
        },
    }
    run = {"machine": "EPYC", "command": "bench_llamacpp.py", "conditions": "alone"}
    snapshot = {"about": ".", "forward_ms": {"1": 8.0}, "methods": methods, "run": run}
    rows = [line for line in results.sections.llamacpp_section(snapshot) if line.startswith("| ")]
    assert rows[1].startswith("| llamacpp_plain |")  # plain first, whatever the snapshot's order
    eagle3 = next(row for row in rows if row.startswith("| eagle3"))
    assert eagle3 == (
        "| eagle3 n=2 (f16 / q8_0) | llama.cpp | 50.0 / 48.0 | 0.50× / 0.48× | 1.50 / 1.50 "
        "| 0.30 / 0.20; 0.30 / 0.20 "
        "| 25.0 (2.0) / 26.0 (2.0) | 1.10× / 1.10× | 8/8 / 8/8 |"
    )
    dflash = "| dflash n=2 (f16) | llama.cpp | 40.0 | 0.40× |"  # each head kind its own row
    assert any(row.startswith(dflash) for row in rows)


def test_each_gguf_export_is_served_as_its_head_kind(bench, tmp_path) -> None:
    gguf = []
    for kind, outtype in (("eagle3", "f16"), ("dflash", "f16"), ("eagle3", "q8_0")):
        export = tmp_path / f"{kind}-{outtype}"
        export.mkdir()
        (export / "model.gguf").write_bytes(b"GGUF")
        (export / "config.json").write_text(json.dumps({"specdraft": {"kind": kind, "outtype": outtype}}))
        gguf.append(export)
    args = type("Args", (), {"gguf": gguf, "draft_lengths": [3]})()
    methods = bench.llamacpp_methods(args, bench.exports(args))
    assert methods["llamacpp_dflash_f16_n3"] == {
        "speculative": "dflash", "draft": str(tmp_path / "dflash-f16" / "model.gguf"), "n_max": 3
    }  # fmt: skip
    assert methods["llamacpp_eagle3_q8_0_n3"]["speculative"] == "eagle3"
    args.gguf.append(gguf[0])
    with pytest.raises(SystemExit, match="both eagle3 f16; give one export per head and type"):
        bench.exports(args)


def test_a_resumed_run_reuses_a_result_of_the_same_job_only(bench, tmp_path) -> None:
    path = tmp_path / "llamacpp_plain.json"
    path.write_text(json.dumps({"outputs": [[1]]}))
    path.with_suffix(".job.json").write_text(json.dumps({"speculative": "none", "max_tokens": 8}))
    assert bench.cached(None, {"speculative": "none", "max_tokens": 8}, path) == {"outputs": [[1]]}
    with pytest.raises(SystemExit, match="the result of other settings"):
        bench.cached(None, {"speculative": "none", "max_tokens": 16}, path)
