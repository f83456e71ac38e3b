"""What a reduced training vocabulary costs in acceptance, as JSON.

Trains one experiment twice on the same cached features for the same steps (same seed, same
batches): over the whole vocabulary, and with ``loss.<setting>=N`` (``draft_vocab_size``: every
step over the N most frequent assistant tokens; ``rollout_vocab_size``: rollout steps j >= 2 only).
Then evaluates both heads on the held-out cache twice: drafting over the whole vocabulary, and over
the N most frequent assistant tokens (what the decoder's shortlist of the same size drafts over).

    python scripts/vocab_acceptance.py --train-cache DIR --val-cache DIR --steps 100 --out vocab.json
    python scripts/vocab_acceptance.py … --experiment hass --setting rollout_vocab_size
    python scripts/vocab_acceptance.py … --steps 400 --reduced-steps 400 640   # + as long as the full one

A finished run is not trained again: a later call with more ``--reduced-steps`` trains only those.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from hydra import compose, initialize_config_module
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import open_dict

from specdraft.data.features import FeatureBatch
from specdraft.eval.load import load_head
from specdraft.train.cli import build_objective, train
from specdraft.train.objective import simulated_tau


def compose_train(run_dir: Path, overrides: list[str]):
    with initialize_config_module("specdraft.conf", version_base="1.3"):
        cfg = compose(
            "train", overrides=[*overrides, f"paths.output_dir={run_dir}"], return_hydra_config=True
        )
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg.hydra
    return cfg


def in_fp32(batch: FeatureBatch) -> FeatureBatch:
    """``batch`` with its floating-point features in fp32."""
    return FeatureBatch(
        **{
            k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in vars(batch).items()
        }
    )


def cache_name(path: str) -> str:
    """A feature cache as its run and split (``regen-512/train``), without the machine's paths."""
    return "/".join(Path(path).resolve().parts[-2:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--train-cache", required=True)
    parser.add_argument("--val-cache", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--experiment", default="eagle")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument(
        "--setting", choices=["draft_vocab_size", "rollout_vocab_size"], default="draft_vocab_size"
    )
    parser.add_argument(
        "--reduced-steps",
        type=int,
        nargs="+",
        help="steps of the reduced variant, one head each (default: --steps); e.g. the steps it makes in "
        "the time the full one takes",
    )
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0, help="of both runs (init, batches, noise)")
    parser.add_argument("--run-dir", type=Path, default=Path("outputs/vocab_acceptance"))
    args = parser.parse_args()

    common = [
        f"experiment={args.experiment}",
        "datamodule=cached",
        f"datamodule.train_cache={args.train_cache}",
        f"datamodule.val_cache={args.val_cache}",
        f"datamodule.max_batch_tokens={args.batch_tokens}",
        "logger=none",
        f"seed={args.seed}",  # the head's initialisation
        f"datamodule.seed={args.seed}",  # the batches' order and the feature noise
        "callbacks.progress.refresh_rate=0",
    ]
    reduced = f"{args.vocab} tokens"
    reduced_steps = args.reduced_steps or [args.steps]
    # The exact losses whatever the experiment's defaults (hass: rollout steps over 8,192 tokens);
    # the reduced variant changes only --setting.
    exact = ["loss.draft_vocab_size=null", "loss.rollout_vocab_size=null"]
    trained = {"full vocabulary": ("full", args.steps, exact)}
    for steps in reduced_steps:
        name = reduced if reduced_steps == [args.steps] else f"{reduced}, {steps} steps"
        trained[name] = (str(args.vocab), steps, [*exact, f"loss.{args.setting}={args.vocab}"])
    configs, heads = {}, {}
    for name, (label, steps, extra) in trained.items():
        seeded = f"-seed{args.seed}" if args.seed else ""  # seed 0: the names of runs before --seed
        run_dir = args.run_dir / f"{args.experiment}-{args.setting}-{label}-{steps}{seeded}"
        limits = [f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}"]
        configs[name] = compose_train(run_dir, [*common, *limits, *extra])
        summary = train(configs[name])
        heads[name] = {
            "overrides": extra,
            "steps": summary["global_step"],
            "train_tokens_per_s": summary["train_tokens_per_s"],
            "fit_seconds": summary["fit_seconds"],
            "checkpoint": str(run_dir / "checkpoints" / "last.ckpt"),
        }

    cfg = configs["full vocabulary"]
    target = instantiate(cfg.target)
    datamodule = instantiate(cfg.datamodule)(target=target)
    datamodule.setup("fit")
    # Both heads evaluated in fp32, whatever dtype the features were cached in.
    batches = [
        in_fp32(datamodule.features_for(batch, training=False)) for batch in datamodule.val_dataloader()
    ]
    drafting = {
        "full vocabulary": cfg,
        reduced: compose_train(args.run_dir, [*common, f"loss.draft_vocab_size={args.vocab}"]),
    }
    objectives = {name: build_objective(config.loss, target, datamodule) for name, config in drafting.items()}
    for name, entry in heads.items():
        head = load_head(entry["checkpoint"], target, torch.float32).eval()
        entry["evaluations"] = {}
        for objective_name, objective in objectives.items():
            matches = counts = None
            with torch.no_grad():
                for batch in batches:
                    out = objective(head, batch, train=False)
                    m = torch.tensor(out.matches, dtype=torch.float64)
                    c = torch.tensor(out.counts, dtype=torch.float64)
                    matches = m if matches is None else matches + m
                    counts = c if counts is None else counts + c
            accuracy = (matches / counts).tolist()
            entry["evaluations"][objective_name] = {"acc": accuracy, "sim_tau": simulated_tau(accuracy)}
            print(name, "drafting over", objective_name, accuracy, simulated_tau(accuracy), flush=True)
    result = {
        "description": (
            f"experiment={args.experiment}, loss.{args.setting}={args.vocab} against none, "
            f"{args.steps} steps (the reduced variant: {', '.join(map(str, reduced_steps))}) × "
            f"{args.batch_tokens}-token batches, seed {args.seed}, "
            f"train cache {cache_name(args.train_cache)}, held-out cache {cache_name(args.val_cache)}"
        ),
        "heads": heads,
    }
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
