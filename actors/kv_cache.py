"""The static key/value cache of one attention layer.

Preallocated once per request at its final size (input tokens + max_tokens), so
decoding never allocates and memory use is known before the request starts —
which is what the router accounts for (`kv_cache_bytes`). New keys and values are
written with `index_copy_` at their positions; readers slice the filled prefix.
"""

from __future__ import annotations

import torch

from weights_tool.architecture import ModelConfig
from weights_tool.dtypes import model_dtype


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
    ) -> None:
        if min(batch_size, max_seq_len, num_kv_heads, head_dim) <= 0:
            raise ValueError(
                f"KVCache sizes must be positive, got batch_size={batch_size}, max_seq_len={max_seq_len}, "
                f"num_kv_heads={num_kv_heads}, head_dim={head_dim}"
            )
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        # k_cache, v_cache: [B, H_kv, max_seq_len, D]; zeros so unread slots are harmless numbers.
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
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
        cache.batch_size, cache.max_seq_len = k_cache.shape[0], k_cache.shape[2]
        return cache

    def update(
        self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v at `input_pos` and return the whole buffers.

        input_pos: [S] positions; k, v: [B, H_kv, S, D]. Returns k_all, v_all:
        [B, H_kv, max_seq_len, D]; positions this sequence has not written yet hold
        zeros or an earlier sequence's values, so the caller slices or masks them out.
        """
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        return self.k_cache, self.v_cache

    def nbytes(self) -> int:
        return self.k_cache.nbytes + self.v_cache.nbytes


def kv_cache_bytes(
    config: ModelConfig, max_seq_len: int, dtype: torch.dtype | str, batch_size: int = 1
) -> int:
    """Bytes the caches of every layer take for `max_seq_len` positions — exactly what `setup_cache` allocates."""
    return config.kv_bytes_per_token(model_dtype(dtype)) * max_seq_len * batch_size
