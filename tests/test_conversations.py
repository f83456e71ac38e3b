import json

import pytest

from specdraft.data.conversations import (
    Message,
    ReadReport,
    is_heldout,
    normalise_record,
    read_hf_dataset,
    read_jsonl,
    read_sharegpt_json,
    split_conversations,
)


def sharegpt_record(index: int) -> dict:
    return {
        "id": f"rec{index}_0",
        "conversations": [
            {"from": "human", "value": f'question {index} with "quotes" and ] brackets'},
            {"from": "gpt", "value": f"answer {index}\n{{not json}}"},
        ],
    }


def write_array(path, records, indent=2) -> str:
    text = json.dumps(records, indent=indent)
    path.write_text(text)
    return text


@pytest.mark.parametrize("cut_inside_record", [0, 1, 2, 5])
def test_sharegpt_salvage_keeps_every_complete_record_of_a_truncated_file(tmp_path, cut_inside_record):
    records = [sharegpt_record(i) for i in range(6)]
    text = json.dumps(records, indent=2)
    # cut the file part way through record 4 (several cut points, incl. right after its '{')
    start_of_fifth = text.index('"rec4_0"') - 10
    (tmp_path / "cut.json").write_text(text[: start_of_fifth + cut_inside_record * 17])
    result = read_sharegpt_json(tmp_path / "cut.json")
    assert [c.id for c in result.conversations] == [f"rec{i}_0" for i in range(4)]
    assert result.report.records == 4
    assert result.report.file_ended_early_at_char is not None


def test_sharegpt_salvage_when_cut_right_after_a_comma_or_before_the_bracket(tmp_path):
    text = json.dumps([sharegpt_record(i) for i in range(3)])
    for cut in (text.rindex(",") + 1, len(text) - 1):
        (tmp_path / "cut.json").write_text(text[:cut])
        result = read_sharegpt_json(tmp_path / "cut.json")
        assert result.report.file_ended_early_at_char is not None
        assert len(result.conversations) == (3 if cut == len(text) - 1 else 2)


def test_complete_sharegpt_file_is_not_reported_truncated(tmp_path):
    write_array(tmp_path / "ok.json", [sharegpt_record(i) for i in range(3)])
    result = read_sharegpt_json(tmp_path / "ok.json")
    assert len(result.conversations) == 3
    assert result.report.file_ended_early_at_char is None
    assert result.conversations[0].messages[1] == Message("assistant", "answer 0\n{not json}")


def test_not_a_json_array_is_one_clear_error(tmp_path):
    (tmp_path / "obj.json").write_text('{"id": 1}')
    with pytest.raises(ValueError, match=r"obj\.json: expected a JSON array"):
        read_sharegpt_json(tmp_path / "obj.json")


def normalise(record, record_id="r"):
    report = ReadReport(source="test")
    return normalise_record(record, record_id, report), report


@pytest.mark.parametrize(
    ("source_role", "role"),
    [
        ("human", "user"),
        ("user", "user"),
        ("gpt", "assistant"),
        ("assistant", "assistant"),
        ("chatgpt", "assistant"),
        ("bard", "assistant"),
        ("bing", "assistant"),
        ("GPT", "assistant"),
    ],
)
def test_role_normalisation(source_role, role):
    other = "gpt" if role == "user" else "human"
    turns = [{"from": source_role, "value": "a"}, {"from": other, "value": "b"}]
    if role == "assistant":
        turns = [{"from": "human", "value": "q"}, *turns[:1]]
    conversation, _ = normalise({"conversations": turns})
    assert role in [m.role for m in conversation.messages]


def test_unknown_roles_are_dropped_and_counted():
    conversation, report = normalise(
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "tool", "content": "t"},
                {"role": "assistant", "content": "a"},
            ]
        }
    )
    assert [m.role for m in conversation.messages] == ["user", "assistant"]
    assert report.dropped_roles == {"tool": 1}


def test_leading_assistant_and_trailing_user_are_dropped_and_counted():
    conversation, report = normalise(
        {
            "conversations": [
                {"from": "gpt", "value": "orphan"},
                {"from": "human", "value": "q"},
                {"from": "gpt", "value": "a"},
                {"from": "human", "value": "unanswered"},
            ]
        }
    )
    assert [m.content for m in conversation.messages] == ["q", "a"]
    assert (report.dropped_leading_assistant, report.dropped_trailing_user) == (1, 1)


def test_system_message_is_kept_first():
    conversation, _ = normalise(
        {
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
            ]
        }
    )
    assert [m.role for m in conversation.messages] == ["system", "user", "assistant"]


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ("just a string", "record is not an object"),
        ({"title": "x"}, "no 'conversations' or 'messages' list"),
        ({"conversations": [{"value": "no role"}]}, "turn without a 'from' string"),
        ({"conversations": [{"from": "human"}]}, "turn without a 'value' text"),
        ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "  "}]}, "empty turn"),
        (
            {
                "conversations": [
                    {"from": "human", "value": "q"},
                    {"from": "human", "value": "q2"},
                    {"from": "gpt", "value": "a"},
                ]
            },
            "roles do not alternate user/assistant",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {"role": "system", "content": "s"},
                    {"role": "assistant", "content": "a"},
                ]
            },
            "system message after the first turn",
        ),
        ({"conversations": [{"from": "human", "value": "q"}]}, "no assistant turn"),
    ],
)
def test_malformed_records_are_skipped_with_reason_and_example(record, reason):
    conversation, report = normalise(record, record_id="sample-7")
    assert conversation is None
    assert report.skipped == {reason: 1}
    assert report.skipped_example == {reason: "sample-7"}


def test_openai_content_parts_are_joined():
    conversation, _ = normalise(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "look "}, {"type": "text", "text": "here"}],
                },
                {"role": "assistant", "content": "ok"},
            ]
        }
    )
    assert conversation.messages[0].content == "look here"


def test_jsonl_reads_both_schemas_and_skips_bad_lines(tmp_path):
    lines = [
        json.dumps(sharegpt_record(0)),
        "{not json",
        "",
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}),
        json.dumps({"id": "bad", "messages": [{"role": "user", "content": "only a question"}]}),
    ]
    (tmp_path / "chats.jsonl").write_text("\n".join(lines) + "\n")
    result = read_jsonl(tmp_path / "chats.jsonl")
    assert [c.id for c in result.conversations] == ["rec0_0", "chats.jsonl:4"]
    assert result.report.records == 4
    assert result.report.skipped == {"line is not valid JSON": 1, "no assistant turn": 1}
    assert result.report.skipped_example["line is not valid JSON"] == "chats.jsonl:2"


def test_limit_stops_after_n_valid_conversations(tmp_path):
    write_array(tmp_path / "ok.json", [sharegpt_record(i) for i in range(5)])
    assert len(read_sharegpt_json(tmp_path / "ok.json", limit=2).conversations) == 2


def test_hf_dataset_saved_to_disk(tmp_path):
    import datasets

    records = [sharegpt_record(i) for i in range(3)]
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "ds"))
    result = read_hf_dataset(str(tmp_path / "ds"))
    assert [c.id for c in result.conversations] == ["rec0_0", "rec1_0", "rec2_0"]


def test_hf_dataset_from_local_json_files(tmp_path):
    lines = [
        json.dumps(
            {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
        )
        for i in range(4)
    ]
    (tmp_path / "train.jsonl").write_text("\n".join(lines))
    result = read_hf_dataset("json", data_files=str(tmp_path / "train.jsonl"))
    assert len(result.conversations) == 4
    assert result.conversations[2].id == "train:2"


def test_split_is_deterministic_keeps_parts_together_and_has_the_requested_size():
    ids = [f"conv{i}_{part}" for i in range(4000) for part in range(2)]
    heldout = {i for i in ids if is_heldout(i, 0.05)}
    assert heldout == {i for i in ids if is_heldout(i, 0.05)}
    assert all((f"{i[:-2]}_0" in heldout) == (f"{i[:-2]}_1" in heldout) for i in ids)
    assert 0.04 < len(heldout) / len(ids) < 0.06
    assert heldout != {i for i in ids if is_heldout(i, 0.05, seed=1)}


def test_split_conversations_partitions_in_order():
    from specdraft.data.conversations import Conversation

    conversations = [
        Conversation(f"c{i}", (Message("user", "q"), Message("assistant", "a"))) for i in range(200)
    ]
    train, heldout = split_conversations(conversations, 0.1)
    assert sorted(c.id for c in train + heldout) == sorted(c.id for c in conversations)
    assert train == [c for c in conversations if c not in heldout]
    with pytest.raises(ValueError, match="heldout_fraction"):
        split_conversations(conversations, 1.0)
