"""Decoding methods by name, built from their config: our decode loop with a trained head or a
draft LM, plain decoding, and HF ``generate`` baselines. Every method is a function
``(prompt_ids, sampling, seed) -> Generation`` on the same target; the methods of our decode
loop (all but HF's) also decode B prompts together (``generate_batch``, :mod:`specdraft.eval.batch`).

Method config (a mapping):

* ``{type: plain}`` — token by token on our target runner (the speedup reference);
* ``{type: head, checkpoint, shape, shortlist, typical, ngram}`` — a trained head in our decode loop;
  ``shortlist``: false, true (the run's ``shortlist.size`` most frequent tokens) or a size;
  ``shape`` = ``{kind: dynamic, depth, top_k, total_tokens}`` | ``{kind: chain, depth,
  threshold}`` | ``{kind: static, paths}`` | ``{kind: static, rank_accept, num_nodes}`` |
  ``{kind: auto, candidates}`` (the fastest candidate on this machine, or plain decoding;
  :mod:`specdraft.eval.autoshape`);
  ``typical: true`` switches on Medusa typical acceptance (LOSSY at T > 0);
  ``ngram: {tokens, max_ngram, min_ngram, branches}`` adds the context's prompt-lookup
  continuations as branches of every tree (:mod:`specdraft.eval.ngram_branches`; null: none);
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
from specdraft.eval.block_drafter import BlockDrafter
from specdraft.eval.decode import Generation, Typical, plain_generate, speculative_generate
from specdraft.eval.draft_model import DraftModelDrafter
from specdraft.eval.drafters import Chain, Drafter, DynamicTree, StaticTree, TreeShape
from specdraft.eval.feature_drafter import FeatureHeadDrafter
from specdraft.eval.lookahead import Lookahead, LookaheadDrafter
from specdraft.eval.medusa_drafter import MedusaDrafter
from specdraft.eval.ngram_branches import NgramBranchDrafter, NgramBranches
from specdraft.eval.runner import TargetRunner
from specdraft.eval.sampling import Sampling
from specdraft.eval.trees import best_static_tree
from specdraft.heads.dflash import DFlashHead
from specdraft.heads.eagle import FeatureHead
from specdraft.heads.medusa import MedusaHead

Generate = Callable[[Tensor, Sampling, int], Generation]
# (prompts, sampling, one seed per prompt) -> one Generation per prompt, decoded together.
GenerateBatch = Callable[[Sequence[Tensor], Sampling, Sequence[int]], list[Generation]]
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


@dataclass(frozen=True)
class MethodContext:
    """What every method of a run is built from (:func:`build_method`'s arguments), and the
    decode functions the builders share."""

    target: Target
    heads: Callable[[str], nn.Module]
    draft_model: Callable[[], nn.Module]
    shortlist: Callable[..., Tensor | None]
    eos_ids: tuple[int, ...]
    max_new_tokens: int
    typical: Typical
    choose_shape: ShapeChooser | None
    compile: bool
    graphs: bool

    def runner(self, aux_layer_ids: Sequence[int] = ()) -> TargetRunner:
        return TargetRunner(self.target, aux_layer_ids, compile=self.compile, graphs=self.graphs)

    def generator(self, seed: int) -> torch.Generator:
        return torch.Generator(self.target.device).manual_seed(seed)  # where the logits are

    def speculative(
        self, make_drafter: Callable[[], Drafter], runner: TargetRunner, typical: Typical | None = None
    ) -> Generate:
        """Our decode loop on ``runner`` with one drafter (made now)."""
        drafter = make_drafter()

        def generate(prompt_ids: Tensor, sampling: Sampling, seed: int) -> Generation:
            return speculative_generate(
                runner,
                drafter,
                prompt_ids,
                self.max_new_tokens,
                sampling,
                self.eos_ids,
                self.generator(seed),
                typical,
            )

        return generate

    def plain(self, runner: TargetRunner) -> Generate:
        """Token-by-token decoding on ``runner``."""

        def generate(prompt_ids: Tensor, sampling: Sampling, seed: int) -> Generation:
            generator = self.generator(seed)
            return plain_generate(runner, prompt_ids, self.max_new_tokens, sampling, self.eos_ids, generator)

        return generate

    def speculative_batches(
        self,
        make_drafter: Callable[[], Drafter],
        aux_layer_ids: Sequence[int] = (),
        typical: Typical | None = None,
    ) -> GenerateBatch:
        """Batched decoding with one drafter per row (made as the batches grow)."""
        runner, drafters = BatchRunner(self.target, aux_layer_ids), []

        def generate_batch(prompts: Sequence[Tensor], sampling: Sampling, seeds: Sequence[int]):
            drafters.extend(make_drafter() for _ in range(len(prompts) - len(drafters)))
            generators = [self.generator(seed) for seed in seeds]
            return speculative_generate_batch(
                runner,
                drafters[: len(prompts)],
                prompts,
                self.max_new_tokens,
                sampling,
                self.eos_ids,
                generators,
                typical,
            )

        return generate_batch

    def plain_batches(self) -> GenerateBatch:
        """Token-by-token decoding of B prompts together."""
        runner = BatchRunner(self.target)

        def generate_batch(prompts: Sequence[Tensor], sampling: Sampling, seeds: Sequence[int]):
            generators = [self.generator(seed) for seed in seeds]
            return plain_generate_batch(
                runner, prompts, self.max_new_tokens, sampling, self.eos_ids, generators
            )

        return generate_batch


def drafter_for_head(
    head: nn.Module,
    shape: TreeShape,
    vocab_shortlist: Tensor | None = None,
    compile: bool = False,
    graphs: bool = False,
) -> Drafter:
    """The drafter of a trained head — the one place that maps a head's kind to how it drafts:
    feature heads autoregressively (a shortlist applies to EAGLE-1/2), Medusa heads and DFlash
    blocks in parallel (a shortlist is ignored: they rank the whole vocabulary of their readout).
    ``graphs``: CUDA graphs for the drafters whose steps have static shapes."""
    if isinstance(head, FeatureHead):
        return FeatureHeadDrafter(
            head, shape, vocab_shortlist=vocab_shortlist, compile=compile, graphs=graphs
        )
    if isinstance(head, MedusaHead):
        return MedusaDrafter(head, shape, compile=compile)
    if isinstance(head, DFlashHead):
        return BlockDrafter(head, shape)
    raise ValueError(f"no drafter for a {type(head).__name__}")


def _plain_method(name: str, config: Mapping[str, Any], run: MethodContext) -> Method:
    return Method(name, "plain", run.plain(run.runner()), generate_batch=run.plain_batches())


def _head_method(name: str, config: Mapping[str, Any], run: MethodContext) -> Method:
    """A trained head in our decode loop; ``shape: auto`` is resolved here (to plain decoding
    when no shape pays on this machine)."""
    head = run.heads(config["checkpoint"])
    use_typical = bool(config.get("typical", False))
    aux_layer_ids = head.target_taps
    runner = run.runner(aux_layer_ids)
    words = method_shortlist(name, config.get("shortlist", False), run.shortlist)
    ngram = NgramBranches(**config["ngram"]) if config.get("ngram") else None

    def drafter_for(shape: TreeShape) -> Drafter:
        drafter = drafter_for_head(head, shape, words, compile=run.compile, graphs=run.graphs)
        return drafter if ngram is None else NgramBranchDrafter(drafter, ngram)

    shape_config, details = dict(config["shape"]), {}
    if shape_config.get("kind") == AUTO:
        if run.choose_shape is None:
            raise ValueError(f"method {name}: shape auto needs a shape chooser (specdraft-bench has one)")
        choice = run.choose_shape(name, runner, drafter_for, shape_config.get("candidates"))
        details = {"auto_shape": choice.record()}
        if choice.shape["kind"] == PLAIN:  # no shape pays on this machine
            return Method(
                name, "head", run.plain(runner), details=details, generate_batch=run.plain_batches()
            )
        shape_config = dict(choice.shape)
    shape = tree_shape(shape_config)
    typical = run.typical if use_typical else None
    generate = run.speculative(lambda: drafter_for(shape), runner, typical)
    batches = run.speculative_batches(lambda: drafter_for(shape), aux_layer_ids, typical)
    return Method(name, "head", generate, not use_typical, details, batches)


def _draft_model_method(name: str, config: Mapping[str, Any], run: MethodContext) -> Method:
    if "depth" not in config:  # its default lives in conf/methods (all.yaml)
        raise ValueError(f"method {name}: draft_model needs depth (drafts per step)")
    shape = Chain(depth=int(config["depth"]), threshold=config.get("threshold"))
    model = run.draft_model()
    drafter = lambda: DraftModelDrafter(model, shape, compile=run.compile)  # noqa: E731
    return Method(
        name,
        "draft_model",
        run.speculative(drafter, run.runner()),
        generate_batch=run.speculative_batches(drafter),
    )


def _lookahead_method(name: str, config: Mapping[str, Any], run: MethodContext) -> Method:
    keys = ("window", "ngram", "guesses", "pool_per_token")
    missing = [key for key in keys if key not in config]
    if missing:
        raise ValueError(f"method {name}: lookahead needs {list(keys)}; missing {missing}")
    settings = Lookahead(**{key: int(config[key]) for key in keys})
    drafter = lambda: LookaheadDrafter(settings)  # noqa: E731
    generate = run.speculative(drafter, run.runner())
    details = {"lookahead": dataclasses.asdict(settings)}
    return Method(
        name, "lookahead", generate, details=details, generate_batch=run.speculative_batches(drafter)
    )


def _hf_method(name: str, config: Mapping[str, Any], run: MethodContext) -> Method:
    """HF ``generate``: plain, prompt lookup or assisted (batch 1 only)."""
    prompt_lookup = config.get("prompt_lookup_tokens")
    assistant = run.draft_model() if config.get("assisted", False) else None
    if assistant is not None and prompt_lookup is not None:
        raise ValueError(f"method {name}: choose prompt_lookup_tokens or assisted, not both")

    def hf(prompt_ids: Tensor, sampling: Sampling, seed: int) -> Generation:
        return hf_generate(
            run.target,
            prompt_ids,
            run.max_new_tokens,
            sampling,
            run.eos_ids,
            seed,
            prompt_lookup,
            assistant,
            config.get("assistant_tokens"),
        )

    return Method(name, "hf", hf)


# method type -> its builder (name, config, the run's context) -> Method
METHOD_BUILDERS: dict[str, Callable[[str, Mapping[str, Any], MethodContext], Method]] = {
    "plain": _plain_method,
    "head": _head_method,
    "draft_model": _draft_model_method,
    "lookahead": _lookahead_method,
    "hf": _hf_method,
}
METHOD_TYPES = tuple(METHOD_BUILDERS)


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
    """The method ``config`` describes, by its type's builder (:data:`METHOD_BUILDERS`).
    ``heads(checkpoint)``, ``draft_model()`` and ``shortlist()`` / ``shortlist(size)`` (the run's
    size / another one) load lazily (and cache);
    ``choose_shape`` resolves ``shape: {kind: auto}``; ``compile``: the target's and the
    drafters' steps through ``torch.compile`` (not the HF baselines); ``graphs``: the target's
    and the feature heads' steps replayed from CUDA graphs (:mod:`specdraft.eval.graphs`) —
    a method's own ``graphs: true|false`` overrides it (e.g. eager plain decoding next to the
    graphed one, in the same interleaved run)."""
    kind = config.get("type")
    if kind not in METHOD_BUILDERS:
        raise ValueError(f"method {name}: type must be one of {METHOD_TYPES}, got {kind!r}")
    graphs = config.get("graphs", graphs)
    if not isinstance(graphs, bool):
        raise ValueError(f"method {name}: graphs must be true or false, got {graphs!r}")
    run = MethodContext(
        target, heads, draft_model, shortlist, eos_ids, max_new_tokens, typical, choose_shape, compile, graphs
    )
    return METHOD_BUILDERS[kind](name, config, run)


def method_problems(methods: Mapping[str, Mapping[str, Any] | None]) -> list[str]:
    """What is wrong with each method's settings, found without loading anything (the command's
    boundary check, before the target loads): its type, its tree shape built as decoding builds
    it (a dynamic tree asking for more nodes than its depth and top_k hold), its lookahead and HF
    sizes. One ``methods.<name>…: …`` line per problem; an empty list when all are usable."""
    problems = []
    for name, config in methods.items():
        if config is None:
            continue
        try:
            _check_method(name, config)
        except (ValueError, TypeError, KeyError) as error:
            problems.append(f"methods.{name}: {error}")
    return problems


def _check_method(name: str, config: Mapping[str, Any]) -> None:
    kind = config.get("type")
    if kind not in METHOD_BUILDERS:
        raise ValueError(f"type must be one of {METHOD_TYPES}, got {kind!r}")
    if kind == "head":
        if "checkpoint" in config and not config["checkpoint"]:  # (auto_shape's pseudo-method has none)
            raise ValueError("checkpoint is not set: expected a training checkpoint (.ckpt) or an export dir")
        shape = dict(config.get("shape") or {})
        shapes = (shape.get("candidates") or []) if shape.get("kind") == AUTO else [shape]
        for candidate in shapes:
            tree_shape(candidate)
        shortlist = config.get("shortlist", False)
        if not isinstance(shortlist, bool) and not (isinstance(shortlist, int) and shortlist > 0):
            raise ValueError(f"shortlist must be true, false or a positive token count, got {shortlist!r}")
        ngram = config.get("ngram")
        if ngram:
            try:
                NgramBranches(**ngram)
            except TypeError as error:
                expected = "tokens, max_ngram, min_ngram, branches"
                raise ValueError(f"ngram: expected {expected} ({error})") from None
    elif kind == "draft_model":
        Chain(depth=int(config.get("depth", 0)), threshold=config.get("threshold"))
    elif kind == "lookahead":
        Lookahead(**{key: config[key] for key in ("window", "ngram", "guesses", "pool_per_token")})
    elif kind == "hf":
        for key in ("prompt_lookup_tokens", "assistant_tokens"):
            value = config.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{key}={value!r}: expected null or an integer >= 1")
