"""The static key/value cache of one attention layer.

Preallocated once per request at its final size (input tokens + max_tokens), so
decoding never allocates and memory use is known before the request starts —
which is what the router accounts for (`kv_cache_bytes`). New keys and values are
written with `index_copy_` at their positions; readers take the span they attend to (`span`).

`kv_dtype: int8` (actor config) stores each position's key and value heads in 8 bits: D int8 values and one
fp32 scale (absmax / 127, `quantize`) a position and head, about half of bf16's bytes. A decoding row's step
reads its whole cache, which is what bounds its attention (batch.md): the decode kernel
(csrc/decode_attention_i8.cpp) reads the 8-bit cache itself; every other reader gets its span dequantized to
the model's dtype. The buffer is one int8 tensor [B, H_kv, S, D + 4], S rounded up to a multiple of 16: each
head's S x D values, tiled for the kernel's instructions (`TILES`), then its S scales, so the kernels take it
where they take a bf16 cache.
"""

from __future__ import annotations

import torch

from weights_tool.architecture import KV_INT8_POSITION_MULTIPLE, ModelConfig
from weights_tool.architecture import KV_INT8_SCALE_BYTES as SCALE_BYTES
from weights_tool.dtypes import model_dtype

# How an 8-bit cache's values are tiled (csrc/decode_attention_i8.cpp): (positions, features) a tile, its
# positions' features side by side in it. Keys [S / 16][D / 4][16][4]: 4 features of 16 positions a 64-byte row,
# one VPDPBUSD against 4 of the query's; values [S / 2][D][2]: a feature's two positions a pair, one VPDPWSSD
# against their two weights.
TILES = {"k": (16, 4), "v": (2, 1)}


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> int8 values [..., D] and fp32 scales [...]: scale = absmax / 127 over D, values
    round(x / scale) (to nearest even), all 0 where x is. The bits decode_attention_i8.cpp's `quantize` writes."""
    xf = x.float()
    scale = xf.abs().amax(-1) / 127
    values = torch.round(xf / scale.unsqueeze(-1)).nan_to_num_(0.0).clamp_(-128, 127).to(torch.int8)
    return values, scale


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 values [..., D] times their scales [...], in `dtype`."""
    return (values.float() * scale.unsqueeze(-1)).to(dtype)


class KVCache:
    """Keys and values of one layer for `max_seq_len` positions.

    Deliberately not an `nn.Module`: the cache is per-request state, not part of
    the model's state dict, which must hold exactly the checkpoint's tensor names.
    """

    def __init__(
        self,
        batch_size: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        is_int8: bool = False,
    ) -> None:
        if min(batch_size, max_seq_len, num_kv_heads, head_dim) <= 0:
            raise ValueError(
                f"KVCache sizes must be positive, got batch_size={batch_size}, max_seq_len={max_seq_len}, "
                f"num_kv_heads={num_kv_heads}, head_dim={head_dim}"
            )
        width = head_dim + SCALE_BYTES if is_int8 else head_dim
        shape = (batch_size, num_kv_heads, allocated_positions(max_seq_len, is_int8), width)
        # k_cache, v_cache: [B, H_kv, max_seq_len, D] (or the int8 layout above); zeros so unread slots are harmless.
        self.k_cache = torch.zeros(shape, dtype=torch.int8 if is_int8 else dtype, device=device)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.dtype, self.is_int8, self.head_dim = dtype, is_int8, head_dim
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len

    @classmethod
    def over(cls, k_cache: torch.Tensor, v_cache: torch.Tensor) -> KVCache:
        """A cache over buffers someone else owns ([B, H_kv, max_seq_len, D] each): a slot of a compiled step's
        slab (actors/compiled_step.py), written and read like a cache of its own."""
        if k_cache.shape != v_cache.shape or k_cache.dim() != 4 or not k_cache.is_contiguous():
            raise ValueError(f"KVCache.over needs two contiguous [B, H_kv, S, D] buffers of one shape, got "
                             f"{list(k_cache.shape)} and {list(v_cache.shape)}")
        cache = cls.__new__(cls)
        cache.k_cache, cache.v_cache = k_cache, v_cache
        cache.dtype, cache.is_int8, cache.head_dim = k_cache.dtype, False, k_cache.shape[3]
        cache.batch_size, cache.max_seq_len = k_cache.shape[0], k_cache.shape[2]
        return cache

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v at `input_pos`. input_pos: [S] positions; k, v: [B, H_kv, S, D]."""
        if not self.is_int8:
            self.k_cache.index_copy_(2, input_pos, k)
            self.v_cache.index_copy_(2, input_pos, v)
            return
        for kind, cache, x in (("k", self.k_cache, k), ("v", self.v_cache, v)):
            values, scale = self._parts(kind, cache)
            q, s = quantize(x)  # q: [B, H_kv, n, D]
            positions, features = TILES[kind]
            values[:, :, input_pos // positions, input_pos % positions] = q.unflatten(-1, (-1, features))
            scale.index_copy_(2, input_pos, s)

    def span(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [start, end), [B, H_kv, end - start, D] each, in the model's dtype."""
        if not self.is_int8:
            return self.k_cache[:, :, start:end], self.v_cache[:, :, start:end]
        out = []
        for kind, cache in (("k", self.k_cache), ("v", self.v_cache)):
            values, scale = self._parts(kind, cache)
            positions = TILES[kind][0]
            first, last = start // positions, -(-end // positions)  # the tiles the span touches
            b, h = scale.shape[:2]
            values = values[:, :, first:last].reshape(b, h, (last - first) * positions, self.head_dim)  # a copy
            skip = start - first * positions
            out.append(dequantize(values[:, :, skip: skip + end - start], scale[:, :, start:end], self.dtype))
        return out[0], out[1]

    def _parts(self, kind: str, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An int8 buffer's values, [B, H_kv, S / P, P, D / F, F] for its tiles of P positions and F features (a
        view of the tiles in position order, written in place), and its scales [B, H_kv, S]."""
        b, h, s, d = cache.shape[0], cache.shape[1], cache.shape[2], self.head_dim
        positions, features = TILES[kind]
        block = cache.view(b, h, s * (d + SCALE_BYTES))
        tiles = block[..., : s * d].view(b, h, s // positions, d // features, positions, features)
        return tiles.transpose(3, 4), block[..., s * d :].view(torch.float32)

    def nbytes(self) -> int:
        return self.k_cache.nbytes + self.v_cache.nbytes


def kv_cache_bytes(
    config: ModelConfig, max_seq_len: int, dtype: torch.dtype | str, batch_size: int = 1, is_int8: bool = False
) -> int:
    """Bytes the caches of every layer take for `max_seq_len` positions — exactly what `setup_cache` allocates."""
    return config.kv_bytes_per_token(model_dtype(dtype), is_int8) * allocated_positions(max_seq_len, is_int8) * batch_size


def allocated_positions(max_seq_len: int, is_int8: bool) -> int:
    """The positions a cache for `max_seq_len` holds: an 8-bit one's rounded up to its kernel's blocks of keys."""
    m = KV_INT8_POSITION_MULTIPLE if is_int8 else 1
    return -(-max_seq_len // m) * m
