import pytest
import torch

import specdraft.data.features as features_module
from specdraft.data.chat import tokenize_conversation
from specdraft.data.conversations import Conversation, Message
from specdraft.data.features import collate, extract_features, length_batches
from specdraft.data.target import load_hf_target
from specdraft.data.tiny import tiny_random_target


def tokenized_samples(target, answers=("Hello there, friend.", "Hi", "A much longer answer " * 4)):
    return [
        tokenize_conversation(
            target.tokenizer,
            Conversation(f"c{i}", (Message("user", f"question {i}"), Message("assistant", a))),
        )
        for i, a in enumerate(answers)
    ]


def test_tiny_target_spec(tiny_target):
    spec = tiny_target.spec
    assert (spec.hidden_size, spec.num_layers, spec.vocab_size, spec.dtype) == (64, 4, 259, "float32")
    assert (spec.num_attention_heads, spec.num_kv_heads, spec.head_dim) == (4, 2, 16)
    assert tiny_target.tokenizer.convert_ids_to_tokens(list(spec.eos_token_ids)) == ["<|im_end|>"]
    assert spec.chat_template == tiny_target.tokenizer.chat_template
    assert spec.aux_layer_ids == (1, 2, 3)


def test_target_is_frozen(tiny_target):
    assert not tiny_target.model.training
    assert not any(p.requires_grad for p in tiny_target.model.parameters())


def test_tiny_target_is_reproducible_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    first, second = tiny_random_target(seed=3), tiny_random_target(seed=3)
    assert torch.rand(1) == expected_next
    for a, b in zip(first.model.state_dict().values(), second.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_aux_layers_follow_the_hidden_states_convention(tiny_target):
    """id i = hidden_states[i] = the stream entering layer i; 0 = embeddings; hidden = post-norm."""
    batch = collate(tokenized_samples(tiny_target)[:1], tiny_target.spec.pad_token_id)
    features = extract_features(tiny_target, batch, aux_layer_ids=(0, 1, 3))
    reference = tiny_target.model(batch.input_ids, output_hidden_states=True).hidden_states
    model = tiny_target.model.model
    hidden = tiny_target.spec.hidden_size
    assert features.aux.shape == (*batch.input_ids.shape, 3 * hidden)
    aux = features.aux.split(hidden, dim=-1)
    assert torch.equal(aux[0], model.embed_tokens(batch.input_ids))
    assert torch.equal(aux[0], reference[0])
    assert torch.equal(aux[1], reference[1])
    assert torch.equal(aux[2], reference[3])
    assert torch.equal(features.hidden, reference[4])  # hidden_states[N] is AFTER the final norm
    with pytest.raises(ValueError, match=r"out of range 0\.\.3"):
        extract_features(tiny_target, batch, aux_layer_ids=(4,))


def test_batched_padded_features_equal_unpadded_single_sequences(tiny_target):
    samples = tokenized_samples(tiny_target)
    batch = collate(samples, tiny_target.spec.pad_token_id)
    features = extract_features(tiny_target, batch, tiny_target.spec.aux_layer_ids, top_k=5)
    for row, sample in enumerate(samples):
        single = extract_features(tiny_target, collate([sample], 0), tiny_target.spec.aux_layer_ids, top_k=5)
        n = len(sample.input_ids)
        torch.testing.assert_close(features.hidden[row, :n], single.hidden[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(features.aux[row, :n], single.aux[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(features.topk_probs[row, :n], single.topk_probs[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(features.loss_mask[row, :n], torch.tensor(sample.loss_mask))
        for padded in (features.hidden, features.aux, features.topk_probs):
            assert not padded[row, n:].any()


def test_a_mask_other_than_right_padding_reaches_the_model(tiny_target):
    """Right padding runs the causal kernel without the mask (above: the same features); a mask
    with a hole elsewhere is the model's to apply."""
    batch = collate(tokenized_samples(tiny_target)[:2], tiny_target.spec.pad_token_id)
    batch.attention_mask[:, 1] = 0
    features = extract_features(tiny_target, batch)
    with torch.no_grad():
        expected = tiny_target.model.get_decoder()(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask
        ).last_hidden_state * batch.attention_mask.unsqueeze(-1)
    torch.testing.assert_close(features.hidden, expected)


@pytest.mark.parametrize("topk_rows", [3, 32])  # 3: chunks of 7 logits rows in pieces 3 + 3 + 1
def test_topk_matches_the_model(tiny_target, monkeypatch, topk_rows):
    monkeypatch.setattr(features_module, "TOPK_ROWS", topk_rows)
    batch = collate(tokenized_samples(tiny_target), tiny_target.spec.pad_token_id)
    features = extract_features(tiny_target, batch, top_k=4, lm_head_chunk_tokens=7)
    logits = tiny_target.model(batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    valid = batch.attention_mask.bool()
    probs, ids = logits.softmax(-1).topk(4, dim=-1)
    torch.testing.assert_close(features.topk_probs[valid], probs[valid], atol=1e-6, rtol=1e-5)
    assert torch.equal(features.topk_ids[valid], ids[valid])
    assert features.topk_probs.dtype == torch.float32
    assert features.aux is None


def test_features_in_bf16_keep_the_target_dtype():
    target = tiny_random_target(dtype="bfloat16")
    batch = collate(tokenized_samples(target), target.spec.pad_token_id)
    features = extract_features(target, batch, target.spec.aux_layer_ids, top_k=2)
    assert features.hidden.dtype == features.aux.dtype == torch.bfloat16
    assert features.topk_probs.dtype == torch.float32


def test_length_batches_respect_the_budget_and_cover_every_sample_once():
    lengths = [5, 17, 3, 9, 16, 2, 30, 8]
    batches = length_batches(lengths, max_batch_tokens=32)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) * max(lengths[i] for i in batch) <= 32
    assert len(batches) < len(lengths)  # similar lengths share batches
    with pytest.raises(ValueError, match="exceeds max_batch_tokens=16"):
        length_batches([17], 16)


def test_collate_right_pads(tiny_target):
    samples = tokenized_samples(tiny_target)
    batch = collate(samples, pad_token_id=0)
    longest = max(len(s.input_ids) for s in samples)
    assert batch.input_ids.shape == (3, longest)
    assert batch.num_tokens == sum(len(s.input_ids) for s in samples)
    short = samples[1]
    assert batch.attention_mask[1].tolist() == [1] * len(short.input_ids) + [0] * (
        longest - len(short.input_ids)
    )


def test_hf_loader_on_a_local_directory(tmp_path, tiny_target):
    tiny_target.model.save_pretrained(tmp_path)
    tiny_target.tokenizer.save_pretrained(tmp_path)
    loaded = load_hf_target(str(tmp_path), dtype="float32", aux_layer_ids=(1, 2, 3))
    assert loaded.spec.revision == "local"
    expected = {**tiny_target.spec.to_dict(), "name": str(tmp_path), "revision": "local"}
    assert loaded.spec.to_dict() == expected
    batch = collate(tokenized_samples(tiny_target), tiny_target.spec.pad_token_id)
    assert torch.equal(extract_features(loaded, batch).hidden, extract_features(tiny_target, batch).hidden)
