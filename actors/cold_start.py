"""How many layers must be resident before a cold actor starts prefill.

A pure function: no Ray, no torch. The derivation, with L layers, every layer taking
`t_load` seconds to become resident (layers arrive in order, so layer i is resident at
(i + 1) * t_load) and `t_compute` seconds of prefill compute for this prompt:

  Prefill starts once N layers are resident, at N * t_load. Without stalls layer i's
  compute starts at N * t_load + i * t_compute; it must not start before layer i is
  resident, (i + 1) * t_load. So for every i in [0, L):

      N >= (i + 1) - i * t_compute / t_load

  If t_compute >= t_load the right side never exceeds 1: compute is slower than the
  stream and one layer is enough. Otherwise the right side grows with i and the last
  layer (i = L - 1) binds:

      N = ceil(L - (L - 1) * t_compute / t_load), clamped to [1, L].

Starting with fewer layers does not finish prefill earlier (the compute would wait on
the stream anyway); starting with more only delays it. N is the earliest start that
runs prefill end to end without waiting, which is when the device is held for the
shortest time for the same time to first token.

`t_compute` grows with the prompt: prefill FLOPs per layer are ~ 2 * params_per_layer
* prompt_tokens (plus attention, ~ 4 * S^2 * H * D, small at these prompt lengths), so
`estimate_prefill_layer_seconds` takes a measured compute rate in FLOP/s.
"""

from __future__ import annotations

import math


def choose_first_layers(num_layers: int, load_s_per_layer: float, compute_s_per_layer: float) -> int:
    """The number of layers to have resident before prefill starts (see the module doc)."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if load_s_per_layer < 0 or compute_s_per_layer < 0:
        raise ValueError("per-layer times must be non-negative")
    if load_s_per_layer == 0 or compute_s_per_layer >= load_s_per_layer:
        return 1
    ratio = compute_s_per_layer / load_s_per_layer
    # A tiny epsilon keeps float noise (e.g. 2.0000000001) from adding a whole layer.
    n = math.ceil(num_layers - (num_layers - 1) * ratio - 1e-9)
    return max(1, min(num_layers, n))


def estimate_prefill_layer_seconds(
    params_per_layer: int, num_heads: int, head_dim: int, prompt_tokens: int, flops_per_s: float
) -> float:
    """Seconds of prefill compute for one decoder layer over `prompt_tokens` tokens."""
    if flops_per_s <= 0:
        raise ValueError("flops_per_s must be positive")
    matmul = 2.0 * params_per_layer * prompt_tokens
    attention = 4.0 * prompt_tokens * prompt_tokens * num_heads * head_dim
    return (matmul + attention) / flops_per_s


def stall_seconds(num_layers: int, first_layers: int, load_s_per_layer: float, compute_s_per_layer: float) -> float:
    """Total time prefill would wait on the stream after starting with `first_layers` resident."""
    t = first_layers * load_s_per_layer
    stalled = 0.0
    for i in range(num_layers):
        ready = (i + 1) * load_s_per_layer
        if ready > t:
            stalled += ready - t
            t = ready
        t += compute_s_per_layer
    return stalled


def warm_layers(config, load_bytes_per_s: float, flops_per_s: float, prompt_tokens: int) -> int:
    """A warm actor's first layers: `choose_first_layers` for a typical prompt of `prompt_tokens`.

    `config` is a `weights_tool.architecture.ModelConfig` (duck-typed: no torch here); the
    load rate is the one assumed before a stream has measured its own.
    """
    if load_bytes_per_s <= 0:
        raise ValueError("load_bytes_per_s must be positive")
    shapes = config.layer_tensor_shapes(0)
    params_per_layer = sum(math.prod(shape) for shape in shapes.values())
    layer_bytes = config.weight_bytes() * params_per_layer / config.num_params()
    t_compute = estimate_prefill_layer_seconds(params_per_layer, config.num_heads, config.head_dim, prompt_tokens,
                                               flops_per_s)
    return choose_first_layers(config.num_layers, layer_bytes / load_bytes_per_s, t_compute)
