"""Attention over a forward's segments: each sequence (or batch row) attends to its own KV cache only.

A forward's tokens may belong to several independent sequences (the rows of a batch,
`Transformer.forward_rows`): the projections run once over all of them, and attention
runs per `Segment`, against that segment's cache and span. Where the actors' CPU kernels pack the
weights (packed_weights.py: bf16 on AVX512-BF16, fp32 over bf16 weights on AVX2), they also switch this
on (`batch_decode_attention`): the rows that decode (one token each) attend in one call per layer
(csrc/decode_attention.cpp for bf16 rows, decode_attention_f32.cpp for fp32 ones: each row's new key and
value written to its own cache, its query over its span, all in C++), and only the prompt
chunks go through SDPA one by one. Where every token of a step decodes and q, k, v are packed as one
(bf16_linear.Fused), a layer's attention is two kernel calls: the joined projection, then RoPE, the
cache writes and attention together, with none of the views, copies and RoPE ops between them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from actors import cpu_kernels
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


def decode_kernel(dtype: torch.dtype):
    """The loaded kernel that attends decoding rows of `dtype`, or None: bf16 on AVX512-BF16, fp32 on AVX2."""
    if (ext := cpu_kernels.loaded_for(dtype)) is None:
        return None
    return ext.decode_attention if dtype == torch.bfloat16 else ext.decode_attention_f32


def is_int8_served(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the decode kernel reads 8-bit caches (kv_cache.py) for rows of `dtype` with heads of `head_dim` on this
    CPU (csrc/decode_attention_i8.cpp: bf16 rows, AVX512-VNNI, head_dim a multiple of 16 up to 128)."""
    return dtype == torch.bfloat16 and cpu_kernels.is_cpu_supported() and head_dim <= 128 and head_dim % 16 == 0


def decodes_alone(segment: Segment) -> bool:
    """One token against the segment's own one-row cache, seeing its whole span: what the decode kernel computes."""
    return (segment.length == 1 and segment.caches is not None and segment.span.mask is None
            and segment.caches[0].batch_size == 1)


def batch_decode_attention(model: nn.Module, enabled: bool = True) -> None:
    """Let (or stop) every attention layer of `model` attend its decoding rows in one kernel call a step."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.is_decode_batched = enabled


class Attention(nn.Module):
    is_decode_batched = False  # batch_decode_attention: the kernel for rows that decode, where it is loaded
    fused_in = None  # bf16_linear.Fused of q, k, v, once packed_weights installs it: one kernel call

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
        decoding = self._decoding(x, segments, layer)
        if len(decoding) == seq_len and self.fused_in is not None and self.q_norm is None:
            # Every token is a row's one decoding token: the projections in one kernel call, then RoPE, the
            # cache writes and attention in another; y: [R, H, D].
            y = decode_kernel(x.dtype)(self.fused_in.joined(x[0]), self.num_heads, self.num_kv_heads,
                                        *self._rows(segments, layer), *rope)
            return self.o_proj(y.view(bsz, seq_len, self.num_heads * self.head_dim))
        q, k, v = self.fused_in(x) if self.fused_in is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q = q.view(bsz, seq_len, self.num_heads, self.head_dim)
        k = k.view(bsz, seq_len, self.num_kv_heads, self.head_dim)
        v = v.view(bsz, seq_len, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # q: [B, H, S, D]; k, v: [B, H_kv, S, D]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if decoding:
            y = self._attend_decoding(q, k, v, segments, decoding, layer)
        elif len(segments) == 1:
            y = self._attend(q, k, v, segments[0], layer)
        else:  # rows of a batch: each attends to its own cache only
            y = torch.cat([self._attend(*(t[:, :, s.offset : s.offset + s.length] for t in (q, k, v)), s, layer)
                           for s in segments], dim=2)
        return self.o_proj(y.transpose(1, 2).reshape(bsz, seq_len, self.num_heads * self.head_dim))

    def _decoding(self, x: torch.Tensor, segments: Sequence[Segment], layer: int) -> list[int]:
        """The segments that decode one token against a one-row cache, where a kernel for `x`'s dtype runs here."""
        if not self.is_decode_batched or x.device.type != "cpu" or x.shape[0] != 1 or self.head_dim % 16:
            return []
        if decode_kernel(x.dtype) is None:  # loaded by packing: a step never loads (or builds) them
            return []
        decoding = [i for i, s in enumerate(segments) if decodes_alone(s)]
        if decoding and not self.kernel_reads(x.dtype, segments[decoding[0]].caches[layer]):
            return []  # 8-bit caches the kernel does not read here: their spans dequantized, through SDPA
        return decoding

    def kernel_reads(self, dtype: torch.dtype, cache: KVCache) -> bool:
        """Whether the decode kernel for rows of `dtype` reads caches like `cache` (an engine's are all alike)."""
        return not cache.is_int8 or is_int8_served(dtype, self.head_dim)

    def _attend_decoding(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Sequence[Segment],
                         decoding: list[int], layer: int) -> torch.Tensor:
        """Every decoding segment in one kernel call, the others through `_attend`; y: [1, H, T, D]."""
        # q: [1, H, T, D]; k, v: [1, H_kv, T, D]. The decoding rows' tokens: [R] of T.
        rows = [segments[i] for i in decoding]
        if len(rows) == q.shape[2]:  # every token decodes: no gather
            heads = (t[0].transpose(0, 1) for t in (q, k, v))  # [R, H(_kv), D]
        else:
            index = torch.tensor([s.offset for s in rows], device=q.device)
            heads = (t[0].index_select(1, index).transpose(0, 1) for t in (q, k, v))
        qkv = torch.cat([t.reshape(len(rows), -1) for t in heads], dim=1)  # [R, (H + 2 H_kv) D], roped
        out = decode_kernel(q.dtype)(qkv, self.num_heads, self.num_kv_heads, *self._rows(rows, layer))  # [R, H, D]
        if len(rows) == len(segments):
            return out.transpose(0, 1).unsqueeze(0)  # [1, H, R, D]: the tokens in order
        parts, j = [], 0
        for i, s in enumerate(segments):
            if j < len(decoding) and decoding[j] == i:
                parts.append(out[j].unsqueeze(1).unsqueeze(0))  # [1, H, 1, D]
                j += 1
            else:
                parts.append(self._attend(*(t[:, :, s.offset: s.offset + s.length] for t in (q, k, v)), s, layer))
        return torch.cat(parts, dim=2)

    @staticmethod
    def _rows(rows: Sequence[Segment], layer: int) -> tuple[list, list, list[int], list[int]]:
        """The decode kernel's per-row arguments: K caches, V caches, each new key's position, each span's start."""
        caches = [s.caches[layer] for s in rows]
        return ([c.k_cache for c in caches], [c.v_cache for c in caches], [s.span.end - 1 for s in rows],
                [s.span.start for s in rows])

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segment, layer: int) -> torch.Tensor:
        # q: [B, H, n, D]; k, v: [B, H_kv, n, D], this segment's tokens
        if seg.caches is not None:
            seg.caches[layer].update(seg.input_pos, k, v)
            # k, v: [B, H_kv, T, D], the cached positions this chunk may attend to.
            k, v = seg.caches[layer].span(seg.span.start, seg.span.end)
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
