"""The drafter of feature heads (EAGLE-1/2, EAGLE-3, HASS): autoregressive head steps on a
preallocated KV cache, chains and static trees grown on the host, EAGLE-2's dynamic tree grown on
tensors (docs/architecture.md §3, "Feature-head drafting")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from specdraft.data.kv_cache import grow_positions
from specdraft.data.packed_linear import pack_linear_weights
from specdraft.eval.drafters import (
    Chain,
    Draft,
    Drafter,
    DraftNode,
    DynamicTree,
    ScoreFilter,
    StaticTree,
    TreeGrowth,
    TreeShape,
)
from specdraft.eval.graphs import GraphedStep
from specdraft.eval.kernels import compiled_step
from specdraft.eval.runner import TargetOutput
from specdraft.eval.sampling import Sampling
from specdraft.eval.trees import tree_from_ancestors
from specdraft.heads.eagle import FeatureHead


@dataclass(frozen=True)
class DynamicLayout:
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
    def of(cls, shape: DynamicTree, device: torch.device) -> DynamicLayout:
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
        self._layouts: dict[DynamicTree, DynamicLayout] = {}
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
        growth = TreeGrowth([DraftNode(root, -1, 0, ())])
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

    def _static(self, growth: TreeGrowth, shape: StaticTree, expand: Callable[[list[int]], Tensor]) -> Draft:
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
            layout = self._layouts[shape] = DynamicLayout.of(shape, device)
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
