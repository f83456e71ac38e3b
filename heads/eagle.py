"""EAGLE-style autoregressive feature heads: EAGLE-1/2 and EAGLE-3.

Both are one Llama decoder layer that drafts autoregressively in feature space. Position t reads
a feature for t and the token x_{t+1}, and produces the feature the next step reads at t+1:

* EAGLE-1/2: the feature is the target's last hidden state (after the final norm), ``f_t``.
  ``h = fc([emb(x_{t+1}); f_t])`` (2H → H) feeds a decoder layer without input norm; the output
  predicts ``f_{t+1}`` and the logits come from the target's frozen lm_head.
* EAGLE-3: the level-1 feature is ``g_t = fc(aux_t)`` (k·H → H), the fusion of k pre-norm target
  layers; at later draft steps it is the layer's own previous output. The attention reads
  ``[norm(emb(x_{t+1})); norm(g_t)]`` (2H), the residual stream is ``g_t``, and the head has its
  own final norm and lm_head over a reduced draft vocabulary (``d2t`` / ``t2d``).

:meth:`FeatureHead.step` is the one computation used for training (full sequences, and the
multi-step rollout of :mod:`specdraft.heads.rollout`) and for drafting (a KV cache as ``past``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdraft.heads.frozen import TargetWeights
from specdraft.heads.interface import DraftHead, TrainingBatch, TrainingPredictions, supervised_positions
from specdraft.heads.layers import AlignedMask, DraftDecoderLayer, RMSNorm
from specdraft.heads.rollout import rollout
from specdraft.heads.spec import TargetSpec
from specdraft.heads.vocab import (
    VocabProjection,
    check_vocab_maps,
    draft_vocab_from_counts,
    target_to_draft_index,
)


@dataclass(frozen=True)
class EagleConfig:
    """EAGLE-1/2. ``fc_bias``: the reference fc has a bias, EAGLE's LLaMA-3 heads do not, and vLLM
    silently ignores one (conf/head/eagle.yaml turns it off)."""

    fc_bias: bool
    kind: str = "eagle"

    def __post_init__(self) -> None:
        if self.kind != "eagle":
            raise ValueError(f"EagleConfig.kind must be 'eagle', got {self.kind!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Eagle3Config:
    """EAGLE-3. ``draft_vocab_size``: the reduced draft vocabulary's size; None (or the target's
    vocabulary size or more) = the full target vocabulary. No default here: conf/head/eagle3.yaml
    sets it."""

    draft_vocab_size: int | None
    kind: str = "eagle3"

    def __post_init__(self) -> None:
        if self.kind != "eagle3":
            raise ValueError(f"Eagle3Config.kind must be 'eagle3', got {self.kind!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class FeatureHead(DraftHead):
    """What EAGLE-1/2 and EAGLE-3 share: a frozen target embedding, one draft decoder layer, and the
    step / logits API. Subclasses define the level-1 features and the attention input. By default
    a head drafts through the target's frozen lm_head over the target vocabulary (EAGLE-1/2); a
    head with a vocabulary of its own (EAGLE-3) overrides the logits and vocabulary methods.
    Every feature head drafts with ``specdraft.eval.feature_drafter.FeatureHeadDrafter``."""

    def __init__(self, spec: TargetSpec, weights: TargetWeights, attention_input_size: int) -> None:
        super().__init__(spec, weights)
        self.register_buffer("target_embedding", weights.embedding, persistent=False)
        self.embedding_scale = weights.embedding_scale
        self.layer = DraftDecoderLayer(spec, attention_input_size)

    def embed(self, token_ids: Tensor) -> Tensor:
        """The target's embedding of ``token_ids``, scaled as the target scales it."""
        embedded = F.embedding(token_ids, self.target_embedding)
        return embedded if self.embedding_scale == 1.0 else embedded * self.embedding_scale

    def initial_features(self, hidden: Tensor, aux: Tensor | None) -> Tensor:
        """The level-1 features B×T×H the head reads from the target (hidden: last hidden state,
        aux: the concatenated aux layers)."""
        raise NotImplementedError

    def attention_inputs(self, features: Tensor, token_ids: Tensor) -> tuple[Tensor, Tensor]:
        """(attention input B×n×(H or 2H), residual B×n×H) for features and the next tokens."""
        raise NotImplementedError

    def logits(self, hidden: Tensor) -> Tensor:
        """Draft logits ...×V' for layer outputs ...×H."""
        return self.target_logits(hidden)

    @property
    def draft_vocab_size(self) -> int:
        """V', the size of the vocabulary the head drafts over."""
        return self.spec.vocab_size

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocabulary ids -> target ids."""
        return draft_ids

    def shortlist_weight(self, target_ids: Tensor) -> Tensor:
        """N×H: the rows of the head's output projection for ``target_ids``, so that drafting over
        a shortlist of the vocabulary (FR-Spec) projects onto them alone."""
        return self.target_lm_head[target_ids]

    def vocab_projection(self, outputs: Tensor) -> VocabProjection:
        return VocabProjection(outputs, self.target_lm_head)

    def training_predictions(self, batch: TrainingBatch, steps: int, detach: bool) -> TrainingPredictions:
        """Roll out ``steps`` aligned steps over the whole batch (:mod:`specdraft.heads.rollout`).
        Position p is supervised when the token at p+1 is an assistant token: every step at p
        predicts the target's feature f_{p+1} and its next-token distribution there, so q = p+1;
        step j needs j−1 positions of target context before p."""
        inputs = batch.input_hidden if batch.input_hidden is not None else batch.hidden
        outputs = rollout(self, self.initial_features(inputs, batch.aux), batch.input_ids, steps, detach)
        b, p = supervised_positions(batch)
        valid = torch.stack([p >= j - 1 for j in range(1, steps + 1)])
        predicted = torch.stack([out[b, p] for out in outputs])  # S×N×H
        return TrainingPredictions(b, p + 1, predicted, valid, predicts_features=True)

    def step(
        self,
        features: Tensor,
        token_ids: Tensor,
        positions: Tensor,
        mask: Tensor | AlignedMask | None,
        past_key: Tensor | None = None,
        past_value: Tensor | None = None,
        cache_index: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One draft step over n positions.

        features   B×n×H   the feature at each position (level 1: :meth:`initial_features`;
                           later steps: the head's own outputs for the previous positions)
        token_ids  B×n     the token that FOLLOWS each position (x_{t+1} at position t)
        positions  B×n     rotary positions
        mask       additive (0 / −inf), broadcastable to B×1×n×(P+n), P = past length; None:
                   causal over the n positions (no past); an AlignedMask: a rollout step's pattern
                   over the earlier levels' K/V as past
        past_*     B×kv_heads×P×head_dim: KV cache, or the K/V of earlier rollout levels
        cache_index n      decoding: past_* are a preallocated cache of P entries; these n
                           positions' keys/values are written into it there, and the mask covers
                           the P entries alone (B×1×n×P)
        Returns (output B×n×H — the next feature; key, value B×kv_heads×n×head_dim of these n).
        """
        attention_input, residual = self.attention_inputs(features, token_ids)
        return self.layer(attention_input, residual, positions, mask, past_key, past_value, cache_index)


class EagleHead(FeatureHead):
    """EAGLE-1/2: predicts the target's next post-norm feature; logits via the frozen lm_head."""

    kind = "eagle"
    config_class = EagleConfig

    def __init__(self, spec: TargetSpec, weights: TargetWeights, config: EagleConfig) -> None:
        super().__init__(spec, weights, attention_input_size=spec.hidden_size)
        self.config = config
        self.fc = nn.Linear(2 * spec.hidden_size, spec.hidden_size, bias=self.config.fc_bias)

    @property
    def target_taps(self) -> tuple[int, ...]:
        return ()  # the last hidden state only

    def initial_features(self, hidden: Tensor, aux: Tensor | None = None) -> Tensor:
        return hidden

    def attention_inputs(self, features: Tensor, token_ids: Tensor) -> tuple[Tensor, Tensor]:
        embedded = self.embed(token_ids).to(features.dtype)
        h = self.fc(torch.cat([embedded, features], dim=-1))
        return h, h  # layer 0 has no input norm: the attention reads h itself


class Eagle3Head(FeatureHead):
    """EAGLE-3: fused multi-layer features, 2H attention input, own norm + draft-vocab lm_head.

    Its draft vocabulary (``d2t`` / ``t2d``, persistent buffers) is the target's until
    :meth:`choose_vocabulary` picks the training split's most frequent assistant tokens, or a
    trained state is loaded; a reduced one starts as the first V' target tokens."""

    kind = "eagle3"
    config_class = Eagle3Config

    def __init__(self, spec: TargetSpec, weights: TargetWeights, config: Eagle3Config) -> None:
        super().__init__(spec, weights, attention_input_size=2 * spec.hidden_size)
        if not spec.aux_layer_ids:
            raise ValueError(f"EAGLE-3 needs target aux layers; target {spec.name} has aux_layer_ids=()")
        if config.draft_vocab_size is not None and config.draft_vocab_size < 1:
            raise ValueError(
                f"EAGLE-3 draft_vocab_size must be >= 1 (or null), got {config.draft_vocab_size}"
            )
        if config.draft_vocab_size is not None and config.draft_vocab_size >= spec.vocab_size:
            config = replace(config, draft_vocab_size=None)  # no smaller than the target's: all of it
        self.config = config
        hidden, draft_vocab = spec.hidden_size, config.draft_vocab_size or spec.vocab_size
        self.fc = nn.Linear(len(spec.aux_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, spec.rms_norm_eps)
        self.input_layernorm = RMSNorm(hidden, spec.rms_norm_eps)
        self.norm = RMSNorm(hidden, spec.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(spec.vocab_size) < draft_vocab)
        self.register_buffer("target_to_draft", target_to_draft_index(self.t2d), persistent=False)
        # Warm start from the target: its final norm and the lm_head rows of the draft vocabulary.
        self.norm.weight.data.copy_(weights.final_norm.float())
        self._warm_start_lm_head()
        self.register_load_state_dict_post_hook(Eagle3Head._vocabulary_loaded)

    def choose_vocabulary(self, token_counts: Callable[[], Tensor]) -> None:
        """A reduced draft vocabulary: the ``draft_vocab_size`` most frequent assistant tokens."""
        if self.config.draft_vocab_size is not None:
            self.set_draft_vocab(*draft_vocab_from_counts(token_counts(), self.config.draft_vocab_size))

    def set_draft_vocab(self, d2t: Tensor, t2d: Tensor) -> None:
        """Draft over the tokens of ``d2t`` (V' offsets) / ``t2d`` (V mask), warm-starting the
        lm_head rows from the target's."""
        check_vocab_maps(d2t, t2d, self.draft_vocab_size, self.spec.vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        self.target_to_draft = target_to_draft_index(self.t2d)
        self._warm_start_lm_head()

    def _warm_start_lm_head(self) -> None:
        vocab = self.draft_to_target(torch.arange(self.draft_vocab_size, device=self.d2t.device))
        self.lm_head.weight.data.copy_(self.target_lm_head[vocab.to(self.target_lm_head.device)].float())

    def _vocabulary_loaded(self, incompatible_keys: Any) -> None:
        # A loaded d2t / t2d replaces the placeholder: check it and re-derive the inverse map.
        check_vocab_maps(self.d2t, self.t2d, self.draft_vocab_size, self.spec.vocab_size)
        self.target_to_draft = target_to_draft_index(self.t2d)

    @property
    def draft_vocab_size(self) -> int:
        return self.d2t.numel()

    @property
    def target_taps(self) -> tuple[int, ...]:
        return tuple(self.spec.aux_layer_ids)

    def initial_features(self, hidden: Tensor, aux: Tensor | None) -> Tensor:
        if aux is None:
            raise ValueError("EAGLE-3 reads the target's aux layers: enable datamodule.aux_layers")
        return self.fc(aux)

    def attention_inputs(self, features: Tensor, token_ids: Tensor) -> tuple[Tensor, Tensor]:
        embedded = self.embed(token_ids).to(features.dtype)
        attention_input = torch.cat([self.input_layernorm(embedded), self.hidden_norm(features)], dim=-1)
        return attention_input, features

    def logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.norm(hidden))

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocabulary ids -> target ids."""
        return draft_ids + self.d2t[draft_ids]

    def shortlist_weight(self, target_ids: Tensor) -> Tensor:
        raise ValueError(
            f"head {self.kind} drafts over its own vocabulary: vocab_shortlist applies to heads that "
            "draft through the target's lm_head"
        )

    def vocab_projection(self, outputs: Tensor) -> VocabProjection:
        if self.draft_vocab_size == self.spec.vocab_size:
            return VocabProjection(self.norm(outputs), self.lm_head.weight)
        vocab = self.draft_to_target(torch.arange(self.draft_vocab_size, device=self.d2t.device))
        return VocabProjection(self.norm(outputs), self.lm_head.weight, vocab, self.target_to_draft)
