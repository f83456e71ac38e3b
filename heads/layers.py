"""Llama building blocks for draft heads, written against the TargetSpec (no transformers).

The attention takes its keys/values from the caller-supplied past plus the current tokens and an
ADDITIVE mask (0 = attend, −inf = masked). One code path serves full-sequence training, the
multi-step rollout (past = the K/V of earlier rollout levels) and decoding (past = the KV cache).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdraft.heads.spec import TargetSpec


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32, as Llama does, then return in the input dtype.
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight.to(x.dtype)


def rope_inverse_frequencies(spec: TargetSpec) -> Tensor:
    """Inverse rotary frequencies (head_dim/2,) of the target's rotary embedding.

    Only the plain ("default") rotary type is implemented: a head whose target scales its rotary
    embedding (Llama-3.1 "llama3", "yarn", …) must not silently train with the wrong positions.
    """
    params = dict(spec.rope_parameters)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise NotImplementedError(
            f"target {spec.name}: rope_parameters.rope_type={rope_type!r} is not implemented by the draft "
            "heads (only 'default')"
        )
    theta = float(params.get("rope_theta", 10000.0))
    exponents = torch.arange(0, spec.head_dim, 2, dtype=torch.float64) / spec.head_dim
    return (1.0 / theta**exponents).float()


def rotary_tables(spec: TargetSpec) -> tuple[Tensor, Tensor]:
    """cos, sin (max_position_embeddings × head_dim, fp32) of Llama's rotary angles, built once
    per module so that a step looks its positions up instead of recomputing them."""
    positions = torch.arange(spec.max_position_embeddings, dtype=torch.float32)
    angles = positions[:, None] * rope_inverse_frequencies(spec)  # P×d/2
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (B×heads×n×d) by angles whose cos/sin are B×1×n×d, Llama's half-split
    convention."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


@dataclass(frozen=True)
class AlignedMask:
    """The attention pattern of multi-step rollout step ``levels`` (:mod:`specdraft.heads.rollout`),
    given by its structure rather than as a dense T×(levels·T) tensor. Keys are laid out
    level-major ([l·T, (l+1)·T) holds level l+1) and query p attends

    * the level-1 keys at q ≤ p − (levels − 1) (causal, shifted), and
    * of each level l = 2..levels, the one key at p − (levels − l).

    ``levels=1`` is plain causal attention. :func:`aligned_attention` computes it without
    materialising the scores of masked keys where it can."""

    levels: int

    def __post_init__(self) -> None:
        if self.levels < 1:
            raise ValueError(f"AlignedMask needs levels >= 1, got {self.levels}")

    def dense(self, length: int, device: torch.device | str | None = None) -> Tensor:
        """The additive mask (0 / −inf) T×(levels·T) of this pattern over ``length`` queries."""
        queries = torch.arange(length, device=device).unsqueeze(-1)  # p
        keys = torch.arange(length, device=device)  # q
        allowed = [keys <= queries - (self.levels - 1)]
        allowed += [keys == queries - (self.levels - level) for level in range(2, self.levels + 1)]
        allowed = torch.cat(allowed, dim=-1)
        return torch.zeros(allowed.shape, device=device).masked_fill(~allowed, float("-inf"))


# (device type, dtype) where SDPA's grouped-query kernel (``enable_gqa``) is slow for a few query
# tokens, so :func:`stacked_query_attention` runs them instead. SmolLM2's shapes (9 query heads on 3
# key/value heads, d = 64), 2 threads, torch 2.13, a 2-core AVX-512-bf16 EPYC, bf16, under a mask:
# one token 121 / 238 µs against 27 / 42 at 256 / 512 keys, 2 and 4 tokens 47 and 47 / 63 and 81
# against 32 and 45 / 50 and 67, 8 and more about equal (64 / 111 against 66 / 116 for 8). In fp32
# enable_gqa is as fast or faster (one token: 20 against 26 µs at 300 keys).
SLOW_GROUPED_QUERY_KERNEL = frozenset({("cpu", torch.bfloat16)})
STACKED_QUERY_TOKENS = 4  # at most this many queries stacked: a draft step's few


def stacked_query_attention(
    query: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, scale: float | None = None
) -> Tensor:
    """Grouped-query attention with the query heads that share a key/value head stacked as rows
    of that head (``groups·n`` rows: row g·n + i is group member g, token i), so that no key or
    value is copied per query head. query B×h×n×d, keys / values B×kv×L×d (query head h reads
    key/value head h // (h / kv), as SDPA's ``enable_gqa`` pairs them), mask None (every query
    sees every key) or additive / bool, shared by the heads: broadcastable to B×1×n×L (tiled over
    the stacked rows). Returns B×h×n×d."""
    batch, heads, n, dim = query.shape
    groups = heads // keys.shape[1]
    rows = query.reshape(batch, keys.shape[1], groups * n, dim)
    if mask is not None:
        mask = mask if mask.dim() == 4 else mask.reshape(-1, 1, mask.shape[-2], mask.shape[-1])
        if n > 1:  # one token's mask row broadcasts over its rows as it is
            mask = torch.cat([mask] * groups, dim=2)  # 3× faster than .repeat here
    out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(batch, heads, n, dim)


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def aligned_attention(query: Tensor, keys: Tensor, values: Tensor, levels: int) -> Tensor:
    """Attention of ``query`` B×h×T×d over ``keys`` / ``values`` B×kv×(levels·T)×d (kv divides h,
    grouped as SDPA's ``enable_gqa``) under :class:`AlignedMask` (``levels``); returns B×h×T×d.

    The level-1 part is causal attention (shifted by levels − 1), which SDPA's fused causal kernel
    computes without touching masked blocks; each later level adds ONE key per query, a dot
    product. The two are merged exactly through their log-sum-exps, as blockwise attention merges
    blocks (:class:`_AlignedAttention`). A dense masked SDPA over T×(levels·T) scores cost 2.2–3.1×
    a causal one at T=1746 on the AVX2 EPYC, forward + backward. The merge needs the fused kernel's
    log-sum-exp, which only the CPU kernel exposes: elsewhere the dense mask is used.
    """
    length, gqa = query.shape[2], keys.shape[1] != query.shape[1]
    if levels == 1:
        return F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=gqa)
    if query.device.type != "cpu" or _CPU_FLASH is None or _CPU_FLASH_BACKWARD is None:
        mask = AlignedMask(levels).dense(length, query.device).to(query.dtype)
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=gqa)
    groups = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    shift = levels - 1

    def diagonal(x: Tensor) -> Tensor:
        """B×h×T×(levels−1)×d: for query p, the key (value) at p − (levels − l) of level l."""
        per_level = []
        for level in range(2, levels + 1):
            kept = max(length - (levels - level), 0)  # queries that have a key this far back
            start = (level - 1) * length
            per_level.append(F.pad(x[:, :, start : start + kept], (0, 0, length - kept, 0)))
        return torch.stack(per_level, dim=3)

    positions = torch.arange(length, device=query.device).unsqueeze(-1)
    diagonal_valid = positions >= torch.arange(shift - 1, -1, -1, device=query.device)  # T×(levels−1)
    level1 = max(length - shift, 0)  # level-1 keys any query attends
    return _AlignedAttention.apply(
        query,
        keys[:, :, :level1],
        values[:, :, :level1],
        diagonal(keys),
        diagonal(values),
        diagonal_valid,
        shift,
    )


class _AlignedAttention(torch.autograd.Function):
    """softmax over [shifted-causal level-1 keys ∪ one diagonal key per later level], merged by
    log-sum-exp. The backward of the level-1 part is the fused kernel's own, called with the MERGED
    output and log-sum-exp: its probabilities exp(s − lse) and its row term rowsum(dO·O) are then
    those of the whole softmax, so its gradients are exact; the diagonal keys' are written out."""

    @staticmethod
    def forward(ctx, query, level1_key, level1_value, diagonal_key, diagonal_value, diagonal_valid, shift):
        # The merge is computed in fp32 (fp64 for fp64 inputs) whatever autocast would choose.
        with torch.autocast(query.device.type, enabled=False):
            return _AlignedAttention._forward(
                ctx, query, level1_key, level1_value, diagonal_key, diagonal_value, diagonal_valid, shift
            )

    @staticmethod
    def _forward(ctx, query, level1_key, level1_value, diagonal_key, diagonal_value, diagonal_valid, shift):
        batch, heads, length, head_dim = query.shape
        scale = 1.0 / math.sqrt(head_dim)
        exact = torch.float64 if query.dtype == torch.float64 else torch.float32
        level1_out = torch.zeros(query.shape, dtype=exact, device=query.device)
        level1_lse = torch.full((batch, heads, length), float("-inf"), dtype=exact, device=query.device)
        if length > shift:  # queries p ≥ shift have level-1 keys: causal over q ≤ p − shift
            out, lse = _CPU_FLASH(query[:, :, shift:], level1_key, level1_value, 0.0, True, scale=scale)
            level1_out[:, :, shift:], level1_lse[:, :, shift:] = out, lse
        scores = torch.einsum("bhtd,bhtld->bhtl", query.to(exact), diagonal_key.to(exact)) * scale
        scores = scores.masked_fill(~diagonal_valid, float("-inf"))
        lse = torch.logaddexp(level1_lse, scores.logsumexp(-1))
        diagonal_probs = (scores - lse.unsqueeze(-1)).exp()
        merged = (level1_lse - lse).exp().unsqueeze(-1) * level1_out
        merged = merged + torch.einsum("bhtl,bhtld->bhtd", diagonal_probs, diagonal_value.to(exact))
        merged = merged.to(query.dtype)
        ctx.save_for_backward(query, level1_key, level1_value, diagonal_key, diagonal_value, merged, lse)
        ctx.diagonal_probs, ctx.shift, ctx.scale = diagonal_probs, shift, scale
        return merged

    @staticmethod
    def backward(ctx, grad_out):
        with torch.autocast(grad_out.device.type, enabled=False):
            return _AlignedAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        query, level1_key, level1_value, diagonal_key, diagonal_value, merged, lse = ctx.saved_tensors
        probs, shift, scale = ctx.diagonal_probs, ctx.shift, ctx.scale
        exact = probs.dtype
        grad_out = grad_out.contiguous()
        grad_query = torch.zeros(query.shape, dtype=exact, device=query.device)
        grad_key, grad_value = torch.zeros_like(level1_key), torch.zeros_like(level1_value)
        if query.shape[2] > shift:
            level1_grad_query, grad_key, grad_value = _CPU_FLASH_BACKWARD(
                grad_out[:, :, shift:],
                query[:, :, shift:],
                level1_key,
                level1_value,
                merged[:, :, shift:],
                lse[:, :, shift:],
                0.0,
                True,
                scale=scale,
            )
            grad_query[:, :, shift:] = level1_grad_query
        grad_exact = grad_out.to(exact)
        row = (grad_exact * merged.to(exact)).sum(-1, keepdim=True)  # rowsum(dO·O)
        grad_scores = probs * (torch.einsum("bhtd,bhtld->bhtl", grad_exact, diagonal_value.to(exact)) - row)
        grad_query += scale * torch.einsum("bhtl,bhtld->bhtd", grad_scores, diagonal_key.to(exact))
        grad_diagonal_key = scale * grad_scores.unsqueeze(-1) * query.to(exact).unsqueeze(3)
        grad_diagonal_value = probs.unsqueeze(-1) * grad_exact.unsqueeze(3)
        return (
            grad_query.to(query.dtype),
            grad_key,
            grad_value,
            grad_diagonal_key.to(diagonal_key.dtype),
            grad_diagonal_value.to(diagonal_value.dtype),
            None,
            None,
        )


class Attention(nn.Module):
    """Grouped-query self-attention whose q/k/v read ``input_size`` features (H, or 2H for EAGLE-3)."""

    def __init__(self, spec: TargetSpec, input_size: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            spec.num_attention_heads,
            spec.num_kv_heads,
            spec.head_dim,
        )
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, spec.hidden_size, bias=False)
        cos, sin = rotary_tables(spec)
        self.register_buffer("rotary_cos", cos, persistent=False)
        self.register_buffer("rotary_sin", sin, persistent=False)

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        mask: Tensor | AlignedMask | None,
        past_key: Tensor | None = None,
        past_value: Tensor | None = None,
        cache_index: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x B×n×input_size, positions B×n, mask (additive, broadcastable to B×1×n×(P+n); None:
        causal over the n tokens, no past — the fused kernel skips masked blocks, ~1.7× faster
        forward + backward than the same mask spelled out; an :class:`AlignedMask` over a past of
        levels − 1 earlier levels of n keys each), past_key/past_value B×kv_heads×P×d (already
        rotated).

        ``cache_index`` (n, decoding): past_key/past_value are a preallocated KV cache of C
        entries; the n new keys/values are written into it at those entries and the attention
        reads the cache alone (mask broadcastable to B×1×n×C), so no step copies the cache.

        Returns (output B×n×H, key, value of the n new tokens: B×kv_heads×n×d)."""
        batch, n, _ = x.shape
        q = self.q_proj(x).view(batch, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos = self.rotary_cos[positions].unsqueeze(1).to(x.dtype)  # B×1×n×d
        sin = self.rotary_sin[positions].unsqueeze(1).to(x.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache_index is not None:
            past_key.index_copy_(2, cache_index, k)
            past_value.index_copy_(2, cache_index, v)
            keys, values = past_key, past_value
        else:
            keys = k if past_key is None else torch.cat([past_key, k], dim=2)
            values = v if past_value is None else torch.cat([past_value, v], dim=2)
        if mask is None and past_key is not None:
            raise ValueError("mask=None means causal over the new tokens: it takes no past")
        if isinstance(mask, AlignedMask):
            if keys.shape[2] != mask.levels * n:
                raise ValueError(
                    f"an AlignedMask of {mask.levels} levels over {keys.shape[2]} keys for {n} queries"
                )
            out = aligned_attention(q, keys, values, mask.levels)
        elif self._stacks(q, mask):  # a draft step's few tokens under a mask
            out = stacked_query_attention(q, keys, values, mask.to(q.dtype))
        else:
            out = F.scaled_dot_product_attention(
                q,
                keys,
                values,
                attn_mask=None if mask is None else mask.to(q.dtype),
                is_causal=mask is None,
                enable_gqa=self.num_kv_heads != self.num_heads,
            )
        return self.o_proj(out.transpose(1, 2).reshape(batch, n, -1)), k, v

    def _stacks(self, query: Tensor, mask: Tensor | None) -> bool:
        """Whether :func:`stacked_query_attention` runs these queries: grouped heads, at most
        :data:`STACKED_QUERY_TOKENS` of them under a mask shared by the heads, where SDPA's
        grouped-query kernel is slow."""
        return (
            mask is not None
            and self.num_kv_heads != self.num_heads
            and query.shape[2] <= STACKED_QUERY_TOKENS
            and (mask.dim() < 4 or mask.shape[1] == 1)
            and (query.device.type, query.dtype) in SLOW_GROUPED_QUERY_KERNEL
        )


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftDecoderLayer(nn.Module):
    """A Llama decoder layer WITHOUT an input norm (EAGLE's layer 0): the caller normalises (or not)
    the attention input itself and passes the residual stream separately, which is what lets
    EAGLE-3 attend over ``[norm(emb); norm(g)]`` (2H) while its residual is ``g`` (H)."""

    def __init__(self, spec: TargetSpec, attention_input_size: int) -> None:
        super().__init__()
        self.self_attn = Attention(spec, attention_input_size)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec.hidden_size, spec.intermediate_size)

    def forward(
        self,
        attention_input: Tensor,
        residual: Tensor,
        positions: Tensor,
        mask: Tensor | AlignedMask | None,
        past_key: Tensor | None = None,
        past_value: Tensor | None = None,
        cache_index: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Returns (output B×n×H, new key, new value); see :meth:`Attention.forward`."""
        attended, key, value = self.self_attn(
            attention_input, positions, mask, past_key, past_value, cache_index
        )
        hidden = residual + attended
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, key, value


def causal_mask(length: int, device: torch.device | str | None = None, past: int = 0) -> Tensor:
    """Additive mask n×(past+n): query i attends keys ≤ past + i."""
    keys = torch.arange(past + length, device=device)
    queries = torch.arange(length, device=device).unsqueeze(-1) + past
    return torch.zeros(length, past + length, device=device).masked_fill(keys > queries, float("-inf"))
