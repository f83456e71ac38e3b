"""The one interface every head kind implements: what training, the drafters, the formats and the
benchmarks need of a head.

A new head kind is a module with a :class:`DraftHead` subclass (and its config dataclass) plus
one line in :data:`specdraft.heads.registry.HEAD_KINDS`; nothing outside its module branches on
it. What the rest of specdraft asks of a head:

* building: ``DraftHead(spec, weights, config)``; ``choose_vocabulary`` before training, for a
  head that drafts over a vocabulary chosen from the training data; ``load_state_dict`` (strict)
  to rebuild a trained one;
* training (``specdraft.train.objective``): ``training_predictions`` and ``vocab_projection``;
  ``parallel_steps`` says whether the number of draft steps is the head's (Medusa's K heads) or
  the objective's choice (an autoregressive head rolls out as many steps as it is asked);
* decoding: ``target_taps`` (the target layers a runner must capture for it); how it drafts is its
  family's drafter (``specdraft.eval.methods.drafter_for_head``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdraft.heads.frozen import TargetWeights
from specdraft.heads.spec import TargetSpec
from specdraft.heads.vocab import VocabProjection


class TrainingBatch(Protocol):
    """What a head trains on (``specdraft.data.features.FeatureBatch`` is one).

    input_ids, attention_mask, loss_mask  B×T
    hidden        B×T×H      the target's last hidden state after its final norm
    aux           B×T×(k·H)  the target's aux layers (``target_taps``), None unless captured
    input_hidden  B×T×H      the features the head reads when they differ from ``hidden`` (noise)
    seed          the seed of what a head draws at random from a training batch (None: its own)
    """

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    hidden: Tensor
    aux: Tensor | None
    input_hidden: Tensor | None
    seed: int | None


@dataclass
class TrainingPredictions:
    """A head's predictions over a batch, aligned on the target position each one predicts.

    batch_index, positions  N      (b, q): every step predicts the target's next-token
                                   distribution at q (its token x_{q+1});
                            or S×N one (b, q) per step and column (a block drafter: step j of
                                   the block at a predicts at q = a+j−1)
    outputs                 S×N×H  step j's output for (b, q): what ``vocab_projection`` reads
    valid                   S×N    step j had the context it needs for (b, q)
    predicts_features: ``outputs[j]`` also predicts the target's last hidden state at q (EAGLE's
    feature regression)
    """

    batch_index: Tensor
    positions: Tensor
    outputs: Tensor
    valid: Tensor
    predicts_features: bool


def shift_left(x: Tensor, fill: float | int = 0) -> Tensor:
    """x[:, p] <- x[:, p+1] along dim 1; the last position gets ``fill``."""
    return torch.cat([x[:, 1:], torch.full_like(x[:, :1], fill)], dim=1)


def supervised_mask(batch: TrainingBatch) -> Tensor:
    """B×T bool: the positions whose next token is a (non-padding) assistant token."""
    return (shift_left(batch.loss_mask) * shift_left(batch.attention_mask)).bool()


def supervised_positions(batch: TrainingBatch) -> tuple[Tensor, Tensor]:
    """(b, p), N each: the positions whose next token is a (non-padding) assistant token."""
    return supervised_mask(batch).nonzero(as_tuple=True)


class DraftHead(nn.Module):
    """The base of every head kind: the frozen target lm_head it trains against, and the interface
    above. ``kind`` names the kind in configs, checkpoints and exports; ``config_class`` is the
    frozen dataclass of its settings (with a ``to_dict``)."""

    kind: ClassVar[str]
    config_class: ClassVar[type]
    spec: TargetSpec
    config: Any

    def __init__(self, spec: TargetSpec, weights: TargetWeights) -> None:
        super().__init__()
        weights.check(spec)
        self.spec = spec
        # The target's own lm_head: the objective recomputes the target's next-token distribution
        # through it from the features, and heads that draft through it read it.
        self.register_buffer("target_lm_head", weights.lm_head, persistent=False)
        self.target_logit_softcap = weights.logit_softcap  # the target's own logits are capped by it

    @property
    def target_taps(self) -> tuple[int, ...]:
        """The target's aux layer ids (the stream entering decoder layer i) the head reads beside
        its last hidden state: what a target runner must capture for it."""
        raise NotImplementedError

    @property
    def parallel_steps(self) -> int | None:
        """How many tokens ahead the head predicts at once (Medusa's K heads, all trained together),
        or None: the head drafts autoregressively, as many steps as the objective asks for."""
        return None

    def target_logits(self, hidden: Tensor) -> Tensor:
        """The target's logits ...×V for its own last hidden states ...×H."""
        return F.linear(hidden, self.target_lm_head.to(hidden.dtype))

    def choose_vocabulary(self, token_counts: Callable[[], Tensor]) -> None:
        """Before training: choose the vocabulary the head drafts over from the training split's
        assistant token counts (V, a pass over the data, so called only by heads that use them).
        Default: the head drafts over the target's vocabulary and needs nothing."""

    def vocab_projection(self, outputs: Tensor) -> VocabProjection:
        """The draft logits of ``TrainingPredictions.outputs`` S×N×H as the objective computes them:
        ``projection.inputs @ projection.weight.T`` per step."""
        raise NotImplementedError

    def training_predictions(self, batch: TrainingBatch, steps: int, detach: bool) -> TrainingPredictions:
        """Every step's prediction at every supervised position of ``batch``. ``steps``: the steps
        to roll out (a head with ``parallel_steps`` predicts its own number); ``detach``: cut the
        gradient through what earlier steps feed later ones."""
        raise NotImplementedError
