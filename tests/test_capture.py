"""data/capture.py: features captured during greedy regeneration equal the feature cache's
forward over the same tokens (fp32), through refills, compactions and rows that end early."""

import pytest
import torch

from specdraft.data import generate
from specdraft.data.capture import FeatureCapture
from specdraft.data.chat import TokenizedConversation
from specdraft.data.features import collate, extract_features
from specdraft.data.generate import greedy_generate
from specdraft.data.tiny import tiny_random_target

TOP_K = 5
MAX_NEW_TOKENS = 12
CPU_TOLERANCE = 1e-5  # of the tensor's largest entry
CUDA_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def target():
    return tiny_random_target(seed=0, initializer_range=0.5)


def prompts_and_eos(model, count: int = 9):
    """Prompts of different lengths, and end tokens taken from their free-running answers so
    that rows end at different steps (some at their first token)."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 100, (3 + 2 * i,), generator=generator).tolist() for i in range(count)]
    free = greedy_generate(model, prompts, MAX_NEW_TOKENS, set(), batch_size=count)
    eos = {free[0][0], free[count // 3][4], free[2 * count // 3][7]}
    return prompts, eos


def assert_close_to_scale(actual, expected, tolerance: float):
    """Equal up to fp32 rounding relative to the tensor's largest entry: the residual stream of
    this random target reaches ~400, where the batches' different sums differ by ~1e-3."""
    expected = expected.to(actual.device)
    scale = expected.abs().max()
    torch.testing.assert_close(actual / scale, expected / scale, atol=tolerance, rtol=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("batch_size", [3, 9])
def test_captured_features_equal_a_full_forward(target, batch_size, device):
    """On a GPU too: the capture hands its pieces to the host as it goes (a chunk's features must
    not pile up beside its KV cache), and they equal the forward on that device."""
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        target = tiny_random_target(seed=0, initializer_range=0.5)
        target.model.to(device)
    # CUDA's fp32 kernels (cuBLAS, SDPA) sum one-token and full-sequence products in different
    # orders: ~1e-5 of the scale apart. A shifted position or a missed row is off by O(1).
    tolerance = CPU_TOLERANCE if device == "cpu" else CUDA_TOLERANCE
    model, aux = target.model, target.spec.aux_layer_ids
    prompts, eos = prompts_and_eos(model)
    plain = greedy_generate(model, prompts, MAX_NEW_TOKENS, eos, batch_size=batch_size)
    capture = FeatureCapture(model, aux, TOP_K)
    answers = greedy_generate(model, prompts, MAX_NEW_TOKENS, eos, batch_size=batch_size, capture=capture)
    assert answers == plain  # feeding each answer's last token once more changes no answer
    assert len({len(a) for a in answers}) > 2 and min(len(a) for a in answers) == 1

    sequences = [prompt + answer for prompt, answer in zip(prompts, answers, strict=True)]
    samples = [TokenizedConversation(str(i), tuple(s), (1,) * len(s)) for i, s in enumerate(sequences)]
    reference = extract_features(target, collate(samples, 0), aux, top_k=TOP_K)
    for index, sequence in enumerate(sequences):
        captured = capture.pop(index)
        kept = (captured.hidden, captured.aux, captured.topk_ids, captured.topk_probs)
        assert {t.device.type for t in kept} == {"cpu"}
        length = len(sequence)
        assert captured.hidden.shape == (length, target.spec.hidden_size)
        assert_close_to_scale(captured.hidden, reference.hidden[index, :length], tolerance)
        assert_close_to_scale(captured.aux, reference.aux[index, :length], tolerance)
        # the top-k from the prompt's last position on (where objectives read it), zero before
        read = slice(len(prompts[index]) - 1, length)
        assert_close_to_scale(captured.topk_probs[read], reference.topk_probs[index, read], tolerance)
        assert torch.equal(captured.topk_ids[read], reference.topk_ids[index, read].cpu())
        assert not captured.topk_probs[: read.start].any() and not captured.topk_ids[: read.start].any()
    assert not capture._pieces  # every sequence handed over once


def test_an_ended_longest_row_waits_in_the_batch_past_its_answer(target, monkeypatch):
    """Two prompts of the longest length prefilled at different times: the first ends (its last
    token fed once more, one column past its answer) and waits in the batch, uncompacted, while
    the second still runs. The cache holds that column too."""
    monkeypatch.setattr(generate, "COMPACT_FRACTION", 1.0)  # ended rows stay while any row runs
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 100, (n,), generator=generator).tolist() for n in (5, 10, 10)]
    capture = FeatureCapture(target.model, target.spec.aux_layer_ids, TOP_K)
    answers = greedy_generate(target.model, prompts, 4, set(), batch_size=2, capture=capture)
    assert answers == greedy_generate(target.model, prompts, 4, set(), batch_size=2)
    for index, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
        assert capture.pop(index).hidden.shape[0] == len(prompt) + len(answer)


def test_without_aux_or_top_k_only_hidden_states(target):
    model = target.model
    prompts, eos = prompts_and_eos(model, 4)
    capture = FeatureCapture(model)
    answers = greedy_generate(model, prompts, MAX_NEW_TOKENS, eos, batch_size=2, capture=capture)
    captured = capture.pop(1)
    assert captured.aux is None and captured.topk_ids is None and captured.topk_probs is None
    assert captured.hidden.shape[0] == len(prompts[1]) + len(answers[1])
    # hooks are gone after the generation
    assert not model.get_decoder()._forward_hooks and not model.get_decoder().layers[1]._forward_pre_hooks


def test_aux_layer_out_of_range(target):
    with pytest.raises(ValueError, match="aux layer id 9 out of range"):
        FeatureCapture(target.model, (9,))
