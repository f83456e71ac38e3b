"""A tiny random Llama target and a tiny byte-level tokenizer, built in memory (no downloads).

The default test tier runs everything on this target. The tokenizer mirrors SmolLM2's layout
(``<|endoftext|>`` 0, ``<|im_start|>`` 1, ``<|im_end|>`` 2, a ChatML template with a default
system prompt) so the tiny target exercises the same code paths as the real one; every other
id is one byte, so any text round-trips.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specdraft.data.conversations import Conversation, ConversationSet, Message, ReadReport
from specdraft.data.target import Target, build_target
from specdraft.system.hardware import resolve_dtype

TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tiny_tokenizer(
    chat_template: str = TINY_CHAT_TEMPLATE,
    special_tokens: Sequence[str] = TINY_SPECIAL_TOKENS,
    bos_token: str = "<|im_start|>",
    eos_token: str = "<|im_end|>",
    pad_token: str = "<|endoftext|>",
) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: the special tokens first, then one id per byte (no merges).

    With the defaults: 3 special tokens + 256 bytes = 259 ids. Tests build Llama-3 and Vicuna
    style tokenizers by passing their special tokens and template.
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(special_tokens)}
    vocab.update({char: len(special_tokens) + i for i, char in enumerate(alphabet)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos_token,
        eos_token=eos_token,
        pad_token=pad_token,
        unk_token=pad_token,
        additional_special_tokens=list(special_tokens),
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def tiny_random_target(
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_attention_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    initializer_range: float = 0.02,
    rms_norm_eps: float = 1e-5,
    tie_word_embeddings: bool = True,
    dtype: str = "float32",
    aux_layer_ids: Sequence[int] = (1, 2, 3),
    attn_implementation: str = "sdpa",
) -> Target:
    """A random Llama with the tiny tokenizer; the same ``seed`` gives the same weights."""
    tokenizer = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=rms_norm_eps,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation=attn_implementation,
    )
    config.architectures = ["LlamaForCausalLM"]
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)  # building a target must not disturb the caller's RNG
    model = model.to(resolve_dtype(dtype))
    return build_target(
        model,
        tokenizer,
        name=f"tiny-random-llama-seed{seed}",
        revision="in-memory",
        aux_layer_ids=aux_layer_ids,
    )


def tiny_conversations(count: int, seed: int) -> ConversationSet:
    """``count`` short synthetic chats (counting, repeating, spelling) with regular answers: a
    conversation source for smoke runs and tests that needs no dataset package."""
    generator = random.Random(seed)
    words = ["draft", "target", "token", "head", "tree", "verify", "accept", "sample"]
    conversations = []
    for index in range(count):
        task = index % 3
        if task == 0:
            start = generator.randint(1, 50)
            stop = start + generator.randint(3, 12)
            question, answer = (
                f"Count from {start} to {stop}.",
                ", ".join(map(str, range(start, stop + 1))) + ".",
            )
        elif task == 1:
            word, times = generator.choice(words), generator.randint(2, 6)
            question, answer = f"Repeat '{word}' {times} times.", " ".join([word] * times)
        else:
            word = generator.choice(words)
            question, answer = f"Spell '{word}'.", "-".join(word.upper())
        messages = (Message("user", question), Message("assistant", answer))
        conversations.append(Conversation(f"tiny{index:04d}", messages))  # no "_k" part suffix
    report = ReadReport(source=f"tiny_conversations(count={count}, seed={seed})", records=count, kept=count)
    return ConversationSet(conversations, report)
