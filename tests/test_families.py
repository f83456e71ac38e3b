"""The invariants of speculative decoding on every decoder family specdraft supports
(data/families.py), each a tiny random fp32 model built from transformers' own config class with
what sets the family apart switched on (data/tiny.py ``TINY_FAMILIES``: Qwen2's q/k/v biases,
Qwen3's q/k norms, Mistral's window on every layer, Gemma 2's alternating windows, soft-capping,
embedding scale and (1 + w) norms, Phi-3's fused projections):

* the family's chat layout masks exactly the answers and their turn ends;
* plain decoding equals the model's own forward, token by token (no cache, transformers' masks);
* greedy speculative output == plain output for every head kind × shape (``shape: auto`` too),
  and in a batch;
* sampling reproduces the target's distribution (chi-square) on Gemma 2, whose logits are capped;
* regeneration equals ``generate`` prompt by prompt, and the features it captures a forward;
* packed (oneDNN) linears decode as the model's own; online and cached features agree; every
  export format reads back bit for bit;
* the frozen pieces a head reads are the target's as the target uses them.

The windows are shorter than the tests' sequences, and the caps below a random model's logits,
so a decoder that ignored either would fail here (checked by hand when they were written).
The same invariants run in depth on the tiny Llama (test_decode.py, test_batch.py, …).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from conftest import DIVERSE_INIT, assert_validated, compose_train, prefix_chi_squares
from hydra.utils import instantiate
from omegaconf import OmegaConf
from test_autoshape import CANDIDATES
from test_block_drafter import CONFIG as DFLASH_CONFIG
from test_block_drafter import dflash_head
from test_capture import MAX_NEW_TOKENS as CAPTURE_NEW_TOKENS
from test_capture import TOP_K, assert_close_to_scale, prompts_and_eos
from test_chat import TWO_TURNS, masked_runs
from test_cli_errors import run_command
from test_datamodule import test_online_and_cached_modes_give_the_same_batches as online_equals_cached
from test_decode import (
    BLOCK,
    GREEDY,
    MAX_NEW,
    SHAPES,
    TOP2,
    TRIALS,
    drafter_for,
    near_target_filter,
    prompt_ids,
    random_head,
    target_block_probabilities,
)
from test_export import trained_record
from test_generate import reference

from specdraft.data.capture import FeatureCapture
from specdraft.data.chat import TokenizedConversation, end_of_turn_token_id, tokenize_conversation
from specdraft.data.families import FAMILIES, UnsupportedTarget
from specdraft.data.features import collate, extract_features
from specdraft.data.generate import greedy_generate
from specdraft.data.packed_linear import pack_linear_weights
from specdraft.data.target import check_target_family, load_hf_target, target_weights
from specdraft.data.tiny import TINY_FAMILIES, tiny_random_target, tiny_tokenizer
from specdraft.eval.autoshape import PLAIN, VerifyLatency, calibrate, choose_shape
from specdraft.eval.batch import BatchRunner, speculative_generate_batch
from specdraft.eval.decode import Typical, plain_generate, speculative_generate
from specdraft.eval.drafters import Chain
from specdraft.eval.methods import build_method, drafter_for_head, tree_shape
from specdraft.eval.runner import TargetRunner
from specdraft.heads.formats import FORMATS, FormatError, read_checkpoint, read_export, write_export
from specdraft.train import cli as train_cli
from specdraft.train.llamacpp import check_servable

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
FAMILY_NAMES = sorted(TINY_FAMILIES)
KINDS = ["medusa", "eagle", "eagle3", "dflash"]
BATCH_PROMPT_LENGTHS = (12, 5, 17)  # ragged rows
EXPORT_KINDS = {
    "eagle": {"fc_bias": False},
    "eagle3": {"draft_vocab_size": 100},
    "medusa": {"num_heads": 2, "num_layers": 1, "own_lm_head": False},
    "dflash": {**DFLASH_CONFIG, "mask_token_id": 7},  # as a trained head records it: resolved
}
# What each family's target is served by (the engines' sources, heads/formats FORMATS): Gemma's
# scaled embeddings and its missing aux-state hand-over keep it to the engines that read neither.
EVERY_FORMAT = set(FORMATS)
LLAMA_DERIVED = EVERY_FORMAT - {"eagle"}  # the official EAGLE code loads Llama and Qwen targets only
GEMMA = {"native", "medusa"}
SERVING_FORMATS = {
    "LlamaForCausalLM": EVERY_FORMAT,
    "Qwen2ForCausalLM": EVERY_FORMAT,
    "Qwen3ForCausalLM": EVERY_FORMAT,
    "MistralForCausalLM": LLAMA_DERIVED,
    "Phi3ForCausalLM": LLAMA_DERIVED,
    "Gemma2ForCausalLM": GEMMA,
    "Gemma3ForCausalLM": GEMMA,
}
# Of the tensor's largest entry: the batches' different sums differ by ~2e-5 on some families
# (Phi-3's fused projections); a shifted position or a missed row is off by O(1).
CAPTURE_TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def target(family):
    """A family's tiny model whose greedy output does not repeat (conftest.DIVERSE_INIT)."""
    return tiny_random_target(seed=0, initializer_range=DIVERSE_INIT, family=family)


@pytest.fixture(scope="module")
def plain(target):
    prompt = prompt_ids(target)
    return prompt, plain_generate(TargetRunner(target), prompt, MAX_NEW, GREEDY, ()).tokens


def head_for(target, kind: str):
    return dflash_head(target) if kind == "dflash" else random_head(target, kind)


def test_every_supported_family_has_a_tiny_model_and_a_target_config():
    assert sorted(FAMILIES) == FAMILY_NAMES
    for name in FAMILY_NAMES:
        config = CONF_DIR / "target" / ("tiny_random.yaml" if name == "llama" else f"tiny_{name}.yaml")
        target = instantiate(OmegaConf.load(config))
        assert target.model.config.model_type == name and target.spec.aux_layer_ids == (1, 2, 3)


def test_the_familys_chat_template_masks_exactly_the_answers(target):
    """Each family's chat layout (ChatML; Mistral's [INST]; Gemma's <start_of_turn>model, no
    system role; Phi-3's <|assistant|>): the loss mask holds each answer and the token that ends
    its turn, which decoding stops at."""
    tokenizer = target.tokenizer
    tokenized = tokenize_conversation(tokenizer, TWO_TURNS)
    end = tokenizer.convert_ids_to_tokens(end_of_turn_token_id(tokenizer))
    assert masked_runs(tokenizer, tokenized) == [f"Hello! How can I help?{end}", f"yes{end}"]
    assert tokenizer.convert_tokens_to_ids(end) in target.spec.eos_token_ids


def test_plain_decoding_equals_the_models_own_forward(target, plain):
    prompt, tokens = plain
    ids = prompt.tolist()
    with torch.no_grad():
        for _ in range(MAX_NEW):
            ids.append(int(target.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert tokens == ids[len(prompt) :]
    assert len(set(tokens)) > MAX_NEW // 2  # diverse: a misplaced key or position would show


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_speculative_equals_plain(target, plain, kind, shape):
    if kind == "medusa" and shape == "dynamic":
        pytest.skip("Medusa candidates do not depend on the drafted prefix: static trees only")
    prompt, expected = plain
    head = head_for(target, kind)
    runner = TargetRunner(target, head.target_taps)
    generation = speculative_generate(
        runner, drafter_for_head(head, SHAPES[shape]), prompt, MAX_NEW, GREEDY, ()
    )
    assert generation.tokens == expected


def test_shape_auto_reproduces_plain_output(target, plain):
    """``shape: auto`` (verification priced at half a plain step, so a tree wins): the chosen
    shape decodes as plain decoding does."""
    prompt, expected = plain
    head = head_for(target, "eagle3")

    def chooser(name, runner, drafter_for, candidates):
        calibrations = calibrate(runner, [prompt], [expected])
        latency = VerifyLatency(1.0, {2: 0.5, 64: 0.5})
        return choose_shape(
            drafter_for, tree_shape, candidates, calibrations, latency, runner, 0, progress=False
        )

    auto = {"type": "head", "checkpoint": "tiny", "shape": {"kind": "auto", "candidates": CANDIDATES}}
    method = build_method(
        "head_auto", auto, target, heads=lambda _: head, draft_model=lambda: None,
        shortlist=lambda: None, eos_ids=(), max_new_tokens=MAX_NEW,
        typical=Typical(epsilon=0.09, delta=0.3), choose_shape=chooser,
    )  # fmt: skip
    assert method.generate(prompt, GREEDY, 0).tokens == expected
    assert method.details["auto_shape"]["chosen"]["kind"] != PLAIN


@pytest.mark.parametrize("kind", list(EXPORT_KINDS))
def test_every_export_reads_back_bit_for_bit(target, tmp_path, kind):
    """Every format whose engine serves the family round-trips; the others are refused in one line
    that names the target's architecture, and write nothing."""
    record = trained_record(target, kind, EXPORT_KINDS[kind])
    lm_head = target_weights(target).lm_head
    for format, info in FORMATS.items():
        if kind not in info.holds():
            continue
        out = tmp_path / format
        if format not in SERVING_FORMATS[target.spec.architecture]:
            with pytest.raises(FormatError, match=f"format {format}: .*{target.spec.architecture} target"):
                write_export(out, record, format, target_spec=target.spec, target_lm_head=lm_head)
            assert not out.exists()
            continue
        write_export(out, record, format, target_spec=target.spec, target_lm_head=lm_head)
        if format == "speculators":  # the format names the verifier it drafts for: this target
            verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
            assert verifier["architectures"] == [target.spec.architecture]
        back = read_export(out, target.spec, target_lm_head=lm_head)
        assert back.kind == kind and set(back.state) == set(record.state)
        assert all(torch.equal(back.state[key], value) for key, value in record.state.items()), format


def test_llamacpp_exports_are_refused_for_families_it_has_not_served(target):
    record = trained_record(target, "eagle3", EXPORT_KINDS["eagle3"])
    if target.spec.architecture == "LlamaForCausalLM":
        check_servable(record)
    else:
        served = sorted(
            f
            for f in SERVING_FORMATS[target.spec.architecture] - {"native"}
            if "eagle3" in FORMATS[f].holds()
        )
        listed = " / ".join([*served, "native"])
        with pytest.raises(
            FormatError, match=f"not {target.spec.architecture}; this head exports as {listed}$"
        ):
            check_servable(record)


# The shortest run that still trains, validates and checkpoints: each family × kind costs ~1.5 s.
TRAIN_SMOKE = [
    "debug=smoke",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "logger=none",
]


@pytest.mark.parametrize("kind", KINDS)
def test_specdraft_train_trains_every_head_kind_on_the_family(family, target, tmp_path, kind):
    target_config = "tiny_random" if family == "llama" else f"tiny_{family}"
    cfg = compose_train(tmp_path, f"experiment={kind}", f"target={target_config}", *TRAIN_SMOKE)
    summary = train_cli.train(cfg)
    assert summary["global_step"] == 2
    assert_validated(summary)
    record = read_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert record.kind == kind and record.spec.architecture == target.spec.architecture


def test_online_and_cached_features_agree(family, tmp_path):
    """On the family's default-init model, as the Llama's test (its tolerances fit those scales)."""
    online_equals_cached(tmp_path, tiny_random_target(seed=0, family=family))


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_batched_rows_equal_each_prompt_alone(target, kind):
    generator = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(3, target.spec.vocab_size, (n,), generator=generator) for n in BATCH_PROMPT_LENGTHS
    ]
    alone = [plain_generate(TargetRunner(target), p, MAX_NEW, GREEDY, ()).tokens for p in prompts]
    head = head_for(target, kind)
    drafters = [drafter_for_head(head, SHAPES["dynamic"]) for _ in prompts]
    runner = BatchRunner(target, head.target_taps)
    rows = speculative_generate_batch(runner, drafters, prompts, MAX_NEW, GREEDY, (), [None] * len(prompts))
    assert [row.tokens for row in rows] == alone


def test_sampling_reproduces_gemma2s_capped_distribution():
    """T = 1, top-2, a chain of EAGLE drafts near the target's own: every prefix of the first
    block follows the distribution of the model's own (soft-capped) logits."""
    target = tiny_random_target(seed=0, initializer_range=DIVERSE_INIT, family="gemma2")
    prompt = prompt_ids(target, seed=7)
    expected = target_block_probabilities(target, prompt, BLOCK, TOP2)
    head = random_head(target, "eagle")
    drafter = drafter_for(head, "eagle", Chain(depth=BLOCK - 2), near_target_filter(target, 0.5))
    runner = TargetRunner(target)
    generator = torch.Generator().manual_seed(0)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(TRIALS):
        block = tuple(speculative_generate(runner, drafter, prompt, BLOCK, TOP2, (), generator).tokens)
        counts[block] = counts.get(block, 0) + 1
    results = prefix_chi_squares(counts, expected)
    assert all(statistic < critical for statistic, critical in results), (results, counts)


def test_regeneration_equals_generate_and_captures_a_forward(family):
    target = tiny_random_target(seed=0, initializer_range=0.5, family=family)
    model, aux = target.model, target.spec.aux_layer_ids
    prompts, eos = prompts_and_eos(model)
    assert greedy_generate(model, prompts, CAPTURE_NEW_TOKENS, eos, batch_size=4) == reference(
        model, prompts, CAPTURE_NEW_TOKENS, eos
    )
    capture = FeatureCapture(model, aux, TOP_K)
    answers = greedy_generate(model, prompts, CAPTURE_NEW_TOKENS, eos, batch_size=4, capture=capture)
    sequences = [prompt + answer for prompt, answer in zip(prompts, answers, strict=True)]
    samples = [TokenizedConversation(str(i), tuple(s), (1,) * len(s)) for i, s in enumerate(sequences)]
    forward = extract_features(target, collate(samples, 0), aux, top_k=TOP_K)
    for index, sequence in enumerate(sequences):
        captured, length = capture.pop(index), len(sequence)
        assert_close_to_scale(captured.hidden, forward.hidden[index, :length], CAPTURE_TOLERANCE)
        assert_close_to_scale(captured.aux, forward.aux[index, :length], CAPTURE_TOLERANCE)
        read = slice(len(prompts[index]) - 1, length)
        assert torch.equal(captured.topk_ids[read], forward.topk_ids[index, read])


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_packed_weights_decode_as_the_model_does(family, plain):
    """The bench and regeneration pack the target's linears for oneDNN: Qwen2's biased q/k/v and
    Phi-3's fused projections too, and the output stays the unpacked model's."""
    packed = tiny_random_target(seed=0, initializer_range=DIVERSE_INIT, family=family)
    assert pack_linear_weights(packed.model) > 0
    prompt, expected = plain
    assert plain_generate(TargetRunner(packed), prompt, MAX_NEW, GREEDY, ()).tokens == expected


def test_a_head_reads_the_embedding_and_final_norm_as_the_target_uses_them(target):
    weights = target_weights(target)
    model, ids = target.model, torch.arange(5)
    with torch.no_grad():
        embedded = model.get_input_embeddings()(ids)
        torch.testing.assert_close(embedded, weights.embedding[ids] * weights.embedding_scale)
        hidden = torch.randn(3, target.spec.hidden_size)
        normed = model.get_decoder().norm(hidden)
        rms = hidden.pow(2).mean(-1, keepdim=True).add(target.spec.rms_norm_eps).rsqrt()
        torch.testing.assert_close(normed, hidden * rms * weights.final_norm)


def test_a_model_without_sdpa_loads_with_eager_attention(tmp_path):
    """target.attn_implementation=sdpa (every config's default) on a Gemma 2 directory: it loads
    with transformers' eager attention (it has no SDPA path) and decodes as the model built here."""
    built = tiny_random_target(seed=0, initializer_range=DIVERSE_INIT, family="gemma2")
    built.model.save_pretrained(tmp_path)
    built.tokenizer.save_pretrained(tmp_path)
    loaded = load_hf_target(
        str(tmp_path), dtype="float32", attn_implementation="sdpa", aux_layer_ids=(1, 2, 3)
    )
    assert loaded.model.config._attn_implementation == "eager"
    prompt = prompt_ids(built)
    decode = [plain_generate(TargetRunner(t), prompt, MAX_NEW, GREEDY, ()).tokens for t in (built, loaded)]
    assert decode[0] == decode[1]


@pytest.fixture(scope="module")
def granite_dir(tmp_path_factory) -> Path:
    """A tiny random Granite saved as an HF directory: a family specdraft does not decode (its
    logits are divided by ``logits_scaling``, which the runner would skip)."""
    tokenizer = tiny_tokenizer()
    config = transformers.GraniteConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    directory = tmp_path_factory.mktemp("granite")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_an_unsupported_family_is_refused_in_one_line(granite_dir):
    refused = r"target family 'granite' \(GraniteForCausalLM\) is not supported: specdraft decodes gemma2,"
    with pytest.raises(UnsupportedTarget, match=refused):
        load_hf_target(str(granite_dir))
    config = {"_target_": "specdraft.data.target.load_hf_target", "name_or_path": str(granite_dir)}
    with pytest.raises(UnsupportedTarget, match=refused):  # from config.json alone
        check_target_family(config)


def test_a_command_refuses_an_unsupported_family_before_it_writes(granite_dir, tmp_path, monkeypatch, capsys):
    """specdraft-train: exit 2 and one line, from the target's config.json, before its run
    directory holds anything of the run (Hydra's own log aside)."""
    run_dir = tmp_path / "run"
    target = [
        "target=llama3_8b_instruct", f"target.name_or_path={granite_dir}", "target.device=cpu",
        "target.aux_layer_ids=[0,1]",
    ]  # fmt: skip
    hydra = [f"hydra.run.dir={run_dir}", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    line = run_command(
        train_cli.main, "specdraft-train", "experiment=eagle", "debug=smoke", *target, *hydra,
        f"paths.log_dir={tmp_path / 'logs'}", monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    assert "target family 'granite'" in line
    assert {path.name for path in run_dir.iterdir()} <= {".hydra", "cli.log"}  # Hydra's, none of the run
