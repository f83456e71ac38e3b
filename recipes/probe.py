"""The quickstart's probe: a few seconds of each stage's own work on this machine, as rates.

:func:`probe` runs each stage's code on the stage's own config — the target answering a batch of
real prompts, its features over a few thousand tokens, a few optimizer steps, a validation batch
of the experiment's head, and the eval's target decoding one token and verifying each of its
trees — and records seconds per unit of work (:class:`Throughput`), from which
:mod:`specdraft.recipes.budget` sizes the stages. Where a few seconds of work would mislead
(fixed costs, padding, a prefill per row), the probe converts to what a whole stage does; each
conversion says what it was measured against.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig

from specdraft.data.attention import use_grouped_query_attention
from specdraft.data.cache import StoredFields, write_cache
from specdraft.data.capture import FeatureCapture
from specdraft.data.chat import TokenizedConversation, tokenize_conversations
from specdraft.data.conversations import Conversation, split_conversations
from specdraft.data.features import length_batches, pad_token_id
from specdraft.data.generate import greedy_generate
from specdraft.data.packed_linear import pack_linear_weights
from specdraft.data.regen import AutoBatch, GenerationSettings, TargetResponder, resolve_batch_size
from specdraft.data.target import Target
from specdraft.eval.autoshape import VerifyLatency, probe_verify_latency
from specdraft.eval.runner import TargetRunner
from specdraft.system.hardware import resolve_precision
from specdraft.train.cli import build_objective, build_training_head, features_for_objective
from specdraft.train.module import DraftHeadModule

# What every stage imports before it does anything (the heaviest stage's modules).
STAGE_IMPORTS = "import specdraft.train.cli, specdraft.eval.cli"
PROBE_CONVERSATIONS = 256  # read for the probe: enough prompts to fill a regeneration batch
PROBE_VAL_BATCHES = 2
PROBE_WARMUP_TOKENS = 8  # prompt tokens per row of the regeneration probe's warm-up
PROBE_PREFILL_PROMPTS = 8  # prompts whose prefill the regeneration probe times, one at a time
PROBE_CACHE_FIXED_SHARE = 0.5  # above this share of the probe's write, its fixed cost is not taken out
# Positions a cache stage computes per token: its hundreds of conversations fill length buckets
# closely (80,105 positions for 71,639 tokens: 250 of SmolLM2's own answers at 8k-token batches;
# 1.04–1.09 per shard of a 45-minute quickstart's 1,200–1,600), where the probe's ~8k tokens fall
# into two or three buckets padded ×1.5–1.6. Kept at 250 answers' 1.12: with it the probe of
# answered turns read 1,265–1,273 tokens/s where two stages that day wrote ~1,180 (AMD EPYC with
# AVX-512-bf16), nearer than that machine's own pace held from one hour to the next (±12 %).
CACHE_STAGE_PADDING = 1.12
EVAL_PROBE_PAST = 256  # tokens before the eval probe's forwards: a prompt and part of an answer
EVAL_PROBE_REPEATS = 3  # forwards timed per node count after a warm-up (the median counts)


@dataclass(frozen=True)
class ProbeSettings:
    """How much work the probe does per stage (conf/quickstart.yaml ``budget.probe``)."""

    regen_new_tokens: int  # decoding steps timed for regeneration (besides one prefill step)
    cache_tokens: int  # tokens of features computed (and then trained on)
    train_steps: int  # optimizer steps, timed start to start: the first and the last are not

    def __post_init__(self) -> None:
        if self.regen_new_tokens < 2 or self.train_steps < 3:
            raise ValueError(
                "budget.probe: regen_new_tokens must be >= 2 (the first step is not timed) and "
                "train_steps >= 3 (timed start to start, the first is not timed and the last has no "
                f"next start), got {self.regen_new_tokens} and {self.train_steps}"
            )


@dataclass(frozen=True)
class Throughput:
    """Seconds per unit of work of each stage on this machine, as :func:`probe` measured them.

    Regeneration (None without self-distillation): ``regen_prefill_s`` per answered prompt,
    ``regen_step_s`` per decoding step of ``regen_rows`` rows, ``answered_fraction`` of the
    first user turns short enough to answer, ``prompt_tokens`` their mean length."""

    startup_s: float  # one stage's start: Python imports, the target, the conversations
    regen_rows: int
    regen_prefill_s: float | None
    regen_step_s: float | None
    answered_fraction: float
    prompt_tokens: float
    conversation_tokens: float  # mean tokens of one cached conversation of the source as it is
    source_conversations: int  # what the source holds: no plan asks for more
    cache_tokens_per_s: float
    # Training and validation cost follows the padded batch (B × T positions), which the
    # length-bucketed sampler fills up to max_batch_tokens; the probe's few batches are smaller,
    # so its median step is scaled to a full batch (fixed costs scaled too: conservative).
    train_step_s: float  # one optimizer step of a full batch
    train_batch_positions: int  # datamodule.max_batch_tokens
    val_positions_per_s: float
    probe_s: float  # what the probe itself took
    # The eval's target as specdraft-eval runs it (None: not probed): one plain decoding step and
    # one verification of each probed node count after a fixed past, as [nodes, seconds] pairs.
    eval_plain_s: float | None = None
    eval_verify_s: list[list[float]] | None = None

    def record(self) -> dict[str, Any]:
        return asdict(self)


def probe(
    data_cfg: DictConfig,
    train_cfg: DictConfig,
    cache_fields: StoredFields,
    cache_batch_tokens: int,
    settings: ProbeSettings,
    regen_cfg: DictConfig | None = None,
    answer_tokens: int | None = None,
    eval_nodes: Sequence[int] = (),
) -> Throughput:
    """Time a few seconds of each stage's own work on this machine.

    data_cfg: a stage config with the target and the conversation source the quickstart reads
    (``target``, ``data``); regen_cfg: the composed specdraft-regen config (None without
    self-distillation: the source's conversations are cached as they are); train_cfg: the
    composed specdraft-train config (its ``datamodule`` caches are replaced by the probe's);
    answer_tokens: the answers' expected length (self-distillation: the source's answers are cut
    to it); eval_nodes: the node counts of the eval's trees, whose verification is timed with a
    plain decoding step on the target as the eval runs it (none: not timed)."""
    started = time.perf_counter()
    imports_s = _time_imports()
    load_started = time.perf_counter()
    target: Target = instantiate(data_cfg.target)
    source = instantiate(data_cfg.data.source)
    # Every stage loads the target and most read the conversations (eval: its shortlist's).
    startup_s = imports_s + time.perf_counter() - load_started
    split, _ = split_conversations(
        source.conversations, data_cfg.data.heldout_fraction, data_cfg.data.split_seed
    )  # what specdraft-regen's `limit` counts
    train = cached = split
    if regen_cfg is not None:  # what the quickstart caches: the first turns regeneration answers
        train = [c for c in map(first_turn, split) if c is not None]
        responder = TargetResponder(
            target, GenerationSettings(**regen_cfg.generation), max_prompt_tokens=regen_cfg.max_prompt_tokens
        )
        cached = answered_turns(train, responder, PROBE_CONVERSATIONS)
    samples, _ = tokenize_conversations(
        target.tokenizer, cached[:PROBE_CONVERSATIONS], data_cfg.data.max_length, False
    )
    if answer_tokens is not None:
        # Regenerated answers are shorter than ShareGPT's: features and training batches of
        # sequences as long as the real ones (attention and padding grow with the length).
        samples = [answer_cut(sample, answer_tokens) for sample in samples]
    if not samples:
        raise ValueError(f"probe: {data_cfg.data.source} has no conversation with an answer to probe with")

    with tempfile.TemporaryDirectory(prefix="specdraft-probe-") as workdir:
        cache_dir = Path(workdir) / "features"
        cache_tokens_per_s = _probe_cache(
            target, samples, cache_fields, cache_batch_tokens, cache_dir, settings
        )
        train_step_s, batch_positions, val_positions_per_s = _probe_training(
            train_cfg, target, cache_dir, settings.train_steps, Path(workdir)
        )
    # Last: it packs the target's weights as specdraft-regen does, which the stages above do not.
    regen = _probe_regen(target, regen_cfg, train, settings) if regen_cfg is not None else None
    rows, prefill_s, step_s, answered, prompt_tokens = regen or (0, None, None, 1.0, 0.0)
    latency = _probe_eval(target, eval_nodes) if eval_nodes else None
    return Throughput(
        startup_s=round(startup_s, 2),
        regen_rows=rows,
        regen_prefill_s=prefill_s,
        regen_step_s=step_s,
        answered_fraction=answered,
        prompt_tokens=prompt_tokens,
        conversation_tokens=statistics.fmean(len(s.input_ids) for s in samples),
        source_conversations=len(split) if regen_cfg is not None else len(source.conversations),
        cache_tokens_per_s=round(cache_tokens_per_s, 1),
        train_step_s=round(train_step_s, 4),
        train_batch_positions=batch_positions,
        val_positions_per_s=round(val_positions_per_s, 1),
        probe_s=round(time.perf_counter() - started, 1),
        eval_plain_s=None if latency is None else round(latency.plain_s, 5),
        eval_verify_s=None if latency is None else [[n, round(v, 5)] for n, v in latency.verify_s.items()],
    )


def _probe_eval(target: Target, node_counts: Sequence[int]) -> VerifyLatency:
    """A plain decoding step and a verification of each of ``node_counts`` nodes, after a
    typical past, on the target as specdraft-eval runs it (packed weights, its attention)."""
    pack_linear_weights(target.model)  # 0 when specdraft-regen's probe packed them already
    use_grouped_query_attention(target.model)
    return probe_verify_latency(TargetRunner(target), node_counts, EVAL_PROBE_PAST, EVAL_PROBE_REPEATS)


def first_turn(conversation: Conversation) -> Conversation | None:
    """The conversation up to its first answer (what the quickstart regenerates and caches)."""
    roles = [m.role for m in conversation.messages]
    if "user" not in roles or "assistant" not in roles[roles.index("user") :]:
        return None
    end = roles.index("assistant", roles.index("user")) + 1
    return Conversation(conversation.id, conversation.messages[:end])


def answered_turns(
    turns: Sequence[Conversation], responder: TargetResponder, limit: int
) -> list[Conversation]:
    """The first ``limit`` of ``turns`` whose prompt leaves room for an answer: those specdraft-regen
    answers, so the only ones a self-distilled cache holds. The others (12 % of the first turns at
    regen.max_prompt_tokens=768) are long prompts, their answer a small part of them. With them the
    probe's samples averaged 399 tokens against a stage's 286, and it read 12,065–12,442 training
    positions/s and 958–1,033 cache tokens/s; without, 11,422–11,821 and 1,265–1,273, where the
    stages ran at ~10,000 and ~1,180 (AMD EPYC with AVX-512-bf16, run qs-padprobe-epyc)."""
    kept: list[Conversation] = []
    for turn in turns:
        if len(kept) == limit:
            break
        if responder.prompt_ids([{"role": "user", "content": first_user(turn)}]) is not None:
            kept.append(turn)
    return kept


def answer_cut(sample: TokenizedConversation, answer_tokens: int) -> TokenizedConversation:
    """``sample`` up to ``answer_tokens`` tokens after its first answer token."""
    end = sample.loss_mask.index(1) + answer_tokens
    return TokenizedConversation(sample.id, sample.input_ids[:end], sample.loss_mask[:end])


def first_user(conversation: Conversation) -> str:
    return next(m.content for m in conversation.messages if m.role == "user")


def _time_imports() -> float:
    """Seconds a fresh Python takes to import the stages' modules (each stage is a process)."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", STAGE_IMPORTS], check=True)
    return time.perf_counter() - started


def _probe_regen(
    target: Target, regen_cfg: DictConfig, conversations: list[Conversation], settings: ProbeSettings
) -> tuple[int, float, float, float, float]:
    """(rows, prefill seconds per prompt, seconds per decoding step of ``rows`` rows, answered
    fraction, mean prompt tokens): one batch of real prompts generating 1 + ``regen_new_tokens``
    tokens, every decoding step timed apart from the prefill before it; the prefill timed apart,
    one prompt at a time, as a continuous batch refills a row whose answer ended. (The batch's
    own prefill pads every prompt to the longest: on an AMX Xeon it put 0.31 s on each prompt,
    where the regeneration it planned spent at most 0.16 — 956 s instead of the 1,180 planned.)"""
    if regen_cfg.packed_weights:
        pack_linear_weights(target.model)
    rules, max_prompt_tokens = AutoBatch(**regen_cfg.auto), regen_cfg.max_prompt_tokens
    rows = resolve_batch_size(regen_cfg.batch_size, target.spec, target.device, max_prompt_tokens, rules)
    generation = GenerationSettings(**regen_cfg.generation)
    responder = TargetResponder(target, generation, rows, regen_cfg.max_prompt_tokens)
    candidates = conversations[: 4 * rows]
    prompts = [responder.prompt_ids([{"role": "user", "content": first_user(c)}]) for c in candidates]
    answered = [p for p in prompts if p is not None]
    if not answered:
        raise ValueError(f"probe: none of {len(prompts)} prompts fits regen.max_prompt_tokens")
    batch = answered[:rows]
    pad_id = pad_token_id(target.spec)
    never_stop: tuple[int, ...] = ()  # every row decodes every step, as in a full batch
    features = regen_cfg.features
    aux = tuple(target.spec.aux_layer_ids) if features.aux_layers else ()

    def capture() -> FeatureCapture | None:
        """What specdraft-regen keeps of each step when it captures the features."""
        return FeatureCapture(target.model, aux, features.top_k) if features.dir is not None else None

    # Warm-up at the batch's shapes (allocations, kernel choices) on short prompts: cheap. The
    # one-prompt prefills below take their median: the first pays for its own shapes.
    warmup = [p[:PROBE_WARMUP_TOKENS] for p in batch]
    greedy_generate(target.model, warmup, 2, never_stop, rows, pad_id, capture=capture())
    stamps: list[float] = []
    greedy_generate(
        target.model, batch, 1 + settings.regen_new_tokens, never_stop, rows, pad_id,
        on_step=lambda _: stamps.append(time.perf_counter()), capture=capture(),
    )  # fmt: skip
    step_s = statistics.median(b - a for a, b in pairwise(stamps))
    prefill_s = []
    for prompt in batch[:PROBE_PREFILL_PROMPTS]:
        started = time.perf_counter()
        # Not capturing: a capture adds a step feeding the answer's last token, at one row here
        # but in a stage a row's 1 step in ~110 of a full batch. Captured, the prefills probed 89
        # ms a prompt (run qs-capture-epyc, which then ran 5 minutes ahead of its ETA) against
        # 44-57 ms in the three runs before; the prefill's own capture is ~0.1 ms a prompt.
        greedy_generate(target.model, [prompt], 1, never_stop, 1, pad_id)  # its prefill and first token
        prefill_s.append(time.perf_counter() - started)
    return (
        len(batch),
        statistics.median(prefill_s),
        step_s,
        len(answered) / len(prompts),
        statistics.fmean(len(p) for p in answered),
    )


def _probe_cache(
    target: Target,
    samples: list[TokenizedConversation],
    fields: StoredFields,
    batch_tokens: int,
    out_dir: Path,
    settings: ProbeSettings,
) -> float:
    """Tokens per second of a cache stage, from specdraft-cache's own writer over ~``cache_tokens``
    tokens. Two things differ between the probe's few batches and a stage's hundreds:
    * the writer's fixed cost per cache (planning, the shard's file, its hash), which a single
      sample measures: a stage pays it once, the probe's 8k tokens would pay it per 8k;
    * padding: the target computes every position of a length bucket, and the probe's few
      buckets are padded ×1.5–1.6 where a stage's are ×:data:`CACHE_STAGE_PADDING`. Per padded
      position the two agreed (AMD EPYC, bf16: 1,346 and 1,320 per second), per token they did not
      (846 and 1,180; on an AMX Xeon 1,150 tokens/s over 8k tokens, ~1,660 in a 300k-token stage).
    So the probe times padded positions and converts them at the stage's padding. The cache
    written is what :func:`_probe_training` trains on."""
    chosen, tokens = [], 0
    for sample in samples:
        if tokens >= settings.cache_tokens:
            break
        chosen.append(sample)
        tokens += len(sample.input_ids)

    def positions(part: list[TokenizedConversation]) -> int:  # what the writer's batches compute
        lengths = [len(sample.input_ids) for sample in part]
        return sum(
            len(rows) * max(lengths[i] for i in rows) for rows in length_batches(lengths, batch_tokens)
        )

    def seconds_to_write(part: list[TokenizedConversation], where: Path) -> float:
        started = time.perf_counter()
        write_cache(target, part, where, fields, {"probe": True}, batch_tokens=batch_tokens, progress=False)
        return time.perf_counter() - started

    fixed_s = seconds_to_write(chosen[:1], out_dir.with_name(out_dir.name + "-fixed-cost"))
    total_s = seconds_to_write(chosen, out_dir)
    if len(chosen) < 2 or fixed_s > PROBE_CACHE_FIXED_SHARE * total_s:  # a difference too noisy to trust
        positions_per_s = positions(chosen) / total_s
    else:
        positions_per_s = (positions(chosen) - positions(chosen[:1])) / (total_s - fixed_s)
    return positions_per_s / CACHE_STAGE_PADDING


class _StepClock(L.Callback):
    """Wall seconds and padded positions (B × T) of every training step and validation batch.

    A training step is timed from its start to the next one's, as the real run spends it: the
    optimizer step, the end-of-step hooks, and fetching, transferring and transforming (noise) the
    next batch. Timed from its start to its own end instead, the probe read 0.48–0.50 s per
    4,096-position step on a 2-core AMX Xeon where the training stage then spent ~0.54 between
    its validations; start to start it reads 0.545–0.55. A validation between two steps is not
    part of the step (it is timed apart)."""

    def __init__(self) -> None:
        self.train: list[tuple[float, int]] = []
        self.val: list[tuple[float, int]] = []
        self._step: tuple[float, int] | None = None  # (start, positions) of the running step
        self._val_started = 0.0

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self._step is not None:
            started, positions = self._step
            self.train.append((now - started, positions))
        self._step = (now, batch.attention_mask.numel())

    def on_validation_start(self, trainer, module) -> None:
        self._step = None

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0) -> None:
        self._val_started = time.perf_counter()

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.val.append((time.perf_counter() - self._val_started, batch.attention_mask.numel()))


def _probe_training(
    train_cfg: DictConfig, target: Target, cache_dir: Path, steps: int, workdir: Path
) -> tuple[float, int, float]:
    """(median seconds of an optimizer step after the first, start to start, scaled to a full
    batch; the full batch's positions; validation positions/s): the experiment's head, objective,
    optimizer, precision and data loader on the probe's cache. ``steps`` >= 3: the first
    interval (the warm-up) is not timed, and the last step has no next start."""
    cfg = train_cfg.copy()
    cfg.datamodule.train_cache = cfg.datamodule.val_cache = str(cache_dir)
    features_for_objective(cfg)
    datamodule = instantiate(cfg.datamodule)(target=target)
    head, record = build_training_head(cfg.head, target, datamodule)
    objective = build_objective(cfg.loss, target, datamodule)
    module = DraftHeadModule(head, objective, instantiate(cfg.optim), head_record=record)
    accelerator = str(cfg.trainer.accelerator)
    clock = _StepClock()
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=1,
        precision=resolve_precision(cfg.trainer.precision, accelerator),
        max_steps=steps,
        val_check_interval=steps,  # counted across epochs: the probe's cache may hold fewer batches
        check_val_every_n_epoch=None,
        limit_val_batches=PROBE_VAL_BATCHES,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
        default_root_dir=workdir,
    )
    trainer.fit(module, datamodule=datamodule)
    full = int(cfg.datamodule.max_batch_tokens)
    timed = clock.train[1:] or clock.train
    val_s = sum(seconds for seconds, _ in clock.val)
    val_positions = sum(positions for _, positions in clock.val)
    return (
        statistics.median(seconds * full / positions for seconds, positions in timed),
        full,
        val_positions / val_s,
    )
