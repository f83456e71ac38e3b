"""``specdraft-cache``: target features for one split of a conversation source, on disk.

specdraft-cache                                       # SmolLM2 over bundled ShareGPT (train split)
specdraft-cache limit=200 aux_layers=true top_k=10    # first 200 conversations, EAGLE-3 + HASS fields
specdraft-cache rank=1 world_size=4                   # this machine's quarter of the shards
specdraft-cache mode=validate out_dir=outputs/features/…

Each rank holds its own lock on ``out_dir`` (``.<name>.rank-<r>.lock``, system/locks.py): ranks
of one cache run at once, two runs of one rank are refused.
"""

from __future__ import annotations

import logging

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from specdraft.data.cache import StoredFields, finalize_manifest, validate_cache, write_cache
from specdraft.data.chat import tokenize_conversations
from specdraft.data.conversations import select_conversations
from specdraft.data.packed_linear import pack_linear_weights
from specdraft.data.settings import SPLITS, THREADS, data_rules
from specdraft.data.target import check_target_family
from specdraft.system.checks import at_least, check_settings, from_text, one_of, optional
from specdraft.system.errors import hydra_command
from specdraft.system.hardware import start
from specdraft.system.locks import output_lock

log = logging.getLogger(__name__)

# specdraft-cache settings (conf/cache.yaml and its groups), checked before anything is read or written.
CACHE_SETTINGS = {
    "mode": one_of("write", "validate"),
    "split": SPLITS,
    "limit": optional(at_least(1)),
    **data_rules(),
    "top_k": at_least(0),
    "shard_tokens": at_least(1),
    "batch_tokens": at_least(1),
    "rank": from_text(at_least(0)),
    "world_size": from_text(at_least(1)),
    "threads": THREADS,
}


@hydra_command("specdraft-cache", "cache")
def main(cfg: DictConfig) -> None:
    check_settings(cfg, CACHE_SETTINGS)
    start("specdraft-cache", cfg.threads, cfg.target)
    check_target_family(cfg.target)
    if cfg.mode == "validate":
        finalize_manifest(cfg.out_dir)
        manifest = validate_cache(cfg.out_dir)
        print(
            f"{cfg.out_dir}: {len(manifest['shards'])} shards, {manifest['num_samples']} samples, "
            f"{manifest['num_tokens']} tokens: all valid"
        )
        return
    # One lock per rank: the ranks of one cache run at once, each writing its own shards.
    with output_lock(cfg.out_dir, "specdraft-cache", part=f"rank-{cfg.rank}"):
        write(cfg)


def write(cfg: DictConfig) -> None:
    """Compute and write this rank's shards of ``cfg.out_dir`` (its manifest once all exist)."""
    source = instantiate(cfg.data.source)
    data = OmegaConf.to_container(cfg.data, resolve=True)
    conversations, description = select_conversations(source.conversations, data, cfg.split, cfg.limit)
    target = instantiate(cfg.target)
    if cfg.packed_weights:
        log.info("cache: %d linear layers pre-packed for oneDNN", pack_linear_weights(target.model))
    samples, token_report = tokenize_conversations(
        target.tokenizer, conversations, cfg.data.max_length, cfg.progress
    )
    if not samples:
        raise SystemExit(
            f"specdraft-cache: the {cfg.split} split of {cfg.data.source} has no conversation with an "
            f"assistant turn to cache ({len(source.conversations)} conversations read, "
            f"{len(conversations)} in the split); nothing written to {cfg.out_dir}"
        )

    fields = StoredFields(tuple(target.spec.aux_layer_ids) if cfg.aux_layers else (), cfg.top_k)
    manifest = write_cache(
        target,
        samples,
        cfg.out_dir,
        fields,
        description,
        cfg.shard_tokens,
        cfg.batch_tokens,
        int(cfg.rank),
        int(cfg.world_size),
        cfg.progress,
    )
    if manifest is None:
        print(f"rank {cfg.rank}: shards written to {cfg.out_dir}; other ranks still have shards to write")
    else:
        print(
            f"{cfg.out_dir}: {manifest['num_samples']} samples, {manifest['num_tokens']} tokens "
            f"({token_report.loss_tokens} assistant) in {len(manifest['shards'])} shards"
        )


if __name__ == "__main__":
    main()
