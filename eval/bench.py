"""The benchmark harness behind ``specdraft-eval`` and ``specdraft-bench``.

For every question, every temperature, every method (plain decoding first, then the others
in config order — interleaved, so machine load hits all methods alike), the question's turns
are answered one by one, each answer joining the chat before the next turn. One unit
(question × temperature, all methods) is appended to ``records.jsonl`` as ONE line once it is
complete, so a killed run resumes after its last complete unit, with no duplicates or holes.
At the end ``report.json`` (and the plots) are rewritten from all records.

``batch_sizes`` (:func:`run_batch_benchmark`): the questions' first turns decoded B at a time
(:mod:`specdraft.eval.batch`) for each batch size, every method on the same batch in turn; a
unit is one batch (batch size × batch × temperature, all methods).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
import zlib
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from specdraft.data.target import Target
from specdraft.eval.decode import Generation
from specdraft.eval.methods import Method
from specdraft.eval.prompts import Question
from specdraft.eval.report import plot, summarize, summarize_batches
from specdraft.eval.sampling import Sampling
from specdraft.system.files import (
    SettingsMismatch,
    append_durably,
    check_or_store_settings,
    cut_torn_tail,
    write_json_atomic,
)
from specdraft.system.hardware import detect_hardware

log = logging.getLogger(__name__)

RECORDS = "records.jsonl"
RUN_CONFIG = "run_config.json"
REPORT = "report.json"
TIME_BOX = "time_box.json"  # the clock of a time-boxed run, across resumes
WARMUP_QUESTIONS = 1  # what warm_up answers with every method, unrecorded (inside a time box)
# Turn t of a question samples with seed + TURN_SEED_STRIDE·t: each turn its own stream, every
# method the same one (a question's seed: the run's seed + a hash of its id).
TURN_SEED_STRIDE = 1000


class BenchDirError(ValueError):
    pass


def question_unit(unit: dict[str, Any]) -> tuple[str, float]:
    """A unit of the per-question benchmark: (question id, temperature)."""
    return unit["question_id"], unit["temperature"]


def batch_unit(unit: dict[str, Any]) -> tuple[int, int, float]:
    """A unit of the batch benchmark: (batch size, batch index, temperature)."""
    return unit["batch_size"], unit["batch"], unit["temperature"]


def prepare_output_dir(
    out_dir: Path,
    config: dict[str, Any],
    resume: bool,
    unit_key: Callable[[dict[str, Any]], Hashable] = question_unit,
) -> set[Hashable]:
    """Create or reopen ``out_dir``; the keys (``unit_key``) of the units already done.

    A reopened directory that holds records must hold the same config (the resume rule of
    system/files.py; ``resume: false`` refuses to reopen it); one without records is taken over.
    A torn last line of records.jsonl (a kill mid-write) is cut off."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config_path, records_path = out_dir / RUN_CONFIG, out_dir / RECORDS
    recorded = records_path.is_file() and records_path.stat().st_size > 0
    if recorded and not resume:
        raise BenchDirError(f"{out_dir} already holds a benchmark run; pass resume=true or a new run_name")
    try:
        check_or_store_settings(config_path, config, outputs_exist=recorded)
    except SettingsMismatch as error:
        raise BenchDirError(f"{error}\nuse a new run_name") from None
    done: set[Hashable] = set()
    if records_path.exists():
        torn = cut_torn_tail(records_path)
        if torn:
            log.warning("%s: dropped a torn last line (%d bytes)", records_path, torn)
        for line in records_path.read_bytes().splitlines():
            done.add(unit_key(json.loads(line)))
    return done


def _time_box(out_dir: Path, max_seconds: float | None) -> dict[str, Any] | None:
    """The time box's clock: the seconds and questions spent under this same box so far, and the
    seconds its warm-ups took (one per start, resumes included)."""
    if max_seconds is None:
        return None
    path = out_dir / TIME_BOX
    stored = json.loads(path.read_text()) if path.is_file() else {}
    if stored.get("max_seconds") == max_seconds:
        return {"warmup_s": 0.0, **stored}
    return {"max_seconds": max_seconds, "spent_s": 0.0, "units": 0, "warmup_s": 0.0}


def box_is_full(box: dict[str, Any]) -> bool:
    """Whether one more question, as long as the mean question so far, would end past the box.
    The warm-ups count (each answers the longest first turn once with every method). The first
    question always runs."""
    if not box["units"]:
        return False
    mean_s = box["spent_s"] / box["units"]
    return box["warmup_s"] + box["spent_s"] + mean_s > box["max_seconds"]


def read_records(out_dir: Path) -> list[dict[str, Any]]:
    records = []
    with (out_dir / RECORDS).open() as handle:
        for line in handle:
            records.extend(json.loads(line)["records"])
    return records


def _append_unit(path: Path, unit: dict[str, Any]) -> None:
    append_durably(path, (json.dumps(unit, separators=(",", ":")) + "\n").encode())


def answer(
    target: Target, question: Question, method: Method, sampling: Sampling, seed: int
) -> list[tuple[Generation, Sequence[int]]]:
    """Answer the question's turns one by one with ``method``: [(generation, prompt ids)]."""
    tokenizer, eos = target.tokenizer, set(target.spec.eos_token_ids)
    messages: list[dict[str, str]] = []
    answers = []
    for turn, text in enumerate(question.turns):
        messages.append({"role": "user", "content": text})
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
        prompt_ids = prompt["input_ids"][0]
        generation = method.generate(prompt_ids, sampling, seed + TURN_SEED_STRIDE * turn)
        reply = tokenizer.decode([t for t in generation.tokens if t not in eos], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        answers.append((generation, prompt_ids))
    return answers


def first_turn_ids(target: Target, question: Question) -> Tensor:
    """The chat-templated token ids of the question's first turn."""
    prompt = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": question.turns[0]}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )
    return prompt["input_ids"][0]


def warm_up(
    target: Target, questions: Sequence[Question], methods: Sequence[Method], sampling: Sampling, seed: int
) -> None:
    """Every method answers the LONGEST first turn of ``questions`` once; nothing is kept. The
    longest, so that the KV caches are sized for the run here: a cache that grows later drops
    its CUDA graphs, and their recapture (~0.1 s each on an H100) would land in a timed answer."""
    prompt = max((first_turn_ids(target, question) for question in questions), key=len)
    for method in methods:
        method.generate(prompt, sampling, seed)


def record_of(
    method: Method,
    question: Question,
    turn: int,
    temperature: float,
    generation: Generation,
    prompt_length: int,
) -> dict[str, Any]:
    has_steps = method.type != "hf"  # HF generate exposes no per-step record
    return {
        "method": method.name,
        "question_id": question.id,
        "category": question.category,
        "turn": turn,
        "temperature": temperature,
        "prompt_tokens": prompt_length,
        "tokens": generation.tokens,
        "total_s": generation.total_s,
        "prefill_s": generation.prefill_s,
        "stop": generation.stop,
        "steps": [
            [s.nodes, s.depth, s.accepted, s.draft_s, s.verify_s, s.bookkeeping_s] for s in generation.steps
        ]
        if has_steps
        else None,
    }


def check_plain_first(methods: Sequence[Method]) -> None:
    """Every speedup is against plain decoding in the same run: it must come first."""
    if not methods or methods[0].type != "plain":
        raise ValueError("the first method must be plain decoding (the speedup reference)")


def question_seed(seed: int, question: Question) -> int:
    """The sampling seed of ``question``: the run's seed moved by a hash of its id, so every method
    (and every batch it lands in) samples it with the same stream, and resuming does not shift it."""
    return seed + zlib.crc32(question.id.encode())


def run_benchmark(
    target: Target,
    questions: Sequence[Question],
    methods: Sequence[Method],
    temperatures: Sequence[float],
    sampling_for: Callable[[float], Sampling],
    out_dir: Path,
    config: dict[str, Any],
    seed: int = 0,
    resume: bool = True,
    progress: bool = True,
    max_seconds: float | None = None,
    warmup: bool = True,
) -> dict[str, Any]:
    """Run (or resume) the benchmark; write records.jsonl, report.json and the plots.

    ``warmup``: before the first timed question every method answers the longest first turn
    once, unrecorded, so one-time costs (CUDA graph captures, cache growth, lazy kernel
    selection, a draft model's first load) do not land on whichever method meets them first.

    ``max_seconds``: a time box, warm-up included. No question is started that would end past it
    (judged by the mean question so far, :func:`box_is_full`); the report covers the questions
    done and says how many were left (``time_box``). The time spent is kept in ``time_box.json``,
    so resuming under the same box continues its clock (a finished box stays finished, and warms
    up no more); another box, or none, starts afresh. Questions run in the given order, so a
    balanced order keeps a cut-short run balanced."""
    check_plain_first(methods)
    done = prepare_output_dir(out_dir, config, resume)
    units = [(q, t) for q in questions for t in temperatures if (q.id, float(t)) not in done]
    if done:
        log.info("resuming %s: %d units done, %d to go", out_dir, len(done), len(units))
    box = _time_box(out_dir, max_seconds)
    if warmup and units and not (box is not None and box_is_full(box)):
        warmup_started = time.perf_counter()
        warm_up(target, [question for question, _ in units], methods, sampling_for(units[0][1]), seed)
        if box is not None:
            box["warmup_s"] += time.perf_counter() - warmup_started
    left = 0
    for done_here, (question, temperature) in enumerate(
        tqdm(units, desc="bench", unit="question", disable=not progress)
    ):
        if box is not None and box_is_full(box):
            left = len(units) - done_here
            log.warning(
                "time box of %.0f s: stopping after %d questions (%.0f s, warm-up %.0f s), %d left undone",
                max_seconds, box["units"], box["spent_s"], box["warmup_s"], left,
            )  # fmt: skip
            break
        unit_started = time.perf_counter()
        sampling = sampling_for(temperature)
        unit_seed = question_seed(seed, question)  # the same for every method
        records = []
        for method in methods:
            for turn, (generation, prompt_ids) in enumerate(
                answer(target, question, method, sampling, unit_seed)
            ):
                records.append(
                    record_of(method, question, turn, float(temperature), generation, len(prompt_ids))
                )
        _append_unit(
            out_dir / RECORDS,
            {
                "question_id": question.id,
                "temperature": float(temperature),
                "load": os.getloadavg()[0],
                "records": records,
            },
        )
        if box is not None:
            box["spent_s"] += time.perf_counter() - unit_started
            box["units"] += 1
            write_json_atomic(out_dir / TIME_BOX, box)
    report = {**report_head(target, config, methods), "results": summarize(read_records(out_dir))}
    if max_seconds is not None:
        report["time_box"] = {"max_seconds": max_seconds, "units_left": left}
    write_json_atomic(out_dir / REPORT, report)
    report["plots"] = [str(p) for p in plot(report["results"], out_dir)]
    return report


def run_batch_benchmark(
    target: Target,
    questions: Sequence[Question],
    methods: Sequence[Method],
    batch_sizes: Sequence[int],
    temperatures: Sequence[float],
    sampling_for: Callable[[float], Sampling],
    out_dir: Path,
    config: dict[str, Any],
    seed: int = 0,
    resume: bool = True,
    progress: bool = True,
    warmup: bool = True,
) -> dict[str, Any]:
    """Throughput against batch size: for each size B, the questions' first turns in batches of
    B (in question order; the last ``len(questions) % B`` are left out, so every batch is full),
    every method decoding each batch in turn (plain decoding first). Resumable per batch, as
    :func:`run_benchmark` is per question. ``warmup``: every method decodes the longest prompts
    at the largest size once, untimed (caches and drafters sized for the run)."""
    check_plain_first(methods)
    unbatched = [m.name for m in methods if m.generate_batch is None]
    if unbatched:
        raise ValueError(
            f"methods {unbatched} cannot decode batches (HF generate); leave them out of the run"
        )
    too_big = [size for size in batch_sizes if size > len(questions)]
    if too_big:
        raise ValueError(f"batch_sizes {too_big}: larger than the {len(questions)} questions of the prompts")
    done = prepare_output_dir(out_dir, config, resume, batch_unit)
    prompts = [first_turn_ids(target, question) for question in questions]
    seeds = [question_seed(seed, question) for question in questions]  # the same in every batch
    units = [
        (size, batch, float(temperature))
        for size in batch_sizes
        for temperature in temperatures
        for batch in range(len(questions) // size)
        if (size, batch, float(temperature)) not in done
    ]
    if warmup and units:
        largest = max(batch_sizes)
        longest = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))[-largest:]
        for method in methods:
            method.generate_batch([prompts[i] for i in longest], sampling_for(units[0][2]), seeds[:largest])
    for size, batch, temperature in tqdm(units, desc="bench batches", unit="batch", disable=not progress):
        rows = range(batch * size, (batch + 1) * size)
        records = []
        for method in methods:
            generations = method.generate_batch(
                [prompts[i] for i in rows], sampling_for(temperature), [seeds[i] for i in rows]
            )
            wall_s = max(generation.total_s for generation in generations)  # the batch ends with its last row
            for i, generation in zip(rows, generations, strict=True):
                record = record_of(method, questions[i], 0, temperature, generation, len(prompts[i]))
                records.append({**record, "batch_size": size, "batch": batch, "wall_s": wall_s})
        _append_unit(
            out_dir / RECORDS,
            {
                "batch_size": size,
                "batch": batch,
                "temperature": temperature,
                "load": os.getloadavg()[0],
                "records": records,
            },
        )
    report = {**report_head(target, config, methods), "batch": summarize_batches(read_records(out_dir))}
    write_json_atomic(out_dir / REPORT, report)
    return report


def report_head(target: Target, config: dict[str, Any], methods: Sequence[Method]) -> dict[str, Any]:
    """What every report starts with: the machine, the config, and how each method was set up."""
    return {
        "machine": machine_info(target.device),
        "config": config,
        "methods": {m.name: {"type": m.type, "lossless": m.lossless, **m.details} for m in methods},
    }


def machine_info(device: str | torch.device = "cpu") -> dict[str, Any]:
    """The machine a measurement ran on: the host CPU (its model and the flags that decide bf16),
    and the accelerator when ``device`` is one (a GPU's numbers also depend on the host, which
    launches every kernel)."""
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "hardware": detect_hardware().record(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_average_1m": os.getloadavg()[0],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if torch.device(device).type != "cpu":
        info["accelerator"] = detect_hardware(device).record()
    return info
