"""What a draft head is trained on: a FeatureBatch → per-step predictions → losses and accuracies.

A "step" is a rollout step j of an EAGLE-style head (every step predicts position p+1's target
distribution from a more draft-made context) or head k of Medusa (predicting k+1 tokens further
ahead). The step weights are β^(j−1) (HASS alignment, EAGLE-3's 0.8^j) or γ^k (Medusa's decay):
one ``step_weight_base``.

The target's next-token distribution is recomputed from its last hidden state through its frozen
lm_head (no grad), once per batch. HASS Top-K uses the cached top-k when the batch has one and the
recomputed distribution otherwise. acc_j is the top-1 match between the draft and the target's
argmax at the supervised positions; simulated τ = 1 + Σ_k Π_{i≤k} acc_i (DESIGN §3).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from specdraft.data.features import FeatureBatch
from specdraft.heads import Eagle3Head, FeatureHead, MedusaHead
from specdraft.train.losses import LossWeights, step_loss
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
    ``rollout.steps``; Medusa always evaluates all its heads.
    """

    def __init__(self, weights: LossWeights, rollout: RolloutConfig, eval_steps: int = 4) -> None:
        self.weights, self.rollout, self.eval_steps = weights, rollout, max(eval_steps, rollout.steps)

    def __call__(self, head: torch.nn.Module, batch: FeatureBatch, train: bool = True) -> ObjectiveOutput:
        if isinstance(head, MedusaHead):
            return self._medusa(head, batch)
        if isinstance(head, FeatureHead):
            return self._feature_head(head, batch, self.rollout.steps if train else self.eval_steps)
        raise TypeError(f"no objective for head type {type(head).__name__}")

    def _target_topk(
        self, batch: FeatureBatch, b: Tensor, p: Tensor, target_probs: Tensor
    ) -> tuple[Tensor, Tensor]:
        """The target's top-K (ids, probs) N×K at positions (b, p): cached, else recomputed."""
        k = self.weights.topk_k
        if batch.topk_ids is not None:
            if batch.topk_ids.shape[-1] < k:
                raise ValueError(
                    f"loss.topk_k={k} but the features hold only the target's top-{batch.topk_ids.shape[-1]}"
                    " (raise datamodule.top_k / the cache's top_k)"
                )
            return batch.topk_ids[b, p, :k], batch.topk_probs[b, p, :k]
        probs, ids = target_probs.topk(k, dim=-1)
        return ids, probs

    def _combine(
        self, steps: list[dict[str, Tensor]], trained: int, output: ObjectiveOutput
    ) -> ObjectiveOutput:
        total = torch.zeros(())
        for j, terms in enumerate(steps, start=1):
            for name, value in terms.items():
                output.terms[f"step{j}/{name}"] = value.detach()
            if j <= trained:
                total = total.to(terms["loss"].device) + self.rollout.step_weight(j) * terms["loss"]
        output.loss = total
        return output

    def _feature_head(self, head: FeatureHead, batch: FeatureBatch, steps: int) -> ObjectiveOutput:
        weights = self.weights
        reduced_vocab = isinstance(head, Eagle3Head) and head.draft_vocab_size != head.spec.vocab_size
        inputs = batch.input_hidden if batch.input_hidden is not None else batch.hidden
        features = head.initial_features(inputs, batch.aux)
        config = RolloutConfig(steps, self.rollout.step_weight_base, self.rollout.detach)
        outputs = rollout(head, features, batch.input_ids, config)

        # Position p is supervised when the token at p+1 is an assistant token: its target
        # feature f_{p+1} and next-token distribution p_{p+1} are what every step predicts.
        supervised = (shift_left(batch.loss_mask) * shift_left(batch.attention_mask)).bool()
        b, p = supervised.nonzero(as_tuple=True)
        with torch.no_grad():
            target_features = batch.hidden[b, p + 1]
            target_logits = head.target_logits(target_features).float()
            target_argmax = target_logits.argmax(-1)
            full_probs = target_logits.softmax(-1)
            topk_ids = topk_probs = None
            if weights.topk > 0:
                topk_ids, topk_probs = self._target_topk(batch, b, p + 1, full_probs)
            keep = torch.ones_like(p, dtype=torch.bool)
            target_probs = full_probs
            if reduced_vocab:
                # EAGLE-3: the target distribution restricted to (and renormalised over) the draft
                # vocabulary; positions whose target argmax the draft cannot propose are skipped.
                target_probs = target_logits[
                    :, head.d2t + torch.arange(head.draft_vocab_size, device=p.device)
                ]
                target_probs = target_probs.softmax(-1)
                keep = head.t2d[target_argmax]
                if topk_ids is not None:
                    topk_ids = head.target_to_draft[topk_ids]
            labels = None
            if weights.ce > 0:
                labels = shift_left(shift_left(batch.input_ids))[b, p]
                valid = shift_left(shift_left(batch.attention_mask))[b, p].bool()
                if reduced_vocab:
                    labels = head.target_to_draft[labels]
                labels = labels.masked_fill(~valid, -1)

        per_step, output = [], ObjectiveOutput(loss=torch.zeros(()))
        for j, out in enumerate(outputs, start=1):
            select = p >= j - 1  # step j needs j−1 positions of target context before it
            predicted = out[b[select], p[select]]
            draft_logits = head.logits(predicted)
            train_select = keep[select]

            def pick(x: Tensor | None, sel=select, tsel=train_select) -> Tensor | None:
                return None if x is None else x[sel][tsel]

            per_step.append(
                step_loss(
                    weights,
                    draft_logits[train_select],
                    target_probs=pick(target_probs),
                    topk_ids=pick(topk_ids),
                    topk_probs=pick(topk_probs),
                    labels=pick(labels),
                    predicted_features=predicted[train_select] if weights.feature > 0 else None,
                    target_features=pick(target_features),
                )
            )
            with torch.no_grad():
                drafted = head.draft_to_target(draft_logits.argmax(-1))
                output.matches.append(int((drafted == target_argmax[select]).sum()))
            output.counts.append(int(select.sum()))
        return self._combine(per_step, self.rollout.steps, output)

    def _medusa(self, head: MedusaHead, batch: FeatureBatch) -> ObjectiveOutput:
        weights = self.weights
        per_step, output = [], ObjectiveOutput(loss=torch.zeros(()))
        for k in range(head.num_heads):
            # Head k at p predicts x_{p+2+k}; the target's distribution for it is p_{p+1+k}.
            ahead = 2 + k
            supervised = (batch.loss_mask[:, ahead:] * batch.attention_mask[:, ahead:]).bool()
            b, p = supervised.nonzero(as_tuple=True)
            draft_logits = head.head_logits(batch.hidden[b, p], k)
            with torch.no_grad():
                target_logits = head.target_logits(batch.hidden[b, p + ahead - 1]).float()
                full_probs = target_logits.softmax(-1)
                topk_ids = topk_probs = None
                if weights.topk > 0:
                    topk_ids, topk_probs = self._target_topk(batch, b, p + ahead - 1, full_probs)
            per_step.append(
                step_loss(
                    weights,
                    draft_logits,
                    target_probs=full_probs,
                    topk_ids=topk_ids,
                    topk_probs=topk_probs,
                    labels=batch.input_ids[b, p + ahead],
                )
            )
            with torch.no_grad():
                output.matches.append(int((draft_logits.argmax(-1) == target_logits.argmax(-1)).sum()))
            output.counts.append(int(p.numel()))
        return self._combine(per_step, head.num_heads, output)
