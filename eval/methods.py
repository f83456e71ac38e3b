"""Decoding methods by name, built from their config: our decode loop with a trained head or a
draft LM, plain decoding, and HF ``generate`` baselines. Every method is a function
``(prompt_ids, sampling, seed) -> Generation`` on the same target; the methods of our decode
loop (all but HF's) also decode B prompts together (``generate_batch``, :mod:`specdraft.eval.batch`).

Method config (a mapping):

* ``{type: plain}`` — token by token on our target runner (the speedup reference);
* ``{type: head, checkpoint, shape, shortlist, typical}`` — a trained head in our decode loop;
  ``shortlist``: false, true (the run's ``shortlist.size`` most frequent tokens) or a size;
  ``shape`` = ``{kind: dynamic, depth, top_k, total_tokens}`` | ``{kind: chain, depth,
  threshold}`` | ``{kind: static, paths}`` | ``{kind: static, rank_accept, num_nodes}`` |
  ``{kind: auto, candidates}`` (the fastest candidate on this machine, or plain decoding;
  :mod:`specdraft.eval.autoshape`);
  ``typical: true`` switches on Medusa typical acceptance (LOSSY at T > 0);
* ``{type: draft_model, depth, threshold}`` — classic speculative sampling with the draft LM;
* ``{type: lookahead, window, ngram, guesses, pool_per_token}`` — lookahead decoding, no draft
  model (:mod:`specdraft.eval.lookahead`);
* ``{type: hf}``, ``{type: hf, prompt_lookup_tokens}``, ``{type: hf, assisted: true,
  assistant_tokens}`` — HF ``generate``: plain, prompt lookup decoding, assisted generation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from specdraft.data.target import Target
from specdraft.eval.autoshape import PLAIN, ShapeChoice
from specdraft.eval.baselines import hf_generate
from specdraft.eval.batch import BatchRunner, plain_generate_batch, speculative_generate_batch
from specdraft.eval.decode import Generation, Typical, plain_generate, speculative_generate
from specdraft.eval.drafters import (
    Chain,
    Drafter,
    DraftModelDrafter,
    DynamicTree,
    StaticTree,
    TreeShape,
    drafter_for_head,
)
from specdraft.eval.lookahead import Lookahead, LookaheadDrafter
from specdraft.eval.runner import TargetRunner
from specdraft.eval.sampling import Sampling
from specdraft.eval.trees import best_static_tree

Generate = Callable[[Tensor, Sampling, int], Generation]
# (prompts, sampling, one seed per prompt) -> one Generation per prompt, decoded together.
GenerateBatch = Callable[[Sequence[Tensor], Sampling, Sequence[int]], list[Generation]]
METHOD_TYPES = ("plain", "head", "draft_model", "lookahead", "hf")
AUTO = "auto"
# (method name, its runner, a drafter for a shape, candidate shape configs or None for the
# defaults) -> the choice; specdraft-bench's chooser calibrates, probes and records it.
ShapeChooser = Callable[
    [str, TargetRunner, Callable[[TreeShape], Drafter], Sequence[Mapping[str, Any]] | None], ShapeChoice
]


@dataclass
class Method:
    """``lossless``: the output distribution is the target's (False only for typical acceptance);
    ``details``: what the report should say about how it was set up (``shape: auto``'s choice);
    ``generate_batch``: B prompts decoded together (None: batch 1 only, as HF ``generate``'s
    prompt lookup and assisted decoding)."""

    name: str
    type: str
    generate: Generate
    lossless: bool = True
    details: dict[str, Any] = field(default_factory=dict)
    generate_batch: GenerateBatch | None = None


def tree_shape(config: Mapping[str, Any]) -> TreeShape:
    """A TreeShape from ``{kind: chain|static|dynamic, ...}`` (``auto`` is resolved by
    :func:`build_method`)."""
    config = dict(config)
    kind = config.pop("kind", None)
    try:
        if kind == "chain":
            return Chain(**config)
        if kind == "dynamic":
            return DynamicTree(**config)
        if kind == "static":
            if "paths" in config:
                return StaticTree(tuple(tuple(int(r) for r in p) for p in config["paths"]))
            return StaticTree(tuple(best_static_tree(config["rank_accept"], config["num_nodes"])))
    except (TypeError, KeyError) as error:
        raise ValueError(f"tree shape {kind}: bad fields {sorted(config)} ({error})") from None
    raise ValueError(f"tree shape kind must be chain, static or dynamic, got {kind!r}")


def method_shortlist(name: str, setting: Any, shortlist: Callable[..., Tensor | None]) -> Tensor | None:
    """A head method's ``shortlist``: false (the whole vocabulary), true (the run's size) or a
    number of tokens."""
    if setting is False:
        return None
    if setting is True:
        return shortlist()
    if isinstance(setting, int) and setting > 0:
        return shortlist(setting)
    raise ValueError(
        f"method {name}: shortlist must be true, false or a positive token count, got {setting!r}"
    )


def build_method(
    name: str,
    config: Mapping[str, Any],
    target: Target,
    heads: Callable[[str], nn.Module],
    draft_model: Callable[[], nn.Module],
    shortlist: Callable[..., Tensor | None],
    eos_ids: tuple[int, ...],
    max_new_tokens: int,
    typical: Typical,
    choose_shape: ShapeChooser | None = None,
    compile: bool = False,
    graphs: bool = False,
) -> Method:
    """``heads(checkpoint)``, ``draft_model()`` and ``shortlist()`` / ``shortlist(size)`` (the run's
    size / another one) load lazily (and cache);
    ``choose_shape`` resolves ``shape: {kind: auto}``; ``compile``: the target's and the
    drafters' steps through ``torch.compile`` (not the HF baselines); ``graphs``: the target's
    and the feature heads' steps replayed from CUDA graphs (:mod:`specdraft.eval.graphs`) —
    a method's own ``graphs: true|false`` overrides it (e.g. eager plain decoding next to the
    graphed one, in the same interleaved run)."""
    kind = config.get("type")
    if kind not in METHOD_TYPES:
        raise ValueError(f"method {name}: type must be one of {METHOD_TYPES}, got {kind!r}")
    graphs = config.get("graphs", graphs)
    if not isinstance(graphs, bool):
        raise ValueError(f"method {name}: graphs must be true or false, got {graphs!r}")

    def decode_with(make_drafter: Callable[[], Drafter], runner: TargetRunner, typical_rule=None) -> Generate:
        drafter = make_drafter()

        def generate(prompt_ids: Tensor, sampling: Sampling, seed: int) -> Generation:
            generator = torch.Generator(target.device).manual_seed(seed)  # where the logits are
            return speculative_generate(
                runner, drafter, prompt_ids, max_new_tokens, sampling, eos_ids, generator, typical_rule
            )

        return generate

    def plain_on(runner: TargetRunner) -> Generate:
        def plain(prompt_ids: Tensor, sampling: Sampling, seed: int) -> Generation:
            generator = torch.Generator(target.device).manual_seed(seed)
            return plain_generate(runner, prompt_ids, max_new_tokens, sampling, eos_ids, generator)

        return plain

    def generators(seeds: Sequence[int]) -> list[torch.Generator]:
        return [torch.Generator(target.device).manual_seed(seed) for seed in seeds]

    def batches_with(
        make_drafter: Callable[[], Drafter], aux_layer_ids=(), typical_rule=None
    ) -> GenerateBatch:
        """Batched decoding with one drafter per row (made as the batches grow)."""
        runner, drafters = BatchRunner(target, aux_layer_ids), []

        def generate_batch(prompts: Sequence[Tensor], sampling: Sampling, seeds: Sequence[int]):
            drafters.extend(make_drafter() for _ in range(len(prompts) - len(drafters)))
            return speculative_generate_batch(
                runner,
                drafters[: len(prompts)],
                prompts,
                max_new_tokens,
                sampling,
                eos_ids,
                generators(seeds),
                typical_rule,
            )

        return generate_batch

    def plain_batches() -> GenerateBatch:
        runner = BatchRunner(target)

        def generate_batch(prompts: Sequence[Tensor], sampling: Sampling, seeds: Sequence[int]):
            return plain_generate_batch(runner, prompts, max_new_tokens, sampling, eos_ids, generators(seeds))

        return generate_batch

    if kind == "plain":
        runner = TargetRunner(target, compile=compile, graphs=graphs)
        return Method(name, kind, plain_on(runner), generate_batch=plain_batches())
    if kind == "head":
        head = heads(config["checkpoint"])
        use_typical = bool(config.get("typical", False))
        aux_layer_ids = head.target_taps
        runner = TargetRunner(target, aux_layer_ids, compile=compile, graphs=graphs)
        words = method_shortlist(name, config.get("shortlist", False), shortlist)
        drafter_for: Callable[[TreeShape], Drafter] = lambda shape: drafter_for_head(  # noqa: E731
            head, shape, words, compile=compile, graphs=graphs
        )
        shape_config, details = dict(config["shape"]), {}
        if shape_config.get("kind") == AUTO:
            if choose_shape is None:
                raise ValueError(f"method {name}: shape auto needs a shape chooser (specdraft-bench has one)")
            choice = choose_shape(name, runner, drafter_for, shape_config.get("candidates"))
            details = {"auto_shape": choice.record()}
            if choice.shape["kind"] == PLAIN:  # no shape pays on this machine
                return Method(name, kind, plain_on(runner), details=details, generate_batch=plain_batches())
            shape_config = dict(choice.shape)
        shape = tree_shape(shape_config)
        typical_rule = typical if use_typical else None
        generate = decode_with(lambda: drafter_for(shape), runner, typical_rule)
        batches = batches_with(lambda: drafter_for(shape), aux_layer_ids, typical_rule)
        return Method(name, kind, generate, not use_typical, details, batches)
    if kind == "draft_model":
        if "depth" not in config:  # its default lives in conf/methods (all.yaml)
            raise ValueError(f"method {name}: draft_model needs depth (drafts per step)")
        shape = Chain(depth=int(config["depth"]), threshold=config.get("threshold"))
        model = draft_model()
        drafter = lambda: DraftModelDrafter(model, shape, compile=compile)  # noqa: E731
        generate = decode_with(drafter, TargetRunner(target, compile=compile, graphs=graphs))
        return Method(name, kind, generate, generate_batch=batches_with(drafter))
    if kind == "lookahead":
        keys = ("window", "ngram", "guesses", "pool_per_token")
        missing = [key for key in keys if key not in config]
        if missing:
            raise ValueError(f"method {name}: lookahead needs {list(keys)}; missing {missing}")
        settings = Lookahead(**{key: int(config[key]) for key in keys})
        drafter = lambda: LookaheadDrafter(settings)  # noqa: E731
        generate = decode_with(drafter, TargetRunner(target, compile=compile, graphs=graphs))
        details = {"lookahead": dataclasses.asdict(settings)}
        return Method(name, kind, generate, details=details, generate_batch=batches_with(drafter))
    # HF generate
    prompt_lookup = config.get("prompt_lookup_tokens")
    assistant = draft_model() if config.get("assisted", False) else None
    if assistant is not None and prompt_lookup is not None:
        raise ValueError(f"method {name}: choose prompt_lookup_tokens or assisted, not both")

    def hf(prompt_ids: Tensor, sampling: Sampling, seed: int) -> Generation:
        return hf_generate(
            target,
            prompt_ids,
            max_new_tokens,
            sampling,
            eos_ids,
            seed,
            prompt_lookup,
            assistant,
            config.get("assistant_tokens"),
        )

    return Method(name, kind, hf)
