"""Llama building blocks for draft heads, written against the TargetSpec (no transformers).

The attention takes its keys/values from the caller-supplied past plus the current tokens and an
ADDITIVE mask (0 = attend, −inf = masked). One code path serves full-sequence training, the
multi-step rollout (past = the K/V of earlier rollout levels) and decoding (past = the KV cache).
"""

from __future__ import annotations

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
        mask: Tensor | None,
        past_key: Tensor | None = None,
        past_value: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x B×n×input_size, positions B×n, mask (additive, broadcastable to B×1×n×(P+n); None:
        causal over the n tokens, no past — the fused kernel skips masked blocks, ~1.7× faster
        forward + backward than the same mask spelled out), past_key/past_value
        B×kv_heads×P×d (already rotated).

        Returns (output B×n×H, key, value of the n new tokens: B×kv_heads×n×d)."""
        batch, n, _ = x.shape
        q = self.q_proj(x).view(batch, n, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos = self.rotary_cos[positions].unsqueeze(1).to(x.dtype)  # B×1×n×d
        sin = self.rotary_sin[positions].unsqueeze(1).to(x.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        keys = k if past_key is None else torch.cat([past_key, k], dim=2)
        values = v if past_value is None else torch.cat([past_value, v], dim=2)
        if mask is None and past_key is not None:
            raise ValueError("mask=None means causal over the new tokens: it takes no past")
        out = F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=None if mask is None else mask.to(q.dtype),
            is_causal=mask is None,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, n, -1)), k, v


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
        mask: Tensor | None,
        past_key: Tensor | None = None,
        past_value: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Returns (output B×n×H, new key, new value); see :meth:`Attention.forward`."""
        attended, key, value = self.self_attn(attention_input, positions, mask, past_key, past_value)
        hidden = residual + attended
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, key, value


def causal_mask(length: int, device: torch.device | str | None = None, past: int = 0) -> Tensor:
    """Additive mask n×(past+n): query i attends keys ≤ past + i."""
    keys = torch.arange(past + length, device=device)
    queries = torch.arange(length, device=device).unsqueeze(-1) + past
    return torch.zeros(length, past + length, device=device).masked_fill(keys > queries, float("-inf"))
