"""Lookahead decoding (Fu et al., ICML 2024): speculation without a draft model.

Each step drafts one tree under the root, which the decode loop verifies in its one target
forward like any other draft (:mod:`specdraft.eval.decode`). The tree has two branches:

* **the lookahead branch**, a window of Jacobi iterations: ``N − 1`` levels (oldest first) of
  ``W`` guesses. Level ``l``'s guess in column ``k`` sits ``k + l + 1`` positions after the root
  and attends to the root, level 0's guesses in columns ``0..k``, then the diagonal — level 1
  to ``l`` in column ``k`` (the paper's Figure 5). Each of these sets is one path, so the window
  IS a tree: level 0 is a chain under the root, level ``l`` column ``k`` hangs under level
  ``l − 1`` column ``k``. The target's argmax at the newest level, column ``k``, is the next
  iteration's guess there; with the diagonal above it, it makes an ``N``-gram for the pool.
  After the step the levels move up one (the oldest is dropped, the new guesses are the newest).
* **the verification branch**: up to ``G`` of the pool's ``N``-grams that start with the root
  (the most recently found first), merged into a trie.

Every root-to-leaf path is a candidate for the acceptance rule — greedy matching at T=0,
recursive rejection sampling over deterministic candidates at T>0 — so the output is the
target's whichever branch a path comes from (a lookahead path accepted is Jacobi decoding's
own convergence). The window starts from the prompt's first tokens; it finds n-grams once it
has run ``N − 1`` iterations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdraft.eval.drafters import Draft, Drafter
from specdraft.eval.runner import TargetOutput
from specdraft.eval.sampling import Sampling
from specdraft.eval.trees import tree_from_parents


@dataclass(frozen=True)
class Lookahead:
    """``window`` W guesses per level, ``ngram`` N (N − 1 levels; N = 2 is plain Jacobi
    decoding), at most ``guesses`` G pool n-grams verified per step (0: the lookahead branch
    alone), at most ``pool_per_token`` n-grams kept per first token (the most recent)."""

    window: int
    ngram: int
    guesses: int
    pool_per_token: int

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"lookahead window W must be >= 1, got {self.window}")
        if self.ngram < 2:
            raise ValueError(f"lookahead n-gram size N must be >= 2, got {self.ngram}")
        if self.guesses < 0:
            raise ValueError(f"lookahead guesses G must be >= 0, got {self.guesses}")
        if self.pool_per_token < max(1, self.guesses):
            raise ValueError(
                f"lookahead pool_per_token must be >= max(1, guesses={self.guesses}), "
                f"got {self.pool_per_token}"
            )


class LookaheadDrafter(Drafter):
    """Drafts lookahead decoding's two branches (module docstring); learns from the target's
    output over the whole tree (:meth:`verified`)."""

    name = "lookahead"

    def __init__(self, settings: Lookahead) -> None:
        super().__init__(settings)  # type: ignore[arg-type]  # no TreeShape: the tree is lookahead's own
        self.settings = settings
        self.levels: list[list[int]] = []  # N−1 levels × W guesses, oldest level first
        self.pool: dict[int, dict[tuple[int, ...], None]] = {}  # first token -> continuations, oldest first
        self._newest: list[int] = []  # node index of each newest-level guess in the last draft

    @property
    def max_depth(self) -> int:
        """The deepest window guess (newest level, last column); the trie is never deeper (W ≥ 1)."""
        return self.settings.window + self.settings.ngram - 2

    def reset(self) -> None:
        super().reset()
        self.levels, self.pool, self._newest = [], {}, []

    def commit(self, tokens: list[int], target: TargetOutput, next_token: int) -> None:
        super().commit(tokens, target, next_token)
        if not self.levels:  # the first commit is the prompt: seed the window with its tokens
            history, window = self.history, self.settings.window
            self.levels = [
                [history[(k + level) % len(history)] for k in range(window)]
                for level in range(self.settings.ngram - 1)
            ]

    def draft(self, root: int, sampling: Sampling, generator: torch.Generator | None = None) -> Draft:
        tokens, parents = [root], [-1]

        def add(token: int, parent: int) -> int:
            tokens.append(token)
            parents.append(parent)
            return len(tokens) - 1

        # Verification branch: the most recent pool n-grams after the root, as a trie.
        children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        found = list(self.pool.get(root, {}))[::-1][: self.settings.guesses]
        for continuation in found:
            node = 0
            for token in continuation:
                child = children.get((node, token))
                if child is None:
                    child = children[(node, token)] = add(token, node)
                node = child
        # Lookahead branch: level 0 is a chain under the root; level l, column k under level l−1, column k.
        above = [0] * self.settings.window
        for level, guesses in enumerate(self.levels):
            for k, token in enumerate(guesses):
                parent = (above[k - 1] if k else 0) if level == 0 else above[k]
                above[k] = add(token, parent)
        self._newest = list(above)
        return Draft(torch.tensor(tokens), tree_from_parents(parents))

    def verified(self, output: TargetOutput) -> None:
        """The next Jacobi iteration (the target's argmax at each newest-level guess), the
        n-grams it completes into the pool, and the levels moved up one."""
        new = output.logits[self._newest].argmax(-1).tolist()
        limit = self.settings.pool_per_token
        for k, token in enumerate(new):
            first, *rest = [level[k] for level in self.levels]
            grams = self.pool.setdefault(first, {})
            continuation = (*rest, token)
            grams.pop(continuation, None)  # found again: now the most recent
            grams[continuation] = None
            if len(grams) > limit:
                del grams[next(iter(grams))]
        self.levels = [*self.levels[1:], new]
