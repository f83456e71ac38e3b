"""Settings checked at each command's boundary (system/checks.py and each command's table): a value
outside its range is refused in one line naming the key, the value and what is allowed, BEFORE any
work — each test replaces the command's first piece of work with a tripwire that fails the test if
it is reached — and every violation is reported together."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from omegaconf import OmegaConf

from specdraft.data import cache_cli, prepare, regen_cli
from specdraft.eval import cli as eval_cli
from specdraft.eval.drafters import DynamicTree
from specdraft.eval.prompts import read_spec_bench
from specdraft.recipes import quickstart
from specdraft.system.checks import (
    SettingsError,
    at_least,
    check_settings,
    each,
    either,
    in_range,
    one_of,
    optional,
)
from specdraft.train import cli as train_cli
from specdraft.train import export
from tests.test_cli_errors import hydra_args, run_command


def tripwire(*args, **kwargs):
    raise AssertionError("the command started its work before checking its settings")


# (entry, command, the module attribute its work starts with, args, what the line must say)
PROBES = [
    (
        cache_cli.main,
        "specdraft-cache",
        (cache_cli, "start"),
        ["limit=-5"],
        "limit=-5: expected null or an integer >= 1",
    ),
    (
        cache_cli.main,
        "specdraft-cache",
        (cache_cli, "start"),
        ["data=sharegpt", "data.source.limit=-1"],
        "data.source.limit=-1: expected null or an integer >= 1",
    ),
    (
        cache_cli.main,
        "specdraft-cache",
        (cache_cli, "start"),
        ["shard_tokens=0"],
        "shard_tokens=0: expected an integer >= 1",
    ),
    (
        cache_cli.main,
        "specdraft-cache",
        (cache_cli, "start"),
        ["top_k=-3"],
        "top_k=-3: expected an integer >= 0",
    ),
    (
        regen_cli.main,
        "specdraft-regen",
        (regen_cli, "start"),
        ["limit=-5"],
        "limit=-5: expected null or an integer >= 1",
    ),
    (
        regen_cli.main,
        "specdraft-regen",
        (regen_cli, "start"),
        ["generation.top_p=1.5"],
        "generation.top_p=1.5: expected a number in (0, 1]",
    ),
    (
        prepare.main,
        "specdraft-prepare",
        (prepare, "start"),
        ["sample_conversations=0"],
        "sample_conversations=0: expected an integer >= 1",
    ),
    (
        eval_cli.eval_main,
        "specdraft-eval",
        (eval_cli, "load_target"),
        ["max_new_tokens=0"],
        "max_new_tokens=0: expected an integer >= 1",
    ),
    (
        eval_cli.eval_main,
        "specdraft-eval",
        (eval_cli, "load_target"),
        ["temperatures=[-1.0]"],
        "temperatures=[-1.0]: expected a non-empty list, each a number >= 0",
    ),
    (
        eval_cli.eval_main,
        "specdraft-eval",
        (eval_cli, "load_target"),
        ["methods.head.shape={kind: dynamic, depth: 1, top_k: 2, total_tokens: 500}"],
        "total_tokens=500 is more than the 3 nodes it can hold",
    ),
    (
        eval_cli.bench_main,
        "specdraft-bench",
        (eval_cli, "load_target"),
        ["methods=head", "max_minutes=-1"],
        "max_minutes=-1: expected null or a number > 0",
    ),
    (
        train_cli.main,
        "specdraft-train",
        (train_cli, "features_for_objective"),
        ["experiment=eagle", "debug=smoke", "trainer.max_steps=0"],
        "trainer.max_steps=0: expected one of -1 or an integer >= 1",
    ),
    (
        train_cli.main,
        "specdraft-train",
        (train_cli, "features_for_objective"),
        ["experiment=hass", "debug=smoke", "loss.weights.topk=-1.0"],
        "loss.weights.topk=-1.0: expected a number >= 0",
    ),
    (
        export.main,
        "specdraft-export",
        (export, "resolve_checkpoint"),
        ["checkpoint=x.ckpt", "speculative_tokens=0"],
        "speculative_tokens=0: expected an integer >= 1",
    ),
    (
        quickstart.main,
        "specdraft-quickstart",
        (quickstart, "load_or_make_plan"),
        ["budget_minutes=-5"],
        "budget_minutes=-5: expected a number > 0",
    ),
]


@pytest.mark.parametrize(
    "entry,command,work,args,expected", PROBES, ids=[f"{p[1]}-{p[3][-1]}" for p in PROBES]
)
def test_a_value_out_of_range_is_refused_before_any_work(
    tmp_path, monkeypatch, capsys, entry: Callable, command, work, args, expected
):
    monkeypatch.setattr(*work, tripwire)
    common = {
        "specdraft-cache": ["target=tiny_random", "data=tiny", f"out_dir={tmp_path / 'cache'}"],
        "specdraft-regen": [
            "target=tiny_random",
            "data=tiny",
            f"out_path={tmp_path / 'regen' / 'out.jsonl'}",
        ],
        "specdraft-prepare": ["target=tiny_random", "data=tiny"],
        "specdraft-eval": ["target=tiny_random", "prompts=tiny", "checkpoint=x.ckpt"],
        "specdraft-bench": ["target=tiny_random", "prompts=tiny", "checkpoint=x.ckpt"],
        "specdraft-train": ["target=tiny_random", f"paths.output_dir={tmp_path / 'run'}"],
        "specdraft-export": ["target=tiny_random", f"out={tmp_path / 'export'}"],
        "specdraft-quickstart": [f"paths.log_dir={tmp_path / 'logs'}"],
    }[command]
    line = run_command(
        entry, command, *common, *args, *hydra_args(tmp_path), monkeypatch=monkeypatch, capsys=capsys
    )
    assert expected in line, line
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["hydra"], written  # nothing but Hydra's own log dir


def test_every_violation_is_reported_together(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cache_cli, "start", tripwire)
    args = ["target=tiny_random", "data=tiny", "limit=-5", "top_k=-3", "split=dev", f"out_dir={tmp_path}/c"]
    line = run_command(
        cache_cli.main,
        "specdraft-cache",
        *args,
        *hydra_args(tmp_path),
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    assert "3 invalid settings" in line, line
    for expected in ("limit=-5", "top_k=-3", "split=dev: expected one of train, heldout, all"):
        assert expected in line, line


def test_rules_accept_their_range_and_refuse_outside_it():
    cfg = OmegaConf.create(
        {"a": 0, "b": 1.0, "c": None, "d": "auto", "e": [0.5, 1.5], "f": True, "w": {"x": 1.0, "y": -0.5}}
    )
    assert not_refused(cfg, {"a": at_least(0), "b": in_range(0, 1), "c": optional(at_least(1))})
    assert not_refused(cfg, {"d": either(one_of("auto"), at_least(1)), "missing.key": at_least(1)})
    assert refused(cfg, {"a": at_least(1)}) == ["a=0: expected an integer >= 1"]
    assert refused(cfg, {"b": in_range(0, 1, closed=(True, False))}) == ["b=1.0: expected a number in [0, 1)"]
    assert refused(cfg, {"b": at_least(1)}) == ["b=1.0: expected an integer >= 1"]  # not an integer
    assert refused(cfg, {"e": each(in_range(0, 1))}) == [
        "e=[0.5, 1.5]: expected a non-empty list, each a number in [0, 1]"
    ]
    assert refused(cfg, {"f": at_least(0)}) == ["f=true: expected an integer >= 0"]  # a bool is no number
    assert refused(cfg, {"f": one_of(1)}) == ["f=true: expected one of 1"]
    assert refused(cfg, {"w.*": at_least(0, integer=False)}) == ["w.y=-0.5: expected a number >= 0"]


def not_refused(cfg, rules) -> bool:
    return refused(cfg, rules) == []


def refused(cfg, rules) -> list[str]:
    try:
        check_settings(cfg, rules)
    except SettingsError as error:
        return str(error).split(": ", 1)[1].split("; ")
    return []


def test_a_dynamic_tree_cannot_ask_for_more_nodes_than_its_shape_holds():
    assert DynamicTree(depth=1, top_k=2, total_tokens=3).max_total_tokens == 3
    assert DynamicTree(depth=3, top_k=2, total_tokens=11).max_total_tokens == 11
    with pytest.raises(ValueError, match=r"total_tokens=4 is more than the 3 nodes"):
        DynamicTree(depth=1, top_k=2, total_tokens=4)


def test_a_prompt_file_with_repeated_question_ids_is_refused_naming_the_file_and_ids(tmp_path):
    """Ids key the records a resume skips: with a repeated id, a resume counted the questions
    sharing it as done ("0 to go") and they never ran."""
    rows = [(1, "math"), (2, "math"), (1, "coding"), (3, "coding"), (2, "stem"), (4, "stem")]
    path = tmp_path / "dup.jsonl"
    path.write_text(
        "".join(json.dumps({"question_id": i, "category": c, "turns": [f"q{i}{c}"]}) + "\n" for i, c in rows)
    )
    with pytest.raises(ValueError, match=r"dup\.jsonl: .*unique.*'1' \(lines 1, 3\), '2' \(lines 2, 5\)$"):
        read_spec_bench(path, per_category=1)  # even where the selection would keep one of each
