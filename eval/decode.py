"""The decode loop: one loop for every drafter, and plain decoding on the same target runner.

    prefill(prompt) -> root ~ p(· | prompt)
    repeat: draft a tree under the root -> verify it in one target forward (the drafter sees
            the whole tree's output: lookahead decoding learns from it) -> accept a path
            (+ one token from the target) -> compact the target's KV cache -> feed the accepted
            path's target features back to the drafter

The acceptance rule follows the sampling settings: greedy matching at T=0; at T>0 speculative
sampling for a sampled chain, recursive rejection sampling for a tree; Medusa's typical
acceptance only when asked for, and it is lossy.

At T=0, on a static runner (``graphs``) with a drafter whose rounds need nothing from the host,
a step is two device calls and ONE host sync (:func:`_greedy_on_device`): the drafter's round
(commit the accepted path, draft the next tree) and the target's greedy verification (verify,
accept, move the accepted entries), each replayed from a CUDA graph; then the accepted tokens
come back. Everything else in between runs on the host while the device works.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from torch import Tensor

from specdraft.data.generate import greedy_tokens
from specdraft.eval.acceptance import (
    greedy_accept,
    speculative_sample_chain,
    tree_rejection_sample,
    typical_accept,
)
from specdraft.eval.drafters import Drafter
from specdraft.eval.runner import TargetRunner
from specdraft.eval.sampling import Sampling


@dataclass(frozen=True)
class Typical:
    """Medusa typical acceptance (LOSSY): accept x when p(x) > min(epsilon, delta·exp(−H(p))).
    The defaults live in conf/bench.yaml (``typical``)."""

    epsilon: float
    delta: float


@dataclass
class StepRecord:
    """One draft → verify → accept round: tree size, tree depth, drafts accepted, seconds spent."""

    nodes: int
    depth: int
    accepted: int
    draft_s: float
    verify_s: float
    bookkeeping_s: float


@dataclass
class Generation:
    """The generated tokens (EOS included when reached) and how they were obtained."""

    tokens: list[int]
    prefill_s: float | None  # None when the generator does not expose it (HF generate)
    total_s: float
    stop: str  # "eos" | "length"
    steps: list[StepRecord] = field(default_factory=list)

    @property
    def target_forwards(self) -> int:
        """Target forwards after the prefill (plain decoding: one per token after the first)."""
        return len(self.steps)


def cut_at_stop(
    tokens: list[int], max_new_tokens: int, eos_ids: Collection[int]
) -> tuple[list[int], str | None]:
    """Cut at the first EOS (kept) or at max_new_tokens; the stop reason, or None to go on."""
    for i, token in enumerate(tokens[:max_new_tokens]):
        if token in eos_ids:
            return tokens[: i + 1], "eos"
    if len(tokens) >= max_new_tokens:
        return tokens[:max_new_tokens], "length"
    return tokens, None


def check_budget(runner: TargetRunner, prompt_ids: Tensor, max_new_tokens: int, extra: int) -> None:
    limit = getattr(runner.model.config, "max_position_embeddings", None)
    if limit is not None and len(prompt_ids) + max_new_tokens + extra > limit:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) + draft depth ({extra}) "
            f"exceeds the target's max_position_embeddings={limit}"
        )


class _Stopwatch:
    """Phase boundaries inside a step without a host sync: CUDA events on a GPU (read once the
    sequence is done), the host clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> float | torch.cuda.Event:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, begin, end) -> float:
        """Between two marks (on a GPU, once both were reached: after a sync)."""
        return begin.elapsed_time(end) / 1000 if self.cuda else end - begin


def device_clock(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device`` has finished its queued work (CUDA runs ahead of
    the host)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.no_grad()
def plain_generate(
    runner: TargetRunner,
    prompt_ids: Tensor,
    max_new_tokens: int,
    sampling: Sampling,
    eos_ids: Collection[int],
    generator: torch.Generator | None = None,
) -> Generation:
    """Token-by-token decoding on the same runner (the speedup baseline)."""
    check_budget(runner, prompt_ids, max_new_tokens, 0)
    runner.reserve(len(prompt_ids) + max_new_tokens)
    device = runner.target.device
    start = device_clock(device)
    output = runner.prefill(prompt_ids)
    prefill_s = device_clock(device) - start
    tokens = [sampling.choose(output.logits[-1], generator)]
    steps = []
    while (stop := cut_at_stop(tokens, max_new_tokens, eos_ids)[1]) is None:
        begin = device_clock(device)
        output = runner.extend(torch.tensor(tokens[-1:]))
        tokens.append(sampling.choose(output.logits[-1], generator))
        steps.append(StepRecord(1, 0, 0, 0.0, device_clock(device) - begin, 0.0))
    return Generation(tokens, prefill_s, device_clock(device) - start, stop, steps)


@torch.no_grad()
def speculative_generate(
    runner: TargetRunner,
    drafter: Drafter,
    prompt_ids: Tensor,
    max_new_tokens: int,
    sampling: Sampling,
    eos_ids: Collection[int],
    generator: torch.Generator | None = None,
    typical: Typical | None = None,
) -> Generation:
    """Speculative decoding of one prompt; lossless unless ``typical`` is given."""
    if sampling.greedy and typical is None and runner.static and drafter.rounds_on_device(sampling):
        return _greedy_on_device(runner, drafter, prompt_ids, max_new_tokens, eos_ids)
    check_budget(runner, prompt_ids, max_new_tokens, drafter.max_depth)
    runner.reserve(len(prompt_ids) + max_new_tokens + drafter.max_depth + 1)
    device = runner.target.device
    start = device_clock(device)
    output = runner.prefill(prompt_ids)
    prefill_s = device_clock(device) - start
    root = sampling.choose(output.logits[-1], generator)
    drafter.reset()
    drafter.commit(prompt_ids.tolist(), output, root)
    tokens, steps = [root], []
    stop = cut_at_stop(tokens, max_new_tokens, eos_ids)[1]
    while stop is None:
        begin = device_clock(device)
        draft = drafter.draft(root, sampling, generator)
        drafted = device_clock(device)
        output = runner.verify(draft.tokens, draft.tree)
        verified = device_clock(device)
        drafter.verified(output)
        nodes, accepted_tokens, root = accept_draft(draft, output.logits, sampling, generator, typical)
        runner.commit(nodes)
        tokens.extend([*accepted_tokens[1:], root])
        drafter.observe(draft.tree.num_nodes - 1, len(nodes) - 1)
        stop = cut_at_stop(tokens, max_new_tokens, eos_ids)[1]
        if stop is None:  # no drafting state is needed after the end
            drafter.commit(accepted_tokens, output.rows(nodes), root)
        depth = int(draft.tree.depths.max())
        steps.append(
            StepRecord(
                draft.tree.num_nodes,
                depth,
                len(nodes) - 1,
                drafted - begin,
                verified - drafted,
                device_clock(device) - verified,
            )
        )
    # Cut what the last step accepted beyond the end.
    tokens, stop = cut_at_stop(tokens, max_new_tokens, eos_ids)
    return Generation(tokens, prefill_s, device_clock(device) - start, stop, steps)


def _greedy_on_device(
    runner: TargetRunner, drafter: Drafter, prompt_ids: Tensor, max_new_tokens: int, eos_ids: Collection[int]
) -> Generation:
    """Greedy speculative decoding with each step on the device (see the module docstring).
    A step's record counts the drafter's round (the commit of the last accepted path included)
    as drafting and the target's acceptance and cache move as verification."""
    depth = drafter.max_depth
    check_budget(runner, prompt_ids, max_new_tokens, depth)
    runner.reserve(len(prompt_ids) + max_new_tokens + depth + 1)
    device = runner.target.device
    start = device_clock(device)
    output = runner.prefill(prompt_ids)
    prefill_s = device_clock(device) - start
    root = greedy_tokens(output.logits[-1]).item()
    drafter.reset()
    drafter.commit(prompt_ids.tolist(), output, root)
    tokens, stop = [root], cut_at_stop([root], max_new_tokens, eos_ids)[1]
    clock, marks = _Stopwatch(device), []
    found, next_past, features = None, None, []  # what the last verification found, and where
    while stop is None:
        begin = clock.mark()
        if found is None:
            tree_tokens, ancestors = drafter.first_round(len(prompt_ids) + max_new_tokens)
            # Room for the last tree: the cache (and the graphs on it) stay put until the end.
            runner.reserve(len(prompt_ids) + max_new_tokens + max(len(tree_tokens), depth + 1))
            past = torch.full((), runner.length, dtype=torch.long, device=device)
        else:  # the path found at `past`, committed; the next tree after it
            tree_tokens, ancestors = drafter.next_round(past, found, *features)
            past = next_past
        drafted = clock.mark()
        found, next_past, *features = runner.verify_greedy(past, tree_tokens, ancestors, depth)
        verified = clock.mark()
        count, tree_depth, *follow = found.tolist()  # the step's one host sync
        runner.advance(count)
        tokens.extend(follow[: count + 1])
        marks.append((len(tree_tokens), tree_depth, count, begin, drafted, verified, clock.mark()))
        stop = cut_at_stop(tokens, max_new_tokens, eos_ids)[1]
    total_s = device_clock(device) - start
    steps = [
        StepRecord(nodes, depth, count, clock.seconds(a, b), clock.seconds(b, c), clock.seconds(c, d))
        for nodes, depth, count, a, b, c, d in marks
    ]
    tokens, stop = cut_at_stop(tokens, max_new_tokens, eos_ids)
    return Generation(tokens, prefill_s, total_s, stop, steps)


def accept_draft(
    draft, logits: Tensor, sampling: Sampling, generator, typical: Typical | None
) -> tuple[list[int], list[int], int]:
    """The accepted nodes (root first, in path order), their tokens, and the next token."""
    tree = draft.tree
    if sampling.greedy:  # typical acceptance degrades to greedy matching at T=0 too
        # On the logits' device; ONE host transfer per step: the path, its tokens, the count
        # and the next token together.
        retrieve = tree.retrieve_indices.to(logits.device)
        tokens = draft.tokens.to(logits.device)
        path_argmax = greedy_tokens(logits)[retrieve.clamp(min=0)]
        candidates = torch.where(retrieve[:, 1:] >= 0, tokens[retrieve[:, 1:].clamp(min=0)], -1)
        row, count = greedy_accept(candidates, path_argmax)
        path = retrieve[row]
        found = torch.cat([path, tokens[path.clamp(min=0)], count[None], path_argmax[row, count][None]])
        found, width = found.tolist(), len(path)
        accepted = found[-2] + 1
        return found[:accepted], found[width : width + accepted], found[-1]
    probs = sampling.probs(logits)  # on the target's device, like the generator
    if typical is not None:
        accepted, next_token = typical_accept(
            draft.tokens, tree.retrieve_indices, probs, typical.epsilon, typical.delta, generator
        )
        nodes = [0, *accepted]
    elif draft.draft_probs is not None:  # a sampled chain: nodes 0..D in order
        count, next_token = speculative_sample_chain(draft.tokens[1:], draft.draft_probs, probs, generator)
        nodes = list(range(count + 1))
    else:
        accepted, next_token = tree_rejection_sample(draft.tokens, tree.parents, probs, generator)
        nodes = [0, *accepted]
    return nodes, draft.tokens[nodes].tolist(), next_token
