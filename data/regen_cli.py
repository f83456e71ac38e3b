"""``specdraft-regen``: the target's own answers to a conversation split, as JSONL.

specdraft-regen limit=1000                             # SmolLM2 re-answers 1,000 ShareGPT conversations
specdraft-regen generation.temperature=0.7 generation.top_p=0.9
specdraft-regen backend=openai openai.base_url=http://localhost:8000/v1 openai.model=my-model
specdraft-regen max_turns=1 features.dir=outputs/features/own features.top_k=10   # + captured feature caches
"""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from specdraft.data.cache import StoredFields
from specdraft.data.captured_cache import CapturedCacheWriter
from specdraft.data.conversations import select_conversations
from specdraft.data.packed_linear import pack_linear_weights
from specdraft.data.regen import (
    AutoBatch,
    GenerationSettings,
    OpenAIResponder,
    RegenReport,
    TargetResponder,
    regenerate,
    report_path,
    resolve_batch_size,
    resolve_chunk_size,
)
from specdraft.data.settings import SPLITS, THREADS, data_rules
from specdraft.data.target import check_target_family
from specdraft.system.checks import (
    at_least,
    check_settings,
    either,
    greater_than,
    in_range,
    integer,
    one_of,
    optional,
)
from specdraft.system.errors import hydra_command
from specdraft.system.files import write_json_atomic
from specdraft.system.hardware import start
from specdraft.system.locks import output_lock

log = logging.getLogger(__name__)


# specdraft-regen settings (conf/regen.yaml and its groups), checked before anything is read or written.
REGEN_SETTINGS = {
    "split": SPLITS,
    "limit": optional(at_least(1)),
    "max_turns": optional(at_least(1)),
    **data_rules(),
    "backend": one_of("target", "openai"),
    "generation.temperature": at_least(0, integer=False),
    "generation.top_p": in_range(0, 1, closed=(False, True)),
    "generation.max_new_tokens": at_least(1),
    "generation.seed": integer(),
    "batch_size": either(one_of("auto"), at_least(1)),
    "chunk_size": either(one_of("auto"), at_least(1)),
    "max_prompt_tokens": at_least(1),
    "auto.cpu_rows": at_least(1),
    "auto.gpu_memory_fraction": in_range(0, 1, closed=(False, True)),
    "auto.max_rows": at_least(1),
    "auto.chunk_batches": at_least(1),
    "auto.min_chunk": at_least(1),
    "features.top_k": at_least(0),
    "features.heldout_fraction": in_range(0, 1, closed=(True, False)),
    "features.split_seed": integer(),
    "openai.concurrency": at_least(1),
    "openai.timeout": greater_than(0),
    "openai.max_retries": at_least(0),
    "threads": THREADS,
}


@hydra_command("specdraft-regen", "regen")
def main(cfg: DictConfig) -> None:
    check_settings(cfg, REGEN_SETTINGS)
    check_openai_backend(cfg)
    # The output and the captured features' directory, each locked (system/locks.py).
    features = nullcontext() if cfg.features.dir is None else output_lock(cfg.features.dir, "specdraft-regen")
    with output_lock(cfg.out_path, "specdraft-regen"), features:
        regen(cfg)


def check_openai_backend(cfg: DictConfig) -> None:
    """With ``backend=openai``: the server's URL and the model it serves, before anything runs
    (the model's default, ``${target.name}``, is unset for a target config without a name)."""
    if cfg.backend != "openai":
        return
    if not cfg.openai.base_url:
        raise ValueError("backend=openai needs openai.base_url (e.g. http://localhost:8000/v1)")
    if not OmegaConf.select(cfg, "openai.model", throw_on_resolution_failure=False):
        raise ValueError(
            "backend=openai needs openai.model, the model the server serves (its default, the "
            "target's name, is not set by this target config)"
        )


def regen(cfg: DictConfig) -> None:
    """Regenerate (or resume) ``cfg.out_path`` (and its captured features) as configured."""
    start("specdraft-regen", cfg.threads, cfg.target)
    check_target_family(cfg.target)
    settings = GenerationSettings(**cfg.generation)
    source = instantiate(cfg.data.source)
    data = OmegaConf.to_container(cfg.data, resolve=True)
    conversations, description = select_conversations(source.conversations, data, cfg.split, cfg.limit)
    if not conversations:  # name the input: the output would otherwise be the only file named
        raise ValueError(
            f"{source.report.source}: no conversation to regenerate in the {cfg.split} split "
            f"({source.report.records} records read, {source.report.kept} kept); expected conversations "
            "with a user turn and an assistant turn (data.source)"
        )
    if cfg.features.dir is not None and cfg.backend != "target":
        raise ValueError("features.dir: features are captured by the target backend only (backend=target)")
    writer = None
    batch_size = None  # rows per target batch (the target backend only)
    if cfg.backend == "target":
        target = instantiate(cfg.target)
        if cfg.packed_weights:
            log.info("regen: %d linear layers pre-packed for oneDNN", pack_linear_weights(target.model))
        rules = AutoBatch(**cfg.auto)
        batch_size = resolve_batch_size(
            cfg.batch_size, target.spec, target.device, cfg.max_prompt_tokens, rules
        )
        chunk_size = resolve_chunk_size(cfg.chunk_size, batch_size, rules)
        log.info("regen: %d rows per batch (batch_size %s), %d conversations per chunk (chunk_size %s)",
                 batch_size, cfg.batch_size, chunk_size, cfg.chunk_size)  # fmt: skip
        fields = None
        if cfg.features.dir is not None:
            aux = tuple(target.spec.aux_layer_ids) if cfg.features.aux_layers else ()
            fields = StoredFields(aux, cfg.features.top_k)
            writer = CapturedCacheWriter(
                {split: Path(cfg.features.dir) / split for split in ("train", "heldout")},
                target,
                fields,
                cfg.features.heldout_fraction,
                cfg.features.split_seed,
                {"regen": str(cfg.out_path), "conversations": description},
            )
        responder = TargetResponder(target, settings, batch_size, cfg.max_prompt_tokens, fields)
    elif cfg.backend == "openai":
        chunk_size = resolve_chunk_size(cfg.chunk_size, cfg.openai.concurrency, AutoBatch(**cfg.auto))
        api_key = os.environ.get(cfg.openai.api_key_env) if cfg.openai.api_key_env else None
        responder = OpenAIResponder(
            cfg.openai.base_url,
            cfg.openai.model,
            settings,
            api_key,
            cfg.openai.concurrency,
            cfg.openai.timeout,
            cfg.openai.max_retries,
        )
    else:
        raise ValueError(f"backend must be 'target' or 'openai', got {cfg.backend!r}")

    Path(cfg.out_path).parent.mkdir(parents=True, exist_ok=True)
    report = regenerate(
        conversations,
        responder,
        cfg.out_path,
        settings,
        description,
        chunk_size,
        cfg.progress,
        cfg.max_turns,
        writer,
    )
    report_run(cfg, report, len(conversations), batch_size, chunk_size)


def report_run(
    cfg: DictConfig, report: RegenReport, conversations: int, rows: int | None, chunk_size: int
) -> None:
    """Write the run's report as JSON beside its output (also of a run that answered nothing: what
    a measurement reads, scripts/results.py), then refuse an empty output or print the summary."""
    numbers = {**asdict(report), "tokens_per_s": report.tokens_per_s, "rows": rows, "chunk_size": chunk_size}
    write_json_atomic(report_path(cfg.out_path), numbers)
    if not Path(cfg.out_path).stat().st_size:
        raise SystemExit(
            f"specdraft-regen: no conversation of the {conversations} was answered (every first "
            f"answer empty or every prompt longer than max_prompt_tokens={cfg.max_prompt_tokens}); "
            f"{cfg.out_path} is empty"
        )
    print(
        f"{cfg.out_path}: {report.written} conversations written this run ({report.turns_answered} turns "
        f"answered, {report.turns_dropped} dropped; {report.generated_tokens} tokens in "
        f"{report.seconds:.0f} s = {report.tokens_per_s:.1f} tokens/s); report: {report_path(cfg.out_path)}"
    )


if __name__ == "__main__":
    main()
