"""Acceptance rules: greedy on literal tensors; sampling reproduces the target's distribution
(chi-square over the first two emitted tokens on a 4-token vocabulary), and a wrong rule fails."""

from __future__ import annotations

import torch

from specdraft.eval.acceptance import greedy_accept, speculative_sample_chain, tree_rejection_sample
from specdraft.eval.sampling import greedy_tokens
from specdraft.eval.trees import tree_buffers

VOCAB = 4
TRIALS = 8000
CHI2_CRITICAL_DF15_P001 = 37.70  # 16 cells → 15 degrees of freedom, p = 0.001


def test_greedy_accept_literal():
    candidates = torch.tensor([[5, 6, 7], [5, 8, -1], [9, 1, 2]])
    target_argmax = torch.tensor([[5, 6, 0, 3], [5, 8, 4, 4], [1, 1, 1, 1]])
    assert tuple(map(int, greedy_accept(candidates, target_argmax))) == (
        0,
        2,
    )  # commit 5, 6 then the target's 0
    assert tuple(map(int, greedy_accept(torch.tensor([[3]]), torch.tensor([[4, 4]])))) == (
        0,
        0,
    )  # only the target's 4


class ToyModel:
    """A next-token distribution for every prefix, fixed by a seed (a stand-in LM)."""

    def __init__(self, seed: int, sharpness: float) -> None:
        self.seed, self.sharpness, self.table = seed, sharpness, {}

    def __call__(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in self.table:
            generator = torch.Generator().manual_seed(hash((self.seed, prefix)) % 2**31)
            logits = torch.randn(VOCAB, generator=generator, dtype=torch.float64) * self.sharpness
            self.table[prefix] = logits.softmax(-1)
        return self.table[prefix]


TARGET, DRAFT = ToyModel(1, 1.5), ToyModel(2, 1.0)


def chi_square(emit) -> float:
    """Run ``emit(generator) -> list of tokens`` TRIALS times; chi-square of the first two tokens
    against the target (a second token not emitted is sampled from the target, as the next
    decoding round would)."""
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for _ in range(TRIALS):
        tokens = emit(generator)
        if len(tokens) < 2:
            tokens.append(int(torch.multinomial(TARGET((tokens[0],)), 1, generator=generator)))
        counts[tokens[0], tokens[1]] += 1
    expected = torch.stack([TARGET(())[a] * TARGET((a,)) for a in range(VOCAB)]) * TRIALS
    return float(((counts - expected) ** 2 / expected).sum())


def chain_emit(rule):
    def emit(generator):
        drafts, draft_probs = [], []
        for _ in range(2):
            q = DRAFT(tuple(drafts))
            draft_probs.append(q)
            drafts.append(int(torch.multinomial(q, 1, generator=generator)))
        target_probs = torch.stack([TARGET(tuple(drafts[:i])) for i in range(3)])
        accepted, token = rule(torch.tensor(drafts), torch.stack(draft_probs), target_probs, generator)
        return [*drafts[:accepted], token]

    return emit


def wrong_chain_rule(draft_tokens, draft_probs, target_probs, generator):
    """On rejection, resample from p instead of the residual max(0, p − q): biased."""
    for i, token in enumerate(draft_tokens.tolist()):
        if torch.rand((), generator=generator) * draft_probs[i, token] > target_probs[i, token]:
            return i, int(torch.multinomial(target_probs[i], 1, generator=generator))
    return len(draft_tokens), int(torch.multinomial(target_probs[-1], 1, generator=generator))


def test_chain_speculative_sampling_preserves_the_target_distribution():
    assert chi_square(chain_emit(speculative_sample_chain)) < CHI2_CRITICAL_DF15_P001
    assert chi_square(chain_emit(wrong_chain_rule)) > 10 * CHI2_CRITICAL_DF15_P001


PATHS = [[0], [1], [2], [0, 0], [0, 1], [1, 0]]


def tree_emit(rule):
    buffers = tree_buffers(PATHS)

    def emit(generator):
        # Deterministic top-k drafts: the r-th most likely draft token under each node's context.
        contexts: dict[tuple[int, ...], tuple[int, ...]] = {(): ()}
        tokens = [0]
        for path in buffers.paths:
            context = contexts[path[:-1]]
            token = int(DRAFT(context).argsort(descending=True)[path[-1]])
            contexts[path] = (*context, token)
            tokens.append(token)
        target_probs = torch.stack([TARGET(contexts[p]) for p in ((), *buffers.paths)])
        accepted, token = rule(torch.tensor(tokens), buffers.parents, target_probs, generator)
        return [tokens[node] for node in accepted] + [token]

    return emit


def wrong_tree_rule(tokens, parents, target_probs, generator):
    """Tries the root's children but, after rejecting them all, samples from the ORIGINAL p."""
    children = [n for n, parent in enumerate(parents.tolist()) if parent == 0]
    for child in children:
        if torch.rand((), generator=generator) < target_probs[0, tokens[child]]:
            return [child], int(torch.multinomial(target_probs[child], 1, generator=generator))
    return [], int(torch.multinomial(target_probs[0], 1, generator=generator))


def test_tree_rejection_sampling_preserves_the_target_distribution():
    assert chi_square(tree_emit(tree_rejection_sample)) < CHI2_CRITICAL_DF15_P001
    assert chi_square(tree_emit(wrong_tree_rule)) > 10 * CHI2_CRITICAL_DF15_P001


def test_greedy_tokens_take_the_first_maximum_like_argmax():
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randint(0, 40, (64, 5000), generator=generator).float() / 8).bfloat16()  # many ties
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
    assert int(greedy_tokens(torch.tensor([1.0, 3.0, 3.0]))) == 1
