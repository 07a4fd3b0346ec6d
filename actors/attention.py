"""Attention over a forward's segments: each sequence (or batch row) attends to its own KV cache only.

A forward's tokens may belong to several independent sequences (the rows of a batch,
`Transformer.forward_rows`): the projections run once over all of them, and attention
runs per `Segment`, against that segment's cache and span.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from actors.kv_cache import KVCache
from actors.layers import Linear, RMSNorm
from actors.rope import apply_rope
from weights_tool.architecture import ModelConfig


@dataclass(frozen=True)
class AttentionSpan:
    """What every layer's attention reads in one forward: keys at cached positions [start, end), masked so."""

    start: int
    end: int
    mask: torch.Tensor | None  # [S, T] bool, True where query i may attend to key j; None: all of them
    is_causal: bool  # queries and keys are the same positions: SDPA's built-in causal mask


@dataclass(frozen=True)
class Segment:
    """One sequence's tokens inside a forward: [offset, offset + length) of the flattened tokens.

    `caches` holds one KVCache per layer (None: no cache, the chunk attends to itself).
    """

    offset: int
    length: int
    input_pos: torch.Tensor  # [length] positions of these tokens in their own sequence
    span: AttentionSpan
    caches: Sequence[KVCache] | None


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_proj = Linear(h, self.num_heads * d, bias=config.has_qkv_bias, dtype=dtype)
        self.k_proj = Linear(h, self.num_kv_heads * d, bias=config.has_qkv_bias, dtype=dtype)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias=config.has_qkv_bias, dtype=dtype)
        self.o_proj = Linear(self.num_heads * d, h, bias=config.has_o_bias, dtype=dtype)
        # Qwen3: RMSNorm over head_dim of each q and k head, before RoPE.
        self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype) if config.has_qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype) if config.has_qk_norm else None
        self.is_gqa = self.num_heads != self.num_kv_heads

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], segments: Sequence[Segment], layer: int
    ) -> torch.Tensor:
        # x: [B, S, hidden]
        bsz, seq_len, _ = x.shape
        q = self.q_proj(x).view(bsz, seq_len, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(bsz, seq_len, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(bsz, seq_len, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # q: [B, H, S, D]; k, v: [B, H_kv, S, D]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if len(segments) == 1:
            y = self._attend(q, k, v, segments[0], layer)
        else:  # rows of a batch: each attends to its own cache only
            y = torch.cat([self._attend(*(t[:, :, s.offset : s.offset + s.length] for t in (q, k, v)), s, layer)
                           for s in segments], dim=2)
        return self.o_proj(y.transpose(1, 2).reshape(bsz, seq_len, self.num_heads * self.head_dim))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segment, layer: int) -> torch.Tensor:
        # q: [B, H, n, D]; k, v: [B, H_kv, n, D], this segment's tokens
        if seg.caches is not None:
            k_all, v_all = seg.caches[layer].update(seg.input_pos, k, v)
            # k, v: [B, H_kv, T, D], the cached positions this chunk may attend to.
            k, v = k_all[:, :, seg.span.start : seg.span.end], v_all[:, :, seg.span.start : seg.span.end]
        if self.is_gqa and q.shape[2] == 1 and seg.span.mask is None:
            # One query sees every key of its span: each KV head's G query heads become G
            # queries of one head ([B, H, 1, D] -> [B, H_kv, G, D]), the same attention with no
            # K/V expansion. CPU SDPA with enable_gqa is ~8x slower in bf16 (batch.md).
            bsz, _, _, d = q.shape
            grouped = q.view(bsz, self.num_kv_heads, self.num_heads // self.num_kv_heads, d)
            return F.scaled_dot_product_attention(grouped, k, v).view(bsz, self.num_heads, 1, d)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=seg.span.mask, is_causal=seg.span.is_causal, enable_gqa=self.is_gqa
        )
