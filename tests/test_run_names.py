"""Run names are single path components (system/names.py): ``run_name=../x`` or ``a/b`` is refused
with one line and exit 2 before Hydra creates the run directory, in train, bench/eval and the
quickstart (whose ``name`` is its stages' run name); a sweep's ``sweep_name`` likewise."""

from __future__ import annotations

import pytest

from specdraft.eval import cli as eval_cli
from specdraft.recipes import quickstart
from specdraft.system.names import check_path_component
from specdraft.train import cli as train_cli
from tests.test_cli_errors import run_command

UNSAFE = ["../../escaped", "a/b", "..", ".hidden", "a\\b"]


def test_a_run_name_is_one_directory_name():
    assert check_path_component("hass-topk_2.1") == "hass-topk_2.1"
    for name in [*UNSAFE, "", "."]:
        with pytest.raises(ValueError, match="expected one directory name"):
            check_path_component(name)


@pytest.mark.parametrize(
    "entry,command,key,args",
    [
        (train_cli.main, "specdraft-train", "run_name", ["debug=smoke"]),
        (eval_cli.eval_main, "specdraft-eval", "run_name", ["target=tiny_random", "checkpoint=x.ckpt"]),
        (quickstart.main, "specdraft-quickstart", "name", ["plan_only=true"]),
    ],
)
@pytest.mark.parametrize("name", ["../../escaped", "a/b"])
def test_an_unsafe_run_name_is_refused_before_anything_is_written(
    tmp_path, monkeypatch, capsys, entry, command, key, args, name
):
    log_dir = tmp_path / "work" / "outputs"
    log_dir.mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    hydra_dir = ["hydra.run.dir=hydra-run"] if key == "name" else []  # the quickstart's own run dir
    line = run_command(
        entry, command, *args, f"{key}={name}", f"paths.log_dir={log_dir}", *hydra_dir,
        monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    assert f"{key}={name!r}: expected one directory name" in line
    assert not list(log_dir.iterdir()) and sorted(p.name for p in tmp_path.rglob("*")) == sorted(
        ["work", "outputs", *(["hydra-run"] if hydra_dir else [])]
    )


def test_an_unsafe_sweep_name_is_refused_before_the_sweep_dir_is_made(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = ["-m", "debug=smoke", "sweep_name=../escaped", "seed=0,1", f"paths.log_dir={tmp_path / 'outputs'}"]
    line = run_command(train_cli.main, "specdraft-train", *args, monkeypatch=monkeypatch, capsys=capsys)
    assert "sweep_name='../escaped': expected one directory name" in line
    assert not list(tmp_path.iterdir())
