"""Prompt-lookup n-grams inside a head's draft tree (docs/architecture.md §4 "N-gram branches").

A head cannot learn what the prompt holds verbatim; an n-gram from the context can. Here the
context (the committed tokens and the root) is searched for earlier occurrences of its last
``max_ngram`` … ``min_ngram`` tokens, latest first, and what followed each occurrence — up to
``tokens`` tokens, at most ``branches`` different continuations — becomes a path under the root
beside the head's candidates, verified in the same target forward. A path shares the nodes the
head already drafted (same parent, same token); the nodes it adds count against the tree's
budget: the head's last-created leaves (its deepest, lowest-ranked candidates) make room.

Lossless as every tree: greedy matching takes the longest path the target agrees with; at T>0
the tree's recursive rejection sampling accepts any proposed child with the target's probability
of it, whatever proposed it: a sampled chain with branches is verified so too, even where its
own tokens spell them (see :func:`with_branches`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specdraft.eval.drafters import Chain, Draft, Drafter, DynamicTree, StaticTree, TreeShape
from specdraft.eval.runner import TargetOutput
from specdraft.eval.sampling import Sampling
from specdraft.eval.trees import tree_from_parents


@dataclass(frozen=True)
class NgramBranches:
    """Which continuations of the context become branches: the longest ``tokens``, matched on
    the context's last ``max_ngram`` down to ``min_ngram`` tokens, at most ``branches`` of them.
    The defaults live in conf/bench.yaml (``ngram``)."""

    tokens: int
    max_ngram: int
    min_ngram: int
    branches: int

    def __post_init__(self) -> None:
        if min(self.tokens, self.min_ngram, self.branches) < 1 or self.max_ngram < self.min_ngram:
            raise ValueError(
                f"n-gram branches need tokens, branches >= 1 and 1 <= min_ngram <= max_ngram, got {self}"
            )


def continuations(
    context: list[int], positions: dict[int, list[int]], settings: NgramBranches
) -> list[list[int]]:
    """Up to ``settings.branches`` different continuations of ``context`` found in it: for n from
    ``max_ngram`` down to ``min_ngram``, each earlier occurrence of its last n tokens (latest
    first) followed by up to ``settings.tokens`` tokens. ``positions[t]`` lists where token t
    occurs in ``context`` (ascending; the last position may be absent)."""
    found: list[list[int]] = []
    end = len(context)
    for n in range(min(settings.max_ngram, end - 1), settings.min_ngram - 1, -1):
        tail = context[end - n :]
        for last in reversed(positions.get(tail[-1], [])):
            start = last - n + 1
            if last >= end - 1 or start < 0 or context[start : last + 1] != tail:
                continue
            following = context[last + 1 : last + 1 + settings.tokens]
            if following not in found:
                found.append(following)
                if len(found) == settings.branches:
                    return found
    return found


def node_budget(shape: TreeShape) -> int:
    """The most nodes (the root included) a drafter of ``shape`` verifies at once."""
    if isinstance(shape, Chain):
        return shape.depth + 1
    if isinstance(shape, StaticTree):
        return len(shape.paths) + 1
    assert isinstance(shape, DynamicTree)
    return shape.total_tokens


def with_branches(draft: Draft, branches: list[list[int]], budget: int) -> Draft:
    """``draft`` with each branch as a path under its root, sharing the nodes it already has, then
    cut back to ``budget`` nodes by dropping the draft's last-created leaves that no branch uses
    (its node order is creation order: parents first, deeper and lower-ranked candidates later)."""
    tokens, parents = draft.tokens.tolist(), draft.tree.parents.tolist()
    children: dict[tuple[int, int], int] = {
        (p, t): node for node, (p, t) in enumerate(zip(parents, tokens, strict=True)) if p >= 0
    }
    on_branch: set[int] = set()
    for branch in branches:
        node = 0
        for token in branch:
            child = children.get((node, token))
            if child is None:
                child = len(tokens)
                tokens.append(token)
                parents.append(node)
                children[(node, token)] = child
            on_branch.add(child)
            node = child
    if len(tokens) == draft.tree.num_nodes:  # every branch was drafted already
        # Verified as a tree all the same: had a sampled chain kept its speculative sampling only
        # when its sampled tokens happen to spell a branch, that choice would condition on them,
        # and speculative sampling is lossless only over the draft's distribution, not given it.
        return Draft(draft.tokens, draft.tree)
    kept = [True] * len(tokens)
    child_count = [0] * len(tokens)
    for parent in parents[1:]:
        child_count[parent] += 1
    surplus = len(tokens) - budget
    for node in range(draft.tree.num_nodes - 1, 0, -1):
        if surplus <= 0:
            break
        if child_count[node] == 0 and node not in on_branch:
            kept[node] = False
            child_count[parents[node]] -= 1
            surplus -= 1
    index = {old: new for new, old in enumerate(i for i, keep in enumerate(kept) if keep)}
    kept_nodes = list(index)
    tree = tree_from_parents([index[parents[i]] if i else -1 for i in kept_nodes])
    device = draft.tokens.device
    return Draft(torch.tensor([tokens[i] for i in kept_nodes], device=device), tree)


class NgramBranchDrafter(Drafter):
    """A head's drafter with :func:`continuations` of the context as extra branches of its trees
    (:func:`with_branches`), within the head's tree budget. The head drafts, commits and
    learns as it would alone: its trees never depend on the branches, and what the target
    commits it reads from the target, whichever branch proposed it."""

    def __init__(self, inner: Drafter, settings: NgramBranches) -> None:
        super().__init__(inner.shape)
        self.inner, self.settings = inner, settings
        self.name = f"{inner.name}+ngram"
        self.budget = node_budget(inner.shape)
        if settings.tokens * settings.branches > self.budget - 1:
            raise ValueError(
                f"n-gram branches of {settings.tokens} tokens × {settings.branches} need up to "
                f"{settings.tokens * settings.branches} nodes; the tree holds {self.budget - 1} "
                "besides the root"
            )
        self.positions: dict[int, list[int]] = {}  # token -> where it occurs in the history

    @property
    def max_depth(self) -> int:
        return max(self.inner.max_depth, self.settings.tokens)

    def candidate_shapes(self) -> list[dict[str, Any]]:
        return self.inner.candidate_shapes()

    def reset(self) -> None:
        super().reset()
        self.inner.reset()
        self.positions = {}

    def commit(self, tokens: list[int], target: TargetOutput, next_token: int) -> None:
        for offset, token in enumerate(tokens, start=len(self.history)):
            self.positions.setdefault(token, []).append(offset)
        super().commit(tokens, target, next_token)
        self.inner.commit(tokens, target, next_token)

    def draft(self, root: int, sampling: Sampling, generator: torch.Generator | None = None) -> Draft:
        draft = self.inner.draft(root, sampling, generator)
        branches = continuations([*self.history, root], self.positions, self.settings)
        return with_branches(draft, branches, self.budget) if branches else draft

    def verified(self, output: TargetOutput) -> None:
        self.inner.verified(output)

    def observe(self, drafted: int, accepted: int) -> None:
        self.inner.observe(drafted, accepted)
