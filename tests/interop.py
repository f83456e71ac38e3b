"""Cross-checking exports on a real serving engine: vLLM (or llama.cpp) and specdraft decode the
same prompt tokens with the same exported head, and their outputs and per-position acceptance are
compared.

Each engine runs in its own virtual environment (vLLM pins its own torch/transformers), one engine
per subprocess, through ``scripts/interop/vllm_generate.py`` or ``llamacpp_generate.py``; this
module prepares what they load and decodes the same prompts with specdraft's own loop.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specdraft.data.target import Target
from specdraft.eval.decode import Generation, speculative_generate
from specdraft.eval.drafters import Chain
from specdraft.eval.methods import drafter_for_head
from specdraft.eval.runner import TargetRunner
from specdraft.eval.sampling import Sampling
from specdraft.heads.interface import DraftHead


def write_serving_target(target: Target, out_dir: Path) -> Path:
    """The target as a plain HF directory an engine loads, in float32, every weight under its
    own name: the GGUF cache keeps a tied model's embedding once, as ``lm_head.weight``, which
    vLLM skips for a tied model (its embedding would stay zero)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {name: t.detach().float().contiguous().clone() for name, t in target.model.state_dict().items()}
    if target.spec.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    target.model.config.save_pretrained(out_dir)
    target.model.generation_config.save_pretrained(out_dir)
    target.tokenizer.save_pretrained(out_dir)
    return out_dir


def vllm_unavailable(python: str | Path, timeout_s: float) -> str | None:
    """Why vLLM cannot run under ``python`` on this machine (one line), or None when it imports.
    Checked up front so that a machine the CPU build does not support skips the interop tier
    instead of failing or hanging in the middle of it."""
    command = [str(python), "-c", "import vllm; from vllm import LLM, SamplingParams"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"`import vllm` did not finish in {timeout_s:.0f} s"
    except OSError as error:
        return f"{python} does not run: {error}"
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or [f"exit {done.returncode}"]
        return f"`import vllm` failed: {lines[-1]}"
    return None


def run_engine(
    python: str | Path,
    script: str | Path,
    job: dict[str, Any],
    work_dir: Path,
    env: dict[str, str],
    timeout_s: float | None = None,
) -> dict:
    """One engine (vLLM, llama.cpp) in a subprocess of ``python`` (the engine's own venv) running
    ``script``: job in, result JSON out. Fails (never hangs) when the engine has not answered
    within ``timeout_s``."""
    work_dir.mkdir(parents=True, exist_ok=True)
    job_path, result_path, log_path = work_dir / "job.json", work_dir / "result.json", work_dir / "engine.log"
    job_path.write_text(json.dumps(job))
    argv = [str(python), str(script), str(job_path), str(result_path)]
    with open(log_path, "w") as log:
        try:
            returncode = subprocess.run(argv, stdout=log, stderr=log, env=env, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            returncode = f"timed out after {timeout_s:.0f} s"
    if returncode != 0 or not result_path.is_file():
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"{Path(script).name} in {work_dir} failed (exit {returncode}); log tail:\n{tail}")
    return json.loads(result_path.read_text())


@dataclass
class ChainAcceptance:
    """Per-position acceptance of chain drafts: position i (0-based) was drafted ``drafted[i]``
    times and accepted ``accepted[i]`` times (accepted means every earlier draft was accepted too)."""

    drafted: list[int]
    accepted: list[int]

    @property
    def rates(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted, self.drafted, strict=True)]

    @property
    def tau(self) -> float:
        """Tokens per verification: 1 + mean accepted drafts per step (step count = drafted[0])."""
        return 1.0 + sum(self.accepted) / self.drafted[0] if self.drafted[0] else 1.0


def chain_acceptance(generations: Sequence[Generation], depth: int) -> ChainAcceptance:
    drafted, accepted = [0] * depth, [0] * depth
    for generation in generations:
        for step in generation.steps:
            for position in range(step.depth):
                drafted[position] += 1
                accepted[position] += position < step.accepted
    return ChainAcceptance(drafted, accepted)


def vllm_acceptance(metrics: dict[str, Any], depth: int) -> ChainAcceptance:
    """vLLM's counters: every draft proposes ``depth`` tokens; accepted per position."""
    drafts = int(metrics["vllm:spec_decode_num_drafts"])
    per_position = [int(v) for v in metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]]
    if len(per_position) != depth:
        raise ValueError(f"vLLM reported acceptance for {len(per_position)} positions, expected {depth}")
    return ChainAcceptance([drafts] * depth, per_position)


def specdraft_chain_decode(
    target: Target, head: DraftHead, prompts: Sequence[list[int]], depth: int, max_new_tokens: int
) -> list[Generation]:
    """Greedy chain decoding of every prompt with specdraft's loop and the head's own drafter (what
    vLLM's EAGLE and DFlash proposers do: a chain of ``depth`` drafts a step)."""
    runner = TargetRunner(target, head.target_taps)
    greedy = Sampling(temperature=0.0)
    generations = []
    for ids in prompts:
        drafter = drafter_for_head(head, Chain(depth=depth))
        with torch.inference_mode():
            generations.append(
                speculative_generate(
                    runner, drafter, torch.tensor(ids), max_new_tokens, greedy, target.spec.eos_token_ids
                )
            )
    return generations
