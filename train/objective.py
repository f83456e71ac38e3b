"""What a draft head is trained on: a FeatureBatch → per-step predictions → losses and accuracies.

A "step" is a rollout step j of an EAGLE-style head (every step predicts position p+1's target
distribution from a more draft-made context) or head k of Medusa (predicting k+1 tokens further
ahead). The step weights are β^(j−1) (HASS alignment, EAGLE-3's 0.8^j) or γ^k (Medusa's decay):
one ``step_weight_base``.

The target's next-token distribution is recomputed from its last hidden state through its frozen
lm_head (no grad) inside :func:`specdraft.train.fused.fused_vocab_losses`, which evaluates every
vocabulary-sized term chunk by chunk. HASS Top-K uses the cached top-k when the batch has one and the
recomputed distribution otherwise. acc_j is the top-1 match between the draft and the target's
argmax at the supervised positions; simulated τ = 1 + Σ_k Π_{i≤k} acc_i (docs/architecture.md §3).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from specdraft.data.features import FeatureBatch, target_topk
from specdraft.heads.frozen import soft_cap
from specdraft.heads.interface import DraftHead, TrainingPredictions, shift_left
from specdraft.heads.vocab import VocabProjection, VocabRestriction
from specdraft.train.fused import (
    TERMS,
    DraftSide,
    TargetSide,
    fused_vocab_losses,
)
from specdraft.train.losses import LossWeights, feature_regression
from specdraft.train.vocab_major import FrozenRows


@dataclass(frozen=True)
class RolloutConfig:
    """steps: n draft steps per batch (1 = plain EAGLE training); step_weight_base: β, step j's
    loss is weighted β^(j−1); detach: cut the gradient through the features earlier steps feed
    to later ones (HASS: true, EAGLE-3 TTT: false)."""

    steps: int = 1
    step_weight_base: float = 1.0
    detach: bool = True

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"rollout steps must be >= 1, got {self.steps}")
        if self.step_weight_base <= 0:
            raise ValueError(f"rollout step_weight_base must be > 0, got {self.step_weight_base}")

    def step_weight(self, step: int) -> float:
        """Loss weight of 1-based step ``step``."""
        return self.step_weight_base ** (step - 1)


@dataclass
class ObjectiveOutput:
    """loss: Σ_j w_j · loss_j over the trained steps; terms: "step{j}/{name}" scalars;
    matches / counts: top-1 matches with the target's argmax and supervised positions per
    evaluated step (sum them over batches before dividing); nonfinite: the terms whose value is a
    NaN or an Inf ("step{j}/{name}" → value, in step order; read from the host copy the terms are
    reported from, so checking it costs no device sync)."""

    loss: Tensor
    terms: dict[str, Tensor] = field(default_factory=dict)
    matches: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    nonfinite: dict[str, float] = field(default_factory=dict)

    @property
    def accuracy(self) -> list[float]:
        return [m / c if c else 0.0 for m, c in zip(self.matches, self.counts, strict=True)]


def simulated_tau(accuracy: list[float]) -> float:
    """1 + Σ_k Π_{i≤k} acc_i for per-step top-1 accuracies acc_1, acc_2, …."""
    tau, survive = 1.0, 1.0
    for acc in accuracy:
        survive *= acc
        tau += survive
    return tau


class DraftObjective:
    """Losses and accuracies of any head on a FeatureBatch.

    weights: loss-term weights; rollout: steps / step weights / detach for training;
    eval_steps: steps evaluated (for acc_j and simulated τ) when ``train=False``, at least
    ``rollout.steps`` (steps beyond the trained ones are measured, not added to the loss);
    a head with parallel steps (Medusa's heads) always evaluates all of them.
    chunk_size: positions per vocabulary chunk (the memory of the vocabulary-sized terms).
    Both are set by conf (conf/train.yaml ``loss``), not here.
    draft_vocab: target ids of a reduced TRAINING vocabulary (for a head with its own reduced one,
    a part of it): the vocabulary-sized terms and acc_j are computed over it (the target's
    distribution renormalised over it, positions whose target argmax lies outside it not trained
    on, as EAGLE-3 does), which divides their cost by V / V'; the head itself, its export and the
    feature loss are unchanged. None: the head's own vocabulary.
    rollout_vocab: target ids of a smaller vocabulary still that training steps j >= 2 (HASS
    alignment, EAGLE-3's training-time test, Medusa heads 2..k) compute those terms over, as
    ``draft_vocab`` does for all of them; step 1 keeps ``draft_vocab``, and validation measures
    every step over ``draft_vocab``. A rollout step costs a vocabulary projection and its
    gradient as step 1 does, so with a 49k vocabulary this cuts HASS's 7 vocabulary-sized
    matmuls a batch (the target's + 2 per step) toward EAGLE's 3. The decoder's default
    shortlist drafts an EAGLE-1/2 head over the most frequent tokens at every depth anyway.
    """

    def __init__(
        self,
        weights: LossWeights,
        rollout: RolloutConfig,
        *,
        eval_steps: int,
        chunk_size: int,
        draft_vocab: Tensor | None = None,
        rollout_vocab: Tensor | None = None,
    ) -> None:
        if chunk_size < 1:
            raise ValueError(f"loss chunk_size must be >= 1, got {chunk_size}")
        self.weights, self.rollout = weights, rollout
        self.eval_steps, self.chunk_size = max(eval_steps, rollout.steps), chunk_size
        self.draft_vocab, self.rollout_vocab = draft_vocab, rollout_vocab
        self.active = [name for name in TERMS if getattr(weights, name) > 0]
        # The target lm_head's rows over each vocabulary in use, kept across batches.
        self._frozen: dict[str, FrozenRows] = {}
        # Where each vocabulary in use lies in the head's, kept across batches (with what it was
        # computed from: held, so that no other tensor can take their place).
        self._restrictions: dict[str, tuple[tuple, VocabRestriction]] = {}

    def __call__(self, head: DraftHead, batch: FeatureBatch, train: bool = True) -> ObjectiveOutput:
        """The loss and per-step accuracies of ``head`` on ``batch``. An autoregressive head rolls
        out ``rollout.steps`` steps when training and ``eval_steps`` otherwise (the steps beyond
        the trained ones weigh 0); a head with parallel steps trains all of them."""
        trained = head.parallel_steps or self.rollout.steps
        steps = head.parallel_steps or (self.rollout.steps if train else self.eval_steps)
        predictions = head.training_predictions(batch, steps, self.rollout.detach)
        b, q = predictions.batch_index, predictions.positions
        outputs, valid = predictions.outputs, predictions.valid
        step_weights = [self.rollout.step_weight(j) if j <= trained else 0.0 for j in range(1, steps + 1)]
        projection = head.vocab_projection(outputs)
        # Steps computed over the training vocabulary: all of them, or step 1 only (when the
        # rollout vocabulary is smaller than what the head drafts over).
        narrows = (
            train
            and self.rollout_vocab is not None
            and self._restriction(head, projection, self.rollout_vocab, rollout=True).narrows
        )
        split = 1 if narrows else steps
        fused = None
        for chosen, rollout, rows in self._step_groups(predictions, steps, split):
            group_b, group_q, group_valid = b, q, valid[chosen]
            group = projection.steps(chosen)
            if rows is not None:  # this step's own positions, its valid columns only
                group_b, group_q = b[chosen][0, rows], q[chosen][0, rows]
                group_valid = group_valid[:, rows]
                group = dataclasses.replace(group, inputs=group.inputs[:, rows])
            terms = self._fused(
                head,
                group,
                batch,
                group_b,
                group_q,
                group_valid,
                step_weights[chosen],
                self._labels(batch, group_b, group_q),
                rollout=rollout,
            )
            fused = terms if fused is None else fused.followed_by(terms)
        features_loss: list[Tensor | None] = [None] * steps
        if predictions.predicts_features and self.weights.feature > 0:
            target_hidden = batch.hidden[b, q]
            features_loss = [
                feature_regression(outputs[j][valid[j]], target_hidden[valid[j]]) for j in range(steps)
            ]
        return self._output(fused, features_loss, step_weights)

    @staticmethod
    def _step_groups(
        predictions: TrainingPredictions, steps: int, split: int
    ) -> list[tuple[slice, bool, Tensor | None]]:
        """(steps, over the rollout vocabulary?, columns) per call of the fused losses: with
        positions shared by the steps, the steps before ``split`` and those after (all columns:
        None); with each step's own positions (a block drafter), one step at a time, over its
        valid columns only (at least one, so that every step is reported)."""
        if predictions.positions.dim() == 1:
            groups = [(slice(0, split), False, None)]
            return groups + ([(slice(split, steps), True, None)] if split < steps else [])
        # Step by step, the valid columns are contiguous in nonzero's row-major order: two host
        # syncs for all the steps, not one per step.
        counts = predictions.valid.sum(1).tolist()
        columns = predictions.valid.nonzero()[:, 1].split(counts)
        return [
            (slice(j, j + 1), j >= split, rows if rows.numel() else rows.new_zeros(1))
            for j, rows in enumerate(columns)
        ]

    def _labels(self, batch: FeatureBatch, b: Tensor, q: Tensor) -> Tensor | None:
        """x_{q+1} at (b, q), −1 where it is padding; None when no term reads labels."""
        if self.weights.ce <= 0:
            return None
        labels = shift_left(batch.input_ids)[b, q]
        return labels.masked_fill(~shift_left(batch.attention_mask)[b, q].bool(), -1)

    def _target_topk(self, batch: FeatureBatch, b: Tensor, p: Tensor, head: DraftHead, target_hidden: Tensor):
        """The target's top-K (ids, probs) N×K at positions (b, p): cached, else recomputed."""
        k = self.weights.topk_k
        if self.weights.topk <= 0:
            return None, None
        if batch.topk_ids is not None:
            if batch.topk_ids.shape[-1] < k:
                raise ValueError(
                    f"loss.topk_k={k} but the features hold only the target's top-{batch.topk_ids.shape[-1]}"
                    " (raise datamodule.top_k / the cache's top_k)"
                )
            return batch.topk_ids[b, p, :k], batch.topk_probs[b, p, :k]
        weight, cap = head.target_lm_head.to(target_hidden.dtype), head.target_logit_softcap
        return target_topk(target_hidden, lambda hidden: soft_cap(F.linear(hidden, weight), cap), k)

    def _fused(
        self,
        head: DraftHead,
        projection: VocabProjection,
        batch: FeatureBatch,
        b: Tensor,
        q: Tensor,
        valid: Tensor,
        step_weights: list[float],
        labels: Tensor | None,
        rollout: bool = False,
    ):
        """The vocabulary-sized terms of ``projection`` (over the training vocabulary, or with
        ``rollout`` the rollout one) against the target at positions (b, q): its distribution
        from ``batch.hidden[b, q]``, its top-K and (cached) argmax there."""
        vocab = self.rollout_vocab if rollout else self.draft_vocab
        frozen = self._frozen_rows(head, projection, batch, vocab, "rollout" if rollout else "train")
        if frozen is not None and vocab is None:
            projection = VocabProjection(projection.inputs, frozen.rows)
        if vocab is not None:
            restriction = self._restriction(head, projection, vocab, rollout)
            projection = projection.restricted_to(restriction, None if frozen is None else frozen.rows)
        target_hidden = batch.hidden[b, q]
        topk_ids, topk_probs = self._target_topk(batch, b, q, head, target_hidden)
        draft = DraftSide(
            hidden=projection.inputs,
            weight=projection.weight,
            valid=valid,
            step_weights=step_weights,
            vocab=projection.draft_vocab,
            target_to_draft=projection.target_to_draft,
            frozen=frozen,
        )
        target = TargetSide(
            hidden=target_hidden,
            lm_head=head.target_lm_head,
            topk_ids=topk_ids,
            topk_probs=topk_probs,
            labels=labels,
            argmax=batch.topk_ids[b, q, 0] if batch.topk_ids is not None else None,
            logit_softcap=head.target_logit_softcap,
        )
        return fused_vocab_losses(draft, target, self.weights, self.chunk_size)

    def _restriction(
        self, head: DraftHead, projection: VocabProjection, vocab: Tensor, rollout: bool
    ) -> VocabRestriction:
        """Where ``vocab`` (the training vocabulary, or with ``rollout`` the rollout one) lies in
        the head's vocabulary: computed once and kept while neither changes (the same tensors,
        not modified in place since). For a head with its own vocabulary (EAGLE-3) computing it
        reads a count on the host: a sync every step on a GPU otherwise."""
        mapping = projection.target_to_draft
        sources = (
            vocab,
            vocab._version,
            mapping,
            None if mapping is None else mapping._version,
            projection.weight.shape[-2],
            projection.weight.device,
        )
        role = "rollout" if rollout else "train"
        kept = self._restrictions.get(role)
        same = kept is not None and all(
            now is then if isinstance(now, Tensor) else now == then
            for now, then in zip(sources, kept[0], strict=True)
        )
        if not same:
            try:
                kept = self._restrictions[role] = (sources, projection.restriction(vocab))
            except ValueError as error:
                setting = "loss.rollout_vocab_size" if rollout else "loss.draft_vocab_size"
                raise ValueError(f"{setting}: {error} ({type(head).__name__})") from None
        return kept[1]

    def _frozen_rows(
        self,
        head: DraftHead,
        projection: VocabProjection,
        batch: FeatureBatch,
        vocab: Tensor | None,
        role: str,
    ):
        """The target lm_head's rows over ``vocab``, prepared once (per ``role``: the training or
        the rollout vocabulary) and kept while the lm_head and the dtypes stay the same, when the
        head drafts through it (EAGLE-1/2) and its outputs and the target's features share a
        dtype; else None."""
        weight, dtype = projection.weight, projection.inputs.dtype
        if weight is not head.target_lm_head or weight.requires_grad or projection.draft_vocab is not None:
            return None
        if batch.hidden.dtype != dtype:
            return None
        frozen = self._frozen.get(role)
        if frozen is None or not frozen.prepared_from(weight, vocab, dtype):
            frozen = self._frozen[role] = FrozenRows(weight, vocab, dtype)
        return frozen

    def _output(
        self, fused, feature_terms: list[Tensor | None], step_weights: list[float]
    ) -> ObjectiveOutput:
        # One host transfer for everything reported.
        steps = len(step_weights)
        features = [f.detach().reshape(1) for f in feature_terms if f is not None]
        reported = torch.cat(
            [fused.matches.double(), fused.counts.double(), fused.terms.double().flatten(), *features]
        ).tolist()
        matches, counts = reported[:steps], reported[steps : 2 * steps]
        term_values = reported[2 * steps : 2 * steps + steps * len(TERMS)]
        feature_values = iter(reported[2 * steps + steps * len(TERMS) :])
        output = ObjectiveOutput(
            loss=fused.loss, matches=[int(m) for m in matches], counts=[int(c) for c in counts]
        )
        coefficients = [getattr(self.weights, name) for name in TERMS]
        for j in range(1, steps + 1):
            step_terms = term_values[(j - 1) * len(TERMS) : j * len(TERMS)]
            step_loss = sum(c * v for c, v in zip(coefficients, step_terms, strict=True))
            for name in self.active:
                output.terms[f"step{j}/{name}"] = fused.terms[j - 1, TERMS.index(name)]
                _note_nonfinite(output, f"step{j}/{name}", step_terms[TERMS.index(name)])
            feature = feature_terms[j - 1]
            if feature is not None:
                output.terms[f"step{j}/feature"] = feature.detach()
                value = next(feature_values)
                _note_nonfinite(output, f"step{j}/feature", value)
                step_loss += self.weights.feature * value
                if step_weights[j - 1] > 0:
                    output.loss = output.loss + step_weights[j - 1] * self.weights.feature * feature
            output.terms[f"step{j}/loss"] = torch.tensor(step_loss)
        return output


def _note_nonfinite(output: ObjectiveOutput, name: str, value: float) -> None:
    """Record term ``name`` in ``output.nonfinite`` when its (host) value is a NaN or an Inf."""
    if not math.isfinite(value):
        output.nonfinite[name] = value
