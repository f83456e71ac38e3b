"""``specdraft-depth-acceptance``: how much acceptance a feature head loses at depth ≥ 2 because,
at decode time, it reads its OWN features: the gap HASS's context alignment is meant to close.

    specdraft-depth-acceptance outputs/results/train/eagle outputs/results/train/hass --out depth.json

(with several runs, each one's chain τ is also logged against the first's, with its interval)

For every held-out chain start (anchor) a, a greedy chain of ``depth`` drafts is simulated along
the held-out continuation, two ways:

* **own features**, as at decode time: draft step j runs at position a+j−1 and reads the head's
  step-(j−1) outputs there (the aligned rollout of :func:`specdraft.heads.rollout.rollout`,
  which the tests hold equal to the decoder's draft steps);
* **target features**, as plain EAGLE training assumes: step j reads the target's features up
  to a+j−1, i.e. it is step 1 at that position.

Step j is right when its argmax over the head's drafting vocabulary is the target's argmax
(over the whole vocabulary: a token outside the drafting vocabulary is a rejection, as when
decoding). Acceptance at depth j = P(step j right | steps 1..j−1 right), the bench's acceptance
per depth of a chain; chain τ = 1 + Σ_j Π_{i≤j} α_i. A step reads the data's token after its
position (teacher forcing); that is the token greedy decoding would have fed only where the
data token is the target's argmax, so a chain is followed only through such positions (on the
quickstart's self-distilled greedy answers, nearly all of them).

Each run dir is measured on its own held-out cache (``run_config.yaml``), with its own drafting
vocabulary (EAGLE-3's; a reduced training vocabulary ``loss.draft_vocab_size``, which is the
decoder's shortlist), from ``checkpoints/last.ckpt`` (the final weights) by default. The counts are
kept per held-out conversation (by sample id), so that :func:`paired_chain_bootstrap` can put a
confidence interval on one head's chain τ against another's measured on the same conversations.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import Tensor
from tqdm import tqdm

from specdraft.data.cache import token_hash
from specdraft.data.chat import assistant_token_counts, tokenize_conversations
from specdraft.data.conversations import select_conversations
from specdraft.data.features import FeatureBatch
from specdraft.data.target import Target
from specdraft.eval.bench import machine_info
from specdraft.eval.load import load_head
from specdraft.eval.report import BOOTSTRAP_SAMPLES, CONFIDENCE, percentile_interval
from specdraft.heads import FeatureHead
from specdraft.heads.interface import shift_left
from specdraft.heads.rollout import rollout
from specdraft.system.errors import user_errors
from specdraft.system.files import write_json_atomic
from specdraft.system.hardware import start
from specdraft.train.cli import build_objective, features_for_objective
from specdraft.train.objective import simulated_tau

log = logging.getLogger(__name__)

DEFAULT_DEPTH = 4
ARGMAX_CHUNK = 128  # positions per vocabulary-sized argmax (4 steps × 128 × 49k fp32 = 100 MB)


def shifted(x: Tensor, offset: int) -> Tensor:
    """x[:, a] <- x[:, a + offset] along dim 1 (False / 0 past the end)."""
    if offset == 0:
        return x
    return torch.cat([x[:, offset:], torch.zeros_like(x[:, :offset])], dim=1)


@dataclass
class ChainCounts:
    """Per sequence s (a held-out conversation) and depth j, both S×D long: attempts[s, j−1] chains
    of s that reached depth j; accepted[s, j−1] those whose step j was right."""

    attempts: Tensor
    accepted: Tensor

    @staticmethod
    def cat(parts: Sequence[ChainCounts]) -> ChainCounts:
        return ChainCounts(torch.cat([p.attempts for p in parts]), torch.cat([p.accepted for p in parts]))

    def acceptance(self) -> list[float | None]:
        """α_j over all sequences (None where no chain reached depth j)."""
        attempts, accepted = self.attempts.sum(0), self.accepted.sum(0)
        return [float(a) / float(n) if n else None for a, n in zip(accepted, attempts, strict=True)]


def chain_counts(right: Tensor, valid: Tensor, fed_ok: Tensor) -> ChainCounts:
    """Greedy chains from every anchor a, counted per sequence (row).

    right   D×B×T bool  step j (row j−1) at position p drafted the target's argmax for p+1
    valid   B×T  bool   position p is supervised (its next token is an assistant token)
    fed_ok  B×T  bool   the token a step at p+1 reads (the data's) is the target's argmax at p+1
    The chain from a reaches depth j when steps 1..j−1 were right at a..a+j−2, positions
    a..a+j−1 are valid and the tokens read at a+1..a+j−1 are the ones greedy decoding feeds.
    """
    depth = right.shape[0]
    through = torch.ones_like(valid)
    reachable = torch.ones_like(valid)
    attempts, accepted = [], []
    for j in range(1, depth + 1):
        reachable = reachable & shifted(valid, j - 1)
        if j > 1:
            reachable = reachable & shifted(fed_ok, j - 2)
        attempts.append((reachable & through).sum(-1))
        through = through & shifted(right[j - 1], j - 1)
        accepted.append((reachable & through).sum(-1))
    return ChainCounts(torch.stack(attempts, dim=-1), torch.stack(accepted, dim=-1))


@torch.no_grad()
def draft_argmax(head: FeatureHead, outputs: Tensor, vocab: Tensor | None) -> Tensor:
    """outputs S×N×H (layer outputs) -> S×N target ids of the draft's argmax over its drafting
    vocabulary (``vocab``: target ids of a reduced one for a head over the whole vocabulary)."""
    projection = head.vocab_projection(outputs)
    if vocab is not None and projection.draft_vocab is None:
        projection = projection.restricted_to(vocab)
    ids = torch.zeros(outputs.shape[:2], dtype=torch.long, device=outputs.device)
    for first in range(0, outputs.shape[1], ARGMAX_CHUNK):
        chunk = projection.inputs[:, first : first + ARGMAX_CHUNK]
        ids[:, first : first + ARGMAX_CHUNK] = torch.matmul(chunk, projection.weight.mT).argmax(-1)
    return projection.draft_vocab[ids] if projection.draft_vocab is not None else ids


@torch.no_grad()
def target_argmax(head: FeatureHead, batch: FeatureBatch, b: Tensor, q: Tensor) -> Tensor:
    """N: the target's argmax after positions (b, q), cached (top-1) or through its lm_head."""
    if batch.topk_ids is not None:
        return batch.topk_ids[b, q, 0]
    hidden = batch.hidden[b, q]
    ids = torch.zeros(hidden.shape[0], dtype=torch.long, device=hidden.device)
    for first in range(0, hidden.shape[0], ARGMAX_CHUNK):
        chunk = hidden[first : first + ARGMAX_CHUNK]
        ids[first : first + ARGMAX_CHUNK] = head.target_logits(chunk).argmax(-1)
    return ids


@torch.no_grad()
def batch_counts(
    head: FeatureHead, batch: FeatureBatch, depth: int, vocab: Tensor | None = None
) -> tuple[ChainCounts, ChainCounts]:
    """(own features, target features) chain counts of one batch, depths 1..``depth``."""
    inputs = batch.input_hidden if batch.input_hidden is not None else batch.hidden
    features = head.initial_features(inputs, batch.aux)
    outputs = rollout(head, features, batch.input_ids, depth, detach=True)

    valid = (shift_left(batch.loss_mask) * shift_left(batch.attention_mask)).bool()  # B×T
    b, p = valid.nonzero(as_tuple=True)
    wanted = target_argmax(head, batch, b, p + 1)  # the argmax for the token after p+1
    drafted = draft_argmax(head, torch.stack([out[b, p] for out in outputs]), vocab)  # D×N
    right = torch.zeros((depth, *valid.shape), dtype=torch.bool, device=valid.device)
    right[:, b, p] = drafted == wanted
    fed_ok = torch.zeros_like(valid)
    fed = shift_left(shift_left(batch.input_ids))  # x_{p+2}: what the step at p+1 reads
    fed_ok[b, p] = fed[b, p] == wanted
    own = chain_counts(right, valid, fed_ok)
    target = chain_counts(right[:1].expand(depth, -1, -1), valid, fed_ok)
    return own, target


def summarise(own: ChainCounts, target: ChainCounts) -> dict[str, Any]:
    """Per feature source: acceptance per depth, its counts and the chain τ, and the counts per
    sequence (S×D lists, in ``own``'s row order); and the gap per depth (target-feature acceptance
    − own-feature acceptance)."""
    result: dict[str, Any] = {}
    for name, counts in (("own_features", own), ("target_features", target)):
        acceptance = counts.acceptance()
        result[name] = {
            "acceptance_per_depth": acceptance,
            "attempts": counts.attempts.sum(0).tolist(),
            "accepted": counts.accepted.sum(0).tolist(),
            "chain_tau": simulated_tau([a or 0.0 for a in acceptance]),
            "attempts_per_conversation": counts.attempts.tolist(),
            "accepted_per_conversation": counts.accepted.tolist(),
        }
    result["gap_per_depth"] = [
        t - o if t is not None and o is not None else None
        for t, o in zip(
            result["target_features"]["acceptance_per_depth"],
            result["own_features"]["acceptance_per_depth"],
            strict=True,
        )
    ]
    return result


def measure_run(
    run_dir: Path, checkpoint: Path | None, depth: int, device: str | None = None
) -> dict[str, Any]:
    """Chain acceptance per depth of a training run's head on its held-out cache (the target on
    ``device``, default the run's)."""
    config_path = run_dir / "run_config.yaml"
    if not config_path.is_file():
        raise SystemExit(f"{run_dir}: no run_config.yaml (not a specdraft-train run dir)")
    cfg = OmegaConf.load(config_path)
    if device is not None:
        cfg.target.device = device
    checkpoint = checkpoint or run_dir / "checkpoints" / "last.ckpt"
    if not checkpoint.exists():  # a .ckpt file or a native export's directory
        raise SystemExit(f"{run_dir}: no checkpoint {checkpoint}")
    features_for_objective(cfg)
    target = instantiate(cfg.target)
    train_counts = None
    train_cache = cfg.datamodule.get("train_cache")
    if cfg.datamodule.mode == "cached" and isinstance(train_cache, str) and not has_shards(Path(train_cache)):
        # Trained elsewhere (a GPU), its training features left behind: only a reduced training
        # vocabulary is read from them, and it is recounted from the conversations they were made of.
        if cfg.loss.get("draft_vocab_size"):
            log.info(
                "%s: %s has no shards here: its tokens are re-read from its plan", run_dir.name, train_cache
            )
            train_counts = planned_assistant_counts(Path(train_cache), target)
        cfg.datamodule.train_cache = cfg.datamodule.val_cache  # setup reads it; nothing else does
    sources = {"conversations": instantiate(cfg.data.source)} if cfg.datamodule.mode == "online" else {}
    datamodule = instantiate(cfg.datamodule)(target=target, num_workers=0, **sources)
    datamodule.setup("validate")
    head = load_head(checkpoint, target, dtype=torch.float32)
    if not isinstance(head, FeatureHead):
        raise SystemExit(
            f"{run_dir}: a {type(head).__name__} reads no features of its own (EAGLE-kind heads only)"
        )
    vocab = build_objective(cfg.loss, target, datamodule, train_counts, rollout=False).draft_vocab
    loader = datamodule.val_dataloader()
    # The loader's rows in order (it does not shuffle held-out data): each row's conversation.
    sample_ids = loader.dataset.sample_ids
    conversations = [sample_ids[index] for rows in loader.batch_sampler for index in rows]
    own, target_counts = [], []
    for batch in tqdm(loader, desc=run_dir.name, unit="batch"):
        batch = datamodule.features_for(batch.to(target.device), training=False)
        for name in ("hidden", "aux", "input_hidden"):
            value = getattr(batch, name)
            if value is not None:
                setattr(batch, name, value.float())
        batch_own, batch_target = batch_counts(head, batch, depth, vocab)
        own.append(batch_own)
        target_counts.append(batch_target)
    if not own:
        raise SystemExit(f"{run_dir}: its validation split ({cfg.datamodule.get('val_cache')}) has no batch")
    return {
        "run": run_dir.name,
        "checkpoint": str(checkpoint),
        "val_cache": cfg.datamodule.get("val_cache"),
        "conversations": conversations,
        **summarise(ChainCounts.cat(own), ChainCounts.cat(target_counts)),
    }


def has_shards(cache: Path) -> bool:
    """Whether every shard a feature cache's plan.json names is on this machine."""
    plan = json.loads((cache / "plan.json").read_text())
    return all((cache / f"{shard['name']}.safetensors").is_file() for shard in plan["shards"])


def planned_assistant_counts(cache: Path, target: Target) -> Tensor:
    """V int64: the assistant-token counts of a feature cache (what a reduced training vocabulary
    is chosen from) without its shards: its conversations re-read from the source its plan.json
    names and tokenized again, checked against the plan's token hash."""
    plan = json.loads((cache / "plan.json").read_text())
    described = plan["source"]
    if "captured_by" in described:
        raise SystemExit(
            f"{cache}: its features were captured during regeneration ({described['regen']}), on the ids "
            "generated: only its shards hold its tokens, and they are not on this machine"
        )
    source = instantiate(described["data"]["source"])
    conversations, _ = select_conversations(
        source.conversations, described["data"], described["split"], described["limit"]
    )
    samples, _ = tokenize_conversations(
        target.tokenizer, conversations, described["data"]["max_length"], progress=False
    )
    if token_hash(samples) != plan["token_hash"]:
        raise SystemExit(
            f"{cache}: its source ({described['data']['source']}) no longer tokenizes to the tokens "
            "the cache was made of (token_hash differs): its training vocabulary cannot be recounted"
        )
    return assistant_token_counts(samples, target.spec.vocab_size)


def paired_chain_bootstrap(
    run: dict[str, Any],
    reference: dict[str, Any],
    source: str = "own_features",
    samples: int = BOOTSTRAP_SAMPLES,
    seed: int = 0,
    confidence: float = CONFIDENCE,
) -> dict[str, Any]:
    """Chain τ of ``run`` against ``reference`` (two :func:`measure_run` results) on the held-out
    conversations both were measured on, with percentile-bootstrap intervals paired by conversation.

    Each resample draws conversations with replacement, sums both heads' counts over them and
    recomputes α per depth and chain τ from the sums, as the whole-sample τ is computed (a depth no
    resampled chain reached adds nothing). Returns ``{"conversations", "chain_tau",
    "chain_tau_reference", "difference", "ratio"}``, the last two ``{"estimate", "low", "high"}``."""
    for name, measured in (("run", run), ("reference", reference)):
        if "conversations" not in measured:
            raise ValueError(
                f"{name} {measured.get('run')!r} has no per-conversation counts "
                "(measured before they were kept: measure it again)"
            )
    rows = {conversation: i for i, conversation in enumerate(reference["conversations"])}
    shared = [(i, rows[c]) for i, c in enumerate(run["conversations"]) if c in rows]
    if not shared:
        raise ValueError(f"{run.get('run')!r} and {reference.get('run')!r} share no held-out conversation")
    mine, theirs = (torch.tensor(index) for index in zip(*shared, strict=True))

    def counts(measured: dict[str, Any], index: Tensor) -> Tensor:  # N×2×D: attempts, accepted
        by_source = measured[source]
        per_row = [by_source["attempts_per_conversation"], by_source["accepted_per_conversation"]]
        return torch.tensor(per_row, dtype=torch.float64)[:, index].transpose(0, 1)

    paired = torch.stack([counts(run, mine), counts(reference, theirs)], dim=1)  # N×2(heads)×2×D
    generator = torch.Generator().manual_seed(seed)
    drawn = paired[torch.randint(len(shared), (samples, len(shared)), generator=generator)].sum(dim=1)

    def chain_tau(totals: Tensor) -> Tensor:  # …×2×D -> …
        attempts, accepted = totals.unbind(-2)
        alpha = torch.where(attempts > 0, accepted / attempts.clamp(min=1), 0.0)
        return 1 + alpha.cumprod(-1).sum(-1)

    tau, tau_reference = chain_tau(paired.sum(dim=0)).unbind(-1)
    resampled, resampled_reference = chain_tau(drawn).unbind(-1)
    return {
        "conversations": len(shared),
        "chain_tau": float(tau),
        "chain_tau_reference": float(tau_reference),
        "difference": percentile_interval(tau - tau_reference, resampled - resampled_reference, confidence),
        "ratio": percentile_interval(tau / tau_reference, resampled / resampled_reference, confidence),
    }


@user_errors("specdraft-depth-acceptance")
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", type=Path, help="specdraft-train run dirs")
    parser.add_argument(
        "--checkpoint",
        type=Path,
        help="with ONE run: this checkpoint (or a native export) instead of last.ckpt",
    )
    parser.add_argument(
        "--device", help="the target's device (default: the run's; e.g. cpu for a head trained on a GPU)"
    )
    parser.add_argument("--depth", type=int, default=DEFAULT_DEPTH)
    parser.add_argument("--out", type=Path, required=True, help="the JSON to write")
    args = parser.parse_args(argv)
    if args.depth < 1:
        parser.error(f"--depth must be >= 1, got {args.depth}")
    if args.checkpoint and len(args.runs) > 1:
        parser.error("--checkpoint names one run's checkpoint: give one run dir")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start("specdraft-depth-acceptance")
    results = {}
    for run_dir in args.runs:
        results[run_dir.name] = measure_run(run_dir, args.checkpoint, args.depth, args.device)
        own, target = results[run_dir.name]["own_features"], results[run_dir.name]["target_features"]
        log.info(
            "%s: acceptance per depth, own features %s, target features %s",
            run_dir.name,
            [round(a, 3) if a is not None else None for a in own["acceptance_per_depth"]],
            [round(a, 3) if a is not None else None for a in target["acceptance_per_depth"]],
        )
    write_json_atomic(args.out, {"depth": args.depth, "machine": machine_info(), "runs": results})
    first, *others = results.values()
    for run in others:
        if set(run["conversations"]) & set(first["conversations"]):
            ratio = paired_chain_bootstrap(run, first)["ratio"]
            log.info(
                "%s: own-feature chain τ ÷ %s's %.3f [%.3f, %.3f] (%.0f %% bootstrap over conversations)",
                run["run"],
                first["run"],
                ratio["estimate"],
                ratio["low"],
                ratio["high"],
                100 * CONFIDENCE,
            )


if __name__ == "__main__":
    main()
