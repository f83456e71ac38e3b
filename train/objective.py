"""What a draft head is trained on: a FeatureBatch → per-step predictions → losses and accuracies.

A "step" is a rollout step j of an EAGLE-style head (every step predicts position p+1's target
distribution from a more draft-made context) or head k of Medusa (predicting k+1 tokens further
ahead). The step weights are β^(j−1) (HASS alignment, EAGLE-3's 0.8^j) or γ^k (Medusa's decay):
one ``step_weight_base``.

The target's next-token distribution is recomputed from its last hidden state through its frozen
lm_head (no grad) inside :func:`specdraft.train.fused.fused_vocab_losses`, which evaluates every
vocabulary-sized term chunk by chunk. HASS Top-K uses the cached top-k when the batch has one and the
recomputed distribution otherwise. acc_j is the top-1 match between the draft and the target's
argmax at the supervised positions; simulated τ = 1 + Σ_k Π_{i≤k} acc_i (DESIGN §3).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from specdraft.data.features import FeatureBatch
from specdraft.heads import Eagle3Head, FeatureHead, MedusaHead
from specdraft.train.fused import DEFAULT_CHUNK_SIZE, TERMS, FusedOutput, fused_vocab_losses, target_topk
from specdraft.train.losses import LossWeights, feature_regression
from specdraft.train.rollout import RolloutConfig, rollout, shift_left


@dataclass
class ObjectiveOutput:
    """loss: Σ_j w_j · loss_j over the trained steps; terms: "step{j}/{name}" scalars;
    matches / counts: top-1 matches with the target's argmax and supervised positions per
    evaluated step (sum them over batches before dividing)."""

    loss: Tensor
    terms: dict[str, Tensor] = field(default_factory=dict)
    matches: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

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
    Medusa always evaluates all its heads. chunk_size: positions per vocabulary chunk.
    """

    def __init__(
        self,
        weights: LossWeights,
        rollout: RolloutConfig,
        eval_steps: int = 4,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        self.weights, self.rollout = weights, rollout
        self.eval_steps, self.chunk_size = max(eval_steps, rollout.steps), chunk_size
        self.active = [name for name in TERMS if getattr(weights, name) > 0]

    def __call__(self, head: torch.nn.Module, batch: FeatureBatch, train: bool = True) -> ObjectiveOutput:
        if isinstance(head, MedusaHead):
            return self._medusa(head, batch)
        if isinstance(head, FeatureHead):
            return self._feature_head(head, batch, self.rollout.steps if train else self.eval_steps)
        raise TypeError(f"no objective for head type {type(head).__name__}")

    def _target_topk(self, batch: FeatureBatch, b: Tensor, p: Tensor, head, target_hidden: Tensor):
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
        return target_topk(target_hidden, head.target_lm_head, k, self.chunk_size)

    def _output(
        self, fused, feature_terms: list[Tensor | None], step_weights: list[float]
    ) -> ObjectiveOutput:
        output = ObjectiveOutput(
            loss=fused.loss, matches=fused.matches.tolist(), counts=fused.counts.tolist()
        )
        coefficients = [getattr(self.weights, name) for name in TERMS]
        for j, step_terms in enumerate(fused.terms, start=1):
            step_loss = sum(c * v for c, v in zip(coefficients, step_terms.tolist(), strict=True))
            for name in self.active:
                output.terms[f"step{j}/{name}"] = step_terms[TERMS.index(name)]
            feature = feature_terms[j - 1]
            if feature is not None:
                output.terms[f"step{j}/feature"] = feature.detach()
                step_loss += self.weights.feature * float(feature.detach())
                if step_weights[j - 1] > 0:
                    output.loss = output.loss + step_weights[j - 1] * self.weights.feature * feature
            output.terms[f"step{j}/loss"] = torch.tensor(step_loss)
        return output

    def _feature_head(self, head: FeatureHead, batch: FeatureBatch, steps: int) -> ObjectiveOutput:
        weights = self.weights
        inputs = batch.input_hidden if batch.input_hidden is not None else batch.hidden
        features = head.initial_features(inputs, batch.aux)
        config = RolloutConfig(steps, self.rollout.step_weight_base, self.rollout.detach)
        outputs = rollout(head, features, batch.input_ids, config)

        # Position p is supervised when the token at p+1 is an assistant token: its target
        # feature f_{p+1} and next-token distribution p_{p+1} are what every step predicts.
        supervised = (shift_left(batch.loss_mask) * shift_left(batch.attention_mask)).bool()
        b, p = supervised.nonzero(as_tuple=True)
        target_hidden = batch.hidden[b, p + 1]
        # Step j needs j−1 positions of target context before it.
        valid = torch.stack([p >= j - 1 for j in range(1, steps + 1)])
        step_weights = [
            self.rollout.step_weight(j) if j <= self.rollout.steps else 0.0 for j in range(1, steps + 1)
        ]
        predicted = torch.stack([out[b, p] for out in outputs])  # S×N×H
        labels = None
        if weights.ce > 0:
            labels = shift_left(shift_left(batch.input_ids))[b, p]
            labels = labels.masked_fill(~shift_left(shift_left(batch.attention_mask))[b, p].bool(), -1)
        topk_ids, topk_probs = self._target_topk(batch, b, p + 1, head, target_hidden)
        if isinstance(head, Eagle3Head) and head.draft_vocab_size != head.spec.vocab_size:
            vocab = head.d2t + torch.arange(head.draft_vocab_size, device=p.device)
            projection_input, projection, maps = (
                head.norm(predicted),
                head.lm_head.weight,
                (vocab, head.target_to_draft),
            )
        elif isinstance(head, Eagle3Head):
            projection_input, projection, maps = head.norm(predicted), head.lm_head.weight, (None, None)
        else:
            projection_input, projection, maps = predicted, head.target_lm_head, (None, None)
        fused = fused_vocab_losses(
            projection_input,
            projection,
            target_hidden,
            head.target_lm_head,
            valid,
            step_weights,
            weights,
            *maps,
            topk_ids,
            topk_probs,
            labels,
            self.chunk_size,
        )
        features_loss = [
            feature_regression(predicted[j][valid[j]], target_hidden[valid[j]])
            if weights.feature > 0
            else None
            for j in range(steps)
        ]
        return self._output(fused, features_loss, step_weights)

    def _medusa(self, head: MedusaHead, batch: FeatureBatch) -> ObjectiveOutput:
        per_head = []
        for k in range(head.num_heads):
            # Head k at p predicts x_{p+2+k}; the target's distribution for it is p_{p+1+k}.
            ahead = 2 + k
            supervised = (batch.loss_mask[:, ahead:] * batch.attention_mask[:, ahead:]).bool()
            b, p = supervised.nonzero(as_tuple=True)
            hidden = head.blocks[k](batch.hidden[b, p]).unsqueeze(0)
            projection = head.lm_heads[k].weight if head.config.own_lm_head else head.target_lm_head
            target_hidden = batch.hidden[b, p + ahead - 1]
            topk_ids, topk_probs = self._target_topk(batch, b, p + ahead - 1, head, target_hidden)
            per_head.append(
                fused_vocab_losses(
                    hidden,
                    projection,
                    target_hidden,
                    head.target_lm_head,
                    torch.ones(1, p.numel(), dtype=torch.bool, device=p.device),
                    [self.rollout.step_weight(k + 1)],
                    self.weights,
                    topk_ids=topk_ids,
                    topk_probs=topk_probs,
                    labels=batch.input_ids[b, p + ahead],
                    chunk_size=self.chunk_size,
                )
            )
        fused = FusedOutput(
            loss=sum(f.loss for f in per_head),
            terms=torch.cat([f.terms for f in per_head]),
            matches=torch.cat([f.matches for f in per_head]),
            counts=torch.cat([f.counts for f in per_head]),
        )
        return self._output(
            fused, [None] * head.num_heads, [self.rollout.step_weight(k + 1) for k in range(head.num_heads)]
        )
