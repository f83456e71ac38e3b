"""Conversations → token ids + assistant-only loss mask, for ANY chat template.

No separator is hard-coded. The conversation is rendered once in full and tokenized once with
character offsets (the ids a head trains on are exactly the ids of that one tokenization). Each
assistant message is then located in the rendered text:

1. render the conversation up to that message with ``add_generation_prompt=True``; when that
   prompt is a prefix of the full text (true of every template we know), the answer starts at or
   after its end — the search can never hit the header or an earlier turn;
2. find the message content there (verbatim, or stripped: Llama-3 templates ``trim`` it);
3. mask every token overlapping the content, plus the turn terminator the target emits to end
   its answer: the first token after the content, provided it is a special token and still
   belongs to this turn (``<|im_end|>``, ``<|eot_id|>``, ``</s>``). Template text after the
   terminator (ChatML's trailing newline) is not something the target generates, so it is not
   learned.

Templates that add BOS or a default system prompt need nothing special: that text lies outside
every assistant span. Tokenization uses ``add_special_tokens=False`` because the template renders
BOS itself when it wants one (as ``apply_chat_template`` does).
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from specdraft.data.conversations import Conversation

log = logging.getLogger(__name__)

_PROBE_ANSWER = "specdraft probe answer 7"


class ChatTemplateError(ValueError):
    """The chat template cannot render this conversation, or its answer cannot be located."""


@dataclass(frozen=True)
class TokenizedConversation:
    """``input_ids`` and ``loss_mask`` have the same length T (1 = an assistant token to learn)."""

    id: str
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class TokenizeReport:
    conversations: int = 0
    kept: int = 0
    truncated: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    skipped_example: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "conversations": self.conversations,
            "kept": self.kept,
            "truncated": self.truncated,
            "tokens": self.tokens,
            "loss_tokens": self.loss_tokens,
            "skipped": dict(self.skipped),
            "skipped_example": self.skipped_example,
        }


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Ids of all special tokens, including added special tokens outside the special-token map
    (Llama-3's ``<|eot_id|>``)."""
    added = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    return frozenset(added | set(tokenizer.all_special_ids))


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase,
    conversation: Conversation,
    max_length: int | None = None,
    special_ids: frozenset[int] | None = None,
) -> TokenizedConversation:
    """Render with the tokenizer's chat template; mask = assistant content + turn terminator.

    Truncates to ``max_length`` tokens (the tail is dropped). Raises :class:`ChatTemplateError`
    if the template fails or an answer cannot be found in the rendered text.
    """
    if not tokenizer.chat_template:
        raise ChatTemplateError("the tokenizer has no chat_template")
    if not getattr(tokenizer, "is_fast", False):
        raise ChatTemplateError("a fast tokenizer is required (character offsets locate the answers)")
    special_ids = special_token_ids(tokenizer) if special_ids is None else special_ids
    messages = [{"role": m.role, "content": m.content} for m in conversation.messages]
    full_text = _render(tokenizer, messages)
    encoding = tokenizer(full_text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids: list[int] = encoding["input_ids"]
    offsets: list[tuple[int, int]] = encoding["offset_mapping"]

    loss_mask = [0] * len(input_ids)
    cursor = 0  # answers are found in order, each after the previous one
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:index], add_generation_prompt=True)
        turn = _render(tokenizer, messages[: index + 1])
        prefix_consistent = full_text.startswith(prompt) and full_text.startswith(turn)
        search_from = max(cursor, len(prompt)) if prefix_consistent else cursor
        turn_end = len(turn) if prefix_consistent else len(full_text)
        start, end = _locate(full_text, message["content"], search_from, conversation.id, index)
        _mark_answer(loss_mask, input_ids, offsets, start, end, turn_end, special_ids)
        cursor = end

    if max_length is not None:
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    return TokenizedConversation(conversation.id, tuple(input_ids), tuple(loss_mask))


def tokenize_conversations(
    tokenizer: PreTrainedTokenizerBase,
    conversations: Sequence[Conversation] | Iterable[Conversation],
    max_length: int | None = None,
    progress: bool = True,
) -> tuple[list[TokenizedConversation], TokenizeReport]:
    """Tokenize many conversations; failures and fully-truncated answers are counted, not raised."""
    if not tokenizer.chat_template:  # else every conversation is skipped, said on an INFO line only
        raise ChatTemplateError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat_template: expected a chat model's tokenizer "
            "(set target.model to one, or give the tokenizer a chat_template in its tokenizer_config.json)"
        )
    special_ids = special_token_ids(tokenizer)
    report = TokenizeReport()
    kept: list[TokenizedConversation] = []
    total = len(conversations) if isinstance(conversations, Sequence) else None
    for conversation in tqdm(conversations, total=total, desc="tokenize", unit="conv", disable=not progress):
        report.conversations += 1
        try:
            tokenized = tokenize_conversation(tokenizer, conversation, None, special_ids)
        except ChatTemplateError as error:
            _skip(report, f"chat template: {error.args[0].split(':')[0]}", conversation.id)
            continue
        if max_length is not None and len(tokenized.input_ids) > max_length:
            report.truncated += 1
            tokenized = TokenizedConversation(
                tokenized.id, tokenized.input_ids[:max_length], tokenized.loss_mask[:max_length]
            )
        if tokenized.num_loss_tokens == 0:
            _skip(report, "no assistant token within max_length", conversation.id)
            continue
        report.kept += 1
        report.tokens += len(tokenized.input_ids)
        report.loss_tokens += tokenized.num_loss_tokens
        kept.append(tokenized)
    for reason, count in report.skipped.most_common():
        log.info("tokenize: skipped %d (%s, e.g. id %s)", count, reason, report.skipped_example[reason])
    return kept, report


def end_of_turn_token_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The special token the chat template puts right after an assistant answer, or None."""
    messages = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": _PROBE_ANSWER}]
    text = _render(tokenizer, messages)
    end = text.find(_PROBE_ANSWER) + len(_PROBE_ANSWER)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    special_ids = special_token_ids(tokenizer)
    for token_id, (start, _) in zip(encoding["input_ids"], encoding["offset_mapping"], strict=True):
        if start >= end:
            return token_id if token_id in special_ids else None
    return None


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], **kwargs: Any) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as error:  # jinja raises its own errors (e.g. a template refusing a role)
        raise ChatTemplateError(f"render failed: {error}") from error


def _locate(text: str, content: str, search_from: int, conversation_id: str, index: int) -> tuple[int, int]:
    for candidate in (content, content.strip()):
        start = text.find(candidate, search_from)
        if start >= 0 and candidate:
            return start, start + len(candidate)
    raise ChatTemplateError(
        f"answer not found: message {index} of {conversation_id} is not verbatim in the rendered text"
    )


def _mark_answer(
    loss_mask: list[int],
    input_ids: list[int],
    offsets: list[tuple[int, int]],
    start: int,
    end: int,
    turn_end: int,
    special_ids: frozenset[int],
) -> None:
    """Set the mask on tokens overlapping [start, end) and on the terminator after them."""
    # Offsets are non-decreasing: skip straight to the first token ending after ``start``.
    first = bisect.bisect_right(offsets, start, key=lambda span: span[1])
    for position in range(first, len(offsets)):
        token_start = offsets[position][0]
        if token_start >= end:
            if token_start < turn_end and input_ids[position] in special_ids:
                loss_mask[position] = 1
            return
        loss_mask[position] = 1


def _skip(report: TokenizeReport, reason: str, conversation_id: str) -> None:
    report.skipped[reason] += 1
    report.skipped_example.setdefault(reason, conversation_id)


def assistant_token_counts(samples: Iterable[TokenizedConversation], vocab_size: int) -> torch.Tensor:
    """V int64: how often each token occurs under the loss mask (assistant tokens) of ``samples``."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for sample in samples:
        ids = torch.tensor(sample.input_ids)[torch.tensor(sample.loss_mask, dtype=torch.bool)]
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts
