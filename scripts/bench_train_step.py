"""Training-step throughput of every head kind on the same cached features, as JSON.

One process composes `specdraft-train`'s own config for each variant (experiment=…,
datamodule=cached), builds its head, objective and optimiser as the entry point does, and times
whole optimiser steps (objective forward + backward + AdamW step) and validation steps (the
objective at ``train=False`` under ``no_grad``) on the same batches, the variants interleaved
batch by batch so that a machine's drift hits all of them alike. Lightning's loop and the data
loader are left out: they are the same for every head, and this measures what the head costs.

    python scripts/bench_train_step.py --train-cache DIR --val-cache DIR --out bench.json
    PYTHONPATH=/path/to/other/checkout python scripts/bench_train_step.py …   # another version

Reports per variant the median training and validation tokens/s (real tokens of the batch, as
``train/tokens`` counts them), and the machine (CPU model and flags, threads, precision).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate

from specdraft.system.hardware import detect_hardware, start
from specdraft.train.cli import build_training_head
from specdraft.train.losses import LossWeights
from specdraft.train.objective import DraftObjective, RolloutConfig

# ``++loss.rollout_vocab_size`` pins the rollout steps' vocabulary whatever an experiment's default
# (and adds the key for checkouts older than it, which ignore it).
FULL_ROLLOUT = "++loss.rollout_vocab_size=null"
ROLLOUT_8K = "++loss.rollout_vocab_size=8192"
VARIANTS = {
    "quickstart": ["experiment=quickstart"],  # EAGLE with the 8,192-token training vocabulary
    # ... distilling the target's whole distribution (soft CE) instead of its cached top-10
    "quickstart_softce": ["experiment=quickstart", "loss.weights.soft_ce=0.02", "loss.weights.topk=0"],
    "eagle": ["experiment=eagle"],
    "hass": ["experiment=hass", FULL_ROLLOUT],
    "eagle3": ["experiment=eagle3", FULL_ROLLOUT],
    "hass_eagle3": ["experiment=hass_eagle3", FULL_ROLLOUT],
    "medusa": ["experiment=medusa"],
    # Reduced training vocabularies (the decoder's default shortlist is 8,192 tokens too).
    "eagle_v8k": ["experiment=eagle", "loss.draft_vocab_size=8192"],
    "hass_v8k": ["experiment=hass", "loss.draft_vocab_size=8192", FULL_ROLLOUT],
    "medusa_v8k": ["experiment=medusa", "loss.draft_vocab_size=8192"],
    "eagle3_v8k": ["experiment=eagle3", "head.config.draft_vocab_size=8192", FULL_ROLLOUT],
    "hass_eagle3_v8k": ["experiment=hass_eagle3", "head.config.draft_vocab_size=8192", FULL_ROLLOUT],
    # Rollout steps j >= 2 over the 8,192 most frequent tokens, step 1 over the whole vocabulary
    # (the defaults of experiments hass, eagle3 and hass_eagle3 since they exist).
    "hass_r8k": ["experiment=hass", ROLLOUT_8K],
    "eagle3_r8k": ["experiment=eagle3", ROLLOUT_8K],
    "hass_eagle3_r8k": ["experiment=hass_eagle3", ROLLOUT_8K],
    # DFlash block drafters: the default (5 layers, blocks of 16), fewer layers, blocks of 8
    # (decay exp(−1/4), the paper's γ for 8).
    "dflash": ["experiment=dflash"],
    "dflash_l2": ["experiment=dflash", "head.config.num_layers=2"],
    "dflash_b8": ["experiment=dflash", "head.config.block_size=8", "loss.rollout.step_weight_base=0.7788"],
    "dflash_v8k": ["experiment=dflash", "loss.draft_vocab_size=8192"],
    "dflash_l2_v8k": ["experiment=dflash", "head.config.num_layers=2", "loss.draft_vocab_size=8192"],
}
BASE_VARIANTS = ["eagle", "hass", "eagle3", "hass_eagle3", "medusa"]


def build(name: str, overrides: list[str], args: argparse.Namespace):
    with initialize_config_module(config_module="specdraft.conf", version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=[
                *overrides,
                "datamodule=cached",
                f"datamodule.train_cache={args.train_cache}",
                f"datamodule.val_cache={args.val_cache}",
                f"datamodule.max_batch_tokens={args.batch_tokens}",
                "datamodule.num_workers=0",
                "datamodule.verify_cache=false",
                *args.override,
            ],
        )
    try:  # what the entry point asks of the datamodule for this objective
        from specdraft.train.cli import features_for_objective

        features_for_objective(cfg)
    except ImportError:  # a checkout from before it
        pass
    target = instantiate(cfg.target)
    datamodule = instantiate(cfg.datamodule)(target=target)
    datamodule.setup("fit")
    head, _ = build_training_head(cfg.head, target, datamodule)
    try:  # the entry point's own builder (reduced training vocabularies, chunk size)
        from specdraft.train.cli import build_objective

        objective = build_objective(cfg.loss, target, datamodule)
    except ImportError:  # a checkout from before build_objective
        objective = DraftObjective(
            LossWeights(**cfg.loss.weights), RolloutConfig(**cfg.loss.rollout), cfg.loss.eval_steps
        )
    optimizer = instantiate(cfg.optim)(params=[p for p in head.parameters() if p.requires_grad])
    return cfg, head, objective, optimizer, datamodule


def batches(datamodule, count: int, training: bool):
    loader = datamodule.train_dataloader() if training else datamodule.val_dataloader()
    out = []
    for batch in loader:
        out.append(datamodule.features_for(batch, training))
        if len(out) == count:
            break
    return out


def cast(batch, dtype):
    if dtype is None:
        return batch
    for name in ("hidden", "aux", "input_hidden"):
        value = getattr(batch, name)
        if value is not None and value.dtype != dtype:
            setattr(batch, name, value.to(dtype))
    return batch


def checkout_commit() -> str:
    """The commit of the specdraft checkout imported (PYTHONPATH may point at another one)."""
    package = Path(build_training_head.__code__.co_filename).resolve().parent
    git = subprocess.run(["git", "-C", str(package), "rev-parse", "HEAD"], capture_output=True, text=True)
    return git.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--train-cache", required=True)
    parser.add_argument("--val-cache", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants", nargs="+", default=BASE_VARIANTS, choices=list(VARIANTS))
    parser.add_argument("--batches", type=int, default=4, help="timed training batches per variant")
    parser.add_argument("--repeats", type=int, default=2, help="passes over those batches")
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--label", default="", help="recorded as is (e.g. the checkout measured)")
    parser.add_argument("--override", nargs="*", default=[], help="extra Hydra overrides for every variant")
    args = parser.parse_args()

    startup = start("bench_train_step", args.threads, {"dtype": "auto"}, "auto", "cpu")
    precision = startup.precision
    autocast = (
        (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision.startswith("bf16") else nullcontext
    )
    runs = {}
    for name in args.variants:
        _, head, objective, optimizer, datamodule = build(name, VARIANTS[name], args)
        # As the training module feeds the objective: bf16-mixed takes the features as they are
        # (autocast casts), full precision needs them in the head's parameter dtype.
        dtype = None if precision.startswith("bf16") else next(head.parameters()).dtype
        train = [cast(b, dtype) for b in batches(datamodule, args.batches, training=True)]
        val = [cast(b, dtype) for b in batches(datamodule, 2, training=False)]
        record = {"experiment": VARIANTS[name], "train_ms": [], "val_ms": [], "tokens": []}
        runs[name] = {
            "head": head,
            "objective": objective,
            "optimizer": optimizer,
            "train": train,
            "val": val,
        }
        runs[name]["record"] = record

    def train_step(run, batch):
        with autocast():
            out = run["objective"](run["head"], batch, train=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(run["head"].parameters(), 0.5)
        run["optimizer"].step()
        run["optimizer"].zero_grad(set_to_none=True)

    def val_step(run, batch):
        with torch.no_grad(), autocast():
            run["objective"](run["head"], batch, train=False)

    for run in runs.values():  # warm-up: allocator, one-off caches
        train_step(run, run["train"][0])
        val_step(run, run["val"][0])
    for _ in range(args.repeats):
        for index in range(args.batches):
            for run in runs.values():
                if index >= len(run["train"]):
                    continue
                batch = run["train"][index]
                began = time.perf_counter()
                train_step(run, batch)
                run["record"]["train_ms"].append(1e3 * (time.perf_counter() - began))
                run["record"]["tokens"].append(int(batch.attention_mask.sum()))
        for run in runs.values():
            for batch in run["val"]:
                began = time.perf_counter()
                val_step(run, batch)
                elapsed_ms = 1e3 * (time.perf_counter() - began)
                run["record"]["val_ms"].append((elapsed_ms, int(batch.attention_mask.sum())))

    hardware = detect_hardware("cpu")
    result = {
        "label": args.label,
        "commit": checkout_commit(),
        "machine": {**hardware.record(), "threads": torch.get_num_threads(), "torch": torch.__version__},
        "precision": precision,
        "batch_tokens": args.batch_tokens,
        "variants": {},
    }
    for name, run in runs.items():
        record = run["record"]
        train_rates = [t / (ms / 1e3) for t, ms in zip(record["tokens"], record["train_ms"], strict=True)]
        val_rates = [t / (ms / 1e3) for ms, t in record["val_ms"]]
        result["variants"][name] = {
            **record,
            "train_tokens_per_s": statistics.median(train_rates),
            "val_tokens_per_s": statistics.median(val_rates),
        }
        print(
            f"{name:>12}  train {statistics.median(train_rates):8.1f} tok/s"
            f"  val {statistics.median(val_rates):8.1f} tok/s"
        )
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
