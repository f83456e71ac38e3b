"""The decode loop's invariants on a tiny fp32 target whose greedy output does not repeat
(conftest.diverse_target; docs/architecture.md §6):

* greedy speculative output == plain greedy output, for untrained, oracle and adversarial
  drafts × chain, static tree, dynamic tree × Medusa, EAGLE, EAGLE-3 (and a draft model);
* the oracle accepts the whole tree depth at every step, the adversary nothing;
* sampling through the whole loop reproduces the target's distribution over whole emitted
  blocks, the bonus token included (chi-square of every prefix), with and without prompt-lookup
  n-gram branches in the trees, and runs on the target's device
  (on the default tiny target, whose peaked distributions let whole blocks be accepted);
* every distribution a feature-head drafter scores candidates with equals the head run from
  scratch on that node's path (greedy equality is blind to bugs that only lower acceptance).
"""

from __future__ import annotations

import pytest
import torch
from conftest import prefix_chi_squares, reference_probs

from specdraft.data.features import TokenBatch, extract_features
from specdraft.data.target import target_weights
from specdraft.data.tiny import tiny_random_target
from specdraft.eval.autoshape import accepted_along
from specdraft.eval.decode import Typical, plain_generate, speculative_generate
from specdraft.eval.draft_model import DraftModelDrafter
from specdraft.eval.drafters import Chain, DynamicTree, StaticTree
from specdraft.eval.feature_drafter import FeatureHeadDrafter
from specdraft.eval.medusa_drafter import MedusaDrafter
from specdraft.eval.methods import build_method, method_shortlist
from specdraft.eval.ngram_branches import NgramBranchDrafter, NgramBranches
from specdraft.eval.runner import TargetRunner
from specdraft.eval.sampling import Sampling
from specdraft.eval.trees import best_static_tree
from specdraft.heads.layers import causal_mask
from specdraft.heads.registry import build_head

MAX_NEW = 40
GREEDY = Sampling()
SHAPES = {
    "chain": Chain(depth=4),
    "static": StaticTree(tuple(best_static_tree([[0.6, 0.2, 0.1], [0.5, 0.2], [0.5, 0.2], [0.5]], 12))),
    "dynamic": DynamicTree(depth=4, top_k=3, total_tokens=10),
}
HEADS = {
    "medusa": {"num_heads": 4, "num_layers": 1, "own_lm_head": False},
    "eagle": {"fc_bias": False},
    "eagle3": {"draft_vocab_size": None},
    "eagle3-reduced": {"draft_vocab_size": 200},
}


def random_head(target, kind: str):
    torch.manual_seed(1)
    head = build_head(kind.removesuffix("-reduced"), HEADS[kind], target.spec, target_weights(target))
    # eagle3-reduced: a draft vocabulary of the 200 lowest ids, which tests d2t on the way.
    head.choose_vocabulary(lambda: torch.zeros(target.spec.vocab_size).index_fill_(0, torch.arange(200), 1.0))
    with torch.no_grad():  # untrained, but not the near-identity of a fresh init
        for parameter in head.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return head.eval()


def drafter_for(head, kind: str, shape, score_filter=None):
    if kind == "medusa":
        return MedusaDrafter(head, shape, score_filter)
    return FeatureHeadDrafter(head, shape, score_filter)


def runner_for(target, kind: str) -> TargetRunner:
    return TargetRunner(target, target.spec.aux_layer_ids if kind.startswith("eagle3") else ())


def prompt_ids(target, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, target.spec.vocab_size, (12,), generator=generator)


def reference_filter(reference: list[int], oracle: bool):
    """Oracle: put the true continuation first; adversary: never propose it."""

    def score_filter(context: list[int], ahead: int, scores: torch.Tensor) -> torch.Tensor:
        index = len(context) + ahead
        if context != reference[: len(context)] or index >= len(reference):
            return scores
        scores = scores.clone()
        scores[reference[index]] = scores.max() + 30.0 if oracle else float("-inf")
        return scores

    return score_filter


@pytest.fixture(scope="module")
def plain(diverse_target):
    prompt = prompt_ids(diverse_target)
    generation = plain_generate(TargetRunner(diverse_target), prompt, MAX_NEW, GREEDY, ())
    return prompt, generation.tokens


@pytest.mark.parametrize("draft", ["untrained", "oracle", "adversarial"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", list(HEADS))
def test_greedy_speculative_equals_plain(diverse_target, plain, kind, shape, draft):
    if kind == "medusa" and shape == "dynamic":
        pytest.skip("Medusa candidates do not depend on the drafted prefix: static trees only")
    if kind == "eagle3-reduced" and draft == "oracle":
        pytest.skip("the true continuation may lie outside a reduced draft vocabulary")
    prompt, expected = plain
    reference = prompt.tolist() + expected
    score_filter = None if draft == "untrained" else reference_filter(reference, draft == "oracle")
    drafter = drafter_for(random_head(diverse_target, kind), kind, SHAPES[shape], score_filter)
    generation = speculative_generate(runner_for(diverse_target, kind), drafter, prompt, MAX_NEW, GREEDY, ())
    assert generation.tokens == expected
    accepted = [step.accepted for step in generation.steps]
    if draft == "oracle":
        assert all(step.accepted == step.depth == 4 for step in generation.steps[:-1]), accepted
        assert len(generation.steps) == -(-(MAX_NEW - 1) // 5)  # 1 + 5 per step
    elif draft == "adversarial":
        assert accepted == [0] * (MAX_NEW - 1)


def test_greedy_stops_at_eos_and_equals_plain(diverse_target):
    """EOS inside an accepted path ends the output right after it, as in plain decoding."""
    prompt = prompt_ids(diverse_target, seed=3)
    free = plain_generate(TargetRunner(diverse_target), prompt, MAX_NEW, GREEDY, ()).tokens
    eos = free[17]  # pretend a mid-sequence token ends the turn
    expected = plain_generate(TargetRunner(diverse_target), prompt, MAX_NEW, GREEDY, {eos})
    assert expected.stop == "eos" and expected.tokens == free[: free.index(eos) + 1]
    reference = prompt.tolist() + free
    drafter = FeatureHeadDrafter(
        random_head(diverse_target, "eagle"), SHAPES["dynamic"], reference_filter(reference, True)
    )
    generation = speculative_generate(TargetRunner(diverse_target), drafter, prompt, MAX_NEW, GREEDY, {eos})
    assert (generation.tokens, generation.stop) == (expected.tokens, "eos")


def test_draft_model_and_threshold_chain_equal_plain(diverse_target, plain):
    """Classic speculative decoding with a (different) small LM, fixed and threshold chains."""
    from specdraft.data.tiny import tiny_random_target

    prompt, expected = plain
    draft_model = tiny_random_target(seed=5).model
    for shape in (Chain(depth=3), Chain(depth=6, threshold=0.3)):
        drafter = DraftModelDrafter(draft_model, shape)
        generation = speculative_generate(TargetRunner(diverse_target), drafter, prompt, MAX_NEW, GREEDY, ())
        assert generation.tokens == expected
    threshold = FeatureHeadDrafter(random_head(diverse_target, "eagle"), Chain(depth=6, threshold=0.3))
    generation = speculative_generate(TargetRunner(diverse_target), threshold, prompt, MAX_NEW, GREEDY, ())
    assert generation.tokens == expected
    assert {step.depth for step in generation.steps} != {6}  # the threshold did cut some chains


def test_the_threshold_chain_drafts_further_after_a_fully_accepted_chain(diverse_target):
    """The threshold falls by its step after a chain accepted whole (draft further next time),
    rises after a rejection, and stays within [threshold_min, threshold_max]."""
    shape = Chain(depth=6, threshold=0.3, threshold_step=0.05, threshold_min=0.2, threshold_max=0.4)
    drafter = FeatureHeadDrafter(random_head(diverse_target, "eagle"), shape)
    drafter.observe(drafted=6, accepted=6)
    assert drafter.threshold == pytest.approx(0.25)
    drafter.observe(drafted=6, accepted=2)
    drafter.observe(drafted=3, accepted=0)
    assert drafter.threshold == pytest.approx(0.35)
    for _ in range(5):
        drafter.observe(drafted=6, accepted=1)
    assert drafter.threshold == pytest.approx(0.4)
    for _ in range(10):
        drafter.observe(drafted=6, accepted=6)
    assert drafter.threshold == pytest.approx(0.2)


def test_draft_model_oracle_accepts_the_whole_chain(diverse_target, plain):
    prompt, expected = plain
    drafter = DraftModelDrafter(diverse_target.model, Chain(depth=3))  # the target drafting for itself
    generation = speculative_generate(TargetRunner(diverse_target), drafter, prompt, MAX_NEW, GREEDY, ())
    assert generation.tokens == expected
    assert all(step.accepted == 3 for step in generation.steps[:-1])


# -- sampling: the emitted distribution is the target's -----------------------------------------
# Wiring, not power: a bonus drawn from the wrong row emits blocks outside the target's top-2
# support within a few hundred trials (mutation-checked); the 5 %-bias power lives in
# test_acceptance.py, whose trials are 100× cheaper.
TRIALS = 1000
TOP2 = Sampling(temperature=1.0, top_k=2)  # 2 tokens per step -> 16 four-token blocks
DRAFT_DEPTH = 2
BLOCK = 1 + DRAFT_DEPTH + 1  # the root, the drafts and the bonus token after full acceptance


# Top-k and top-p together: the top token alone often reaches 0.9 of the top-2 mass, so the
# nucleus cut (the crossing token kept) runs inside verification too.
TOP2_NUCLEUS = Sampling(temperature=1.0, top_k=2, top_p=0.9)


def target_block_probabilities(
    target, prompt: torch.Tensor, length: int, sampling: Sampling = TOP2
) -> dict[tuple[int, ...], float]:
    """Exact P(t_1 … t_length) under ``sampling``, from plain forwards and the independent
    reference of the filters (conftest.reference_probs), never the decoder's own Sampling.probs."""
    table: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.no_grad():
        for _ in range(length):
            grown = {}
            for block, p in table.items():
                ids = torch.cat([prompt, torch.tensor(block, dtype=torch.long)])[None]
                logits = target.model(input_ids=ids).logits[0, -1]
                probs = reference_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
                for token, q in enumerate(probs):
                    if q > 0:
                        grown[(*block, token)] = p * q
            table = grown
    return table


def near_target_filter(target, strength: float):
    """Draft scores = the target's own top-4 log-probs + fixed noise: drafts that are often, not
    always, accepted (a draft outside the target's top 2 always fails), so acceptance, rejection
    and the bonus after full acceptance all run."""
    cache = {}
    top4 = Sampling(temperature=1.0, top_k=4)

    def score_filter(context: list[int], ahead: int, scores: torch.Tensor) -> torch.Tensor:
        key = (tuple(context), ahead)
        if key not in cache:
            with torch.no_grad():
                context = list(context)
                for _ in range(ahead):  # a Medusa head `ahead` tokens on: along the target's argmax
                    context.append(
                        int(target.model(input_ids=torch.tensor([context])).logits[0, -1].argmax())
                    )
                logits = target.model(input_ids=torch.tensor([context])).logits[0, -1].float()
            noise = torch.randn(logits.shape, generator=torch.Generator().manual_seed(len(cache)))
            cache[key] = top4.probs(logits).log() + strength * noise
        return cache[key]

    return score_filter


# Prompt-lookup branches after every root (eval/ngram_branches.py): the prompt below opens with
# every token id once, so each root's 1-gram is found there. Their nodes come out of the tree's
# budget, so the trees below leave the head room to be accepted whole too.
BRANCHES = NgramBranches(tokens=DRAFT_DEPTH, max_ngram=1, min_ngram=1, branches=1)
ONE_TOKEN_BRANCH = NgramBranches(tokens=1, max_ngram=1, min_ngram=1, branches=1)


@pytest.mark.parametrize(
    "kind,shape,sampling,ngram",
    [
        ("eagle", Chain(depth=DRAFT_DEPTH), TOP2, None),
        ("eagle", DynamicTree(depth=DRAFT_DEPTH, top_k=2, total_tokens=5), TOP2, None),
        ("medusa", StaticTree(((0,), (1,), (0, 0), (1, 0))), TOP2, None),
        ("eagle", DynamicTree(depth=DRAFT_DEPTH, top_k=2, total_tokens=5), TOP2_NUCLEUS, None),
        ("eagle", DynamicTree(depth=DRAFT_DEPTH, top_k=2, total_tokens=7), TOP2, BRANCHES),
        ("eagle", Chain(depth=DRAFT_DEPTH + 1), TOP2, ONE_TOKEN_BRANCH),
    ],
    ids=[
        "eagle-chain",
        "eagle-dynamic-tree",
        "medusa-static-tree",
        "eagle-dynamic-tree-top-p",
        "eagle-dynamic-tree-ngram-branches",
        "eagle-sampled-chain-ngram-branches",
    ],
)
def test_sampling_reproduces_the_target_distribution(tiny_target, kind, shape, sampling, ngram):
    """The first BLOCK tokens — the root, then the first round's drafts and its bonus token (or a
    later round's tokens after a rejection) — follow the target's distribution, every prefix of
    them (conftest.prefix_chi_squares); with n-gram branches beside the head's candidates too
    (a sampled chain that gains one is verified as a tree)."""
    prompt = prompt_ids(tiny_target, seed=7)
    if ngram is not None:
        every_token = torch.randperm(tiny_target.spec.vocab_size, generator=torch.Generator().manual_seed(3))
        prompt = torch.cat([every_token, prompt])
    expected = target_block_probabilities(tiny_target, prompt, BLOCK, sampling)
    drafter = drafter_for(random_head(tiny_target, kind), kind, shape, near_target_filter(tiny_target, 0.5))
    runner = runner_for(tiny_target, kind)
    generator = torch.Generator().manual_seed(0)
    if ngram is not None:
        drafter = NgramBranchDrafter(drafter, ngram)
        # The branch is there: what followed the root's latest occurrence, drafted under it.
        output, context = runner.prefill(prompt), prompt.tolist()
        root = int(output.logits[-1].argmax())
        drafter.reset()
        drafter.commit(context, output, root)
        last = len(context) - 1 - context[::-1].index(root)
        branch = [*context, root][last + 1 : last + 1 + ngram.tokens]
        assert accepted_along(drafter.draft(root, sampling, generator), branch) == len(branch) > 0
    counts: dict[tuple[int, ...], int] = {}
    outcomes = {"accepted all": 0, "rejected some": 0}
    for _ in range(TRIALS):
        generation = speculative_generate(runner, drafter, prompt, BLOCK, sampling, (), generator)
        block = tuple(generation.tokens)
        counts[block] = counts.get(block, 0) + 1
        step = generation.steps[0]
        outcomes["accepted all"] += step.accepted == step.depth
        outcomes["rejected some"] += step.accepted < step.depth
    results = prefix_chi_squares(counts, expected)
    assert all(statistic < critical for statistic, critical in results), (results, counts)
    assert min(outcomes.values()) > 0.05 * TRIALS, outcomes  # both branches of the rule ran


def test_vocab_shortlist_keeps_greedy_output_and_drafts_inside_it(diverse_target, plain):
    prompt, expected = plain
    shortlist = torch.arange(3, 150)
    head = random_head(diverse_target, "eagle")
    drafter = FeatureHeadDrafter(head, SHAPES["dynamic"], vocab_shortlist=shortlist)
    generation = speculative_generate(TargetRunner(diverse_target), drafter, prompt, MAX_NEW, GREEDY, ())
    assert generation.tokens == expected
    drafter.reset()
    runner = TargetRunner(diverse_target)
    output = runner.prefill(prompt)
    drafter.commit(prompt.tolist(), output, expected[0])
    draft = drafter.draft(expected[0], GREEDY)
    assert draft.tokens[1:].min() >= 3 and draft.tokens[1:].max() < 150
    with pytest.raises(ValueError, match="eagle3 drafts over its own vocabulary"):
        FeatureHeadDrafter(random_head(diverse_target, "eagle3"), SHAPES["chain"], vocab_shortlist=shortlist)


def test_method_shortlist_setting_picks_the_run_size_a_size_or_none():
    sizes = []

    def shortlist(size=None):
        sizes.append(size)
        return torch.arange(size or 8)

    assert method_shortlist("m", False, shortlist) is None
    assert len(method_shortlist("m", True, shortlist)) == 8  # the run's own size
    assert len(method_shortlist("m", 5, shortlist)) == 5
    assert sizes == [None, 5]
    for bad in (0, -3, "8k", 2.5):
        with pytest.raises(ValueError, match="method m: shortlist must be true, false or a positive"):
            method_shortlist("m", bad, shortlist)


# -- drafting: every node's draft distribution is the head's, run from scratch on its path --------
def head_from_scratch(target, head, context: list[int], committed: int) -> torch.Tensor:
    """Draft log-probs V after ``context`` = committed tokens + [root, n_1, …, n_d]: the head
    reads the target's features of the committed tokens (one plain target forward), then runs
    the path's draft steps one by one with a plain causal KV cache — no tree, no masks to get
    wrong, positions counted by hand."""
    history, path = context[:committed], context[committed:]
    ones = torch.ones(1, committed, dtype=torch.long)
    features = extract_features(
        target, TokenBatch(torch.tensor([history]), ones, ones), aux_layer_ids=target.spec.aux_layer_ids
    )
    with torch.no_grad():
        level1 = head.initial_features(features.hidden, features.aux)
        following = torch.tensor([[*history[1:], path[0]]])
        out, keys, values = head.step(
            level1, following, torch.arange(committed)[None], causal_mask(committed)
        )
        out = out[:, -1:]
        for depth, token in enumerate(path[1:], start=1):
            out, key, value = head.step(
                out,
                torch.tensor([[token]]),
                torch.tensor([[committed - 1 + depth]]),
                torch.zeros(1, committed + depth),
                keys,
                values,
            )
            keys, values = torch.cat([keys, key], dim=2), torch.cat([values, value], dim=2)
        return head.logits(out[0, 0]).float().log_softmax(-1)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_every_drafted_node_scores_like_the_head_on_its_path(diverse_target, kind, shape):
    """Greedy equality is blind to drafting bugs that only lower acceptance (a node that sees its
    siblings, a rotary position off by one): compare every distribution the drafter scores
    candidates with — at the root after each commit, and at every expanded tree node — with the
    head run from scratch on that node's path."""
    seen: list[tuple[list[int], int, torch.Tensor]] = []
    holder = {}

    def record(context: list[int], ahead: int, scores: torch.Tensor) -> torch.Tensor:
        seen.append((list(context), len(holder["drafter"].history), scores.clone()))
        return scores

    head = random_head(diverse_target, kind)
    drafter = holder["drafter"] = drafter_for(head, kind, SHAPES[shape], record)
    speculative_generate(
        runner_for(diverse_target, kind), drafter, prompt_ids(diverse_target), 12, GREEDY, ()
    )
    assert len({len(context) - committed for context, committed, _ in seen}) > 1  # tree nodes, not only roots
    for context, committed, scores in seen:
        expected = head_from_scratch(diverse_target, head, context, committed)
        torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-4, msg=f"context {context}")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], ids=["cpu", "cuda"])
def test_sampling_runs_on_the_targets_device(device):
    """T>0 through the methods as the bench builds them: the generator, the target's and the
    draft's probabilities and the acceptance rules all live on the target's device."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    target = tiny_random_target(seed=0)
    target.model.to(device)
    head = random_head(target, "eagle").to(device)
    prompt = prompt_ids(target)
    shapes = {
        "chain": {"kind": "chain", "depth": 3},
        "tree": {"kind": "dynamic", "depth": 3, "top_k": 2, "total_tokens": 6},
    }
    for name, shape in [("plain", None), *shapes.items()]:
        config = {"type": "plain"} if shape is None else {"type": "head", "checkpoint": "x", "shape": shape}
        method = build_method(
            name,
            config,
            target,
            heads=lambda _: head,
            draft_model=lambda: None,
            shortlist=lambda: None,
            eos_ids=(),
            max_new_tokens=16,
            typical=Typical(epsilon=0.09, delta=0.3),
        )
        first = method.generate(prompt, Sampling(temperature=1.0), 3)
        assert len(first.tokens) == 16
        assert method.generate(prompt, Sampling(temperature=1.0), 3).tokens == first.tokens  # seeded
