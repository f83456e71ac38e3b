"""Export: every format from a trained-layout head on the tiny target, checked against the
hand-written layouts in tests/layouts/, read back bit for bit; native exports draft exactly like
the head they came from; wrong targets and inexpressible heads are refused; writes are atomic."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from safetensors.torch import load_file, save_file

from specdraft.data.target import target_weights
from specdraft.data.tiny import tiny_random_target
from specdraft.eval.drafters import Chain, DynamicTree
from specdraft.eval.feature_drafter import FeatureHeadDrafter
from specdraft.eval.load import load_head
from specdraft.eval.runner import TargetRunner
from specdraft.eval.sampling import Sampling
from specdraft.heads.formats import (
    FORMATS,
    FormatError,
    HeadRecord,
    detect_format,
    export_files,
    read_checkpoint,
    read_export,
    write_export,
)
from specdraft.heads.frozen import random_target_weights
from specdraft.heads.registry import build_head
from specdraft.train.export import export

LAYOUTS = sorted((Path(__file__).parent / "layouts").glob("*.json"))
KINDS = {
    "eagle": {"fc_bias": False},
    "eagle-bias": {"fc_bias": True},
    "eagle3": {"draft_vocab_size": 100},
    "eagle3-full": {"draft_vocab_size": None},
    "medusa": {"num_heads": 2, "num_layers": 2, "own_lm_head": False},
    "medusa-own": {"num_heads": 2, "num_layers": 1, "own_lm_head": True},
    "dflash": {"num_layers": 2, "block_size": 4, "mask_token_id": 7, "anchor_fraction": 0.5},
}


@pytest.fixture(scope="module")
def target():
    return tiny_random_target(seed=0)


def trained_record(target, kind: str, config: dict, seed: int = 0) -> HeadRecord:
    """A head whose every weight is random (a zero-initialised weight would hide a dropped key)."""
    head = build_head(kind, config, target.spec, target_weights(target))
    head.choose_vocabulary(
        lambda: torch.rand(target.spec.vocab_size, generator=torch.Generator().manual_seed(seed))
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return HeadRecord(kind, dict(config), target.spec, head.state_dict())


def save_checkpoint(path: Path, record: HeadRecord) -> Path:
    """``record`` in the layout specdraft-train's checkpoints have."""
    path.parent.mkdir(parents=True, exist_ok=True)
    head = {"kind": record.kind, "config": record.config, "target_spec": record.spec.to_dict()}
    torch.save({"state_dict": {f"head.{k}": v for k, v in record.state.items()}, "specdraft": head}, path)
    return path


def symbols(target, record: HeadRecord) -> dict:
    spec = target.spec
    aux = list(spec.aux_layer_ids)
    return {
        "H": spec.hidden_size,
        "2H": 2 * spec.hidden_size,
        "3H": 3 * spec.hidden_size,
        "Q": spec.num_attention_heads * spec.head_dim,
        "KV": spec.num_kv_heads * spec.head_dim,
        "D": spec.head_dim,
        "I": spec.intermediate_size,
        "V": spec.vocab_size,
        "Vd": record.config.get("draft_vocab_size") or spec.vocab_size,
        "aux": aux,
        "aux-1": [i - 1 for i in aux],
        "target-name": spec.name,
    }


def field(config: dict, dotted: str):
    value = config
    for part in dotted.split("."):
        value = value[int(part)] if isinstance(value, list) else value[part]
    return value


@pytest.mark.parametrize("layout_path", LAYOUTS, ids=[p.stem for p in LAYOUTS])
def test_export_matches_the_documented_layout(target, layout_path):
    layout = json.loads(layout_path.read_text())
    record = trained_record(target, layout["head"]["kind"], layout["head"]["config"])
    values = symbols(target, record)
    lm_head = target_weights(target).lm_head
    config, tensors = export_files(record, layout["format"], target_spec=target.spec, target_lm_head=lm_head)

    for key, expected in layout["config"].items():
        expected = values.get(expected, expected) if isinstance(expected, str) else expected
        assert field(config, key) == expected, f"{layout_path.name}: config {key}"
    expected_shapes = {name: [values[d] for d in dims] for name, dims in layout["tensors"].items()}
    assert {name: list(t.shape) for name, t in tensors.items()} == expected_shapes
    assert not set(layout.get("absent", [])) & set(tensors)
    for name in layout.get("zero", []):
        assert not torch.any(tensors[name])
    for name, dtype in layout.get("dtypes", {}).items():
        assert str(tensors[name].dtype) == f"torch.{dtype}"
    for name in layout.get("target_lm_head", []):
        assert torch.equal(tensors[name], lm_head)


def test_every_format_of_every_kind_is_covered_by_a_layout():
    covered = {
        (json.loads(p.read_text())["format"], json.loads(p.read_text())["head"]["kind"]) for p in LAYOUTS
    }
    wanted = {(f, k) for f, info in FORMATS.items() if f != "native" for k in info.holds()}
    assert wanted <= covered


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["as-trained", "bf16"])
@pytest.mark.parametrize("name", KINDS)
def test_export_reads_back_bit_for_bit(target, tmp_path, name, dtype):
    kind = name.split("-")[0]
    record = trained_record(target, kind, KINDS[name])
    lm_head = target_weights(target).lm_head
    exported = 0
    for format, info in FORMATS.items():
        if kind not in info.holds() or (format == "vllm" and KINDS[name].get("fc_bias")):
            continue
        out = write_export(
            tmp_path / format, record, format, target_spec=target.spec, target_lm_head=lm_head, dtype=dtype
        )
        back = read_export(out, target.spec, target_lm_head=lm_head)
        assert back.kind == kind and back.spec.aux_layer_ids == target.spec.aux_layer_ids
        assert set(back.state) == set(record.state)
        for key, value in record.state.items():
            expected = value.to(dtype) if dtype and value.is_floating_point() else value
            assert back.state[key].dtype == expected.dtype, f"{format}: {key}"
            assert torch.equal(back.state[key], expected), f"{format}: {key}"
        exported += 1
    assert exported >= 2


# SmolLM2's vocabulary: ids above 256 are not all bf16 / fp16 numbers, so a vocabulary map cast
# with the weights reads back as other tokens (the tiny target's 259 tokens would hide it).
REAL_VOCAB, REAL_DRAFT_VOCAB = 49_152, 4_096


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_vocabulary_maps_keep_their_integer_ids_in_a_half_precision_export(target, tmp_path, dtype):
    """An EAGLE-3 head with a reduced draft vocabulary over a 49,152-token target, exported in half
    precision to every format that carries d2t / t2d: the maps read back as the head's own
    tensors, integer dtype and every id exact."""
    spec = replace(target.spec, vocab_size=REAL_VOCAB)
    weights = random_target_weights(spec, seed=0)
    head = build_head("eagle3", {"draft_vocab_size": REAL_DRAFT_VOCAB}, spec, weights)
    head.choose_vocabulary(lambda: torch.rand(REAL_VOCAB, generator=torch.Generator().manual_seed(0)))
    record = HeadRecord("eagle3", {"draft_vocab_size": REAL_DRAFT_VOCAB}, spec, head.state_dict())
    maps = {k: v for k, v in record.state.items() if not v.is_floating_point()}
    assert maps and max(int(v.max()) for v in maps.values()) > 2048  # ids a half float cannot hold
    formats = [f for f, info in FORMATS.items() if "eagle3" in info.holds()]
    for format in formats:
        out = write_export(
            tmp_path / format, record, format, target_spec=spec, target_lm_head=weights.lm_head, dtype=dtype
        )
        back = read_export(out, spec, target_lm_head=weights.lm_head)
        for key, value in maps.items():
            assert back.state[key].dtype == value.dtype, f"{format}: {key} is {back.state[key].dtype}"
            assert torch.equal(back.state[key], value), f"{format}: {key}"
    assert len(formats) >= 2


@pytest.mark.parametrize("name", ["eagle", "eagle3", "medusa"])
def test_native_export_drafts_exactly_like_the_checkpoint(target, tmp_path, name):
    config = {
        "eagle": {"fc_bias": False},
        "eagle3": {"draft_vocab_size": 100},
        "medusa": {"num_heads": 3, "num_layers": 1, "own_lm_head": False},
    }[name]
    checkpoint = save_checkpoint(tmp_path / "head.ckpt", trained_record(target, name, config))
    record = read_checkpoint(checkpoint)
    out = write_export(tmp_path / "native", record, "native", target_spec=target.spec)
    original, exported = load_head(checkpoint, target), load_head(out, target)
    for key, value in original.state_dict().items():
        assert torch.equal(exported.state_dict()[key], value)
    if name == "medusa":
        hidden = torch.randn(3, target.spec.hidden_size)
        assert torch.equal(original(hidden), exported(hidden))
        return
    aux = original.spec.aux_layer_ids if name == "eagle3" else ()
    prompt = torch.tensor(target.tokenizer("the quick brown fox jumps")["input_ids"])
    for shape, sampling in [
        (DynamicTree(depth=3, top_k=3, total_tokens=8), Sampling()),
        (Chain(depth=3), Sampling(temperature=1.0)),  # sampled: the draft distributions too
    ]:
        drafts = []
        for head in (original, exported):
            runner = TargetRunner(target, aux)
            output = runner.prefill(prompt)
            root = int(output.logits[-1].argmax())
            drafter = FeatureHeadDrafter(head, shape)
            drafter.reset()
            drafter.commit(prompt.tolist(), output, root)
            drafts.append(drafter.draft(root, sampling, torch.Generator().manual_seed(0)))
        assert torch.equal(drafts[0].tokens, drafts[1].tokens)
        assert torch.equal(drafts[0].tree.parents, drafts[1].tree.parents)
        if sampling.temperature:
            assert torch.equal(drafts[0].draft_probs, drafts[1].draft_probs)


def test_wrong_target_is_refused_naming_both(target, tmp_path):
    record = trained_record(target, "eagle", {"fc_bias": False})
    for other in (
        tiny_random_target(seed=1, hidden_size=32),
        tiny_random_target(seed=1, num_attention_heads=2),
    ):
        with pytest.raises(FormatError, match=r"tiny-random-llama-seed0.*tiny-random-llama-seed1") as error:
            write_export(tmp_path / "out", record, "vllm", target_spec=other.spec)
        assert "head" in str(error.value) and "target" in str(error.value)
    smaller_vocab = replace(tiny_random_target(seed=1).spec, vocab_size=200)
    with pytest.raises(FormatError, match=r"vocab_size: head 259 vs target 200"):
        export_files(record, "native", target_spec=smaller_vocab)
    assert not (tmp_path / "out").exists()


def test_inexpressible_heads_are_refused(target):
    lm_head = target_weights(target).lm_head
    cases = [
        (trained_record(target, "eagle", {"fc_bias": True}), "vllm", "silently ignores"),
        (
            trained_record(target, "eagle", {"fc_bias": False}),
            "speculators",
            "a head of kind eagle exports as one of",
        ),
        (
            trained_record(target, "medusa", {"num_heads": 4, "num_layers": 1, "own_lm_head": False}),
            "eagle",
            "not 'medusa'",
        ),
        (trained_record(target, "eagle3", {"draft_vocab_size": 100}), "medusa", "not 'eagle3'"),
    ]
    for record, format, message in cases:
        with pytest.raises(FormatError, match=message):
            export_files(record, format, target_spec=target.spec, target_lm_head=lm_head)
    with pytest.raises(FormatError, match="needs the target's weights"):
        export_files(
            trained_record(target, "medusa", {"num_heads": 4, "num_layers": 1, "own_lm_head": False}),
            "medusa",
            target_spec=target.spec,
        )
    layer0 = tiny_random_target(seed=0, aux_layer_ids=(0, 2, 3))
    record = trained_record(layer0, "eagle3", {"draft_vocab_size": 100})
    with pytest.raises(FormatError, match="aux layer id 0"):
        export_files(record, "sglang", target_spec=layer0.spec)
    two_taps = tiny_random_target(seed=0, aux_layer_ids=(1, 3))
    record = trained_record(two_taps, "eagle3", {"draft_vocab_size": 100})
    with pytest.raises(FormatError, match="exactly 3 aux layers"):
        export_files(record, "sglang", target_spec=two_taps.spec)
    export_files(record, "vllm", target_spec=two_taps.spec)  # vLLM reads any number


def test_damaged_exports_are_refused_with_the_key(target, tmp_path):
    record = trained_record(target, "eagle3", {"draft_vocab_size": 100})
    out = write_export(tmp_path / "vllm", record, "vllm", target_spec=target.spec)
    tensors = load_file(out / "model.safetensors")
    del tensors["midlayer.hidden_norm.weight"]
    tensors["norm.weight"] = torch.ones(7)
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(
        FormatError, match=r"missing \['hidden_norm.weight'\].*norm.weight: \(\(7,\), \(64,\)\)"
    ):
        read_export(out, target.spec)
    (out / "config.json").write_text("{not json")
    with pytest.raises(FormatError, match=r"config\.json: not valid JSON"):
        read_export(out, target.spec)


def test_exports_are_atomic_and_never_overwrite_silently(target, tmp_path):
    first, second = (
        trained_record(target, "eagle", {"fc_bias": False}, seed=0),
        trained_record(target, "eagle", {"fc_bias": False}, seed=1),
    )
    out = write_export(tmp_path / "head", first, "native", target_spec=target.spec)
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(FormatError, match="overwrite=true"):
        write_export(out, second, "native", target_spec=target.spec)
    with pytest.raises(FormatError, match="silently ignores"):  # refused before anything moved
        write_export(
            out,
            trained_record(target, "eagle", {"fc_bias": True}),
            "vllm",
            target_spec=target.spec,
            overwrite=True,
        )
    assert (out / "model.safetensors").read_bytes() == before
    write_export(out, second, "native", target_spec=target.spec, overwrite=True)
    assert torch.equal(read_export(out, target.spec).state["fc.weight"], second.state["fc.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]  # no staging or retired dirs left
    assert (out / "model.safetensors").stat().st_mode & 0o044  # readable by the serving user


def compose_export(tmp_path: Path, *overrides: str):
    with initialize_config_module("specdraft.conf", version_base="1.3"):
        return compose(
            "export",
            overrides=["target=tiny_random", f"paths.log_dir={tmp_path}", *overrides],
        )


def test_specdraft_export_from_a_run_dir_then_specdraft_eval_loads_it(target, tmp_path):
    run_dir = tmp_path / "train" / "hass"
    best = save_checkpoint(
        run_dir / "checkpoints" / "best-step=2.ckpt", trained_record(target, "eagle", {"fc_bias": False})
    )
    last = trained_record(target, "eagle3", {"draft_vocab_size": 100})
    save_checkpoint(run_dir / "checkpoints" / "last.ckpt", last)
    (run_dir / "summary.json").write_text(json.dumps({"best_checkpoint": str(best)}))

    out = export(compose_export(tmp_path, f"checkpoint={run_dir}", "format=native"))
    assert out == tmp_path / "export" / "hass-native"
    config = json.loads((out / "config.json").read_text())
    assert config["kind"] == "eagle" and config["provenance"]["checkpoint"] == str(best.resolve())
    assert config["target"]["name"] == target.spec.name
    head = load_head(out, target)
    assert torch.equal(head.fc.weight, load_head(best, target).fc.weight)

    (run_dir / "summary.json").unlink()  # no best recorded: the last checkpoint
    out = export(compose_export(tmp_path, f"checkpoint={run_dir}", "format=vllm", "dtype=bfloat16"))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    with pytest.raises(ValueError, match="dtype=half: expected null or one of bfloat16, float16, float32"):
        export(compose_export(tmp_path, f"checkpoint={run_dir}", "dtype=half"))
    with pytest.raises(FileNotFoundError, match="no such file or run directory"):
        export(compose_export(tmp_path, f"checkpoint={tmp_path / 'nowhere'}"))


def test_specdraft_export_converts_an_export_directory(target, tmp_path):
    """A pretrained head ships as a native export (assets/heads/): it converts to an engine's
    layout like a checkpoint does, weight for weight."""
    record = trained_record(target, "eagle", KINDS["eagle"])
    native = write_export(tmp_path / "pretrained", record, "native", target_spec=target.spec)

    out = export(compose_export(tmp_path, f"checkpoint={native}", "format=vllm"))
    assert out == tmp_path / "export" / "pretrained-vllm"
    assert detect_format(json.loads((out / "config.json").read_text())) == "vllm"
    converted = read_export(out, target.spec, target_lm_head=target_weights(target).lm_head)
    assert converted.kind == "eagle"
    for name, tensor in record.state.items():
        assert torch.equal(converted.state[name], tensor), name


class _NotTensors:
    """A class a weights-only unpickler refuses to build."""


@pytest.mark.parametrize("content", ["garbage", "truncated", "foreign pickle"])
def test_a_corrupt_checkpoint_is_not_a_specdraft_checkpoint_in_one_line(tmp_path, content):
    """Never torch's advice to retry with weights_only=False (code execution for an untrusted file)."""
    path = tmp_path / "head.ckpt"
    if content == "garbage":
        path.write_bytes(b"\x00\x01 not a checkpoint at all")
    elif content == "truncated":
        torch.save({"state_dict": {"w": torch.zeros(64, 64)}}, path)
        path.write_bytes(path.read_bytes()[:200])
    else:
        torch.save({"specdraft": _NotTensors()}, path)
    with pytest.raises(FormatError, match=r"head\.ckpt: not a specdraft checkpoint \(") as caught:
        read_checkpoint(path)
    message = str(caught.value)
    assert "\n" not in message and "weights_only" not in message
