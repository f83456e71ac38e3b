"""``specdraft-prepare``: the target + data pipeline end to end, with a JSON report.

Loads (and caches) the frozen target, reads the conversation source, splits it, renders a sample
of the training conversations with assistant loss masks, runs the target over them exactly as
feature caching and online training will (last hidden, EAGLE-3 aux layers, top-k), and writes
``report.json``: what was read and skipped, token counts, load times and target throughput.

    specdraft-prepare                                  # SmolLM2-135M + bundled ShareGPT
    specdraft-prepare target=tiny_random sample_conversations=20
    specdraft-prepare data=jsonl data.source.path=my_chats.jsonl
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from specdraft.data.chat import TokenizedConversation, tokenize_conversations
from specdraft.data.conversations import split_conversations
from specdraft.data.features import collate, extract_features, length_batches, pad_token_id
from specdraft.data.regen import GenerationSettings, TargetResponder
from specdraft.data.settings import THREADS, data_rules
from specdraft.data.target import Target, check_target_family
from specdraft.system.checks import at_least, check_settings
from specdraft.system.errors import hydra_command
from specdraft.system.files import write_json_atomic
from specdraft.system.hardware import start

log = logging.getLogger(__name__)


# specdraft-prepare settings (conf/prepare.yaml and its groups), checked before the target loads.
PREPARE_SETTINGS = {
    **data_rules(),
    "sample_conversations": at_least(1),
    "batch_tokens": at_least(1),
    "top_k": at_least(0),
    "threads": THREADS,
    "chat_check.max_new_tokens": at_least(1),
}


@hydra_command("specdraft-prepare", "prepare")
def main(cfg: DictConfig) -> None:
    check_settings(cfg, PREPARE_SETTINGS)
    start("specdraft-prepare", cfg.threads, cfg.target)
    check_target_family(cfg.target)
    started = time.perf_counter()
    target: Target = instantiate(cfg.target)
    load_seconds = time.perf_counter() - started
    log.info(
        "target %s (%s, %s) loaded in %.1f s",
        target.spec.name,
        target.spec.revision,
        target.spec.dtype,
        load_seconds,
    )

    source = instantiate(cfg.data.source)
    train, heldout = split_conversations(source.conversations, cfg.data.heldout_fraction, cfg.data.split_seed)
    log.info("split: %d train, %d held-out conversations", len(train), len(heldout))

    sample = train[: cfg.sample_conversations]
    tokenized, token_report = tokenize_conversations(
        target.tokenizer, sample, cfg.data.max_length, cfg.progress
    )
    throughput = measure_feature_throughput(target, tokenized, cfg.batch_tokens, cfg.top_k, cfg.progress)
    greedy = TargetResponder(
        target,
        GenerationSettings(temperature=0.0, top_p=1.0, max_new_tokens=cfg.chat_check.max_new_tokens, seed=0),
    )
    answer = greedy([[{"role": "user", "content": cfg.chat_check.prompt}]], seed=0)[0]
    log.info("chat check: %r -> %r", cfg.chat_check.prompt, answer)

    report = {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "target": target.spec.to_dict(),
        "target_load_seconds": load_seconds,
        "read": source.report.to_dict(),
        "split": {"train": len(train), "heldout": len(heldout)},
        "tokenize_sample": token_report.to_dict(),
        "feature_throughput": throughput,
        "chat_check": {"prompt": cfg.chat_check.prompt, "answer": answer},
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
    }
    path = Path(cfg.paths.output_dir) / "report.json"
    write_json_atomic(path, report)
    print(
        f"\n{target.spec.name}: loaded in {load_seconds:.1f} s; "
        f"{source.report.kept} conversations from {source.report.records} records "
        f"({len(train)} train / {len(heldout)} held-out); "
        f"sample: {token_report.tokens} tokens, {token_report.loss_tokens} assistant; "
        f"features at {throughput['tokens_per_second']:.0f} tokens/s\nreport: {path}"
    )


def measure_feature_throughput(
    target: Target, tokenized: Sequence[TokenizedConversation], batch_tokens: int, top_k: int, progress: bool
) -> dict[str, float]:
    """Run feature extraction over ``tokenized`` in length-bucketed batches; tokens/s excludes padding."""
    batches = length_batches([len(t.input_ids) for t in tokenized], batch_tokens)
    pad_id = pad_token_id(target.spec)
    real_tokens = padded_tokens = 0
    seconds = 0.0
    bar = tqdm(
        total=sum(len(t.input_ids) for t in tokenized), desc="features", unit="tok", disable=not progress
    )
    for indices in batches:
        batch = collate([tokenized[i] for i in indices], pad_id)
        started = time.perf_counter()
        extract_features(target, batch, target.spec.aux_layer_ids, top_k=top_k)
        seconds += time.perf_counter() - started
        real_tokens += batch.num_tokens
        padded_tokens += batch.input_ids.numel()
        bar.update(batch.num_tokens)
    bar.close()
    return {
        "tokens": real_tokens,
        "padded_tokens": padded_tokens,
        "batches": len(batches),
        "seconds": seconds,
        "tokens_per_second": real_tokens / seconds if seconds else 0.0,
    }


if __name__ == "__main__":
    main()
