import dataclasses
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
import torch

from specdraft.data.cache import CacheError, StoredFields
from specdraft.data.cache_dataset import FeatureCache
from specdraft.data.captured_cache import CapturedCacheWriter
from specdraft.data.chat import TokenizedConversation
from specdraft.data.conversations import Conversation, Message, is_heldout, read_jsonl
from specdraft.data.datamodule import FeatureDataModule
from specdraft.data.features import collate, extract_features
from specdraft.data.regen import (
    AutoBatch,
    GenerationSettings,
    OpenAIResponder,
    TargetResponder,
    regenerate,
    resolve_batch_size,
    resolve_chunk_size,
    row_bytes,
)
from specdraft.data.tiny import tiny_random_target


def conversations(count=9):
    return [
        Conversation(
            f"r{i}",
            (
                Message("user", f"question {i}"),
                Message("assistant", "old answer"),
                Message("user", f"follow-up {i}"),
                Message("assistant", "old again"),
            ),
        )
        for i in range(count)
    ]


class RecordingResponder:
    description: ClassVar[dict] = {"backend": "fake"}

    def __init__(
        self, fail_after_calls=None, answer=lambda history: f"new answer to {history[-1]['content']}"
    ):
        self.calls, self.histories, self.fail_after_calls, self.answer = 0, [], fail_after_calls, answer
        self.generated_tokens = 0

    def __call__(self, histories, seed):
        if self.fail_after_calls is not None and self.calls == self.fail_after_calls:
            raise KeyboardInterrupt
        self.calls += 1
        self.histories += [list(h) for h in histories]
        return [self.answer(h) for h in histories]


SETTINGS = GenerationSettings(temperature=0.8, top_p=0.9, max_new_tokens=12, seed=7)


def run(responder, path, convs=None, **kwargs):
    return regenerate(
        convs or conversations(),
        responder,
        path,
        SETTINGS,
        {"data": "test"},
        chunk_size=2,
        progress=False,
        **kwargs,
    )


def test_every_turn_is_answered_in_the_regenerated_context(tmp_path):
    responder = RecordingResponder()
    run(responder, tmp_path / "out.jsonl")
    second_turn = [h for h in responder.histories if len(h) == 3]
    assert second_turn[0][1] == {"role": "assistant", "content": "new answer to question 0"}
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert records[0]["messages"][3] == {"role": "assistant", "content": "new answer to follow-up 0"}
    result = read_jsonl(tmp_path / "out.jsonl")
    assert len(result.conversations) == 9 and not result.report.skipped


def test_unanswerable_turns_end_the_conversation(tmp_path):
    responder = RecordingResponder(
        answer=lambda h: None if "follow-up" in h[-1]["content"] or h[-1]["content"] == "question 1" else "ok"
    )
    report = run(responder, tmp_path / "out.jsonl")
    records = {
        json.loads(line)["id"]: json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()
    }
    assert "r1" not in records and report.skipped_conversations == 1
    assert [m["role"] for m in records["r0"]["messages"]] == ["user", "assistant"]
    assert report.turns_dropped == 8 + 2


class CrashingTargetResponder(TargetResponder):
    """Dies (like a kill) on call number ``dies_at`` (the fifth)."""

    calls, dies_at = 0, 5

    def __call__(self, histories, seed):
        if self.calls == self.dies_at - 1:
            raise KeyboardInterrupt
        self.calls += 1
        return super().__call__(histories, seed)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_resume_after_a_crash_writes_what_an_uninterrupted_run_writes(tmp_path, temperature):
    target = tiny_random_target(initializer_range=0.5)
    settings = GenerationSettings(temperature=temperature, top_p=0.9, max_new_tokens=8, seed=3)

    def go(path, responder):
        return regenerate(conversations(7), responder, path, settings, {"d": 1}, chunk_size=2, progress=False)

    go(tmp_path / "reference.jsonl", TargetResponder(target, settings, batch_size=3))
    with pytest.raises(KeyboardInterrupt):
        go(tmp_path / "resumed.jsonl", CrashingTargetResponder(target, settings, batch_size=3))
    # and a kill between an append and its progress record: junk past the recorded size
    with (tmp_path / "resumed.jsonl").open("ab") as handle:
        handle.write(b'{"id": "r4", "messages": [{"role": "user", "con')
    go(tmp_path / "resumed.jsonl", TargetResponder(target, settings, batch_size=3))
    assert (tmp_path / "resumed.jsonl").read_bytes() == (tmp_path / "reference.jsonl").read_bytes()


def test_batched_left_padded_answers_equal_single_prompt_answers(tmp_path):
    target = tiny_random_target(dtype="float64", initializer_range=0.5)
    settings = GenerationSettings(temperature=0.0, top_p=1.0, seed=0, max_new_tokens=10)
    histories = [[{"role": "user", "content": "hi" * n}] for n in (1, 7, 3, 12)]
    batched = TargetResponder(target, settings, batch_size=4)(histories, seed=0)
    single = [TargetResponder(target, settings, batch_size=1)([h], seed=0)[0] for h in histories]
    assert batched == single
    assert len(set(batched)) > 1


def test_other_settings_on_resume_are_refused(tmp_path):
    run(RecordingResponder(), tmp_path / "out.jsonl")
    before = (tmp_path / "out.jsonl").read_bytes()
    with pytest.raises(
        ValueError, match=r"other settings \(nothing was changed\):[\s\S]*settings\.temperature: stored 0\.8"
    ):
        regenerate(
            conversations(),
            RecordingResponder(),
            tmp_path / "out.jsonl",
            GenerationSettings(temperature=0.0, top_p=1.0, max_new_tokens=512, seed=0),
            {"data": "test"},
            chunk_size=2,
            progress=False,
        )
    assert (tmp_path / "out.jsonl").read_bytes() == before


def test_too_long_prompts_are_not_sent_to_the_target():
    target = tiny_random_target()
    responder = TargetResponder(
        target, GenerationSettings(temperature=0.0, top_p=1.0, seed=0, max_new_tokens=8), max_prompt_tokens=80
    )
    answers = responder(
        [[{"role": "user", "content": "x" * 100}], [{"role": "user", "content": "y"}]], seed=0
    )
    assert answers[0] is None and answers[1] is not None


class FakeOpenAIServer(BaseHTTPRequestHandler):
    requests: ClassVar[list] = []
    fail_first: ClassVar[int] = 0

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeOpenAIServer.requests.append((self.path, body, self.headers.get("Authorization")))
        if FakeOpenAIServer.fail_first > 0:
            FakeOpenAIServer.fail_first -= 1
            self.send_response(503)
            self.end_headers()
            return
        reply = {
            "choices": [
                {"message": {"role": "assistant", "content": f" served: {body['messages'][-1]['content']}"}}
            ]
        }
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_openai_compatible_backend(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAIServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        FakeOpenAIServer.requests, FakeOpenAIServer.fail_first = [], 1
        base_url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        responder = OpenAIResponder(
            base_url, "served-model", SETTINGS, api_key="secret", concurrency=2, max_retries=2
        )
        run(responder, tmp_path / "out.jsonl", convs=conversations(3))
    finally:
        server.shutdown()
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert records[0]["messages"][1]["content"] == "served: question 0"
    path, body, auth = FakeOpenAIServer.requests[-1]
    assert path == "/v1/chat/completions" and auth == "Bearer secret"
    assert (body["model"], body["temperature"], body["top_p"], body["max_tokens"]) == (
        "served-model",
        0.8,
        0.9,
        12,
    )
    assert len(FakeOpenAIServer.requests) == 6 + 1  # 3 conversations × 2 turns + one retried 503


def test_openai_backend_needs_a_url():
    with pytest.raises(ValueError, match="base_url is required"):
        OpenAIResponder("", "m", SETTINGS)


def test_regenerated_output_feeds_the_training_data_path(tmp_path, tiny_target):
    """read back → tokenize → cache → FeatureCache: the path a head trains from."""
    from specdraft.data.cache import StoredFields, write_cache
    from specdraft.data.cache_dataset import FeatureCache
    from specdraft.data.chat import tokenize_conversations

    run(RecordingResponder(), tmp_path / "out.jsonl")
    samples, report = tokenize_conversations(
        tiny_target.tokenizer, read_jsonl(tmp_path / "out.jsonl").conversations, 512, progress=False
    )
    assert report.kept == 9 and report.loss_tokens > 0
    write_cache(tiny_target, samples, tmp_path / "cache", StoredFields(), {"d": "regen"}, progress=False)
    assert len(FeatureCache(tmp_path / "cache")) == 9
    assert torch.is_tensor(FeatureCache(tmp_path / "cache")[0]["hidden"])


def test_max_turns_answers_only_the_first_turns_and_is_part_of_the_resume_key(tmp_path):
    responder = RecordingResponder()
    report = run(responder, tmp_path / "out.jsonl", max_turns=1)
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in records)
    assert report.turns_answered == len(records) and all(len(h) == 1 for h in responder.histories)
    with pytest.raises(ValueError, match="max_turns"):
        run(RecordingResponder(), tmp_path / "out.jsonl", max_turns=2)


RULES = AutoBatch(cpu_rows=32, gpu_memory_fraction=0.5, max_rows=1024, chunk_batches=4, min_chunk=64)


def test_auto_batch_size_follows_the_gpus_free_memory_and_the_rows_size():
    """SmolLM2 in bf16 at 768 prompt tokens: 2 (K, V) × 30 layers × 3 KV heads × 64 + 2 × 1536
    intermediate + 768 mask columns = 15,360 values = 30,720 bytes per position, × 768."""
    spec = tiny_random_target(seed=0).spec
    smollm2 = dataclasses.replace(
        spec, num_layers=30, num_kv_heads=3, head_dim=64, intermediate_size=1536, dtype="bfloat16"
    )
    assert row_bytes(smollm2, 768) == 30_720 * 768
    cuda = torch.device("cuda")
    rows = resolve_batch_size("auto", smollm2, cuda, 768, RULES, free_bytes=10 * 2**30)
    assert rows == int(0.5 * 10 * 2**30) // (30_720 * 768) == 227
    assert resolve_batch_size("auto", smollm2, cuda, 768, RULES, free_bytes=80 * 2**30) == 1024  # max_rows
    assert resolve_batch_size("auto", smollm2, cuda, 768, RULES, free_bytes=1) == 1
    assert resolve_batch_size("auto", smollm2, torch.device("cpu"), 768, RULES) == 32
    assert resolve_batch_size(7, smollm2, cuda, 768, RULES) == 7  # given: as given
    with pytest.raises(ValueError, match="batch_size must be >= 1 or 'auto', got 0"):
        resolve_batch_size(0, smollm2, cuda, 768, RULES)


def test_auto_chunk_size_holds_a_few_batches():
    """Rows are refilled within a chunk only: a chunk smaller than the batch would leave rows idle."""
    assert resolve_chunk_size("auto", 256, RULES) == 1024
    assert resolve_chunk_size("auto", 8, RULES) == 64  # min_chunk
    assert resolve_chunk_size(10, 256, RULES) == 10
    with pytest.raises(ValueError, match="chunk_size must be >= 1 or 'auto'"):
        resolve_chunk_size(-1, 256, RULES)


def captured_run(tmp_path, name, responder_class=TargetResponder, heldout_fraction=0.3, answers=None):
    """First turns of 7 conversations in chunks of 2, greedy, features captured into
    ``<name>/{train,heldout}``, the answers into ``<answers or name>.jsonl``."""
    target = tiny_random_target(initializer_range=0.5)
    settings = GenerationSettings(temperature=0.0, top_p=1.0, max_new_tokens=8, seed=3)
    fields = StoredFields(target.spec.aux_layer_ids, top_k=4)
    dirs = {split: tmp_path / name / split for split in ("train", "heldout")}
    writer = CapturedCacheWriter(dirs, target, fields, heldout_fraction, 1, {"d": 1})
    responder = responder_class(target, settings, batch_size=3, capture=fields)
    convs = conversations(7)
    answers_path = tmp_path / f"{answers or name}.jsonl"
    regenerate(convs, responder, answers_path, settings, {"d": 1}, 2, False, 1, writer)
    return target, fields, dirs


def test_captured_features_are_caches_of_the_generated_tokens(tmp_path):
    target, fields, dirs = captured_run(tmp_path, "run")
    records = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    caches = {split: FeatureCache(d, target.spec, fields) for split, d in dirs.items()}
    assert len(caches["train"]) + len(caches["heldout"]) == len(records) == 7
    assert len(caches["heldout"]) > 0 and len(caches["train"]) > 0
    assert caches["heldout"].sample_ids == [r["id"] for r in records if is_heldout(r["id"], 0.3, 1)]
    for cache in caches.values():
        for index in range(len(cache)):
            sample = cache[index]
            record = next(r for r in records if r["id"] == cache.sample_ids[index])
            prompt = target.tokenizer.apply_chat_template(
                record["messages"][:1], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
            answer = sample["input_ids"][len(prompt) :].tolist()
            assert sample["input_ids"][: len(prompt)].tolist() == prompt
            assert (
                target.tokenizer.decode(answer, skip_special_tokens=True).strip()
                == record["messages"][1]["content"]
            )
            assert sample["loss_mask"].tolist() == [0] * len(prompt) + [1] * len(answer)
            tokens = TokenizedConversation(
                "x", tuple(sample["input_ids"].tolist()), tuple(sample["loss_mask"].tolist())
            )
            expected = extract_features(target, collate([tokens], 0), fields.aux_layer_ids, fields.top_k)
            read = slice(len(prompt) - 1, None)  # the top-k where objectives read it
            for name, rows in (("hidden", slice(None)), ("aux", slice(None)), ("topk_probs", read)):
                expected_value = getattr(expected, name)[0, rows]
                scale = expected_value.abs().max()
                torch.testing.assert_close(
                    sample[name][rows] / scale, expected_value / scale, atol=5e-5, rtol=0
                )
            assert torch.equal(sample["topk_ids"][read], expected.topk_ids[0, read])


class CrashingCaptureResponder(CrashingTargetResponder):
    """Dies on its third call, after two chunks were written."""

    dies_at = 3


def test_captured_features_resume_to_what_an_uninterrupted_run_writes(tmp_path):
    _, _, reference = captured_run(tmp_path, "reference")
    with pytest.raises(KeyboardInterrupt):
        captured_run(tmp_path, "resumed", CrashingCaptureResponder)
    resumed_dirs = {split: tmp_path / "resumed" / split for split in ("train", "heldout")}
    assert not (resumed_dirs["train"] / "manifest.json").exists()  # unfinished: no manifest
    (resumed_dirs["train"] / ".shard-00002.safetensors.junk").write_bytes(b"half a shard")
    _, _, resumed = captured_run(tmp_path, "resumed")
    for split in ("train", "heldout"):
        names = sorted(p.name for p in reference[split].iterdir())
        assert sorted(p.name for p in resumed[split].iterdir()) == names
        for name in names:
            expected = (reference[split] / name).read_bytes()
            if name in ("plan.json", "manifest.json"):  # the regen path differs in the source
                expected = expected.replace(b"reference.jsonl", b"resumed.jsonl")
            assert (resumed[split] / name).read_bytes() == expected, name


def test_captured_features_refuse_a_directory_of_other_settings(tmp_path):
    captured_run(tmp_path, "run")
    shard = (tmp_path / "run" / "train" / "shard-00000.safetensors").read_bytes()
    with pytest.raises(CacheError, match="heldout_fraction"):  # answers of their own, same features.dir
        captured_run(tmp_path, "run", heldout_fraction=0.5, answers="other")
    assert (tmp_path / "run" / "train" / "shard-00000.safetensors").read_bytes() == shard  # untouched


def test_captured_features_need_first_turns_and_greedy_answers(tmp_path):
    target = tiny_random_target()
    fields = StoredFields((), 2)
    with pytest.raises(ValueError, match="greedy"):
        TargetResponder(target, SETTINGS, capture=fields)
    greedy = dataclasses.replace(SETTINGS, temperature=0.0)
    writer = CapturedCacheWriter(
        {s: tmp_path / s for s in ("train", "heldout")}, target, fields, 0.1, 1, {"d": 1}
    )
    responder = TargetResponder(target, greedy, capture=fields)
    with pytest.raises(ValueError, match="max_turns=1"):
        regenerate(conversations(2), responder, tmp_path / "o.jsonl", greedy, {}, 2, False, None, writer)


def test_captured_caches_train_the_answers_only_and_keep_to_their_directory(tmp_path):
    target, fields, dirs = captured_run(tmp_path, "run")
    caches = {"train_cache": str(dirs["train"]), "val_cache": str(dirs["heldout"])}
    answers = FeatureDataModule("cached", target, True, 4, **caches)
    answers.setup("fit")  # the default: supervised where the next token is the answer's
    everything = FeatureDataModule("cached", target, True, 4, **caches, supervise="all")
    with pytest.raises(ValueError, match=r"captured during regeneration.*supervise=all"):
        everything.setup("fit")  # would read the top-k at prompt positions, where it is zero
    cache_dir = tmp_path / "other" / "train"
    cache_dir.mkdir(parents=True)
    (cache_dir / "plan.json").write_text("{}")  # what specdraft-cache writes first
    writer = CapturedCacheWriter(
        {"train": cache_dir, "heldout": tmp_path / "other" / "heldout"}, target, fields, 0.3, 1, {"d": 1}
    )
    with pytest.raises(CacheError, match="specdraft-cache wrote"):
        writer.start()


def test_the_cli_writes_its_report_as_json_beside_its_output(tmp_path, monkeypatch):
    """specdraft-regen's numbers are read from JSON (scripts/results.py), not scraped from its line."""
    import sys

    from hydra.core.global_hydra import GlobalHydra

    from specdraft.data import regen_cli
    from specdraft.data.regen import report_path

    out = tmp_path / "out.jsonl"
    GlobalHydra.instance().clear()
    argv = ["specdraft-regen", "target=tiny_random", "data=tiny", "limit=3", "max_turns=1", "batch_size=2"]
    argv += ["generation.max_new_tokens=4", "progress=false", f"out_path={out}", f"hydra.run.dir={tmp_path}"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit):  # the tiny random target's first answers are empty: none written
        regen_cli.main()
    report = json.loads(report_path(out).read_text())
    assert report_path(out) == tmp_path / "out.jsonl.report.json"
    assert report["conversations"] == 3 and report["rows"] == 2 and report["chunk_size"] == 64
    assert report["written"] == 0 and report["turns_dropped"] == 3
    assert report["tokens_per_s"] == pytest.approx(report["generated_tokens"] / max(report["seconds"], 1e-9))
