"""What every drafter shares: the interface (what proposes the tokens the target verifies), the
tree shapes it drafts, and the tree grown node by node on the host.

Every drafter follows the decode loop's rhythm (:mod:`specdraft.eval.decode`):

* ``reset()`` before a new sequence;
* ``commit(tokens, target_output, next_token)``: the target has committed ``tokens`` (the
  prompt, or the root plus the accepted drafts) and produced ``target_output`` for them;
  ``next_token`` is the new root, sampled from the target but not yet run by it;
* ``draft(root, sampling, generator) -> Draft``: a tree whose node 0 is the root;
* ``verified(target_output)``: the target's output over every node of that tree;
* ``observe(drafted, accepted)``: feedback for adaptive policies.

At T=0 a drafter whose rounds need nothing from the host (``rounds_on_device``) runs them on
tensors instead: ``first_round`` after the prompt's commit, then ``next_round`` (commit what the
target's greedy verification found + draft the next tree, one CUDA graph) every step.

Tree shapes: :class:`Chain` (top-1 at T=0; sampled from the draft at T>0, for lossless
speculative sampling; optionally cut by an adaptive confidence threshold), :class:`StaticTree`
(paths of sibling ranks, e.g. Medusa choices) and :class:`DynamicTree` (EAGLE-2: expand the
top-k frontier by cumulative draft log-probability, then keep the best nodes globally).

Tests plug oracle / adversarial drafts in through ``score_filter``: it sees each candidate
distribution with the context it is conditioned on, and may rewrite it.

The drafters themselves live beside this module: :mod:`specdraft.eval.feature_drafter` (EAGLE
heads), :mod:`specdraft.eval.medusa_drafter` and :mod:`specdraft.eval.block_drafter` (DFlash),
both on :mod:`specdraft.eval.parallel_drafter` (every depth ranked in one forward),
:mod:`specdraft.eval.draft_model` (a draft LM) and :mod:`specdraft.eval.lookahead`;
:func:`specdraft.eval.methods.drafter_for_head` picks a trained head's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from specdraft.eval.runner import TargetOutput
from specdraft.eval.sampling import Sampling
from specdraft.eval.trees import TreeBuffers, tree_buffers

# (context tokens, how many tokens after the context the candidates are for (0 = the next
# one), log-probs V over the target vocabulary) -> rewritten log-probs V.
ScoreFilter = Callable[[list[int], int, Tensor], Tensor]


@dataclass(frozen=True)
class Chain:
    """Draft ``depth`` tokens in a line. ``threshold`` (threshold drafting): stop early once the
    draft's cumulative probability of the chain falls below it; the threshold adapts after
    every step, down by ``threshold_step`` when the whole chain was accepted (draft further)
    and up by it otherwise, within [threshold_min, threshold_max]."""

    depth: int = 5
    threshold: float | None = None
    threshold_step: float = 0.05
    threshold_min: float = 0.01
    threshold_max: float = 0.9

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"chain depth must be >= 1, got {self.depth}")
        if self.threshold is not None and not self.threshold_min <= self.threshold <= self.threshold_max:
            raise ValueError(
                f"chain threshold {self.threshold} outside [{self.threshold_min}, {self.threshold_max}]"
            )


@dataclass(frozen=True)
class StaticTree:
    """A fixed tree of sibling-rank paths (see :mod:`specdraft.eval.trees`)."""

    paths: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2: ``depth`` expansion levels of the ``top_k`` best frontier nodes (each with
    ``top_k`` children), then the ``total_tokens − 1`` best drafted nodes overall (+ the root)."""

    depth: int = 5
    top_k: int = 10
    total_tokens: int = 60

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 2:
            raise ValueError(f"dynamic tree needs depth, top_k >= 1 and total_tokens >= 2, got {self}")
        if self.total_tokens > self.max_total_tokens:
            raise ValueError(
                f"dynamic tree depth={self.depth}, top_k={self.top_k}: total_tokens={self.total_tokens} is "
                f"more than the {self.max_total_tokens} nodes it can hold (1 + top_k + (depth - 1)·top_k²)"
            )

    @property
    def max_total_tokens(self) -> int:
        """The root and every candidate the expansion drafts: the most nodes a tree can keep."""
        return 1 + self.top_k + (self.depth - 1) * self.top_k**2


TreeShape = Chain | StaticTree | DynamicTree


@dataclass
class Draft:
    """tokens n (node 0 = the root), the tree, and for a SAMPLED chain the draft distribution
    that produced each drafted token (depth×V over the target vocabulary; None otherwise)."""

    tokens: Tensor
    tree: TreeBuffers
    draft_probs: Tensor | None = None


@dataclass
class DraftNode:
    token: int  # target vocabulary id
    parent: int
    depth: int
    path: tuple[int, ...]
    score: float = 0.0  # cumulative draft log-probability


@dataclass
class TreeGrowth:
    """A tree being drafted: node 0 is the root."""

    nodes: list[DraftNode] = field(default_factory=list)

    def add(self, token: int, parent: int, rank: int, score: float) -> int:
        up = self.nodes[parent]
        self.nodes.append(DraftNode(token, parent, up.depth + 1, (*up.path, rank), score))
        return len(self.nodes) - 1

    def context(self, history: list[int], node: int) -> list[int]:
        """The committed tokens plus the tokens of ``node`` and its ancestors (root included)."""
        path = []
        while node >= 0:
            path.append(self.nodes[node].token)
            node = self.nodes[node].parent
        return history + path[::-1]

    def draft(self, keep: list[int], tree_of: Callable[[tuple[tuple[int, ...], ...]], TreeBuffers]) -> Draft:
        """The Draft of nodes ``keep``; ``tree_of(paths)`` builds (or recalls) their buffers."""
        tree = tree_of(tuple(sorted((self.nodes[i].path for i in keep), key=lambda p: (len(p), p))))
        by_path = {self.nodes[i].path: self.nodes[i].token for i in keep}
        tokens = torch.tensor([self.nodes[0].token, *(by_path[p] for p in tree.paths)])
        return Draft(tokens, tree)


class Drafter:
    """Shared bookkeeping: the committed history, the score filter, the chain threshold."""

    name = "drafter"

    def __init__(self, shape: TreeShape, score_filter: ScoreFilter | None = None) -> None:
        self.shape, self.score_filter = shape, score_filter
        self.history: list[int] = []
        self.threshold = shape.threshold if isinstance(shape, Chain) else None
        self._trees: dict[tuple[tuple[int, ...], ...], TreeBuffers] = {}

    @property
    def max_depth(self) -> int:
        shape = self.shape
        return max(len(p) for p in shape.paths) if isinstance(shape, StaticTree) else shape.depth

    def _memoised_tree(self, paths: tuple[tuple[int, ...], ...]) -> TreeBuffers:
        """Buffers of a recurring shape (chains, static trees), built once."""
        tree = self._trees.get(paths)
        if tree is None:
            tree = self._trees[paths] = tree_buffers(paths)
        return tree

    def candidate_shapes(self) -> list[dict[str, Any]]:
        """Shape configs (``{kind: chain, depth: 8}``, …) that ``shape: auto`` tries for this
        drafter beside the configured candidates (:func:`specdraft.eval.autoshape.choose_shape`):
        shapes the configured list cannot know, such as a block drafter's deep chains. None here."""
        return []

    def reset(self) -> None:
        self.history = []
        self.threshold = self.shape.threshold if isinstance(self.shape, Chain) else None

    def commit(self, tokens: list[int], target: TargetOutput, next_token: int) -> None:
        self.history.extend(tokens)

    def draft(self, root: int, sampling: Sampling, generator: torch.Generator | None = None) -> Draft:
        raise NotImplementedError

    def verified(self, output: TargetOutput) -> None:
        """The target's output over the whole draft just verified (every node, accepted or not):
        lookahead decoding reads its next Jacobi iteration from it; the others need nothing."""

    # -- rounds on the device (greedy decoding, fixed shapes; see decode.py) -------------------
    def rounds_on_device(self, sampling: Sampling) -> bool:
        """Whether this drafter can run greedy rounds on device tensors alone (:meth:`first_round`,
        :meth:`next_round`): fixed-shape trees, no host-side state, nothing read back."""
        return False

    def first_round(self, length: int) -> tuple[Tensor, Tensor]:
        """After :meth:`commit` of the prompt, for a sequence of up to ``length`` tokens: the
        first tree, as (tokens n, ancestors n×n bool; node 0 the root)."""
        raise NotImplementedError

    def next_round(self, past: Tensor, found: Tensor, *features: Tensor) -> tuple[Tensor, Tensor]:
        """Commit what :meth:`~specdraft.eval.runner.TargetRunner.verify_greedy` found when it
        ran after ``past`` committed positions (its ``found``, and the target's features at the
        positions it committed: past, past+1, …), and draft the next tree after them: (tokens
        n, ancestors n×n)."""
        raise NotImplementedError

    def observe(self, drafted: int, accepted: int) -> None:
        """Adapt the chain threshold: lower it after a fully accepted chain, raise it otherwise."""
        if self.threshold is None:
            return
        shape = self.shape
        step = -shape.threshold_step if accepted >= drafted else shape.threshold_step
        self.threshold = min(shape.threshold_max, max(shape.threshold_min, self.threshold + step))

    # -- helpers for subclasses -------------------------------------------------------------------
    def _filtered(
        self, contexts: list[list[int]], ahead: int, log_probs: Tensor, to_target: Tensor
    ) -> Tensor:
        """Apply the score filter (tests only) to n×V' log-probs over vocabulary ids ``to_target``."""
        if self.score_filter is None:
            return log_probs
        vocab = self.vocab_size
        rows = []
        for context, row in zip(contexts, log_probs, strict=False):
            full = torch.full((vocab,), float("-inf"), dtype=row.dtype, device=row.device)
            full = full.index_copy(0, to_target, row)
            rows.append(self.score_filter(context, ahead, full)[to_target])
        return torch.stack(rows).log_softmax(-1)

    def _chain(
        self,
        growth: TreeGrowth,
        first: Tensor,
        step: Callable[[int], Tensor],
        to_target: Tensor,
        sampling: Sampling,
        generator: torch.Generator | None,
    ) -> Draft:
        """Grow a chain from the root: ``first`` are the log-probs V' for depth 1, ``step(node)``
        gives them after ``node``. Sampled (with the draft distributions) unless greedy."""
        depth = self.shape.depth
        log_probs, probs, cumulative, node = first, [], 1.0, 0
        for d in range(1, depth + 1):
            if sampling.greedy:
                index = int(log_probs.argmax())
                q = None
            else:
                q = sampling.probs(log_probs)
                index = int(torch.multinomial(q, 1, generator=generator))
            chosen_prob = float(log_probs[index].exp())
            if self.threshold is not None and d > 1 and cumulative * chosen_prob < self.threshold:
                break
            cumulative *= chosen_prob
            node = growth.add(int(to_target[index]), node, 0, 0.0)
            if q is not None:
                probs.append(torch.zeros(self.vocab_size, device=q.device).index_copy_(0, to_target, q))
            if d < depth:
                log_probs = step(node)
        result = growth.draft(list(range(1, len(growth.nodes))), self._memoised_tree)
        result.draft_probs = torch.stack(probs) if probs else None
        return result
