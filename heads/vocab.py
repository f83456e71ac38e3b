"""Draft vocabularies: EAGLE-3's reduced one, and what a head's vocabulary projection is.

The draft head predicts over the ``draft_vocab_size`` most frequent assistant tokens of the
training data. Draft id i maps to target id ``i + d2t[i]`` (d2t holds OFFSETS, the convention of
EAGLE-3, vLLM and SGLang); ``t2d`` is a bool mask over the target vocabulary marking the tokens
the draft can propose. Draft ids are ordered by target id, so d2t is non-decreasing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class VocabProjection:
    """What a head's draft logits are, as the training objective computes them chunk by chunk:
    ``logits = inputs @ weight.T`` (per step when ``weight`` has one matrix per step).

    inputs          S×N×H   what the projection reads, one row of N per draft step / Medusa head
    weight          V'×H    the projection (frozen target lm_head, or the head's own), or S×V'×H
    draft_vocab     V'      target id of each draft id; None: the draft vocabulary is the target's
    target_to_draft V       draft id of each target id, −1 outside (with ``draft_vocab``)
    """

    inputs: Tensor
    weight: Tensor
    draft_vocab: Tensor | None = None
    target_to_draft: Tensor | None = None

    def steps(self, selected: slice) -> VocabProjection:
        """The projection of the draft steps ``selected`` only (rows of ``inputs``, and of
        ``weight`` when it has one matrix per step)."""
        weight = self.weight[selected] if self.weight.dim() == 3 else self.weight
        return VocabProjection(self.inputs[selected], weight, self.draft_vocab, self.target_to_draft)

    def restriction(self, vocab: Tensor) -> VocabRestriction:
        """Where the target ids ``vocab`` lie in this projection's vocabulary (what
        :meth:`restricted_to` needs). It depends on ``vocab`` and the head's vocabulary only, and
        reads how many tokens are inside on the host, so a caller that restricts every step
        computes it once and passes it instead of ``vocab``."""
        vocab = vocab.to(self.weight.device)
        if self.draft_vocab is None:
            size = self.weight.shape[-2]
            index = _positions(vocab, size)
            return VocabRestriction(vocab, vocab, index, narrows=vocab.numel() < size, unchanged=False)
        own_rows = self.target_to_draft.to(vocab.device)[vocab]
        inside = own_rows >= 0
        kept = int(inside.sum())  # the one host sync
        if not kept:
            raise ValueError(
                f"none of its {vocab.numel()} tokens lies inside the head's own "
                f"{self.weight.shape[-2]}-token draft vocabulary"
            )
        whole = kept == self.draft_vocab.numel()
        vocab, own_rows = vocab[inside], own_rows[inside]
        index = _positions(vocab, self.target_to_draft.numel())
        return VocabRestriction(vocab, own_rows, index, narrows=not whole, unchanged=whole)

    def restricted_to(self, vocab: Tensor | VocabRestriction, rows: Tensor | None = None) -> VocabProjection:
        """The same projection over the target ids ``vocab`` only (or a :meth:`restriction` of
        them): a reduced training vocabulary for a head that drafts over the whole target
        vocabulary; for a head with its own reduced one, over the tokens of ``vocab`` inside it
        (``self`` when that is all of it: a head warm-started from another run's vocabulary keeps
        training). ``rows``: ``weight``'s rows of ``vocab`` when the caller keeps them (of a frozen
        weight), instead of selecting them."""
        restriction = vocab if isinstance(vocab, VocabRestriction) else self.restriction(vocab)
        if restriction.unchanged:
            return self
        weight = self.weight[..., restriction.own_rows, :] if rows is None else rows
        return VocabProjection(self.inputs, weight, restriction.vocab, restriction.index)


@dataclass(frozen=True)
class VocabRestriction:
    """A vocabulary of target ids as it lies in a projection's (:meth:`VocabProjection.restriction`).

    vocab      V''  the target ids kept: those inside the projection's vocabulary
    own_rows   V''  their rows of the projection's weight
    index      V    position in ``vocab`` of each target id, −1 outside
    narrows    bool fewer tokens than the projection has
    unchanged  bool restricting gives the projection itself (its own vocabulary, all of it kept)
    """

    vocab: Tensor
    own_rows: Tensor
    index: Tensor
    narrows: bool
    unchanged: bool


def _positions(vocab: Tensor, size: int) -> Tensor:
    """size: the position of each id in ``vocab``, −1 for the ids not in it."""
    index = torch.full((size,), -1, dtype=torch.long, device=vocab.device)
    index[vocab] = torch.arange(vocab.numel(), device=vocab.device)
    return index


def draft_vocab_from_counts(counts: Tensor, draft_vocab_size: int) -> tuple[Tensor, Tensor]:
    """counts V (token frequencies) -> (d2t draft_vocab_size int64, t2d V bool).

    The most frequent tokens win; ties go to the lower id, so the map is deterministic.
    """
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(
            f"draft_vocab_size must be in 1..{vocab_size} (the target vocab), got {draft_vocab_size}"
        )
    ids = torch.arange(vocab_size)
    # Stable sort by descending count keeps ascending ids among ties.
    order = torch.sort(-counts.to(torch.float64), stable=True).indices
    chosen = torch.sort(ids[order[:draft_vocab_size]]).values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return chosen - torch.arange(draft_vocab_size), t2d


def full_vocab_maps(vocab_size: int) -> tuple[Tensor, Tensor]:
    """The identity mapping: the draft predicts over the whole target vocabulary."""
    return torch.zeros(vocab_size, dtype=torch.long), torch.ones(vocab_size, dtype=torch.bool)


def target_to_draft_index(t2d: Tensor) -> Tensor:
    """V int64: the draft id of each target id, −1 for tokens outside the draft vocabulary.
    (Shape ops only: it also runs on the meta device, where export checks build heads.)"""
    return torch.where(t2d, t2d.long().cumsum(0) - 1, -1)


def check_vocab_maps(d2t: Tensor, t2d: Tensor, draft_vocab_size: int, vocab_size: int) -> None:
    """Refuse maps that are not a draft vocabulary of ``draft_vocab_size`` tokens out of
    ``vocab_size``: the wrong lengths, t2d marking another number of tokens, d2t mapping a draft
    id to a target token t2d does not mark, or draft ids out of target-id order (the inverse
    map, :func:`target_to_draft_index`, numbers the marked tokens in order)."""
    if d2t.shape != (draft_vocab_size,) or t2d.shape != (vocab_size,):
        raise ValueError(
            f"draft vocabulary maps: d2t has shape {tuple(d2t.shape)} and t2d {tuple(t2d.shape)}; "
            f"expected ({draft_vocab_size},) and ({vocab_size},)"
        )
    if int(t2d.sum()) != draft_vocab_size:
        raise ValueError(
            f"draft vocabulary maps: t2d marks {int(t2d.sum())} tokens but d2t has {draft_vocab_size}"
        )
    ids = torch.arange(draft_vocab_size, device=d2t.device) + d2t
    if bool((ids < 0).any() | (ids >= vocab_size).any()) or not bool(t2d[ids.clamp(0, vocab_size - 1)].all()):
        raise ValueError("draft vocabulary maps: d2t maps draft ids to target tokens t2d does not mark")
    if not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("draft vocabulary maps: d2t must map draft ids to increasing target ids")
