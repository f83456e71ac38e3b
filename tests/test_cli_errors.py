"""Every command's user errors: ONE line on stderr, ``<command>: error: …``, exit code 2, and the
traceback only with SPECDRAFT_DEBUG=1 (system/errors.py). Each command runs in-process, as its
console script does, on the tiny target."""

from __future__ import annotations

import errno
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from safetensors.torch import save_file

from specdraft.data import cache_cli, prepare, regen_cli
from specdraft.data.cache import CacheError
from specdraft.data.cache_dataset import FeatureCache
from specdraft.data.chat import ChatTemplateError, tokenize_conversations
from specdraft.data.conversations import Conversation, Message
from specdraft.data.tiny import tiny_random_target, tiny_tokenizer
from specdraft.eval import cli as eval_cli
from specdraft.recipes import depth_acceptance, quickstart, sweep_report
from specdraft.system.errors import USER_ERROR_EXIT_CODE, user_errors, user_message
from specdraft.train import cli as train_cli
from specdraft.train import export
from tests.test_bench import save_tiny_checkpoint
from tests.test_cache import samples_for, write


def run_command(entry: Callable[[], None], command: str, *args: str, monkeypatch, capsys) -> str:
    """Run ``entry`` as the console script ``command`` with ``args``; its stderr's last line."""
    GlobalHydra.instance().clear()
    monkeypatch.setattr(sys, "argv", [command, *args])
    with pytest.raises(SystemExit) as stop:
        entry()
    assert stop.value.code == USER_ERROR_EXIT_CODE, capsys.readouterr()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    assert lines[-1].startswith(f"{command}: error: "), lines[-3:]
    return lines[-1]


def hydra_args(tmp_path: Path) -> list[str]:
    return [f"hydra.run.dir={tmp_path / 'hydra'}", "hydra/job_logging=none", "hydra/hydra_logging=none"]


LATIN1_LINES = '{}\n{"id": "café"}\n'.encode("latin-1")  # line 2, column 12: é in Latin-1


NOT_UTF8_JSON = b"{\xff}"
USER_ONLY_LINE = b'{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n'


def write_file(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def checkpoint_without_state_dict(tmp_path: Path) -> Path:
    path = save_tiny_checkpoint(tmp_path / "no-state.ckpt")
    checkpoint = torch.load(path, weights_only=True)
    del checkpoint["state_dict"]
    torch.save(checkpoint, path)
    return path


def truncated_export(tmp_path: Path) -> Path:
    write_file(tmp_path / "export" / "config.json", b"{}")
    write_file(tmp_path / "export" / "model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    return tmp_path / "export"


def corrupt_checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "corrupt.ckpt"
    path.write_bytes(b"PK\x03\x04 truncated")
    return path


@pytest.mark.parametrize(
    "entry,command,args,expected",
    [
        (
            eval_cli.bench_main,
            "specdraft-bench",
            lambda t: [
                "target=tiny_random",
                "prompts=tiny",
                f"checkpoint={t / 'missing.ckpt'}",
                "methods=head",
            ],
            "missing.ckpt does not exist",
        ),
        (
            eval_cli.eval_main,
            "specdraft-eval",
            lambda t: ["target=tiny_random", "prompts=tiny", f"checkpoint={corrupt_checkpoint(t)}"],
            "corrupt.ckpt: not a specdraft checkpoint",
        ),
        (
            eval_cli.eval_main,
            "specdraft-eval",
            lambda t: [
                "target=tiny_random",
                "target.hidden_size=32",
                "prompts=tiny",
                f"checkpoint={save_tiny_checkpoint(t / 'head.ckpt')}",
            ],
            "tiny-random-llama-seed0",  # the head's target, not this one
        ),
        (
            eval_cli.bench_main,
            "specdraft-bench",
            lambda t: ["target=tiny_random", "prompts=tiny", "checkpoint=x", "batch_sizes=[0]"],
            "batch_sizes: expected a non-empty list of positive integers",
        ),
        (
            export.main,
            "specdraft-export",
            lambda t: ["target=tiny_random", f"checkpoint={corrupt_checkpoint(t)}", "format=native"],
            "not a specdraft checkpoint",
        ),
        (
            export.main,
            "specdraft-export",
            lambda t: ["target=tiny_random", f"checkpoint={t / 'missing.ckpt'}", "format=nonsense"],
            "format=nonsense: expected one of",
        ),
        (
            cache_cli.main,
            "specdraft-cache",
            lambda t: ["target=tiny_random", "data=tiny", "mode=bogus", f"out_dir={t / 'cache'}"],
            "mode=bogus: expected one of write, validate",
        ),
        (
            regen_cli.main,
            "specdraft-regen",
            lambda t: ["target=tiny_random", "data=tiny", "batch_size=0", f"out_path={t / 'out.jsonl'}"],
            "batch_size=0: expected one of auto or an integer >= 1",
        ),
        (
            train_cli.main,
            "specdraft-train",
            lambda t: [
                "experiment=eagle",
                "debug=smoke",
                "target=tiny_random",
                "resume=maybe",
                f"paths.output_dir={t}",
            ],
            "resume=maybe: expected one of auto, true, false",
        ),
        (
            train_cli.main,
            "specdraft-train",
            lambda t: [
                "experiment=eagle3",
                "debug=smoke",
                "target=tiny_random",
                "datamodule.aux_layers=false",
                f"paths.output_dir={t}",
            ],
            "head eagle3 reads the target's layers [1, 2, 3]",  # refused before training starts
        ),
        (
            train_cli.main,
            "specdraft-train",
            lambda t: [
                "experiment=hass",
                "debug=smoke",
                "target=tiny_random",
                "datamodule.top_k=2",
                f"paths.output_dir={t}",
            ],
            "loss.topk_k=10 but the features hold only the target's top-2",  # inside Trainer.fit
        ),
        (
            quickstart.main,
            "specdraft-quickstart",
            lambda t: ['overrides.train=["trainer.max_steps=800"]', f"paths.log_dir={t}"],
            "overrides.train sets trainer.max_steps",  # refused before anything is probed
        ),
        (
            prepare.main,
            "specdraft-prepare",
            lambda t: [
                "target=tiny_random",
                "data=tiny",
                "data.heldout_fraction=2.0",
                f"paths.output_dir={t}",
            ],
            "heldout_fraction",
        ),
        (  # Hydra's own error, before the job: an unknown key
            train_cli.main,
            "specdraft-train",
            lambda t: ["experiment=eagle", "target=tiny_random", "optim.bogus=1", f"paths.output_dir={t}"],
            "Could not override 'optim.bogus'",
        ),
        (  # Hydra's own error: bad override syntax
            export.main,
            "specdraft-export",
            lambda t: ["target=tiny_random", "format=["],
            "no viable alternative at input '['",
        ),
        (  # an instantiate error: a missing prompts file, named with its key and _target_
            eval_cli.eval_main,
            "specdraft-eval",
            lambda t: [
                "target=tiny_random",
                "prompts=mt_bench",
                f"prompts.path={t / 'missing.jsonl'}",
                f"checkpoint={t / 'missing.ckpt'}",
            ],
            "missing.jsonl does not exist (set prompts.path) (instantiating _target_",
        ),
        (
            eval_cli.eval_main,
            "specdraft-eval",
            lambda t: [
                "target=tiny_random",
                "prompts=tiny",
                f"checkpoint={checkpoint_without_state_dict(t)}",
            ],
            "no-state.ckpt: not a specdraft training checkpoint (expected a 'specdraft' record and a state",
        ),
        (
            eval_cli.eval_main,
            "specdraft-eval",
            lambda t: ["target=tiny_random", "prompts=tiny", f"checkpoint={truncated_export(t)}"],
            "model.safetensors: not a readable safetensors file",
        ),
        (  # a truncated last.ckpt on resume, refused before Lightning reads it
            train_cli.main,
            "specdraft-train",
            lambda t: [
                "experiment=eagle",
                "debug=smoke",
                "target=tiny_random",
                f"paths.output_dir={t}",
                f"+touch={write_file(t / 'checkpoints' / 'last.ckpt', b'PK')}",
            ],
            "last.ckpt: not a specdraft checkpoint",
        ),
        (
            cache_cli.main,
            "specdraft-cache",
            lambda t: [
                "target=tiny_random",
                "data=jsonl",
                f"data.source.path={t / 'gone.jsonl'}",
                f"out_dir={t}",
            ],
            "gone.jsonl: No such file or directory (expected an existing path)",
        ),
        (
            regen_cli.main,
            "specdraft-regen",
            lambda t: [
                "target=tiny_random",
                "data=jsonl",
                f"data.source.path={write_file(t / 'latin1.jsonl', LATIN1_LINES)}",
                f"out_path={t / 'out.jsonl'}",
            ],
            "latin1.jsonl:2: not UTF-8 text (byte 0xe9 at column 12; expected a UTF-8 encoded file)",
        ),
        (  # the input has no assistant turn: the input is named, not the output
            regen_cli.main,
            "specdraft-regen",
            lambda t: [
                "target=tiny_random",
                "data=jsonl",
                f"data.source.path={write_file(t / 'asks.jsonl', USER_ONLY_LINE)}",
                f"out_path={t / 'out.jsonl'}",
            ],
            "asks.jsonl: no conversation to regenerate in the train split (1 records read, 0 kept)",
        ),
        (
            regen_cli.main,
            "specdraft-regen",
            lambda t: ["target=tiny_random", "data=tiny", "backend=openai", f"out_path={t / 'out.jsonl'}"],
            "backend=openai needs openai.base_url",
        ),
        (  # the model's default, ${target.name}, does not resolve for the tiny target
            regen_cli.main,
            "specdraft-regen",
            lambda t: [
                "target=tiny_random",
                "data=tiny",
                "backend=openai",
                "openai.base_url=http://localhost:8000/v1",
                f"out_path={t / 'out.jsonl'}",
            ],
            "backend=openai needs openai.model",
        ),
        (
            cache_cli.main,
            "specdraft-cache",
            lambda t: [
                "target=tiny_random",
                "mode=validate",
                f"out_dir={write_file(t / 'c' / 'plan.json', NOT_UTF8_JSON).parent}",
            ],
            "plan.json: not UTF-8 JSON",
        ),
        (
            cache_cli.main,
            "specdraft-cache",
            lambda t: [
                "target=tiny_random",
                "mode=validate",
                f"out_dir={write_file(t / 'c' / 'plan.json', b'{}').parent}",
            ],
            "plan.json: not a cache file of ours (expected a JSON object with format_version",
        ),
        (
            train_cli.main,
            "specdraft-train",
            lambda t: [
                "experiment=eagle3",
                "debug=smoke",
                "head.config.draft_vocab_size=64",  # asks the caches for their top-k first
                "datamodule=cached",
                f"datamodule.train_cache={write_file(t / 'c' / 'capture.json', b'{}').parent}",
                f"datamodule.val_cache={t / 'c'}",
                f"paths.output_dir={t / 'run'}",
            ],
            "manifest.json not found: the cache is unfinished",
        ),
        (sweep_report.main, "specdraft-sweep-report", lambda t: [str(t / "no-sweep-here")], "no-sweep-here"),
        (
            depth_acceptance.main,
            "specdraft-depth-acceptance",
            lambda t: [str(t), "--out", str(t / "depth.json")],
            "no run_config.yaml (not a specdraft-train run dir)",
        ),
    ],
    ids=lambda value: value if isinstance(value, str) and value.startswith("specdraft") else "",
)
def test_user_errors_are_one_line_with_exit_code_2(
    tmp_path, monkeypatch, capsys, entry, command, args, expected
):
    hydra = (
        [] if command in ("specdraft-sweep-report", "specdraft-depth-acceptance") else hydra_args(tmp_path)
    )
    GlobalHydra.instance().clear()
    monkeypatch.setattr(sys, "argv", [command, *args(tmp_path), *hydra])
    with pytest.raises(SystemExit) as stop:
        entry()
    err = capsys.readouterr().err
    assert stop.value.code == USER_ERROR_EXIT_CODE, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{command}: error: "), lines[-3:]
    assert expected in lines[0], lines[0]


def test_the_traceback_shows_with_the_debug_flag_and_bugs_keep_theirs(monkeypatch, capsys):
    @user_errors("specdraft-demo")
    def bad_value() -> None:
        raise ValueError("step must be positive,\n  got -1")

    @user_errors("specdraft-demo")
    def bug() -> None:
        raise TypeError("a bug, not a user error")

    with pytest.raises(SystemExit) as stop:
        bad_value()
    assert stop.value.code == USER_ERROR_EXIT_CODE
    assert capsys.readouterr().err == "specdraft-demo: error: step must be positive,; got -1\n"
    with pytest.raises(TypeError):
        bug()
    monkeypatch.setenv("SPECDRAFT_DEBUG", "1")
    with pytest.raises(ValueError, match="step must be positive"):
        bad_value()


class RefusingDataset(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int):
        raise ValueError("shard 3: expected input_ids,\n  got nothing")


def test_an_error_raised_in_a_dataloader_worker_keeps_only_its_own_message(capsys):
    """torch re-raises a worker's exception in the main process with the worker's traceback in its
    message: the one line shows the original message alone."""

    @user_errors("specdraft-demo")
    def load() -> None:
        next(iter(torch.utils.data.DataLoader(RefusingDataset(), num_workers=1)))

    with pytest.raises(SystemExit):
        load()
    assert capsys.readouterr().err == "specdraft-demo: error: shard 3: expected input_ids,; got nothing\n"


def test_os_errors_naming_a_file_are_user_errors_and_bare_ones_bugs():
    """An OSError with a filename is the user's environment (named, with what was expected); one
    without is a bug and keeps its traceback; so does an instantiation failing on a bug."""
    denied = user_message(PermissionError(errno.EACCES, "Permission denied", "/runs/x"))
    assert denied == "/runs/x: Permission denied (expected a path this user may read and write)"
    read_only = user_message(OSError(errno.EROFS, "Read-only file system", "/mnt/ro/out.jsonl"))
    assert read_only == "/mnt/ro/out.jsonl: Read-only file system (expected a writable file system)"
    assert user_message(OSError(errno.EINVAL, "Invalid argument")) is None
    try:
        instantiate({"_target_": "builtins.int", "_args_": ["x"]})
    except InstantiationException as error:
        assert user_message(error) == (
            "invalid literal for int() with base 10: 'x' (instantiating _target_ builtins.int)"
        )
    try:
        instantiate({"_target_": "builtins.len", "_args_": [3]})
    except InstantiationException as error:
        assert user_message(error) is None  # TypeError: a bug, not the user's


def test_a_tokenizer_without_a_chat_template_is_refused_in_one_line():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = None
    conversation = Conversation("a", (Message("user", "q"), Message("assistant", "a")))
    with pytest.raises(ChatTemplateError, match="has no chat_template: expected a chat model's tokenizer"):
        tokenize_conversations(tokenizer, [conversation], progress=False)


@pytest.mark.parametrize("damage", ["truncated", "missing key"])
def test_a_damaged_cache_shard_is_named_with_the_key(tmp_path, damage):
    target = tiny_random_target()
    write(target, samples_for(target, count=4), tmp_path)
    cache = FeatureCache(tmp_path)
    shard = next(tmp_path.glob("*.safetensors"))
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:100])
        expected = f"{shard}: "
    else:
        save_file({"loss_mask": torch.zeros(3, dtype=torch.int8)}, str(shard))
        expected = f"{shard}: File does not contain tensor input_ids"
    with pytest.raises(CacheError, match="expected a complete shard") as refused:
        cache.tokens(0)
    assert str(refused.value).startswith(expected)
