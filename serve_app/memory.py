"""A request's memory need, derived from the model's sizes (design invariant 3).

Stdlib only, like the policy: `request_features` turns a model's numbers, a request's
prompt length and its sampling settings into the `RequestFeatures` that `decide()` accounts with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from actors.sampling_params import SamplingParams  # torch-free, as the policy modules must be
from serve_app.policy import PolicyConfig
from serve_app.snapshot import RequestFeatures
from weights_tool.architecture import KV_INT8_POSITION_MULTIPLE


@dataclass(frozen=True)
class ModelNumbers:
    """The sizes of a model the accounting needs; `from_config` takes a `ModelConfig`."""

    weight_bytes: int
    kv_bytes_per_token: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype_bytes: int
    # The most bytes a row's cache takes beyond kv_bytes_per_token x its tokens: an 8-bit cache rounds its positions
    # up to a multiple of KV_INT8_POSITION_MULTIPLE (actors/kv_cache.py); counted with the request's workspace.
    kv_pad_bytes: int = 0

    @classmethod
    def from_config(cls, config: Any, dtype: str | None = None, is_kv_int8: bool = False) -> ModelNumbers:
        """From a `weights_tool.architecture.ModelConfig` (duck-typed: policy imports no model code).

        `dtype`: the one the actors compute in (actors/compute_dtype.py); None: the file's. `is_kv_int8`: the
        actors keep 8-bit KV caches (`kv_dtype: int8`).
        """
        kv_per_token = config.kv_bytes_per_token(dtype)
        return cls(
            weight_bytes=config.weight_bytes(dtype),
            kv_bytes_per_token=config.kv_bytes_per_token(dtype, is_kv_int8),
            kv_pad_bytes=(KV_INT8_POSITION_MULTIPLE - 1) * config.kv_bytes_per_token(dtype, True) if is_kv_int8 else 0,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            vocab_size=config.vocab_size,
            # kv per token = 2 * layers * kv_heads * head_dim * dtype bytes.
            dtype_bytes=kv_per_token // (2 * config.num_layers * config.num_kv_heads * config.head_dim),
        )


def workspace_bytes(m: ModelNumbers, input_tokens: int) -> int:
    """Peak transient memory of prefilling `input_tokens` at batch 1 (actors/model.py's forward).

    With S = input_tokens, b = dtype bytes, and one layer's activations alive at a time:
      attention: x, normed x [S, h]; q, k, v, their RoPE'd copies and the SDPA output and
                 its reshaped copy [S, H*D] / [S, H_kv*D]; o_proj output [S, h]
                 -> b * S * (3h + 4*H*D + 3*H_kv*D)
      MLP:       x, h, normed h, down output [S, h]; silu(gate), up, their product [S, I]
                 -> b * S * (4h + 3I)
      mask:      [S, S] bool -> S^2
      RoPE:      cos, sin [S, D] in the model dtype, built from fp32 [S, D] -> S * D * (2b + 8)
      sampling:  last-position logits [V] in the model dtype, fp32 copy, softmax, sort values
                 and int64 indices, cumsum -> V * (b + 32)
    The [H, S, S] score matrix is not counted: CUDA's memory-efficient SDPA kernel (the
    one chosen with a boolean mask) computes attention in tiles. Decode is prefill with S=1.
    """
    s, b, h = input_tokens, m.dtype_bytes, m.hidden_size
    attention = b * s * (3 * h + 4 * m.num_heads * m.head_dim + 3 * m.num_kv_heads * m.head_dim)
    mlp = b * s * (4 * h + 3 * m.intermediate_size)
    return max(attention, mlp) + s * s + s * m.head_dim * (2 * b + 8) + m.vocab_size * (b + 32) + m.kv_pad_bytes


def request_features(
    model: str,
    numbers: ModelNumbers,
    input_tokens: int,
    sampling: SamplingParams,
    policy: PolicyConfig,
    *,
    ttft_target_s: float | None = None,
    total_target_s: float | None = None,
    tpot_target_s: float | None = None,
) -> RequestFeatures:
    """The features of one request, with its memory need derived from the model's sizes.

    `sampling` is the request's own `SamplingParams`, so its max_tokens and the settings the
    scorer reads come from the one object the actor runs with. The targets are keyword-only:
    three optional floats in a row are easy to pass in the wrong order.
    """
    # SamplingParams has already checked max_tokens >= 1; only the prompt length is left to check.
    if input_tokens < 1:
        raise ValueError(f"input_tokens must be >= 1, got {input_tokens}")
    return RequestFeatures(
        model=model,
        input_tokens=input_tokens,
        max_tokens=sampling.max_tokens,
        weight_bytes=numbers.weight_bytes,
        kv_bytes_per_token=numbers.kv_bytes_per_token,
        workspace_bytes=workspace_bytes(numbers, input_tokens),
        actor_overhead_bytes=policy.actor_overhead_bytes,
        ttft_target_s=ttft_target_s,
        total_target_s=total_target_s,
        tpot_target_s=tpot_target_s,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
    )
