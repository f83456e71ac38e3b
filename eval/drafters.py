"""Drafters: what proposes the tokens the target verifies.

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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from specdraft.data.packed_linear import pack_linear_weights
from specdraft.eval.graphs import GraphedStep
from specdraft.eval.kernels import compiled_step
from specdraft.eval.runner import PositionalKVCache, TargetOutput, grow_positions
from specdraft.eval.sampling import Sampling
from specdraft.eval.trees import TreeBuffers, tree_buffers, tree_from_ancestors
from specdraft.heads.eagle import FeatureHead
from specdraft.heads.medusa import MedusaHead

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


TreeShape = Chain | StaticTree | DynamicTree


@dataclass
class Draft:
    """tokens n (node 0 = the root), the tree, and for a SAMPLED chain the draft distribution
    that produced each drafted token (depth×V over the target vocabulary; None otherwise)."""

    tokens: Tensor
    tree: TreeBuffers
    draft_probs: Tensor | None = None


@dataclass
class _Node:
    token: int  # target vocabulary id
    parent: int
    depth: int
    path: tuple[int, ...]
    score: float = 0.0  # cumulative draft log-probability


@dataclass
class _Growth:
    """A tree being drafted: node 0 is the root."""

    nodes: list[_Node] = field(default_factory=list)

    def add(self, token: int, parent: int, rank: int, score: float) -> int:
        up = self.nodes[parent]
        self.nodes.append(_Node(token, parent, up.depth + 1, (*up.path, rank), score))
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


@dataclass(frozen=True)
class _DynamicLayout:
    """What every round of a dynamic tree's growth on tensors shares, built once per shape: the
    candidates are numbered as they are created (the root, the top_k depth-1 nodes, then top_k²
    children per expansion), so these never change."""

    count: int  # candidates: the root, top_k at depth 1, top_k² per expansion
    start: Tensor  # count×count bool, the ancestor matrix before any expansion
    first_frontier: Tensor  # top_k: the depth-1 nodes
    children: tuple[Tensor, ...]  # per expansion (depth − 1 of them), the top_k² nodes it creates
    children_self: tuple[Tensor, ...]  # per expansion, top_k²×count bool: each of them sees itself
    own: Tensor  # top_k×top_k bool: frontier node i's own draft entry among this expansion's
    no_entries: Tensor  # top_k×0 bool: the depth-1 nodes see no draft entries
    root: Tensor  # 1 int64: node 0

    @classmethod
    def of(cls, shape: DynamicTree, device: torch.device) -> _DynamicLayout:
        k = shape.top_k
        count = 1 + k + (shape.depth - 1) * k * k
        identity = torch.eye(count, dtype=torch.bool, device=device)
        start = identity.clone()  # every node sees itself
        start[1 : k + 1, 0].fill_(True)  # the depth-1 nodes descend from the root (no host copy)
        children = tuple(
            torch.arange(1 + k + e * k * k, 1 + k + (e + 1) * k * k, device=device)
            for e in range(shape.depth - 1)
        )
        return cls(
            count,
            start,
            torch.arange(1, k + 1, device=device),
            children,
            tuple(identity[nodes] for nodes in children),
            torch.eye(k, dtype=torch.bool, device=device),
            torch.zeros(k, 0, dtype=torch.bool, device=device),
            torch.zeros(1, dtype=torch.long, device=device),
        )


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
        growth: _Growth,
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


class FeatureHeadDrafter(Drafter):
    """EAGLE-1/2 and EAGLE-3 heads. The head's KV cache holds one entry per committed position,
    computed from the TARGET's features (the accepted path's features are fed back after every
    verification); tree nodes get entries after the committed ones that live for one drafting
    round (the next commit overwrites them). The cache is one preallocated tensor written by
    position, read whole under a mask, so every head step has a static shape; with ``graphs``
    (on CUDA) each step size replays a CUDA graph (:mod:`specdraft.eval.graphs`). The dynamic
    tree (EAGLE-2) is grown on tensors: per depth one head step over the frontier, a top-k, a
    global top-k; no Python loop over nodes, nothing copied to the host. ``compile``: the head's
    step through ``torch.compile``."""

    def __init__(
        self,
        head: FeatureHead,
        shape: TreeShape,
        score_filter: ScoreFilter | None = None,
        vocab_shortlist: Tensor | None = None,
        compile: bool = False,
        graphs: bool = False,
    ) -> None:
        super().__init__(shape, score_filter)
        self.head = head
        self._step = compiled_step(head.step) if compile else head.step
        self._commit_graph = GraphedStep(self._commit_step, enabled=graphs)
        self._expand_graph = GraphedStep(self._expand_step, enabled=graphs)
        self._round_graph = GraphedStep(self._next_round_step, enabled=graphs)
        self.name = type(head).__name__
        self.dtype = next(head.parameters()).dtype
        self.device = next(head.parameters()).device
        self.vocab_size = head.spec.vocab_size
        self.shortlist: nn.Linear | None = None
        if vocab_shortlist is None:
            self.to_target = head.draft_to_target(torch.arange(head.draft_vocab_size, device=self.device))
        else:
            # FR-Spec-style drafting over the most frequent tokens only: the frozen lm_head is
            # the largest matmul of a drafting step, and verification keeps the output exact.
            ids = vocab_shortlist.long().unique().cpu()
            if ids.numel() == 0 or ids[0] < 0 or ids[-1] >= self.vocab_size:
                raise ValueError(f"vocab_shortlist: ids must lie in 0..{self.vocab_size - 1}")
            self.to_target = ids.to(self.device)
            weight = head.shortlist_weight(self.to_target).to(self.dtype).contiguous()
            self.shortlist = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=self.device)
            self.shortlist.weight = nn.Parameter(weight, requires_grad=False)
            pack_linear_weights(self.shortlist)  # a few rows per step: data/packed_linear.py's kernel
        spec = head.spec
        self.kv = torch.zeros(2, 1, spec.num_kv_heads, 0, spec.head_dim, dtype=self.dtype, device=self.device)
        self._slots = 0  # draft entries written after the committed ones this round
        self._layouts: dict[DynamicTree, _DynamicLayout] = {}
        self.reset()

    @property
    def _max_slots(self) -> int:
        """Draft entries one round writes at most (one per expanded node)."""
        shape = self.shape
        if isinstance(shape, DynamicTree):
            return (shape.depth - 1) * shape.top_k
        return len(shape.paths) if isinstance(shape, StaticTree) else shape.depth

    def _reserve(self, length: int) -> None:
        kv = self.kv
        self.kv = grow_positions(kv, length, keep=len(self.history))
        if self.kv is not kv:  # the graphs read and wrote the old cache
            for graph in (self._commit_graph, self._expand_graph, self._round_graph):
                graph.reset()

    def reset(self) -> None:
        super().reset()
        self.root_output: Tensor | None = None  # 1×1×H, the head's output at the last committed position
        self.root_log_probs: Tensor | None = None  # V', candidates for depth 1
        self._next_root: int | None = None  # the root the last commit announced

    def _head_step(
        self, features: Tensor, tokens: Tensor, positions: Tensor, write_index: Tensor, mask: Tensor
    ) -> Tensor:
        """One static head step over n positions: features 1×n×H, tokens and positions 1×n,
        write_index n (where their entries go), mask n×capacity additive (over the whole cache,
        these n entries included: they are written before the attention reads it). Returns
        their outputs 1×n×H."""
        out, _, _ = self._step(features, tokens, positions, mask, self.kv[0], self.kv[1], write_index)
        return out

    def _draft_log_probs(self, outputs: Tensor) -> Tensor:
        """n×H head outputs -> n×V' draft log-probs (fp32)."""
        logits = self.head.logits(outputs) if self.shortlist is None else self.shortlist(outputs)
        return logits.float().log_softmax(-1)

    def _expand_step(self, features, tokens, positions, write_index, mask) -> tuple[Tensor, Tensor]:
        """:meth:`_head_step` over tree nodes: their log-probs n×V' and outputs 1×n×H."""
        out = self._head_step(features, tokens, positions, write_index, mask)
        return self._draft_log_probs(out[0]), out

    def _commit_step(self, tokens, positions, write_index, mask, last, hidden, *aux) -> tuple[Tensor, Tensor]:
        """:meth:`_head_step` on the target's features (hidden 1×n×H[, aux 1×n×k·H]): the
        log-probs 1×V' at row ``last`` (0-dim: the last committed position; its candidates are
        depth 1's — the vocabulary projection is the step's largest matmul, so no other row is
        projected) and the output there 1×1×H."""
        features = self.head.initial_features(hidden, aux[0] if aux else None)
        out = self._head_step(features, tokens, positions, write_index, mask)
        root_output = out.index_select(1, last.view(1))
        return self._draft_log_probs(root_output[0]), root_output

    def _mask(self, past: int | Tensor, visible: Tensor) -> Tensor:
        """n×capacity additive: every committed entry (< ``past``, an int or a 0-dim tensor), and
        of this round's entries at past, past+1, … (the draft entries written so far, then the n
        being written) the ones ``visible`` (n×m bool) marks."""
        n, m, capacity = *visible.shape, self.kv.shape[-2]
        columns = torch.arange(capacity, device=self.device)
        mask = torch.full((n, capacity), float("-inf"), dtype=self.dtype, device=self.device)
        mask.masked_fill_(columns < past, 0)
        seen = torch.full((n, m), float("-inf"), dtype=self.dtype, device=self.device).masked_fill_(
            visible, 0
        )
        return mask.scatter_(1, (past + columns[:m]).expand(n, m), seen)

    @torch.no_grad()
    def commit(self, tokens: list[int], target: TargetOutput, next_token: int) -> None:
        past, count = len(self.history), len(tokens)
        self._reserve(past + count + self._max_slots)
        inputs = self._commit_inputs(
            past,
            torch.tensor([*tokens[1:], next_token], device=self.device),
            torch.full((), count - 1, device=self.device),
            target.hidden.to(self.device),
            None if target.aux is None else target.aux.to(self.device),
        )
        # A prompt's length does not recur: replay only what the decoding loop commits.
        step = self._commit_graph if count <= self.max_depth + 1 else self._commit_graph.eager
        log_probs, self.root_output = step(*inputs)
        super().commit(tokens, target, next_token)
        self._next_root = next_token
        context = [[*self.history, next_token]]
        self.root_log_probs = self._filtered(context, 0, log_probs, self.to_target)[0]

    def _commit_inputs(
        self, past: int | Tensor, following: Tensor, last: Tensor, hidden: Tensor, aux: Tensor | None
    ) -> list[Tensor]:
        """:meth:`_commit_step`'s arguments for n positions after ``past`` (an int or a 0-dim
        tensor): following n (the token after each), last 0-dim (the row whose candidates are
        drafted from), the target's hidden n×H[, aux n×k·H]; causal among the n."""
        n = len(following)
        written = past + torch.arange(n, device=self.device)
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril_()
        inputs = [following[None], written[None], written, self._mask(past, causal), last]
        return inputs + [x.to(self.dtype)[None] for x in (hidden, aux) if x is not None]

    def _expand(
        self,
        past: int | Tensor,
        features: Tensor,
        tokens: Tensor,
        depth: int,
        ancestors: Tensor,
        contexts: list[list[int]],
        graphed: bool = True,
    ) -> tuple[Tensor, Tensor]:
        """One head step over n same-depth tree nodes after ``past`` committed positions: their
        draft log-probs n×V' and outputs 1×n×H (valid until the next step of n nodes). features
        1×n×H (their parents' outputs), tokens n, ancestors n×S bool (which of this round's S
        earlier draft entries each node sees). Their entries are written next. ``graphed``: the
        step replays its own graph (not inside a graph being captured)."""
        n, slots = len(tokens), self._slots
        write_index = past + slots + torch.arange(n, device=self.device)
        positions = (past - 1 + depth) + torch.zeros(1, n, dtype=torch.long, device=self.device)
        # Each node sees the entries of its ancestors drafted earlier this round, and its own.
        visible = torch.cat([ancestors, torch.eye(n, dtype=torch.bool, device=self.device)], dim=1)
        mask = self._mask(past, visible)
        step = self._expand_graph if graphed else self._expand_step
        log_probs, out = step(features, tokens[None], positions, write_index, mask)
        self._slots += n
        return self._filtered(contexts, 0, log_probs, self.to_target), out

    @torch.no_grad()
    def draft(self, root: int, sampling: Sampling, generator: torch.Generator | None = None) -> Draft:
        if self._next_root is None or root != self._next_root:
            raise ValueError(f"draft(root={root}) but the last commit announced root {self._next_root}")
        self._slots = 0
        if isinstance(self.shape, DynamicTree):
            tokens, ancestors = self._dynamic(
                len(self.history), root, self.root_output, self.root_log_probs, self.shape, graphed=True
            )
            return Draft(tokens, tree_from_ancestors(ancestors))
        growth = _Growth([_Node(root, -1, 0, ())])
        outputs = {0: self.root_output}
        slot_of: dict[int, int] = {}  # expanded node -> its draft entry

        def expand(nodes: list[int]) -> Tensor:
            """One head step over same-depth ``nodes``: their log-probs n×V'."""
            ancestors = torch.zeros(len(nodes), self._slots, dtype=torch.bool)
            for i, node in enumerate(nodes):
                up = growth.nodes[node].parent
                while up > 0:
                    ancestors[i, slot_of[up]] = True
                    up = growth.nodes[up].parent
            features = torch.cat([outputs[growth.nodes[n].parent] for n in nodes], dim=1)
            tokens = torch.tensor([growth.nodes[n].token for n in nodes], device=self.device)
            contexts = [growth.context(self.history, n) for n in nodes] if self.score_filter else []
            first = self._slots
            log_probs, out = self._expand(
                len(self.history),
                features,
                tokens,
                growth.nodes[nodes[0]].depth,
                ancestors.to(self.device),
                contexts,
            )
            out = out.clone()  # a replayed step's outputs are overwritten by its next replay
            for i, n in enumerate(nodes):
                outputs[n], slot_of[n] = out[:, i : i + 1], first + i
            return log_probs

        if isinstance(self.shape, Chain):
            return self._chain(
                growth, self.root_log_probs, lambda n: expand([n])[0], self.to_target, sampling, generator
            )
        return self._static(growth, self.shape, expand)

    def _static(self, growth: _Growth, shape: StaticTree, expand: Callable[[list[int]], Tensor]) -> Draft:
        tree = self._memoised_tree(tuple(sorted(shape.paths, key=lambda p: (len(p), p))))
        width: dict[tuple[int, ...], int] = {}  # children needed per parent path
        for path in tree.paths:
            width[path[:-1]] = max(width.get(path[:-1], 0), path[-1] + 1)
        in_tree = set(tree.paths)
        by_path = {(): 0}
        depth = max(len(p) for p in tree.paths)
        for d in range(1, depth + 1):
            parents = [by_path[p] for p in by_path if len(p) == d - 1 and p in width]
            log_probs = self.root_log_probs[None] if d == 1 else expand(parents)
            for parent, row in zip(parents, log_probs, strict=False):
                parent_path = growth.nodes[parent].path
                top = row.topk(width[parent_path])
                for rank, (score, index) in enumerate(
                    zip(top.values.tolist(), top.indices.tolist(), strict=False)
                ):
                    if (*parent_path, rank) in in_tree:
                        node = growth.add(int(self.to_target[index]), parent, rank, score)
                        by_path[(*parent_path, rank)] = node
        return growth.draft(list(range(1, len(growth.nodes))), self._memoised_tree)

    @property
    def _device_shape(self) -> DynamicTree | None:
        """The shape as a dynamic tree, when rounds can run on the device: a dynamic tree, or a
        chain without a threshold (a dynamic tree of top_k 1)."""
        shape = self.shape
        if isinstance(shape, Chain) and shape.threshold is None:
            return DynamicTree(depth=shape.depth, top_k=1, total_tokens=shape.depth + 1)
        return shape if isinstance(shape, DynamicTree) else None

    def rounds_on_device(self, sampling: Sampling) -> bool:
        return sampling.greedy and self.score_filter is None and self._device_shape is not None

    @torch.no_grad()
    def first_round(self, length: int) -> tuple[Tensor, Tensor]:
        # Room for the last commit's padded rows and the drafts after it: nothing reallocates
        # (and invalidates the graphs) mid-sequence.
        self._reserve(length + self.max_depth + 1 + self._max_slots)
        self._slots = 0
        return self._dynamic(
            len(self.history),
            self._next_root,
            self.root_output,
            self.root_log_probs,
            self._device_shape,
            graphed=True,
        )

    @torch.no_grad()
    def next_round(self, past: Tensor, found: Tensor, *features: Tensor) -> tuple[Tensor, Tensor]:
        return self._round_graph(past, found, *features)

    def _next_round_step(
        self, past: Tensor, found: Tensor, hidden: Tensor, *aux: Tensor
    ) -> tuple[Tensor, Tensor]:
        """:meth:`next_round` as one fixed-shape step: the max_depth+1 committed rows (those past
        the accepted count are padding, written beyond the committed past and never read), then
        the tree after them."""
        count = found[0]
        log_probs, root_output = self._commit_step(
            *self._commit_inputs(past, found[2:], count, hidden, aux[0] if aux else None)
        )
        self._slots = 0
        return self._dynamic(
            past + count + 1,
            found[2:].index_select(0, count.view(1))[0],  # (a 0-dim index would be read on the host)
            root_output,
            log_probs[0],
            self._device_shape,
            graphed=False,
        )

    def _dynamic(
        self,
        past: int | Tensor,
        root: int | Tensor,
        root_output: Tensor,
        root_log_probs: Tensor,
        shape: DynamicTree,
        graphed: bool,
    ) -> tuple[Tensor, Tensor]:
        """EAGLE-2 on tensors after ``past`` committed positions, from the root (a token, or a
        0-dim tensor), the head's output there (1×1×H) and its depth-1 log-probs (V'). Returns
        the kept nodes' tokens n and ancestor matrix n×n (node 0 the root).

        Candidates are numbered as they are created — the root, the top_k depth-1 nodes, then
        top_k² children per depth — so a node's ancestors always come first and row i of
        ``ancestors`` (ancestors and itself) lists node i's path in order."""
        k, device = shape.top_k, self.device
        layout = self._layouts.get(shape)
        if layout is None:
            layout = self._layouts[shape] = _DynamicLayout.of(shape, device)
        count = layout.count
        # No Python scalars written into device tensors by indexing (a copy from the host, which a
        # CUDA capture forbids): fills, and masks built on the device.
        tokens = torch.zeros(count, dtype=torch.long, device=device)
        tokens[0].fill_(root)
        scores = torch.zeros(count, dtype=torch.float32, device=device)
        ancestors = layout.start.clone()
        top = root_log_probs.topk(k)
        frontier = layout.first_frontier
        tokens[frontier], scores[frontier] = self.to_target[top.indices], top.values
        features = root_output.expand(1, k, -1)
        frontier_sees = layout.no_entries  # the draft entries of this round each frontier node sees
        created = 1 + k
        for depth, (children, children_self) in enumerate(
            zip(layout.children, layout.children_self, strict=True), start=1
        ):
            contexts = (
                [[*self.history, *tokens[ancestors[n]].tolist()] for n in frontier.tolist()]
                if self.score_filter
                else []
            )
            log_probs, out = self._expand(
                past, features, tokens[frontier], depth, frontier_sees, contexts, graphed
            )
            top = log_probs.topk(k, dim=-1)  # k×k: each frontier node's best children
            child_scores = (scores[frontier, None] + top.values).flatten()
            created += k * k
            tokens[children] = self.to_target[top.indices.flatten()]
            scores[children] = child_scores
            parent_rows = ancestors[frontier, None].expand(k, k, count).reshape(k * k, count)
            ancestors[children] = parent_rows | children_self
            # The next frontier: the k best children overall, in creation order.
            best = child_scores.topk(k).indices.sort().values
            parent_row = best // k
            frontier = children[best]
            features = out[:, parent_row]
            frontier_sees = torch.cat([frontier_sees[parent_row], layout.own[parent_row]], dim=1)
        # Global rerank: the total_tokens − 1 best candidates. A stable sort keeps a parent
        # (created first, never lower-scored) ahead of its children, so the kept set is a tree.
        keep = min(shape.total_tokens - 1, created - 1)
        order = torch.sort(scores[1:created], descending=True, stable=True).indices[:keep] + 1
        nodes = torch.cat([layout.root, order.sort().values])
        return tokens[nodes], ancestors[nodes][:, nodes]


class MedusaDrafter(Drafter):
    """Medusa heads: head k ranks the token k+2 positions after the last committed one, all
    from that position's target hidden state, so a node's candidates do not depend on the
    drafted prefix and the tree is static (or a chain). ``compile``: the heads through
    ``torch.compile``."""

    name = "MedusaHead"

    def __init__(
        self,
        head: MedusaHead,
        shape: TreeShape,
        score_filter: ScoreFilter | None = None,
        compile: bool = False,
    ) -> None:
        if isinstance(shape, DynamicTree):
            raise ValueError(
                "Medusa heads draft chains or static trees, not dynamic trees: use a shape like "
                "{kind: static, rank_accept: [[0.6, 0.2], [0.4, 0.1]], num_nodes: 6} (methods=medusa)"
            )
        depth = shape.depth if isinstance(shape, Chain) else max(len(p) for p in shape.paths)
        if depth > head.num_heads:
            raise ValueError(
                f"a depth-{depth} draft needs {depth} Medusa heads; this head has {head.num_heads}"
            )
        super().__init__(shape, score_filter)
        self.head = head
        self._heads = compiled_step(head) if compile else head
        self.dtype = next(head.parameters()).dtype
        self.device = next(head.parameters()).device
        self.vocab_size = head.spec.vocab_size
        self.to_target = torch.arange(self.vocab_size, device=self.device)
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.last_hidden: Tensor | None = None

    def commit(self, tokens: list[int], target: TargetOutput, next_token: int) -> None:
        super().commit(tokens, target, next_token)
        self.last_hidden = target.hidden[-1:].to(self.device, self.dtype)

    @torch.no_grad()
    def draft(self, root: int, sampling: Sampling, generator: torch.Generator | None = None) -> Draft:
        log_probs = self._heads(self.last_hidden)[:, 0].float().log_softmax(-1)  # K×V
        if self.score_filter is not None:
            context = [*self.history, root]
            log_probs = torch.cat(
                [
                    self._filtered([context], k, log_probs[k : k + 1], self.to_target)
                    for k in range(len(log_probs))
                ]
            )
        growth = _Growth([_Node(root, -1, 0, ())])
        if isinstance(self.shape, Chain):
            step = lambda node: log_probs[growth.nodes[node].depth]  # noqa: E731
            return self._chain(growth, log_probs[0], step, self.to_target, sampling, generator)
        paths = sorted(self.shape.paths, key=lambda p: (len(p), p))
        width = [0] * max(len(p) for p in paths)
        for path in paths:
            width[len(path) - 1] = max(width[len(path) - 1], path[-1] + 1)
        ranked = [log_probs[d].topk(w) for d, w in enumerate(width)]
        by_path = {(): 0}
        for path in paths:
            top = ranked[len(path) - 1]
            rank = path[-1]
            by_path[path] = growth.add(
                int(top.indices[rank]), by_path[path[:-1]], rank, float(top.values[rank])
            )
        return growth.draft(list(range(1, len(growth.nodes))), self._memoised_tree)


def drafter_for_head(
    head: nn.Module,
    shape: TreeShape,
    vocab_shortlist: Tensor | None = None,
    compile: bool = False,
    graphs: bool = False,
) -> Drafter:
    """The drafter of a trained head — the one place that maps a head's kind to how it drafts:
    feature heads autoregressively (a shortlist applies to EAGLE-1/2), Medusa heads in parallel
    (a shortlist is ignored: its heads rank their own vocabulary). ``graphs``: CUDA graphs for the
    drafters whose steps have static shapes."""
    if isinstance(head, FeatureHead):
        return FeatureHeadDrafter(
            head, shape, vocab_shortlist=vocab_shortlist, compile=compile, graphs=graphs
        )
    if isinstance(head, MedusaHead):
        return MedusaDrafter(head, shape, compile=compile)
    raise ValueError(f"no drafter for a {type(head).__name__}")


class DraftModelDrafter(Drafter):
    """Classic speculative sampling (Leviathan et al. 2023; Chen et al. 2023, DeepMind): a small
    causal LM sharing the target's tokenizer drafts a chain with its own KV cache; at T>0 the
    drafts are sampled from it. After a rejection its cache is cropped back to the committed
    prefix. ``compile``: its forward through ``torch.compile``."""

    name = "draft_model"

    def __init__(
        self,
        model: PreTrainedModel,
        shape: Chain,
        score_filter: ScoreFilter | None = None,
        compile: bool = False,
    ) -> None:
        if not isinstance(shape, Chain):
            raise ValueError("a draft model drafts chains (shape Chain)")
        super().__init__(shape, score_filter)
        self.model = model
        self._forward = compiled_step(model) if compile else model
        self.vocab_size = model.get_output_embeddings().out_features
        parameter = next(model.parameters())
        self.to_target = torch.arange(self.vocab_size, device=parameter.device)
        # the cache is kept across sequences, written by position
        self.cache = PositionalKVCache.for_model(model, parameter.dtype, parameter.device)
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.fed = []
        self.cache.crop(0)

    @torch.no_grad()
    def _feed(self, tokens: list[int], contexts: list[list[int]]) -> Tensor:
        device = next(self.model.parameters()).device
        positions = torch.arange(len(self.fed), len(self.fed) + len(tokens), device=device)[None]
        self.cache.reserve(len(self.fed) + len(tokens))
        self.cache.write_at = len(self.fed)
        output = self._forward(
            input_ids=torch.tensor([tokens], device=device),
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.fed.extend(tokens)
        self.cache.write_at = len(self.fed)
        log_probs = output.logits[0, -1:].float().log_softmax(-1)
        return self._filtered(contexts, 0, log_probs, self.to_target)[0]

    def draft(self, root: int, sampling: Sampling, generator: torch.Generator | None = None) -> Draft:
        sequence = [*self.history, root]
        common = 0
        for fed, token in zip(self.fed, sequence, strict=False):
            if fed != token:
                break
            common += 1
        common = min(common, len(sequence) - 1)  # always feed at least the root
        self.cache.crop(common)
        self.fed = self.fed[:common]
        growth = _Growth([_Node(root, -1, 0, ())])
        first = self._feed(sequence[common:], [sequence] if self.score_filter else [])

        def step(node: int) -> Tensor:
            contexts = [growth.context(self.history, node)] if self.score_filter else []
            return self._feed([growth.nodes[node].token], contexts)

        return self._chain(growth, first, step, self.to_target, sampling, generator)
