"""``specdraft-export format=llamacpp`` without llama.cpp: the refusals, the rotary regrouping, and
the read-back of the converter's GGUF against the head, EAGLE-3 and DFlash (with a stand-in
converter that writes what the pinned one writes, and errs on request). The real converter and
llama.cpp's own decoding of the export: tests/test_interop_llamacpp.py (``make interop-llamacpp``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from test_export import trained_record

from specdraft.data.tiny import tiny_random_target
from specdraft.heads.formats import FormatError, read_export
from specdraft.heads.formats.files import CONFIG_FILE, GGUF_FILE
from specdraft.train.llamacpp import (
    OUTTYPES,
    Converter,
    check_servable,
    expected_gguf,
    interleave_rotary_rows,
    write_gguf_export,
)

FAKE_CONVERTER = Path(__file__).parent / "llamacpp_fake_converter.py"


@pytest.fixture(scope="module")
def target():
    return tiny_random_target(seed=0)


@pytest.fixture(scope="module")
def eagle3(target):
    return trained_record(target, "eagle3", {"draft_vocab_size": 100})


@pytest.fixture(scope="module")
def dflash(target):
    return trained_record(target, "dflash", DFLASH_CONFIG)


DFLASH_CONFIG = {"num_layers": 2, "block_size": 4, "mask_token_id": 7, "anchor_fraction": 0.5}


def fake() -> Converter:
    return Converter(script=FAKE_CONVERTER, python=Path(sys.executable))


def test_rotary_rows_are_paired_per_head():
    # two heads of head_dim 4, one input column: rows (x0 x1 y0 y1) per head → (x0 y0 x1 y1)
    weight = torch.tensor([[0.0], [1.0], [10.0], [11.0], [20.0], [21.0], [30.0], [31.0]])
    paired = interleave_rotary_rows(weight, heads=2)
    assert paired.flatten().tolist() == [0.0, 10.0, 1.0, 11.0, 20.0, 30.0, 21.0, 31.0]


@pytest.mark.parametrize("outtype", OUTTYPES)
def test_export_reads_back_in_every_outtype(target, eagle3, tmp_path, outtype):
    out = write_gguf_export(tmp_path / "gguf", eagle3, target=target, converter=fake(), outtype=outtype)
    assert sorted(p.name for p in out.iterdir()) == [CONFIG_FILE, GGUF_FILE]
    ours = json.loads((out / CONFIG_FILE).read_text())["specdraft"]
    assert (ours["format"], ours["outtype"], ours["kind"]) == ("llamacpp", outtype, "eagle3")


@pytest.mark.parametrize("outtype", ["f32", "q8_0"])
def test_a_dflash_export_reads_back(target, dflash, tmp_path, outtype):
    out = write_gguf_export(tmp_path / "gguf", dflash, target=target, converter=fake(), outtype=outtype)
    ours = json.loads((out / CONFIG_FILE).read_text())["specdraft"]
    assert (ours["format"], ours["outtype"], ours["kind"]) == ("llamacpp", outtype, "dflash")


@pytest.mark.parametrize(
    ("mistake", "names"),
    [
        ("taps", "dflash.target_layers"),
        ("causal", "dflash.attention.causal is True, expected False"),
        ("drop_norm", "output_norm.weight"),
    ],
)
def test_a_dflash_gguf_that_differs_writes_nothing(target, dflash, tmp_path, monkeypatch, mistake, names):
    monkeypatch.setenv("FAKE_CONVERTER_MISTAKE", mistake)
    with pytest.raises(FormatError, match=names):
        write_gguf_export(tmp_path / "gguf", dflash, target=target, converter=fake(), outtype="f16")
    assert list(tmp_path.iterdir()) == []


def test_expected_dflash_names_are_llamacpps(dflash):
    names = expected_gguf(dict(dflash.state), dflash, "f32")
    fusion_and_norms = {"fc.weight", "enc.output_norm.weight", "output_norm.weight"}
    assert fusion_and_norms | {"blk.1.attn_q_norm.weight", "blk.0.ffn_down.weight"} <= set(names)
    assert not any(name.startswith("layers.") for name in names)


def test_a_full_vocabulary_head_has_no_maps(target, tmp_path):
    record = trained_record(target, "eagle3", {"draft_vocab_size": None})
    write_gguf_export(tmp_path / "gguf", record, target=target, converter=fake(), outtype="f32")


@pytest.mark.parametrize(
    ("mistake", "names"),
    [
        ("no_permute", "blk.0.attn_q.weight differs"),
        ("taps", "eagle3.target_layers"),
        ("drop_norm", "output_norm.weight"),
        ("fail", "converter failed (exit 1)"),
    ],
)
def test_a_converter_that_errs_writes_nothing(target, eagle3, tmp_path, monkeypatch, mistake, names):
    monkeypatch.setenv("FAKE_CONVERTER_MISTAKE", mistake)
    out = tmp_path / "gguf"
    with pytest.raises(FormatError, match=names.replace("(", r"\(").replace(")", r"\)")):
        write_gguf_export(out, eagle3, target=target, converter=fake(), outtype="f16")
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_an_existing_export_is_replaced_only_with_overwrite(target, eagle3, tmp_path):
    out = write_gguf_export(tmp_path / "gguf", eagle3, target=target, converter=fake(), outtype="f16")
    with pytest.raises(FormatError, match="already holds files"):
        write_gguf_export(out, eagle3, target=target, converter=fake(), outtype="f16")
    write_gguf_export(out, eagle3, target=target, converter=fake(), outtype="q8_0", overwrite=True)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_kinds_llamacpp_does_not_serve_are_refused(target, kind):
    config = {
        "eagle": {"fc_bias": False},
        "medusa": {"num_heads": 2, "num_layers": 1, "own_lm_head": False},
    }[kind]
    with pytest.raises(FormatError, match=f"format=llamacpp exports eagle3/dflash heads, not '{kind}'"):
        check_servable(trained_record(target, kind, config))


def test_a_head_with_two_taps_is_refused(tmp_path):
    target = tiny_random_target(seed=0, aux_layer_ids=(1, 2))
    record = trained_record(target, "eagle3", {"draft_vocab_size": 100})
    with pytest.raises(FormatError, match=r"exactly 3 target layers; this head fuses 2 \(\[1, 2\]\)"):
        write_gguf_export(tmp_path / "gguf", record, target=target, converter=fake(), outtype="f16")


def test_a_missing_converter_names_make_llamacpp(target, eagle3, tmp_path):
    missing = Converter(script=tmp_path / "convert_hf_to_gguf.py", python=Path(sys.executable))
    with pytest.raises(FormatError, match="make llamacpp"):
        write_gguf_export(tmp_path / "gguf", eagle3, target=target, converter=missing, outtype="f16")


def test_reading_a_gguf_export_says_what_it_is(target, eagle3, tmp_path):
    out = write_gguf_export(tmp_path / "gguf", eagle3, target=target, converter=fake(), outtype="f16")
    with pytest.raises(FormatError, match=r"a llama\.cpp export \(model\.gguf\), which llama\.cpp loads"):
        read_export(out, target.spec)
