"""The real Hydra configs, composed and shrunk (lightning-hydra-template style)."""

import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.utils import get_method, instantiate
from omegaconf import OmegaConf, open_dict

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
TARGETS = sorted(p.stem for p in (CONF_DIR / "target").glob("*.yaml"))
DATA = sorted(p.stem for p in (CONF_DIR / "data").glob("*.yaml"))


def compose_prepare(*overrides: str):
    with initialize_config_module(config_module="specdraft.conf", version_base="1.3"):
        return compose(config_name="prepare", overrides=list(overrides), return_hydra_config=True)


@pytest.mark.parametrize("target", TARGETS)
def test_every_target_config_matches_its_loader_signature(target):
    cfg = compose_prepare(f"target={target}")
    loader = get_method(cfg.target._target_)
    parameters = inspect.signature(loader).parameters
    accepts_kwargs = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    for key in cfg.target:
        if key != "_target_":
            assert key in parameters or accepts_kwargs, f"{target}.yaml: {key} is not a parameter of {loader}"


@pytest.mark.parametrize("data", DATA)
def test_every_data_config_has_the_split_fields(data):
    cfg = compose_prepare(f"data={data}")
    assert {"source", "max_length", "heldout_fraction", "split_seed"} <= set(cfg.data)
    get_method(cfg.data.source._target_)


def test_tiny_target_config_instantiates():
    cfg = compose_prepare("target=tiny_random")
    target = instantiate(cfg.target)
    assert target.spec.hidden_size == 64
    assert target.spec.aux_layer_ids == (1, 2, 3)


def test_default_config_is_smollm2_with_bundled_sharegpt():
    cfg = compose_prepare()
    assert cfg.target.name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert cfg.data.source._target_.endswith("read_bundled_sharegpt")
    with open_dict(cfg):
        cfg.paths.output_dir = "unused"  # normally resolved by Hydra at run time
    assert OmegaConf.select(cfg, "paths.cache_dir", throw_on_missing=True)


def test_prepare_cli_end_to_end_on_the_tiny_target(tmp_path):
    lines = [
        json.dumps(
            {
                "id": f"c{i}",
                "messages": [
                    {"role": "user", "content": f"question {i}"},
                    {"role": "assistant", "content": f"answer {i}"},
                ],
            }
        )
        for i in range(30)
    ]
    lines.append("{broken")
    (tmp_path / "chats.jsonl").write_text("\n".join(lines))
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdraft.data.prepare",
            "target=tiny_random",
            "data=jsonl",
            f"data.source.path={tmp_path / 'chats.jsonl'}",
            "sample_conversations=10",
            "progress=false",
            f"hydra.run.dir={run_dir}",
            "chat_check.max_new_tokens=4",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["read"]["records"] == 31
    assert report["read"]["skipped"] == {"line is not valid JSON": 1}
    assert report["split"]["train"] + report["split"]["heldout"] == 30
    assert report["tokenize_sample"]["kept"] == 10
    assert report["feature_throughput"]["tokens"] == report["tokenize_sample"]["tokens"]
    assert report["target"]["hidden_size"] == 64
    assert "report:" in result.stdout


@pytest.mark.parametrize("preset", ["online", "cached"])
def test_datamodule_presets_instantiate_with_a_runtime_target(preset, tiny_target):
    from specdraft.data.conversations import ConversationSet, ReadReport
    from specdraft.data.datamodule import FeatureDataModule

    cfg = compose_prepare("target=tiny_random", f"+datamodule={preset}")
    if preset == "cached":
        cfg.datamodule.train_cache, cfg.datamodule.val_cache = "train_dir", "val_dir"
    make = instantiate(cfg.datamodule)
    extra = {"conversations": ConversationSet([], ReadReport("none"))} if preset == "online" else {}
    module = make(target=tiny_target, **extra)
    assert isinstance(module, FeatureDataModule)
    assert module.mode == preset and module.noise.amplitude == 0.1


def test_the_two_stage_hass_experiment_is_hass_at_a_third_of_the_lr_from_given_weights(tmp_path):
    """conf/experiment/hass_2stage.yaml: the reference's second stage, Top-K on, lr / 3."""
    from tests.conftest import compose_train

    hass = compose_train(tmp_path, "experiment=hass")
    second = compose_train(tmp_path, "experiment=hass_2stage", "init_from=stage1/last.ckpt")
    assert second.init_from == "stage1/last.ckpt" and second.loss == hass.loss
    assert second.loss.weights.topk > 0 and second.datamodule.top_k == hass.datamodule.top_k
    assert second.optim.lr == pytest.approx(hass.optim.lr / 3, rel=1e-4)


METHODS = sorted(p.stem for p in (CONF_DIR / "methods").glob("*.yaml"))


def compose_bench(*overrides: str):
    with initialize_config_module(config_module="specdraft.conf", version_base="1.3"):
        return compose(config_name="bench", overrides=["checkpoint=head.ckpt", *overrides])


@pytest.mark.parametrize("methods", METHODS)
def test_every_method_preset_resolves_its_shapes_to_mappings(methods):
    from specdraft.eval.cli import method_configs

    cfg = compose_bench(f"methods={methods}")
    for name, method in method_configs(cfg).items():
        if method is not None and "shape" in method:
            assert method["shape"]["kind"] in {"chain", "static", "dynamic", "auto"}, name
    candidates = OmegaConf.to_container(cfg.auto_shape.candidates, resolve=True)
    assert all(c["kind"] in {"chain", "dynamic"} for c in candidates)


def test_a_head_method_without_a_checkpoint_is_one_clear_error():
    from specdraft.eval.cli import method_configs
    from specdraft.eval.methods import method_problems

    problems = method_problems(method_configs(compose_bench("methods=equal_tokens")))
    assert problems and all("checkpoint is not set" in p for p in problems)
    unset = {"methods.eagle2_tree", "methods.eagle2_chain", "methods.eagle3_tree"}
    assert {p.split(":")[0] for p in problems} == unset
    given = compose_bench("methods=ablation", "+checkpoints.eagle2=a.ckpt", "+checkpoints.hass=b.ckpt")
    unset = {p.split(":")[0] for p in method_problems(method_configs(given))}
    recipes = ("eagle2_lk", "hass_lk", "eagle3", "eagle3_lk")
    assert unset == {f"methods.{r}{ngram}" for r in recipes for ngram in ("", "_ngram")}


def test_named_inline_and_unknown_shapes():
    from specdraft.eval.cli import method_configs

    named = method_configs(compose_bench("methods=head", "methods.head.shape=${shapes.eagle2_24}"))
    assert named["head"]["shape"] == {"kind": "dynamic", "depth": 5, "top_k": 6, "total_tokens": 24}
    inline = method_configs(compose_bench("methods=head", "methods.head.shape={kind: chain, depth: 4}"))
    assert inline["head"]["shape"] == {"kind": "chain", "depth": 4}  # replaced, not merged into the default
    with pytest.raises(ValueError, match=r"(?s)shapes\.eagle2_13.*known shapes.*eagle2_12"):
        method_configs(compose_bench("methods=head", "methods.head.shape=${shapes.eagle2_13}"))
    with pytest.raises(ValueError, match=r"\$\{shapes\.eagle2_12\}"):
        method_configs(compose_bench("methods=head", "methods.head.shape=eagle2_12"))


EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
GROUPS = {
    group: sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
    for group in ("head", "loss", "optim", "scheduler", "trainer", "datamodule", "data", "debug")
}


def sweep_points(name: str) -> list[str]:
    """Every single value the hparams_search preset ``name`` sweeps, as an override."""
    params = (
        OmegaConf.load(CONF_DIR / "hparams_search" / f"{name}.yaml")
        .hydra.get("sweeper", {})
        .get("params", {})
    )
    return [f"{key}={value}" for key, values in params.items() for value in str(values).split(",")]


TRAIN_COMPOSITIONS = (
    [[f"experiment={e}"] for e in EXPERIMENTS]
    + [[f"experiment={e}", "debug=smoke"] for e in EXPERIMENTS]
    + [[f"{group}={choice}"] for group, choices in GROUPS.items() for choice in choices]
    + [
        [f"hparams_search={p.stem}", point]
        for p in sorted((CONF_DIR / "hparams_search").glob("*.yaml"))
        for point in sweep_points(p.stem) or [""]
    ]
)


@pytest.mark.parametrize("overrides", TRAIN_COMPOSITIONS, ids=" ".join)
def test_every_composed_train_config_passes_the_train_checks(tmp_path, overrides):
    """Each experiment, group choice, debug preset and swept value is within the ranges
    specdraft-train checks at its boundary (train/cli.py TRAIN_SETTINGS)."""
    from specdraft.system.checks import check_settings
    from specdraft.train.cli import TRAIN_SETTINGS
    from tests.conftest import compose_train

    cfg = compose_train(tmp_path, *[o for o in overrides if o])
    check_settings(cfg, TRAIN_SETTINGS)


def compose_command(name: str, *overrides: str):
    with initialize_config_module(config_module="specdraft.conf", version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


COMMAND_COMPOSITIONS = (
    [("bench", [f"methods={m}", f"prompts={p}"]) for m in METHODS for p in ("tiny", "mt_bench")]
    + [("bench", [f"prompts={p}"]) for p in sorted(q.stem for q in (CONF_DIR / "prompts").glob("*.yaml"))]
    + [("eval", [f"target={t}"]) for t in TARGETS]
    + [
        (name, [f"data={d}", f"target={t}"])
        for name in ("cache", "regen", "prepare")
        for d in DATA
        for t in TARGETS
    ]
    + [("export", [f"format={f}"]) for f in ("native", "eagle", "vllm", "speculators", "sglang", "medusa")]
    + [("quickstart", [])]
)


@pytest.mark.parametrize(
    "name,overrides", COMMAND_COMPOSITIONS, ids=lambda v: v if isinstance(v, str) else " ".join(v)
)
def test_every_composed_command_config_passes_its_checks(name, overrides):
    """The defaults and every preset of each command are within the ranges it checks at its
    boundary (the table next to its entry point)."""
    from specdraft.data import cache_cli, prepare, regen_cli
    from specdraft.eval import cli as eval_cli
    from specdraft.recipes import quickstart
    from specdraft.system.checks import check_settings
    from specdraft.train import export

    checkpoint = ["checkpoint=head.ckpt"] if name in ("bench", "eval", "export") else []
    for preset in (o.removeprefix("methods=") for o in overrides if o.startswith("methods=")):
        # a preset's other heads, by name (`${oc.select:checkpoints.<name>,null}`)
        preset_text = (CONF_DIR / "methods" / f"{preset}.yaml").read_text()
        names = sorted(set(re.findall(r"checkpoints\.(\w+)", preset_text)))
        checkpoint += [f"+checkpoints.{n}={n}.ckpt" for n in names]
    cfg = compose_command(name, *checkpoint, *overrides)
    if name in ("bench", "eval"):
        eval_cli.check_bench_settings(cfg)
        return
    tables = {
        "cache": cache_cli.CACHE_SETTINGS,
        "regen": regen_cli.REGEN_SETTINGS,
        "prepare": prepare.PREPARE_SETTINGS,
        "export": export.EXPORT_SETTINGS,
        "quickstart": quickstart.QUICKSTART_SETTINGS,
    }
    check_settings(cfg, tables[name])
