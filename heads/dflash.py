"""DFlash (Chen et al., 2026, arXiv 2602.06036): a block drafter. One forward of a few decoder
layers fills a whole block of draft tokens.

A block anchored at position a holds the token x_a (the last committed token when decoding: the
target sampled it but has not run it) followed by ``block_size − 1`` copies of a mask token, at
rotary positions a, a+1, …; block position k (k ≥ 1) predicts x_{a+k}, read out through the
target's frozen lm_head. Inside the block attention is NOT causal: every block position sees every
other. Each draft layer's keys/values are the block's own plus a context: the target's features
at every position before a (strictly: x_a's features do not exist yet when decoding), the fusion
``ctx = hidden_norm(fc([aux taps]))`` of the target layers the head taps (EAGLE-3's taps: the same
caches), projected by that layer's own k/v projections. The context is NOT carried through the
draft layers: every layer reads the same fused features, so a committed position costs one fc
and a k/v projection per layer, once.

The layers are Qwen3's (input norm, q/k RMS norms per head, post-attention norm, SwiGLU MLP), as
in the reference code and the engines that load it (docs/architecture.md §3 "DFlash").

Training (:meth:`DFlashHead.training_predictions`) runs many blocks per sequence in one forward:
a random ``anchor_fraction`` of the supervised positions start a block, each block sees the
context before its own anchor, and block position k = step k predicts the target's next-token
distribution at a+k−1. The objective weights step k by ``step_weight_base^(k−1)``: the paper's
exponential decay exp(−(k−1)/γ) is base e^(−1/γ).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdraft.heads.frozen import TargetWeights
from specdraft.heads.interface import DraftHead, TrainingBatch, TrainingPredictions, supervised_mask
from specdraft.heads.layers import MLP, RMSNorm, apply_rotary, rotary_tables
from specdraft.heads.spec import TargetSpec
from specdraft.heads.vocab import VocabProjection

# Validation draws its anchors from a generator seeded with this, so every validation of a run
# scores the same blocks (training draws from the global generator).
VALIDATION_ANCHOR_SEED = 0


@dataclass(frozen=True)
class DFlashConfig:
    """DFlash. ``num_layers`` draft decoder layers; ``block_size`` tokens per block (the last
    committed token and ``block_size − 1`` drafts); ``mask_token_id`` the target token id whose
    (frozen) embedding fills the drafted block positions, None: the target's last vocabulary id;
    ``anchor_fraction`` (training only) the share of supervised positions that start a block in
    each sequence. No defaults here: conf/head/dflash.yaml sets them."""

    num_layers: int
    block_size: int
    mask_token_id: int | None
    anchor_fraction: float
    kind: str = "dflash"

    def __post_init__(self) -> None:
        if self.kind != "dflash":
            raise ValueError(f"DFlashConfig.kind must be 'dflash', got {self.kind!r}")
        if self.num_layers < 1 or self.block_size < 2:
            raise ValueError(f"DFlash needs num_layers >= 1 and block_size >= 2, got {self}")
        if not 0 < self.anchor_fraction <= 1:
            raise ValueError(f"DFlash anchor_fraction must be in (0, 1], got {self.anchor_fraction}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Blocks:
    """Blocks drafted in one forward, n per sequence of a batch of B.

    tokens     B×n×k  the anchor token then mask tokens (k = block_size)
    anchors    B×n    each block's anchor position a: its token sits at rotary position a + i
    context    B×n×T  bool, the context positions each block sees (those before its anchor)
    """

    tokens: Tensor
    anchors: Tensor
    context: Tensor

    @property
    def positions(self) -> Tensor:
        """B×n×k rotary positions."""
        offsets = torch.arange(self.tokens.shape[-1], device=self.anchors.device)
        return self.anchors.unsqueeze(-1) + offsets


def block_attention(
    query: Tensor,
    context_key: Tensor,
    context_value: Tensor,
    key: Tensor,
    value: Tensor,
    context: Tensor | None,
) -> Tensor:
    """Attention of every block position over its block (all of it: not causal) and the context
    its block sees. query B×h×n×k×d; context_key / _value B×kv×T×d; key / value B×kv×n×k×d (the
    block's own); context B×n×T bool or None (every block sees the whole context). kv divides h
    (grouped-query, as SDPA's ``enable_gqa`` pairs heads). Returns B×h×n×k×d.

    One softmax over the T context keys and the k block keys, written out rather than as one
    dense mask over the n·k block keys of every block: that mask's scores would be n times as
    many (a 2,048-token batch of 256 blocks of 16: 4,096 × 6,144 scores a head, against × 2,064).
    """
    batch, heads, n, k, d = query.shape
    kv = context_key.shape[1]
    grouped = query.reshape(batch, kv, heads // kv, n, k, d)
    scale = 1.0 / math.sqrt(d)
    context_scores = torch.einsum("bgmnid,bgtd->bgmnit", grouped, context_key) * scale
    if context is not None:
        hidden = ~context[:, None, None, :, None, :]  # B×1×1×n×1×T
        context_scores = context_scores.masked_fill(hidden, float("-inf"))
    block_scores = torch.einsum("bgmnid,bgnjd->bgmnij", grouped, key) * scale
    # The softmax in fp32 at least: bf16 scores over hundreds of keys lose the small probabilities.
    exact = torch.promote_types(query.dtype, torch.float32)
    probs = torch.cat([context_scores, block_scores], dim=-1).to(exact).softmax(-1).to(query.dtype)
    context_probs, block_probs = probs.split([context_key.shape[2], k], dim=-1)
    out = torch.einsum("bgmnit,bgtd->bgmnid", context_probs, context_value)
    out = out + torch.einsum("bgmnij,bgnjd->bgmnid", block_probs, value)
    return out.reshape(batch, heads, n, k, d)


class BlockAttention(nn.Module):
    """Qwen3's grouped-query attention (RMS norms on each head's queries and keys, before the
    rotary embedding) over a block and its context (:func:`block_attention`)."""

    def __init__(self, spec: TargetSpec) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            spec.num_attention_heads,
            spec.num_kv_heads,
            spec.head_dim,
        )
        hidden = spec.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps)
        cos, sin = rotary_tables(spec)
        self.register_buffer("rotary_cos", cos, persistent=False)
        self.register_buffer("rotary_sin", sin, persistent=False)

    def _rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """x B×heads×L×d at rotary positions B×L."""
        cos = self.rotary_cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.rotary_sin[positions].unsqueeze(1).to(x.dtype)
        return apply_rotary(x, cos, sin)

    def keys_values(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The rotated keys and the values B×kv×L×d of inputs x B×L×H at positions B×L."""
        batch, length, _ = x.shape
        key = self.k_norm(self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim))
        value = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        return self._rotate(key.transpose(1, 2), positions), value.transpose(1, 2)

    def forward(
        self, x: Tensor, positions: Tensor, context_key: Tensor, context_value: Tensor, context: Tensor | None
    ) -> Tensor:
        """x B×n×k×H (n blocks of k), positions B×n×k, the context's keys/values B×kv×T×d (from
        :meth:`keys_values` of the fused target features), context B×n×T bool or None.
        Returns B×n×k×H."""
        batch, n, k, _ = x.shape
        flat_positions = positions.reshape(batch, n * k)
        query = self.q_proj(x).view(batch, n * k, self.num_heads, self.head_dim)
        query = self._rotate(self.q_norm(query).transpose(1, 2), flat_positions)
        key, value = self.keys_values(x.reshape(batch, n * k, -1), flat_positions)
        out = block_attention(
            query.reshape(batch, self.num_heads, n, k, self.head_dim),
            context_key,
            context_value,
            key.reshape(batch, self.num_kv_heads, n, k, self.head_dim),
            value.reshape(batch, self.num_kv_heads, n, k, self.head_dim),
            context,
        )
        return self.o_proj(out.permute(0, 2, 3, 1, 4).reshape(batch, n, k, -1))


class BlockDecoderLayer(nn.Module):
    """A Qwen3 decoder layer whose attention also reads a context's keys/values."""

    def __init__(self, spec: TargetSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = BlockAttention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec.hidden_size, spec.intermediate_size)

    def forward(
        self, x: Tensor, positions: Tensor, context_kv: tuple[Tensor, Tensor], context: Tensor | None
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, *context_kv, context)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashHead(DraftHead):
    """DFlash: ``num_layers`` block decoder layers over the fused target taps. Drafts with
    ``specdraft.eval.block_drafter.BlockDrafter``."""

    kind = "dflash"
    config_class = DFlashConfig

    def __init__(self, spec: TargetSpec, weights: TargetWeights, config: DFlashConfig) -> None:
        super().__init__(spec, weights)
        if not spec.aux_layer_ids:
            raise ValueError(f"DFlash needs target aux layers; target {spec.name} has aux_layer_ids=()")
        mask_token_id = spec.vocab_size - 1 if config.mask_token_id is None else config.mask_token_id
        if not 0 <= mask_token_id < spec.vocab_size:
            raise ValueError(
                f"DFlash mask_token_id={mask_token_id} is not a token of the target's "
                f"{spec.vocab_size}-token vocabulary"
            )
        self.config = replace(config, mask_token_id=mask_token_id)  # resolved: checkpoints record it
        hidden = spec.hidden_size
        self.register_buffer("target_embedding", weights.embedding, persistent=False)
        self.embedding_scale = weights.embedding_scale  # the target's (Gemma: √H)
        self.fc = nn.Linear(len(spec.aux_layer_ids) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, spec.rms_norm_eps)
        self.layers = nn.ModuleList(BlockDecoderLayer(spec) for _ in range(config.num_layers))
        # Its own final norm, initialised to ones as the reference's is, NOT to the target's: with a
        # tied lm_head the target's norm scales each mask/anchor embedding's readout of itself into
        # logits so large (step CE ~37 at init) that the step-1 accuracy learned in 150 steps fell
        # from 0.055 to 0.018 (docs/architecture.md §3 "DFlash").
        self.norm = RMSNorm(hidden, spec.rms_norm_eps)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    @property
    def target_taps(self) -> tuple[int, ...]:
        return tuple(self.spec.aux_layer_ids)

    @property
    def parallel_steps(self) -> int:
        """Block positions 1..block_size−1, all drafted (and trained) at once."""
        return self.block_size - 1

    # -- the computation, shared by training and drafting ---------------------------------------
    def context_features(self, aux: Tensor) -> Tensor:
        """The fused target features B×T×H of the aux taps B×T×(k·H)."""
        return self.hidden_norm(self.fc(aux))

    def context_keys_values(self, features: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Every layer's context keys and values (B×kv×T×d each) of fused features B×T×H at
        positions B×T."""
        return [layer.self_attn.keys_values(features, positions) for layer in self.layers]

    def block_tokens(self, anchor_tokens: Tensor) -> Tensor:
        """...×k: each anchor token followed by ``block_size − 1`` mask tokens."""
        masks = torch.full(
            (*anchor_tokens.shape, self.block_size - 1), self.mask_token_id, device=anchor_tokens.device
        )
        return torch.cat([anchor_tokens.unsqueeze(-1), masks], dim=-1)

    def block_outputs(
        self, blocks: Blocks, context_kv: list[tuple[Tensor, Tensor]], dtype: torch.dtype
    ) -> Tensor:
        """The last layer's outputs B×n×k×H (before the final norm) of ``blocks`` over each
        layer's context keys/values."""
        x = F.embedding(blocks.tokens, self.target_embedding)
        x = (x if self.embedding_scale == 1.0 else x * self.embedding_scale).to(dtype)
        positions = blocks.positions
        for layer, kv in zip(self.layers, context_kv, strict=True):
            x = layer(x, positions, kv, blocks.context)
        return x

    def logits(self, outputs: Tensor) -> Tensor:
        """Draft logits ...×V of block outputs ...×H."""
        return self.target_logits(self.norm(outputs))

    def vocab_projection(self, outputs: Tensor) -> VocabProjection:
        return VocabProjection(self.norm(outputs), self.target_lm_head)

    # -- training ------------------------------------------------------------------------------
    def sample_anchors(self, batch: TrainingBatch) -> tuple[Tensor, Tensor]:
        """(anchors B×n, kept B×n bool): a random ``anchor_fraction`` of each sequence's anchor
        candidates (positions a whose next token x_{a+1} is supervised, so a block's first draft
        is), at least one, sorted; rows with fewer fill up with not-kept anchors at 0. Drawn from
        a generator seeded with the batch's ``seed`` when training (the global one without), from
        one seeded with :data:`VALIDATION_ANCHOR_SEED` otherwise: every validation scores the
        same blocks, and a resumed run trains on the blocks an uninterrupted one would."""
        candidates = supervised_mask(batch)
        counts = candidates.sum(1)
        wanted = torch.where(counts > 0, (counts * self.config.anchor_fraction).ceil().long().clamp(min=1), 0)
        width = max(int(wanted.max()), 1)
        seed = VALIDATION_ANCHOR_SEED if not self.training else getattr(batch, "seed", None)
        generator = None if seed is None else torch.Generator(candidates.device).manual_seed(seed)
        scores = torch.rand(candidates.shape, generator=generator, device=candidates.device)
        order = scores.masked_fill(~candidates, 2.0).argsort(dim=1)[:, :width]  # chosen first
        kept = torch.arange(width, device=order.device) < wanted.unsqueeze(1)
        anchors = torch.where(kept, order, candidates.shape[1])
        anchors, _ = anchors.sort(dim=1)
        kept = anchors < candidates.shape[1]
        return anchors.masked_fill(~kept, 0), kept

    def training_predictions(self, batch: TrainingBatch, steps: int, detach: bool) -> TrainingPredictions:
        """Blocks at :meth:`sample_anchors`' anchors. Step j (block position j, j = 1..k−1) of
        the block at a predicts x_{a+j}: the target's distribution at q = a+j−1, so each step has
        its own positions (S×N, N = B·n). Valid where the block is kept and q is supervised.
        ``steps`` and ``detach`` do not apply: the block positions are drafted together."""
        if batch.aux is None:
            raise ValueError("DFlash reads the target's aux layers: enable datamodule.aux_layers")
        rows, length = batch.input_ids.shape
        anchors, kept = self.sample_anchors(batch)
        features = self.context_features(batch.aux)
        every = torch.arange(length, device=anchors.device)
        context_kv = self.context_keys_values(features, every.expand(rows, length))
        blocks = Blocks(
            tokens=self.block_tokens(batch.input_ids.gather(1, anchors)),
            anchors=anchors,
            context=every < anchors.unsqueeze(-1),
        )
        outputs = self.block_outputs(blocks, context_kv, features.dtype)  # B×n×k×H
        steps_ahead = torch.arange(1, self.block_size, device=anchors.device)  # j = 1..k−1
        positions = anchors.unsqueeze(0) + (steps_ahead - 1).view(-1, 1, 1)  # S×B×n: q = a+j−1
        supervised = supervised_mask(batch)
        # Past the end: clamped to the last position, whose next token is never supervised.
        positions = positions.clamp(max=length - 1)
        row = torch.arange(rows, device=anchors.device).view(1, -1, 1).expand_as(positions)
        valid = kept.unsqueeze(0) & supervised[row, positions]
        steps_total = self.block_size - 1
        predicted = outputs[:, :, 1:].permute(2, 0, 1, 3).reshape(steps_total, -1, outputs.shape[-1])
        return TrainingPredictions(
            row.reshape(steps_total, -1),
            positions.reshape(steps_total, -1),
            predicted,
            valid.reshape(steps_total, -1),
            predicts_features=False,
        )
