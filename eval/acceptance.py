"""Acceptance rules of speculative decoding (pure functions over one sequence's tensors).

* Greedy: the longest drafted prefix that matches the target's argmax, plus the target's token.
* Speculative sampling for a chain (lossless): accept draft x with probability min(1, p(x)/q(x));
  on rejection sample from norm(max(0, p − q)); if every draft is accepted, sample a bonus from p.
* Recursive rejection sampling for a tree whose children are deterministic top-k drafts (q = 1
  for each tried sibling, lossless): at a node, try its children in rank order, accepting child
  c with probability p(c); after a rejection set p(c) = 0 and renormalise; if every child is
  rejected, sample from what is left of p. An accepted child becomes the node.

p is always the target's distribution after the same temperature / top-p / top-k processing
plain decoding uses; these functions only see the processed probabilities.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor


def greedy_accept(candidates: Tensor, target_argmax: Tensor) -> tuple[Tensor, Tensor]:
    """candidates L×D (drafted tokens along each root-to-leaf path, −1 padded), target_argmax
    L×(D+1) (the target's argmax at each node of the path, the root first).

    Returns (best path row, number of accepted drafts) as 0-dim tensors on the inputs' device
    (no host sync); the committed tokens are candidates[row, :n] followed by
    target_argmax[row, n]."""
    matches = (candidates == target_argmax[:, :-1]).long().cumprod(dim=1)
    accepted = matches.sum(dim=1)
    row = accepted.argmax()
    return row, accepted[row]


def greedy_accept_tree(
    tokens: Tensor, ancestors: Tensor, target_argmax: Tensor, max_depth: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Greedy acceptance on a tree given by its ancestor matrix, in fixed-shape tensor ops (no
    host sync: a CUDA graph can hold it). tokens n (node 0 = the root), ancestors n×n bool (row
    i: node i's ancestors and itself; ancestors come first), target_argmax n (the target's
    argmax at each node, i.e. for the token after it).

    A drafted node matches when its token is its parent's argmax; it is accepted when it and
    every ancestor match. Siblings carry distinct tokens (the top-k of one distribution), so the
    accepted nodes form one path; its deepest node is where the target's token comes from.
    Returns (path max_depth+1: the accepted nodes in depth order, root first, padded with the
    deepest; count: drafts accepted; next token), all on the inputs' device."""
    n = len(tokens)
    order = torch.arange(n, device=tokens.device)
    depths = ancestors.sum(-1) - 1
    # The parent is the deepest proper ancestor: the last one, as ancestors come first.
    proper = ancestors & (order[:, None] != order[None, :])
    parents = order.expand(n, n).masked_fill(~proper, -1).amax(-1)
    matches = (tokens == target_argmax[parents.clamp(min=0)]) | (parents < 0)
    accepted = ~(ancestors & ~matches).any(-1)
    # A 1-element index, not a 0-dim one: indexing by a 0-dim tensor reads it on the host.
    deepest = depths.masked_fill(~accepted, -1).argmax().view(1)
    # On a root-to-node path every node has its own depth: depth d goes to slot d (the nodes
    # off the path to a slot past the end, which is dropped).
    slots = depths.masked_fill(~ancestors.index_select(0, deepest)[0], max_depth + 1)
    path = deepest.expand(max_depth + 2).clone().scatter_(0, slots, order)[: max_depth + 1]
    return path, depths.index_select(0, deepest)[0], target_argmax.index_select(0, deepest)[0]


def _sample(probs: Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def speculative_sample_chain(
    draft_tokens: Tensor, draft_probs: Tensor, target_probs: Tensor, generator: torch.Generator | None = None
) -> tuple[int, int]:
    """draft_tokens K (sampled from draft_probs), draft_probs K×V, target_probs (K+1)×V.

    Returns (number of accepted drafts n, the next token): the committed tokens are
    draft_tokens[:n] followed by the next token."""
    for i, token in enumerate(draft_tokens.tolist()):
        p, q = target_probs[i, token], draft_probs[i, token]
        u = torch.rand((), generator=generator, device=target_probs.device)
        if u * q <= p:  # u < min(1, p/q), without dividing by q
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp(min=0)
        return i, _sample(residual / residual.sum(), generator)
    return len(draft_tokens), _sample(target_probs[-1], generator)


def tree_rejection_sample(
    tokens: Tensor, parents: Tensor, target_probs: Tensor, generator: torch.Generator | None = None
) -> tuple[list[int], int]:
    """tokens n (each node's drafted token; the root's is ignored), parents n (−1 for the root;
    children in rank order have increasing node index), target_probs n×V (the target's
    distribution at each node, i.e. for the token after it).

    Returns (the accepted nodes from the root's child down, the next token)."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents.tolist()):
        if parent >= 0:
            children.setdefault(parent, []).append(node)
    accepted: list[int] = []
    node = 0
    while True:
        p = target_probs[node].clone()
        for child in children.get(node, []):
            token = int(tokens[child])
            if torch.rand((), generator=generator, device=p.device) < p[token]:
                accepted.append(child)
                node = child
                break
            p[token] = 0
            p = p / p.sum()
        else:  # every child rejected (or a leaf): the target's own token from what is left
            return accepted, _sample(p, generator)


def typical_accept(
    tokens: Tensor,
    retrieve_indices: Tensor,
    target_probs: Tensor,
    epsilon: float,
    delta: float,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int]:
    """Medusa's typical acceptance — LOSSY: the output distribution is NOT the target's.

    Along each root-to-leaf path (retrieve_indices L×(D+1), −1 padded) a drafted token x is
    accepted when p(x) > min(epsilon, delta·exp(−H(p))), p being the target's distribution at
    its parent. The longest accepted prefix wins (the first on ties); the next token is sampled
    from p at its last node. Returns (accepted nodes from the root's child down, next token)."""
    entropy = -(target_probs * target_probs.clamp(min=1e-30).log()).sum(-1)
    threshold = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))
    best: list[int] = []
    for row in retrieve_indices.tolist():
        path = [n for n in row if n >= 0]
        accepted = []
        for parent, child in itertools.pairwise(path):
            if target_probs[parent, tokens[child]] <= threshold[parent]:
                break
            accepted.append(child)
        if len(accepted) > len(best):
            best = accepted
    last = best[-1] if best else 0
    return best, _sample(target_probs[last], generator)
