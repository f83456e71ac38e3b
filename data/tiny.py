"""Tiny random targets of every supported decoder family and a tiny byte-level tokenizer, built
in memory (no downloads).

The default test tier runs everything on the tiny Llama; the decoding, feature and export
invariants run on every family of :data:`TINY_FAMILIES` too, each built from transformers' own
config class with what sets the family apart switched on at tiny sizes. The tokenizer puts a
family's special tokens first, then one id per byte, so any text round-trips; the default (the
Llama's and Qwen's) mirrors SmolLM2's layout (``<|endoftext|>`` 0, ``<|im_start|>`` 1,
``<|im_end|>`` 2, a ChatML template with a default system prompt) so the tiny target exercises
the same code paths as the real one, the others their family's chat layout.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerFast

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


# A window shorter than the tests' sequences (a 12-token prompt + 40 new tokens), so that the
# keys it hides are exercised.
TINY_SLIDING_WINDOW = 16
# Gemma 2 caps attention scores at 50 and logits at 30, which a tiny random model's never reach:
# caps this low bend them, so that a decoder that skipped capping would compute something else.
TINY_SOFTCAP = 1.0


@dataclass(frozen=True)
class TinyChat:
    """A family's chat layout for the tiny tokenizer: its special tokens and chat template (the
    released template's structure: how turns open and end, where the answer starts), BOS, EOS
    and padding."""

    special_tokens: tuple[str, ...] = TINY_SPECIAL_TOKENS
    template: str = TINY_CHAT_TEMPLATE
    bos: str = "<|im_start|>"
    eos: str = "<|im_end|>"
    pad: str = "<|endoftext|>"

    def tokenizer(self) -> PreTrainedTokenizerFast:
        return tiny_tokenizer(self.template, self.special_tokens, self.bos, self.eos, self.pad)


CHATML = TinyChat()  # SmolLM2's and Qwen's
MISTRAL_CHAT = TinyChat(
    ("<unk>", "<s>", "</s>", "[INST]", "[/INST]"),
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST] ' + message['content'] + '[/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}",
    bos="<s>",
    eos="</s>",
    pad="<unk>",
)
GEMMA_CHAT = TinyChat(  # no system role; the assistant is "model"; answers are trimmed
    ("<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"),
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}",
    bos="<bos>",
    eos="<eos>",
    pad="<pad>",
)
PHI3_CHAT = TinyChat(
    ("<unk>", "<s>", "</s>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"),
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}",
    bos="<s>",
    eos="<|endoftext|>",
    pad="<|endoftext|>",
)


@dataclass(frozen=True)
class TinyFamily:
    """A decoder family as the tests build it: transformers' config class, the settings that set
    the family apart (what a decoder must reproduce to stay lossless on it), whether the lm_head
    is the embedding (as in the family's small releases), the attention implementation
    transformers runs it with (Gemma 2's soft-capping has no SDPA path), and its chat layout."""

    config_class: str
    features: dict[str, Any] = field(default_factory=dict)
    tied: bool = True
    attention: str = "sdpa"
    chat: TinyChat = CHATML


TINY_FAMILIES = {
    "llama": TinyFamily("LlamaConfig"),
    "qwen2": TinyFamily("Qwen2Config"),  # q/k/v projections with biases
    "qwen3": TinyFamily("Qwen3Config"),  # per-head q/k RMS norms
    # every layer windowed
    "mistral": TinyFamily(
        "MistralConfig", {"sliding_window": TINY_SLIDING_WINDOW}, tied=False, chat=MISTRAL_CHAT
    ),
    # (1 + w) RMS norms, a √hidden embedding scale, GeGLU, attention and final logit soft-capping,
    # windowed and global layers alternating. Untied (Gemma ties): a tied tiny Gemma, whose
    # embedding is scaled up, predicts its last token again and again, which would hide a
    # misplaced key or position.
    "gemma2": TinyFamily(
        "Gemma2Config",
        {
            "sliding_window": TINY_SLIDING_WINDOW,
            "attn_logit_softcapping": TINY_SOFTCAP,
            "final_logit_softcapping": TINY_SOFTCAP,
        },
        tied=False,
        attention="eager",
        chat=GEMMA_CHAT,
    ),
    # q/k norms, windowed layers with their own rotary base, √hidden embedding scale, (1 + w) norms
    "gemma3_text": TinyFamily(
        "Gemma3TextConfig",
        {"sliding_window": TINY_SLIDING_WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
        tied=False,
        chat=GEMMA_CHAT,
    ),
    "phi3": TinyFamily("Phi3Config", tied=False, chat=PHI3_CHAT),  # fused q/k/v and gate/up projections
}


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
    tie_word_embeddings: bool | None = None,
    dtype: str = "float32",
    aux_layer_ids: Sequence[int] = (1, 2, 3),
    attn_implementation: str | None = None,
    family: str = "llama",
) -> Target:
    """A random model of ``family`` (:data:`TINY_FAMILIES`) with the tiny tokenizer; the same
    ``seed`` gives the same weights. ``tie_word_embeddings`` and ``attn_implementation`` None:
    the family's."""
    if family not in TINY_FAMILIES:
        raise ValueError(f"tiny target family {family!r}: expected one of {sorted(TINY_FAMILIES)}")
    spec = TINY_FAMILIES[family]
    tokenizer = spec.chat.tokenizer()
    features = dict(spec.features)
    if "layer_types" in features:  # a pattern, repeated over the layers
        pattern = features["layer_types"]
        features["layer_types"] = [pattern[i % len(pattern)] for i in range(num_layers)]
    config: PretrainedConfig = getattr(transformers, spec.config_class)(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=spec.tied if tie_word_embeddings is None else tie_word_embeddings,
        rms_norm_eps=rms_norm_eps,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **features,
    )
    config._attn_implementation = attn_implementation or spec.attention
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.random.set_rng_state(generator_state)  # building a target must not disturb the caller's RNG
    model.config.architectures = [type(model).__name__]
    model = model.to(resolve_dtype(dtype))
    name = f"tiny-random-llama-seed{seed}" if family == "llama" else f"tiny-random-{family}-seed{seed}"
    return build_target(model, tokenizer, name=name, revision="in-memory", aux_layer_ids=aux_layer_ids)


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
