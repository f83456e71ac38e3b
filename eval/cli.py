"""``specdraft-bench`` and ``specdraft-eval`` (Hydra): decode prompts with every configured
method on the same target, interleaved per question, and write records.jsonl, report.json and
the plots (acceptance_per_depth.png, speedup.png) to ``${paths.log_dir}/bench/${run_name}``.

    specdraft-bench checkpoint=outputs/train/hass/checkpoints/last.ckpt   # MT-bench, T=0 and 1, all methods
    specdraft-eval checkpoint=outputs/train/hass/checkpoints/last.ckpt    # the head vs plain decoding only
    specdraft-bench checkpoint=… methods=batch batch_sizes=[1,2,4,8,16]     # throughput vs batch size
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationKeyError

from specdraft.data.attention import GROUPED_QUERY_ATTENTION, use_grouped_query_attention
from specdraft.data.chat import assistant_token_counts, tokenize_conversations
from specdraft.data.conversations import split_conversations
from specdraft.data.packed_linear import PackedLinear, pack_linear_weights
from specdraft.data.settings import THREADS, data_rules, source_rules
from specdraft.data.target import Target
from specdraft.eval.autoshape import (
    ShapeChoice,
    cached_verify_latency,
    calibrate,
    choose_shape,
    greedy_continuations,
    probe_verify_latency,
)
from specdraft.eval.baselines import load_draft_model
from specdraft.eval.batch import check_batch_sizes
from specdraft.eval.bench import run_batch_benchmark, run_benchmark
from specdraft.eval.decode import Typical
from specdraft.eval.drafters import Drafter, TreeShape
from specdraft.eval.graphs import resolve_graphs
from specdraft.eval.load import load_head
from specdraft.eval.methods import Method, ShapeChooser, build_method, method_problems, tree_shape
from specdraft.eval.runner import TargetRunner
from specdraft.eval.sampling import Sampling
from specdraft.eval.shortlist import cached_assistant_counts
from specdraft.heads.vocab import draft_vocab_from_counts
from specdraft.system.checks import (
    at_least,
    check_settings,
    each,
    greater_than,
    in_range,
    integer,
    one_of,
    optional,
)
from specdraft.system.errors import hydra_command
from specdraft.system.files import write_json_atomic
from specdraft.system.hardware import detect_hardware, start
from specdraft.system.locks import output_lock

log = logging.getLogger(__name__)

# specdraft-bench / -eval settings (conf/bench.yaml and its groups), checked before anything loads;
# the methods' shapes and sizes are checked with them (eval/methods.py method_problems), the batch
# sizes next (eval/batch.py check_batch_sizes, shared with the batched benchmark).
BENCH_SETTINGS = {
    "temperatures": each(at_least(0, integer=False)),
    "top_p": in_range(0, 1, closed=(False, True)),
    "top_k": at_least(0),
    "max_new_tokens": at_least(1),
    "max_minutes": optional(greater_than(0)),
    "seed": integer(),
    "threads": THREADS,
    "head_dtype": optional(one_of("bfloat16", "float16", "float32")),
    "graphs": one_of("auto", True, False),
    **source_rules("prompts"),
    "prompts.max_turns": optional(at_least(1)),
    "prompts.per_category": optional(at_least(1)),
    "prompts.heldout_fraction": in_range(0, 1, closed=(True, False)),
    "shortlist.size": optional(at_least(1)),
    **data_rules("shortlist"),
    "shortlist.split_limit": optional(at_least(1)),
    "auto_shape.calibration.prompts": at_least(1),
    "auto_shape.calibration.max_prompt_tokens": at_least(1),
    "auto_shape.calibration.new_tokens": at_least(1),
    "auto_shape.latency.node_counts": each(at_least(1)),
    "auto_shape.latency.past": at_least(0),
    "auto_shape.latency.repeats": at_least(1),
    "auto_shape.finalists": at_least(0),
    "auto_shape.min_gain": at_least(0, integer=False),
    "draft_model.num_layers": at_least(1),
    "typical.epsilon": in_range(0, 1),
    "typical.delta": in_range(0, 1),
    "ngram_branches.tokens": at_least(1),
    "ngram_branches.max_ngram": at_least(1),
    "ngram_branches.min_ngram": at_least(1),
    "ngram_branches.branches": at_least(1),
}


@hydra_command("specdraft-bench", "bench")
def bench_main(cfg: DictConfig) -> None:
    _main(cfg, "specdraft-bench")


@hydra_command("specdraft-eval", "eval")
def eval_main(cfg: DictConfig) -> None:
    _main(cfg, "specdraft-eval")


def _main(cfg: DictConfig, command: str) -> None:
    report = run(cfg, command)
    if "batch" in report:
        print(format_batch_table(report["batch"]))
        print(f"report: {Path(cfg.paths.output_dir) / 'report.json'}")
        return
    print(format_table(report["results"]))
    box = report.get("time_box")
    if box and box["units_left"]:
        print(f"time box of {box['max_seconds'] / 60:.1f} min: {box['units_left']} questions left undone")
    print(f"report: {Path(cfg.paths.output_dir) / 'report.json'}")


def run(cfg: DictConfig, command: str = "specdraft-bench") -> dict[str, Any]:
    """Decodes ``cfg.prompts`` with plain decoding and every method of ``cfg.methods``, interleaved
    per question, at every temperature; returns the report (the batched benchmark's with
    ``batch_sizes``). Holds the run dir's lock (system/locks.py) throughout, taken once the
    settings are checked."""
    check_bench_settings(cfg)
    with output_lock(cfg.paths.output_dir, command):
        return run_locked(cfg, command)


def run_locked(cfg: DictConfig, command: str) -> dict[str, Any]:
    batch_sizes = configured_batch_sizes(cfg)  # checked before anything is loaded
    target = load_target(cfg, command)
    questions = instantiate(cfg.prompts)
    if not questions:
        raise ValueError(f"prompts {cfg.prompts}: no questions")
    methods = configured_methods(cfg, target)
    log.info(
        "methods: %s; %d questions × temperatures %s",
        [m.name for m in methods],
        len(questions),
        list(cfg.temperatures),
    )
    # The time box limits this invocation, it does not change what is measured: a resumed run may
    # have another one. The shape catalogue is not a setting either: what runs is in the methods.
    unrecorded = ("max_minutes", "shapes")
    config = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k not in unrecorded}
    temperatures = [float(t) for t in cfg.temperatures]
    out_dir, sampling_for = Path(cfg.paths.output_dir), lambda t: Sampling(t, cfg.top_p, cfg.top_k)
    run_settings = {"seed": cfg.seed, "resume": cfg.resume, "progress": cfg.progress, "warmup": cfg.warmup}
    if batch_sizes is not None:
        return run_batch_benchmark(
            target,
            questions,
            methods,
            batch_sizes,
            temperatures,
            sampling_for,
            out_dir,
            config,
            **run_settings,
        )
    max_seconds = 60 * cfg.max_minutes if cfg.max_minutes is not None else None
    return run_benchmark(
        target,
        questions,
        methods,
        temperatures,
        sampling_for,
        out_dir,
        config,
        max_seconds=max_seconds,
        **run_settings,
    )


def check_bench_settings(cfg: DictConfig) -> None:
    """Every setting of a benchmark run within its allowed values (:data:`BENCH_SETTINGS`, each
    method's shape and sizes, ``shape: auto``'s candidates), all reported in one error."""
    candidates = OmegaConf.to_container(cfg.auto_shape.candidates, resolve=True)
    auto = {"type": "head", "shape": {"kind": "auto", "candidates": candidates}}
    check_settings(cfg, BENCH_SETTINGS, method_problems({**method_configs(cfg), "auto_shape": auto}))


def configured_batch_sizes(cfg: DictConfig) -> list[int] | None:
    """``cfg.batch_sizes`` checked (None: not the batched benchmark)."""
    if cfg.get("batch_sizes") is None:
        return None
    sizes = cfg.batch_sizes
    sizes = OmegaConf.to_container(sizes) if OmegaConf.is_config(sizes) else sizes
    return check_batch_sizes(sizes, "batch_sizes")


def load_target(cfg: DictConfig, command: str) -> Target:
    """The target of ``cfg.target``, loaded once the process is set up for ``command`` (threads,
    the machine's record), with the kernel paths the config asks for."""
    start(command, cfg.threads, cfg.target)
    target: Target = instantiate(cfg.target)
    if cfg.packed_weights:
        log.info("linear layers pre-packed for oneDNN: %d of the target", pack_linear_weights(target.model))
    if cfg.grouped_query_attention and use_grouped_query_attention(target.model):
        log.info(
            "attention: masked multi-token queries (one-token bf16 ones on a CPU) on the key/value "
            "heads (%s)",
            GROUPED_QUERY_ATTENTION,
        )
    return target


def configured_methods(cfg: DictConfig, target: Target) -> list[Method]:
    """Plain decoding, then every method of ``cfg.methods`` (a null one left out), on ``target``."""
    head_dtype = getattr(torch, cfg.head_dtype) if cfg.head_dtype else None

    def frozen_head(path: str) -> torch.nn.Module:
        head = load_head(path, target, head_dtype)
        if cfg.packed_weights:  # its few-row matmuls gain as much as the target's (data/packed_linear.py)
            pack_linear_weights(head)
        return head

    # Loaded on first use and shared by the methods that need them.
    heads = functools.cache(frozen_head)
    draft_model = functools.cache(
        lambda: load_draft_model(target, cfg.draft_model.path, cfg.draft_model.num_layers)
    )
    counts = functools.cache(
        lambda: (
            cached_assistant_counts(cfg.shortlist.cache, target.spec.vocab_size)
            if cfg.shortlist.get("cache")
            else assistant_counts(cfg.shortlist, target)
        )
    )
    shortlist = functools.cache(
        lambda size=None: vocab_shortlist(counts, cfg.shortlist.size if size is None else size)
    )
    graphs = resolve_graphs(cfg.graphs, target.device)
    specs = {"plain": {"type": "plain"}, **method_configs(cfg)}
    return [
        build_method(
            name,
            spec,
            target,
            heads=heads,
            draft_model=draft_model,
            shortlist=shortlist,
            eos_ids=target.spec.eos_token_ids,
            max_new_tokens=cfg.max_new_tokens,
            typical=Typical(**cfg.typical),
            choose_shape=shape_chooser(cfg, target, graphs),
            compile=cfg.compile,
            graphs=graphs,
        )
        for name, spec in specs.items()
        if spec is not None
    ]


def method_configs(cfg: DictConfig) -> dict[str, Any]:
    """``cfg.methods`` resolved: each ``shape: ${shapes.<name>}`` becomes its mapping from
    conf/shapes.yaml; a name that is not there is one error that names the known ones."""
    known = f"known shapes (conf/shapes.yaml): {', '.join(cfg.shapes)}"
    try:
        methods = OmegaConf.to_container(cfg.methods, resolve=True)
    except InterpolationKeyError as error:
        if "shapes." not in str(error):
            raise
        raise ValueError(f"{error}\n{known}") from None
    for name, method in methods.items():
        shape = (method or {}).get("shape")
        if isinstance(shape, str):  # a bare name: the catalogue is read by interpolation only
            raise ValueError(
                f"method {name}: shape {shape!r}: a named shape is written ${{shapes.{shape}}}; {known}"
            )
    return methods


def shape_chooser(cfg: DictConfig, target: Target, graphs: bool) -> ShapeChooser:
    """``shape: auto`` for this run (eval/autoshape.py): calibration continuations and the
    verify-latency probe (on the decoder's own steps: ``graphs`` or not) are made once and shared
    by the methods; each method's choice is written to ``auto_shape-<method>.json`` in the run
    dir, so a resumed run keeps it."""
    settings = cfg.auto_shape
    out_dir = Path(cfg.paths.output_dir)

    @functools.cache
    def prompts() -> list[torch.Tensor]:
        return calibration_prompts(settings.calibration, target)

    @functools.cache
    def continuations() -> list[list[int]]:
        return greedy_continuations(TargetRunner(target), prompts(), settings.calibration.new_tokens)

    @functools.cache
    def latency():
        probe = settings.latency
        key = {
            "machine": detect_hardware().record(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "target": [target.spec.name, target.spec.revision, str(target.dtype), str(target.device)],
            "packed_weights": any(isinstance(m, PackedLinear) for m in target.model.modules()),
            "attention": target.model.config._attn_implementation,
            "compile": cfg.compile,
            "graphs": graphs,
            "probe": OmegaConf.to_container(probe, resolve=True),
        }
        measure = functools.partial(
            probe_verify_latency,
            TargetRunner(target, compile=cfg.compile, graphs=graphs),
            probe.node_counts,
            probe.past,
            probe.repeats,
        )
        return cached_verify_latency(Path(cfg.paths.cache_dir) / "latency", key, measure)[0]

    def choose(
        name: str,
        runner: TargetRunner,
        drafter_for: Callable[[TreeShape], Drafter],
        candidates: Sequence[Mapping[str, Any]] | None,
    ) -> ShapeChoice:
        path = out_dir / f"auto_shape-{name}.json"
        if path.exists():  # a resumed run keeps the shape its records were measured with
            log.info("shape: auto for %s: the choice recorded in %s", name, path)
            return ShapeChoice.from_record(json.loads(path.read_text()))
        calibrations = calibrate(runner, prompts(), continuations())
        if candidates is None:
            candidates = OmegaConf.to_container(settings.candidates, resolve=True)
        choice = choose_shape(
            drafter_for,
            tree_shape,
            candidates,
            calibrations,
            latency(),
            runner,
            settings.finalists,
            settings.min_gain,
            cfg.progress,
        )
        write_json_atomic(path, choice.record())
        return choice

    return choose


def calibration_prompts(cfg: DictConfig, target: Target) -> list[torch.Tensor]:
    """Chat prompts from the first user turns of the first ``cfg.prompts`` held-out conversations
    of ``cfg.source`` whose prompt fits ``cfg.max_prompt_tokens`` tokens (never the benchmark's
    questions)."""
    source = instantiate(cfg.source)
    _, heldout = split_conversations(source.conversations, cfg.heldout_fraction, cfg.split_seed)
    prompts = []
    for conversation in heldout:
        first = next((m for m in conversation.messages if m.role == "user"), None)
        if first is None:
            continue
        ids = target.tokenizer.apply_chat_template(
            [{"role": "user", "content": first.content}],
            add_generation_prompt=True,
            return_dict=True,
            return_tensors="pt",
        )["input_ids"][0]
        if len(ids) <= cfg.max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) == cfg.prompts:
            break
    if not prompts:
        raise ValueError(
            f"auto_shape.calibration: no held-out conversation of {cfg.source} has a first user turn "
            f"of at most {cfg.max_prompt_tokens} tokens"
        )
    return prompts


def assistant_counts(cfg: DictConfig, target: Target) -> torch.Tensor:
    """How often each target token is an assistant token in the training split of ``cfg.source``
    (its first ``cfg.split_limit`` conversations, as a feature cache made with that limit holds)
    (V counts): what the shortlist ranks by."""
    source = instantiate(cfg.source)
    train, _ = split_conversations(source.conversations, cfg.heldout_fraction, cfg.split_seed)
    train = train[: cfg.get("split_limit")]
    samples, _ = tokenize_conversations(target.tokenizer, train, cfg.max_length, progress=False)
    return assistant_token_counts(samples, target.spec.vocab_size)


def vocab_shortlist(counts: Callable[[], torch.Tensor], size: int | None) -> torch.Tensor | None:
    """The ``size`` most frequent assistant tokens by ``counts()`` (None: no shortlist)."""
    if size is None:
        return None
    counted = counts()
    d2t, _ = draft_vocab_from_counts(counted, min(size, len(counted)))
    log.info(
        "vocab shortlist: %d tokens cover %.1f%% of %d assistant tokens",
        len(d2t),
        100 * counted[torch.arange(len(d2t)) + d2t].sum() / counted.sum(),
        int(counted.sum()),
    )
    return torch.arange(len(d2t)) + d2t


def format_table(results: dict[str, Any]) -> str:
    """A plain-text summary: one row per temperature × method."""
    lines = [f"{'T':>4} {'method':<26} {'tok/s':>7} {'speedup':>8} {'tau':>5} {'overhead':>8}  α_d"]
    for temperature, methods in results.items():
        for name, entry in methods.items():
            o = entry["overall"]
            rates = " ".join(f"{r:.2f}" for r in o.get("acceptance_per_depth") or [] if r is not None)
            lines.append(
                f"{temperature[2:]:>4} {name:<26} {o['tokens_per_s'] or 0:7.1f} {o.get('speedup') or 0:8.2f} "
                f"{o.get('tau') or 0:5.2f} {o.get('overhead_share') or 0:8.2f}  {rates}"
            )
    return "\n".join(lines)


def format_batch_table(batch: dict[str, Any]) -> str:
    """A plain-text summary of the batch benchmark: one row per temperature × batch size × method."""
    lines = [f"{'T':>4} {'B':>3} {'method':<22} {'tok/s':>7} {'× plain':>8} {'ms/tok/row':>10} {'tau':>5}"]
    for temperature, section in batch.items():
        for size, methods in section["sizes"].items():
            for name, entry in methods.items():
                speedup, tau = entry.get("speedup") or 0, entry["tau"] or 1
                lines.append(
                    f"{temperature[2:]:>4} {size:>3} {name:<22} {entry['tokens_per_s']:7.1f} "
                    f"{speedup:8.2f} {entry['row_ms_per_token']:10.1f} {tau:5.2f}"
                )
        crossover = section["crossover"]
        lines.append(
            f"{temperature[2:]:>4} crossover (smallest batch size no faster than plain): {crossover}"
        )
    return "\n".join(lines)
