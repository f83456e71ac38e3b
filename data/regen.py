"""Regenerating the assistant turns with the target itself (self-distillation data).

Heads trained on the target's own answers accept far more of its drafts (Medusa-2, EAGLE-3).
Every user turn is re-answered in context: the history a turn is answered in holds the
regenerated answers before it. Two backends produce the answers:

* :class:`TargetResponder` — the built-in target, batched: at temperature 0
  :func:`specdraft.data.generate.greedy_generate` (KV cache written in place, continuous
  batching: a row whose answer ended takes the next prompt at once); when sampling,
  ``generate`` on left-padded batches of prompts of similar length;
* :class:`OpenAIResponder` — any OpenAI-compatible ``/chat/completions`` server (vLLM, SGLang).

Output is OpenAI-style JSONL (``{"id", "messages"}``), which :func:`read_jsonl` reads back.
Conversations are processed in fixed chunks in source order (``chunk_size: auto``: a few batches,
so that continuous batching keeps the rows busy); each finished chunk is appended
with one write + fsync, then ``<out>.progress.json`` records the chunks done and the byte size
they end at. Sampling is seeded per (seed, chunk, turn, batch), so a run killed at any moment and
restarted writes exactly what an uninterrupted run writes: on restart the output is cut back to
the recorded size and the interrupted chunk is generated again. ``<out>.meta.json`` holds the
settings; a restart with other settings is refused once an answer is written.

Greedy first turns can also keep the target's features as they are computed (``features``: a
:class:`~specdraft.data.capture.FeatureCapture` in the generator; one shard per chunk, written by a
:class:`~specdraft.data.captured_cache.CapturedCacheWriter` before the chunk is recorded as done).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm

from specdraft.data.cache import StoredFields
from specdraft.data.capture import FeatureCapture
from specdraft.data.captured_cache import CapturedCacheWriter, CapturedSample
from specdraft.data.conversations import Conversation
from specdraft.data.generate import greedy_generate
from specdraft.data.target import Target
from specdraft.heads.spec import TargetSpec
from specdraft.system.files import (
    SettingsMismatch,
    append_durably,
    check_or_store_settings,
    write_json_atomic,
)

log = logging.getLogger(__name__)

History = list[dict[str, str]]
REGEN_FORMAT_VERSION = 1


class Responder(Protocol):
    """Answers a batch of chat histories (None where it cannot); ``seed`` makes sampling
    reproducible. ``description`` goes into the output's meta file; ``generated_tokens`` is a
    running count of answer tokens, for throughput reports."""

    description: dict[str, Any]
    generated_tokens: int

    def __call__(self, histories: Sequence[History], seed: int) -> list[str | None]: ...


@dataclass(frozen=True)
class GenerationSettings:
    """How the target answers (conf/regen.yaml ``generation`` sets every field):
    ``temperature`` 0 is greedy; ``seed`` makes sampling reproducible."""

    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int


class TargetResponder:
    """Answers with the built-in target, ``batch_size`` rows at a time. With ``capture`` (greedy
    only) it also keeps the target features of each answered prompt + answer (data/capture.py):
    after a call, ``captured[i]`` holds history i's (input_ids, loss_mask, features), None where
    it was not answered."""

    def __init__(
        self,
        target: Target,
        settings: GenerationSettings,
        batch_size: int = 16,
        max_prompt_tokens: int = 2048,
        capture: StoredFields | None = None,
    ) -> None:
        if capture is not None and settings.temperature != 0:
            raise ValueError(
                "features are captured during greedy regeneration only (generation.temperature=0)"
            )
        self.target, self.settings, self.capture = target, settings, capture
        self.captured: list[tuple[list[int], list[int], Any] | None] = []
        self.batch_size = batch_size
        self.max_prompt_tokens = min(max_prompt_tokens, target.spec.max_position_embeddings)
        self.description = {
            "backend": "target",
            "target": target.spec.name,
            "revision": target.spec.revision,
            "dtype": target.spec.dtype,
        }
        if settings.temperature == 0:  # greedy answers come from data.generate, not generate()
            self.description["generator"] = "greedy_generate"

        self.generated_tokens = 0  # running count, for throughput reports

    def prompt_ids(self, history: History) -> list[int] | None:
        """Token ids of the history + generation prompt, or None if too long to answer."""
        ids = self.target.tokenizer.apply_chat_template(
            history, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        return ids if len(ids) + self.settings.max_new_tokens <= self.max_prompt_tokens else None

    @torch.no_grad()
    def __call__(self, histories: Sequence[History], seed: int) -> list[str | None]:
        """One answer per history (None where the prompt is too long). Greedy: continuously
        batched, ``batch_size`` rows. Sampling: batches of prompts of similar length, batch b
        sampled with seed ``seed + b``."""
        prompts = [self.prompt_ids(h) for h in histories]
        order = sorted(
            (i for i, p in enumerate(prompts) if p is not None), key=lambda i: (len(prompts[i]), i)
        )
        answers: list[str | None] = [None] * len(histories)
        spec, settings = self.target.spec, self.settings
        pad_id = spec.pad_token_id if spec.pad_token_id is not None else spec.eos_token_ids[0]
        if settings.temperature == 0:
            fields = self.capture
            capture = (
                FeatureCapture(self.target.model, fields.aux_layer_ids, fields.top_k)
                if fields is not None
                else None
            )
            new_tokens = greedy_generate(
                self.target.model,
                [prompts[i] for i in order],
                settings.max_new_tokens,
                spec.eos_token_ids,
                self.batch_size,
                pad_id,
                capture=capture,
            )
            self._decode_answers(order, new_tokens, answers)
            if capture is not None:
                self.captured = [None] * len(histories)
                for row, (index, tokens) in enumerate(zip(order, new_tokens, strict=True)):
                    prompt = prompts[index]
                    mask = [0] * len(prompt) + [1] * len(tokens)  # the answer, its end token included
                    self.captured[index] = (prompt + tokens, mask, capture.pop(row))
            return answers
        for batch_number, start in enumerate(range(0, len(order), self.batch_size)):
            indices = order[start : start + self.batch_size]
            width = max(len(prompts[i]) for i in indices)
            input_ids = torch.full((len(indices), width), pad_id, dtype=torch.long)
            attention_mask = torch.zeros_like(input_ids)
            for row, index in enumerate(indices):  # left padding: every prompt ends at the last column
                input_ids[row, width - len(prompts[index]) :] = torch.tensor(prompts[index])
                attention_mask[row, width - len(prompts[index]) :] = 1
            input_ids = input_ids.to(self.target.device)
            attention_mask = attention_mask.to(self.target.device)
            torch.manual_seed(seed + batch_number)
            output = self.target.model.generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=settings.max_new_tokens,
                eos_token_id=list(spec.eos_token_ids),
                pad_token_id=pad_id,
                do_sample=True,
                temperature=settings.temperature,
                top_p=settings.top_p,
            )
            # generate pads rows that ended early
            new_tokens = [[t for t in row if t != pad_id] for row in output[:, width:].tolist()]
            self._decode_answers(indices, new_tokens, answers)
        return answers

    def _decode_answers(self, indices: Sequence[int], new_tokens: list[list[int]], answers: list) -> None:
        for index, tokens in zip(indices, new_tokens, strict=True):
            answers[index] = self.target.tokenizer.decode(tokens, skip_special_tokens=True).strip()
        self.generated_tokens += sum(len(tokens) for tokens in new_tokens)


class OpenAIResponder:
    """Answers through an OpenAI-compatible server (``base_url`` like ``http://host:8000/v1``)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        settings: GenerationSettings,
        api_key: str | None = None,
        concurrency: int = 8,
        timeout: float = 120.0,
        max_retries: int = 3,
    ) -> None:
        if not base_url:
            raise ValueError("openai backend: base_url is required (e.g. http://localhost:8000/v1)")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.settings, self.api_key = model, settings, api_key
        self.concurrency, self.timeout, self.max_retries = concurrency, timeout, max_retries
        self.description = {"backend": "openai", "url": self.url, "model": model}
        self.generated_tokens = 0  # from the servers' usage.completion_tokens

    def __call__(self, histories: Sequence[History], seed: int) -> list[str | None]:
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(lambda item: self._complete(item[1], seed + item[0]), enumerate(histories)))

    def _complete(self, history: History, seed: int) -> str | None:
        body = json.dumps(
            {
                "model": self.model,
                "messages": history,
                "temperature": self.settings.temperature,
                "top_p": self.settings.top_p,
                "max_tokens": self.settings.max_new_tokens,
                "seed": seed,
            }
        ).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        for attempt in range(self.max_retries + 1):
            try:
                request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    reply = json.loads(response.read())
                self.generated_tokens += int(reply.get("usage", {}).get("completion_tokens", 0))
                return reply["choices"][0]["message"]["content"].strip()
            except urllib.error.HTTPError as error:
                if error.code == 400:  # typically: the prompt exceeds the server's context
                    log.warning("server refused a prompt (HTTP 400): %s", error.read()[:200])
                    return None
                if error.code < 500 or attempt == self.max_retries:
                    raise RuntimeError(f"{self.url}: HTTP {error.code} {error.reason}") from error
            except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
                if attempt == self.max_retries:
                    raise RuntimeError(f"{self.url}: {error}") from error
            time.sleep(2**attempt)
        return None


@dataclass(frozen=True)
class AutoBatch:
    """How ``batch_size: auto`` and ``chunk_size: auto`` resolve (conf/regen.yaml ``auto``).

    Greedy answers are continuously batched WITHIN a chunk of conversations only (a chunk is
    the unit of resume), so a chunk smaller than the batch leaves rows idle: measured on an
    H100 with 256 rows, chunks of 64 conversations ran at ~500 tokens/s and chunks of 1,024 at
    2,317. ``chunk_size: auto`` is ``chunk_batches`` batches (at least ``min_chunk``)."""

    cpu_rows: int
    gpu_memory_fraction: float  # of the GPU's free memory, for the rows' KV cache + prefill
    max_rows: int
    chunk_batches: int
    min_chunk: int


def row_bytes(spec: TargetSpec, max_prompt_tokens: int) -> int:
    """Bytes one row of greedy decoding can hold at its longest: its KV cache over
    ``max_prompt_tokens`` positions, plus the peak of its prefill (the MLP's two intermediate
    activations and the padded attention-mask row per position)."""
    element = torch.finfo(getattr(torch, spec.dtype)).bits // 8
    kv = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim
    per_position = kv + 2 * spec.intermediate_size + max_prompt_tokens
    return element * per_position * max_prompt_tokens


def resolve_batch_size(
    batch_size: int | str,
    spec: TargetSpec,
    device: torch.device,
    max_prompt_tokens: int,
    rules: AutoBatch,
    free_bytes: int | None = None,
) -> int:
    """``batch_size`` as rows: an int as given; ``"auto"``: on a GPU as many rows as
    ``rules.gpu_memory_fraction`` of its free memory holds (``free_bytes``; default: asked of
    the device), at most ``rules.max_rows``; on a CPU ``rules.cpu_rows``."""
    if batch_size != "auto":
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1 or 'auto', got {batch_size!r}")
        return int(batch_size)
    if device.type != "cuda":
        return rules.cpu_rows
    if free_bytes is None:
        free_bytes, _ = torch.cuda.mem_get_info(device)
    rows = int(rules.gpu_memory_fraction * free_bytes) // row_bytes(spec, max_prompt_tokens)
    return max(1, min(rules.max_rows, rows))


def resolve_chunk_size(chunk_size: int | str, batch_size: int, rules: AutoBatch) -> int:
    """``chunk_size`` as conversations: an int as given; ``"auto"``: ``rules.chunk_batches``
    batches, at least ``rules.min_chunk``."""
    if chunk_size != "auto":
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be >= 1 or 'auto', got {chunk_size!r}")
        return int(chunk_size)
    return max(rules.min_chunk, rules.chunk_batches * batch_size)


@dataclass
class RegenReport:
    """What one ``regenerate`` call did; ``specdraft-regen`` writes it as JSON next to its output
    (:func:`report_path`), so measurements read numbers rather than scrape its printed line."""

    conversations: int = 0
    written: int = 0
    turns_answered: int = 0
    turns_dropped: int = 0  # a prompt too long or an empty answer ends its conversation there
    skipped_conversations: int = 0
    generated_characters: int = 0
    generated_tokens: int = 0  # as counted by the responder
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of this run (prefills included)."""
        return self.generated_tokens / max(self.seconds, 1e-9)


def report_path(out_path: str | Path) -> Path:
    """Where ``specdraft-regen`` writes the report of its last run on ``out_path``."""
    out_path = Path(out_path)
    return out_path.with_name(out_path.name + ".report.json")


def regenerate(
    conversations: Sequence[Conversation],
    responder: Responder,
    out_path: str | Path,
    settings: GenerationSettings,
    source: dict[str, Any],
    chunk_size: int = 64,
    progress: bool = True,
    max_turns: int | None = None,
    features: CapturedCacheWriter | None = None,
) -> RegenReport:
    """Regenerate the assistant turns of ``conversations`` into ``out_path`` (resumable).
    ``max_turns``: answer only the first N user turns of each conversation (None: all); the
    conversation ends after them. ``features``: also write the target features the responder
    captured (a :class:`TargetResponder` with ``capture``; first turns only), one shard per chunk,
    written before the chunk counts as done; their caches are finished at the end."""
    if max_turns is not None and max_turns < 1:
        raise ValueError(f"max_turns must be >= 1 or None, got {max_turns}")
    if features is not None and (max_turns != 1 or getattr(responder, "capture", None) != features.fields):
        raise ValueError(
            f"captured features need max_turns=1 and the target backend capturing {features.fields} (a "
            "later turn's prompt holds the earlier answers as re-tokenized text, not as the ids generated)"
        )
    out_path = Path(out_path)
    header = {
        "format_version": REGEN_FORMAT_VERSION,
        "responder": responder.description,
        "settings": asdict(settings),
        "source": source,
        "chunk_size": chunk_size,
        "conversation_ids_sha256": hashlib.sha256(
            "\n".join(c.id for c in conversations).encode()
        ).hexdigest(),
    }
    if max_turns is not None:  # absent when answering every turn: older outputs stay resumable
        header["max_turns"] = max_turns
    if features is not None:
        header["features"] = {
            "dirs": {split: str(d) for split, d in sorted(features.dirs.items())},
            "fields": features.fields.to_dict(),
            "heldout_fraction": features.heldout_fraction,
            "split_seed": features.split_seed,
        }
    meta_path, progress_path = (out_path.with_name(f"{out_path.name}.{e}.json") for e in ("meta", "progress"))
    try:  # the settings bind once a chunk is recorded as done
        check_or_store_settings(meta_path, header, outputs_exist=progress_path.is_file())
    except SettingsMismatch as error:
        raise ValueError(f"{error}\nchoose another out_path or remove the old output") from None
    if features is not None:
        features.start()
    chunks = [conversations[i : i + chunk_size] for i in range(0, len(conversations), chunk_size)]
    position = _resume_point(out_path, progress_path)

    report = RegenReport(conversations=len(conversations))
    todo = range(position["chunks_done"], len(chunks))
    total_turns = sum(len(_user_turns(c, max_turns)) for i in todo for c in chunks[i])
    tokens_before = responder.generated_tokens
    started = time.perf_counter()
    with tqdm(total=total_turns, desc="regenerate", unit="turn", disable=not progress) as bar:
        for chunk_index in todo:
            records = _regenerate_chunk(
                chunks[chunk_index], responder, settings.seed, chunk_index, report, bar, max_turns
            )
            if features is not None:  # before the chunk is recorded as done
                features.write_chunk(chunk_index, _captured_samples(chunks[chunk_index], records, responder))
            lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
            append_durably(out_path, lines)
            position = {"chunks_done": chunk_index + 1, "bytes": position["bytes"] + len(lines)}
            write_json_atomic(progress_path, position)
            report.written += len(records)
            elapsed = time.perf_counter() - started
            tokens = responder.generated_tokens - tokens_before
            bar.set_postfix(tokens_per_s=f"{tokens / max(elapsed, 1e-9):.0f}")
    report.seconds = time.perf_counter() - started
    report.generated_tokens = responder.generated_tokens - tokens_before
    if features is not None:
        features.finish(len(chunks))
    return report


def _captured_samples(
    chunk: Sequence[Conversation], records: Sequence[dict[str, Any]], responder: TargetResponder
) -> list[CapturedSample]:
    """The captured samples of a first-turn chunk's written records, in chunk order: the
    responder's one call for the chunk answered its conversations in chunk order."""
    answered = {record["id"] for record in records}
    asked = [c for c in chunk if _user_turns(c, 1)]
    if not asked:  # the responder was not called for this chunk
        return []
    samples = []
    for conversation, captured in zip(asked, responder.captured, strict=True):
        if conversation.id in answered:
            input_ids, loss_mask, found = captured
            samples.append(CapturedSample(conversation.id, input_ids, loss_mask, found))
    return samples


def _regenerate_chunk(
    chunk: Sequence[Conversation],
    responder: Responder,
    seed: int,
    chunk_index: int,
    report: RegenReport,
    bar: tqdm,
    max_turns: int | None,
) -> list[dict[str, Any]]:
    histories: list[History] = [
        [{"role": "system", "content": c.messages[0].content}] if c.messages[0].role == "system" else []
        for c in chunk
    ]
    user_turns = [_user_turns(c, max_turns) for c in chunk]
    alive = [True] * len(chunk)
    for turn in range(max(len(t) for t in user_turns)):
        asking = [i for i in range(len(chunk)) if alive[i] and turn < len(user_turns[i])]
        if not asking:
            break
        for i in asking:
            histories[i].append({"role": "user", "content": user_turns[i][turn]})
        # one seed stream per (chunk, turn): the batches within get seed + batch number
        turn_seed = seed * 1_000_003 + chunk_index * 1_009 + turn * 100_003
        answers = responder([histories[i] for i in asking], turn_seed)
        for i, answer in zip(asking, answers, strict=True):
            if answer:
                histories[i].append({"role": "assistant", "content": answer})
                report.turns_answered += 1
                report.generated_characters += len(answer)
            else:
                histories[i].pop()  # the unanswered user turn
                alive[i] = False
                report.turns_dropped += len(user_turns[i]) - turn
        bar.update(len(asking))
    records = []
    for conversation, history in zip(chunk, histories, strict=True):
        if any(m["role"] == "assistant" for m in history):
            records.append({"id": conversation.id, "messages": history})
        else:
            report.skipped_conversations += 1
    return records


def _user_turns(conversation: Conversation, max_turns: int | None) -> list[str]:
    return [m.content for m in conversation.messages if m.role == "user"][:max_turns]


def _resume_point(out_path: Path, progress_path: Path) -> dict[str, int]:
    """Chunks already done, with the output cut back to exactly their bytes (a kill after an
    append but before the progress update leaves a chunk that is generated again)."""
    progress = (
        json.loads(progress_path.read_text()) if progress_path.is_file() else {"chunks_done": 0, "bytes": 0}
    )
    size = out_path.stat().st_size if out_path.is_file() else 0
    if size < progress["bytes"]:
        raise ValueError(
            f"{out_path} has {size} bytes but {progress_path} records {progress['bytes']}: "
            "the output was modified; remove both files to start over"
        )
    if size > progress["bytes"]:
        log.warning("%s: removing %d bytes of an interrupted chunk", out_path, size - progress["bytes"])
        with out_path.open("r+b") as handle:
            handle.truncate(progress["bytes"])
            os.fsync(handle.fileno())
    return progress
