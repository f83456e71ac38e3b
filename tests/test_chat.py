"""The assistant loss mask, token by token, on several chat-template styles.

The tiny tokenizers are byte-level (one token per character, special tokens whole), so the
expected mask can be written as text: every masked run of tokens must decode to exactly the
expected answer spans, and the unmasked tokens to everything else.
"""

import pytest

from specdraft.data.chat import (
    ChatTemplateError,
    end_of_turn_token_id,
    tokenize_conversation,
    tokenize_conversations,
)
from specdraft.data.conversations import Conversation, Message
from specdraft.data.tiny import tiny_tokenizer

LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
VICUNA_SPECIALS = ("<unk>", "<s>", "</s>")
VICUNA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + ' ' }}"
    "{% else %}{{ 'A chat between a user and an assistant. ' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ 'USER: ' + message['content'] + ' ' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'ASSISTANT: ' + message['content'] + '</s>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
PLAIN_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + '\\n' }}"
    "{% else %}{{ message['content'] + '\\n\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def chatml():
    return tiny_tokenizer()


def llama3():
    return tiny_tokenizer(LLAMA3_TEMPLATE, LLAMA3_SPECIALS, "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>")


def vicuna():
    return tiny_tokenizer(VICUNA_TEMPLATE, VICUNA_SPECIALS, "<s>", "</s>", "<unk>")


def plain():
    return tiny_tokenizer(PLAIN_TEMPLATE)


def conversation(*turns: tuple[str, str], conversation_id: str = "c1") -> Conversation:
    return Conversation(conversation_id, tuple(Message(role, content) for role, content in turns))


def masked_runs(tokenizer, tokenized) -> list[str]:
    """The text of each maximal run of masked tokens."""
    runs, current = [], []
    for token_id, mask in zip(tokenized.input_ids, tokenized.loss_mask, strict=True):
        if mask:
            current.append(token_id)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


TWO_TURNS = conversation(
    ("user", "Hi there"),
    ("assistant", "Hello! How can I help?"),
    ("user", "Say yes"),
    ("assistant", "yes"),
)


@pytest.mark.parametrize(
    ("make_tokenizer", "expected_runs", "expected_text"),
    [
        (
            chatml,
            ["Hello! How can I help?<|im_end|>", "yes<|im_end|>"],
            "<|im_start|>system\nYou are a tiny test model.<|im_end|>\n"
            "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"
            "<|im_start|>user\nSay yes<|im_end|>\n<|im_start|>assistant\nyes<|im_end|>\n",
        ),
        (
            llama3,
            ["Hello! How can I help?<|eot_id|>", "yes<|eot_id|>"],
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello! How can I help?<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nSay yes<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nyes<|eot_id|>",
        ),
        (
            vicuna,
            ["Hello! How can I help?</s>", "yes</s>"],
            "<s>A chat between a user and an assistant. USER: Hi there ASSISTANT: Hello! How can I help?</s>"
            "USER: Say yes ASSISTANT: yes</s>",
        ),
        (
            plain,
            ["Hello! How can I help?", "yes"],  # no special terminator: the newline is template text
            "User: Hi there\nAssistant: Hello! How can I help?\nUser: Say yes\nAssistant: yes\n",
        ),
    ],
    ids=["chatml", "llama3", "vicuna", "plain"],
)
def test_loss_mask_token_by_token(make_tokenizer, expected_runs, expected_text):
    tokenizer = make_tokenizer()
    tokenized = tokenize_conversation(tokenizer, TWO_TURNS)
    assert tokenizer.decode(list(tokenized.input_ids)) == expected_text
    assert masked_runs(tokenizer, tokenized) == expected_runs
    # one token per character (specials whole), so the count pins every position
    assert tokenized.num_loss_tokens == sum(
        len(tokenizer(run, add_special_tokens=False).input_ids) for run in expected_runs
    )


def test_template_bos_is_not_doubled():
    tokenizer = llama3()
    tokenized = tokenize_conversation(tokenizer, TWO_TURNS)
    bos = tokenizer.bos_token_id
    assert tokenized.input_ids[0] == bos
    assert tokenized.input_ids.count(bos) == 1


def test_trimming_template_masks_the_trimmed_answer():
    tokenized = tokenize_conversation(
        llama3(), conversation(("user", "q"), ("assistant", "  spaced answer \n"))
    )
    assert masked_runs(llama3(), tokenized) == ["spaced answer<|eot_id|>"]


def test_answer_repeated_in_the_user_turn_is_masked_in_the_answer_only():
    tokenizer = chatml()
    conv = conversation(("user", "yes"), ("assistant", "yes"))
    tokenized = tokenize_conversation(tokenizer, conv)
    text = tokenizer.decode(list(tokenized.input_ids))
    first_masked = tokenized.loss_mask.index(1)
    assert text.count("yes") == 2
    assert tokenizer.decode(list(tokenized.input_ids[:first_masked])).endswith("<|im_start|>assistant\n")
    assert masked_runs(tokenizer, tokenized) == ["yes<|im_end|>"]


def test_system_message_replaces_the_default_and_is_not_learned():
    tokenizer = vicuna()
    conv = conversation(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hey"))
    tokenized = tokenize_conversation(tokenizer, conv)
    assert tokenizer.decode(list(tokenized.input_ids)).startswith("<s>Be brief. USER: Hi")
    assert masked_runs(tokenizer, tokenized) == ["Hey</s>"]


def test_truncation_cuts_ids_and_mask_together():
    tokenizer = chatml()
    full = tokenize_conversation(tokenizer, TWO_TURNS)
    cut = tokenize_conversation(tokenizer, TWO_TURNS, max_length=60)
    assert cut.input_ids == full.input_ids[:60]
    assert cut.loss_mask == full.loss_mask[:60]


def test_tokenize_conversations_counts_truncation_and_skips():
    tokenizer = chatml()
    prompt_heavy = conversation(("user", "x" * 200), ("assistant", "late answer"), conversation_id="long")
    kept, report = tokenize_conversations(
        tokenizer, [TWO_TURNS, prompt_heavy], max_length=100, progress=False
    )
    assert [k.id for k in kept] == ["c1"]
    assert report.truncated == 2
    assert report.skipped == {"no assistant token within max_length": 1}
    assert report.skipped_example["no assistant token within max_length"] == "long"
    assert report.loss_tokens == kept[0].num_loss_tokens


def test_template_errors_are_counted_not_raised():
    refusing = tiny_tokenizer("{{ raise_exception('system role not supported') }}")
    with pytest.raises(ChatTemplateError, match="render failed"):
        tokenize_conversation(refusing, TWO_TURNS)
    kept, report = tokenize_conversations(refusing, [TWO_TURNS], progress=False)
    assert kept == []
    assert report.skipped == {"chat template: render failed": 1}


def test_missing_template_is_a_clear_error():
    tokenizer = chatml()
    tokenizer.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        tokenize_conversation(tokenizer, TWO_TURNS)


@pytest.mark.parametrize(
    ("make_tokenizer", "expected"),
    [(chatml, "<|im_end|>"), (llama3, "<|eot_id|>"), (vicuna, "</s>"), (plain, None)],
    ids=["chatml", "llama3", "vicuna", "plain"],
)
def test_end_of_turn_token(make_tokenizer, expected):
    tokenizer = make_tokenizer()
    token_id = end_of_turn_token_id(tokenizer)
    assert (tokenizer.convert_ids_to_tokens(token_id) if token_id is not None else None) == expected
