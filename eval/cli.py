"""``specdraft-bench`` and ``specdraft-eval`` (Hydra): decode prompts with every configured
method on the same target, interleaved per question, and write records.jsonl, report.json and
the plots (acceptance_per_depth.png, speedup.png) to ``${paths.log_dir}/bench/${run_name}``.

    specdraft-bench checkpoint=outputs/train/hass/checkpoints/last.ckpt   # MT-bench, T=0 and 1, all methods
    specdraft-eval checkpoint=outputs/train/hass/checkpoints/last.ckpt    # the head vs plain decoding only
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from specdraft.data.chat import assistant_token_counts, tokenize_conversations
from specdraft.data.conversations import split_conversations
from specdraft.data.hardware import start
from specdraft.data.target import Target
from specdraft.eval.baselines import load_draft_model
from specdraft.eval.bench import BenchDirError, run_benchmark
from specdraft.eval.decode import Typical
from specdraft.eval.kernels import pack_linear_weights
from specdraft.eval.load import load_head
from specdraft.eval.methods import build_method
from specdraft.eval.sampling import Sampling
from specdraft.heads.vocab import draft_vocab_from_counts

log = logging.getLogger(__name__)


@hydra.main(version_base="1.3", config_path="pkg://specdraft.conf", config_name="bench")
def bench_main(cfg: DictConfig) -> None:
    _main(cfg, "specdraft-bench")


@hydra.main(version_base="1.3", config_path="pkg://specdraft.conf", config_name="eval")
def eval_main(cfg: DictConfig) -> None:
    _main(cfg, "specdraft-eval")


def _main(cfg: DictConfig, command: str) -> None:
    try:
        report = run(cfg, command)
    except BenchDirError as error:
        raise SystemExit(f"specdraft-bench: {error}") from None
    print(format_table(report["results"]))
    print(f"report: {Path(cfg.paths.output_dir) / 'report.json'}")


def run(cfg: DictConfig, command: str = "specdraft-bench") -> dict[str, Any]:
    start(command, cfg.threads, cfg.target)
    target: Target = instantiate(cfg.target)
    if cfg.packed_weights:
        log.info("linear layers pre-packed for oneDNN: %d of the target", pack_linear_weights(target.model))
    questions = instantiate(cfg.prompts)
    if not questions:
        raise ValueError(f"prompts {cfg.prompts}: no questions")
    head_dtype = getattr(torch, cfg.head_dtype) if cfg.head_dtype else None
    eos_ids = target.spec.eos_token_ids

    def frozen_head(path: str) -> torch.nn.Module:
        head = load_head(path, target, head_dtype)
        if cfg.packed_weights:  # its few-row matmuls gain as much as the target's (eval/kernels.py)
            pack_linear_weights(head)
        return head

    # Loaded on first use and shared by the methods that need them.
    heads = functools.cache(frozen_head)
    draft_model = functools.cache(
        lambda: load_draft_model(target, cfg.draft_model.path, cfg.draft_model.num_layers)
    )
    shortlist = functools.cache(lambda: vocab_shortlist(cfg.shortlist, target))
    methods = [
        build_method(
            name,
            spec,
            target,
            heads=heads,
            draft_model=draft_model,
            shortlist=shortlist,
            eos_ids=eos_ids,
            max_new_tokens=cfg.max_new_tokens,
            typical=Typical(**cfg.typical),
        )
        for name, spec in {
            "plain": {"type": "plain"},
            **OmegaConf.to_container(cfg.methods, resolve=True),
        }.items()
        if spec is not None
    ]
    log.info(
        "methods: %s; %d questions × temperatures %s",
        [m.name for m in methods],
        len(questions),
        list(cfg.temperatures),
    )
    return run_benchmark(
        target,
        questions,
        methods,
        [float(t) for t in cfg.temperatures],
        lambda t: Sampling(t, cfg.top_p, cfg.top_k),
        Path(cfg.paths.output_dir),
        OmegaConf.to_container(cfg, resolve=True),
        seed=cfg.seed,
        resume=cfg.resume,
        progress=cfg.progress,
    )


def vocab_shortlist(cfg: DictConfig, target: Target) -> torch.Tensor | None:
    """The ``cfg.size`` most frequent assistant tokens of the training split (None: no shortlist)."""
    if cfg.size is None:
        return None
    source = instantiate(cfg.source)
    train, _ = split_conversations(source.conversations, cfg.heldout_fraction, cfg.split_seed)
    samples, _ = tokenize_conversations(target.tokenizer, train, cfg.max_length, progress=False)
    counts = assistant_token_counts(samples, target.spec.vocab_size)
    d2t, _ = draft_vocab_from_counts(counts, min(cfg.size, target.spec.vocab_size))
    log.info(
        "vocab shortlist: %d tokens cover %.1f%% of %d assistant tokens",
        len(d2t),
        100 * counts[torch.arange(len(d2t)) + d2t].sum() / counts.sum(),
        int(counts.sum()),
    )
    return torch.arange(len(d2t)) + d2t


def format_table(results: dict[str, Any]) -> str:
    """A plain-text summary: one row per temperature × method."""
    lines = [f"{'T':>4} {'method':<26} {'tok/s':>7} {'speedup':>8} {'tau':>5} {'overhead':>8}  α_d"]
    for temperature, methods in results.items():
        for name, entry in methods.items():
            o = entry["overall"]
            rates = " ".join(f"{r:.2f}" for r in o.get("acceptance_per_depth") or [] if r is not None)
            lines.append(
                f"{temperature[2:]:>4} {name:<26} {o['tokens_per_s'] or 0:7.1f} {o.get('speedup') or 0:8.2f} "
                f"{o.get('tau') or 0:5.2f} {o.get('overhead_share') or 0:8.2f}  {rates}"
            )
    return "\n".join(lines)
