"""Every decoder layer of a decode-only step in one C++ call: the step without Python between its kernels.

A step in which every row decodes one token (the common step of a running batch) is, per layer, ~12 kernel
and ATen calls on a few rows. From Python each paid the interpreter's and nn.Module's overhead: SmolLM2's
one-row step took 11.4 ms through the layers one by one, 9.3 ms in one call, in one rotation on a 2-core
AVX512-BF16 CPU (benchmarks/results/engine_avx512bf16.md as of commit f55a7a1; 15.2 against 11.8 ms on a busier day). `DecodeLayers` (csrc/decode_layers.h) makes the same calls in the same order from
C++ (the same kernels, the same ATen ops, the same bits as the layers' own forward), so only the embedding, the
final norm, the head and sampling stay in Python.

It serves a model packed for one of the actors' own kernels (packed_weights.py: "bf16_linear", bf16 rows on
AVX512-BF16; "bf16_weights", fp32 rows over bf16 weights on AVX2) whose every layer has q, k, v and gate, up
joined, its RMSNorms and decode attention through the kernels, and no QK-norm; any other step (a prompt chunk
in it, a cold actor's weights still arriving) runs the layers one by one, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from actors import bf16_linear, bf16_weight_linear, cpu_kernels
from actors.attention import Attention, Segment, decodes_alone


def build(model):
    """The kernel's `DecodeLayers` for `model` (a Transformer, packed and installed), or None where it does not
    serve it (see the module docstring). Cheap: it holds references to the packed tensors, copies nothing."""
    ext, layers = cpu_kernels.loaded_for(model.dtype), model.model.layers
    if ext is None or model.device.type != "cpu" or not len(layers):
        return None
    layout, layout_linear = _LAYOUTS[model.dtype]
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.o_proj, mlp.down_proj)
        if (attn.fused_in is None or mlp.fused_in is None or attn.q_norm is not None or not attn.is_decode_batched
                or attn.head_dim % 16 or not layer.input_layernorm.is_fused
                or not layer.post_attention_layernorm.is_fused
                or any(m.packed_weight is None or m.packed_kernel != layout for m in linears)
                or any(f.kernel is not layout_linear for f in (attn.fused_in, mlp.fused_in))):
            return None
    c = model.config
    return ext.DecodeLayers(
        [layer.input_layernorm.weight for layer in layers], [layer.post_attention_layernorm.weight for layer in layers],
        [layer.self_attn.fused_in.packed for layer in layers], [layer.self_attn.fused_in.bias for layer in layers],
        [layer.self_attn.o_proj.packed_weight for layer in layers], [layer.self_attn.o_proj.bias for layer in layers],
        [layer.mlp.fused_in.packed for layer in layers], [layer.mlp.fused_in.bias for layer in layers],
        [layer.mlp.down_proj.packed_weight for layer in layers], [layer.mlp.down_proj.bias for layer in layers],
        c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.intermediate_size,
        model.model.layers[0].input_layernorm.eps)


# The packed layout each rows' dtype's extension reads (Linear.packed_kernel) and that layout's `linear`
# (bf16_linear.Fused.kernel): bf16 rows on AVX512-BF16, fp32 rows over bf16 weights on AVX2.
_LAYOUTS = {torch.bfloat16: ("bf16_linear", bf16_linear.linear), torch.float32: ("bf16_weights", bf16_weight_linear.linear)}


def takes(x: torch.Tensor, segments: Sequence[Segment], attention: Attention) -> bool:
    """Every token of the step is a row's one decoding token against its own one-row cache, seeing its whole span,
    in caches the kernel reads (`attention`: the first layer's): the step `DecodeLayers.run` computes (as
    Attention._decoding's kernel path, for every segment)."""
    return (x.shape[0] == 1 and len(segments) == x.shape[1] and all(decodes_alone(s) for s in segments)
            and attention.kernel_reads(x.dtype, segments[0].caches[0]))


def forward(decode_layers, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
            segments: Sequence[Segment]) -> torch.Tensor:
    """x [1, R, hidden] after every layer, one decoding token a segment (`takes`); rope: each row's cos, signed
    sin [R, D]."""
    caches = [s.caches for s in segments]
    k_caches = [[row[layer].k_cache for row in caches] for layer in range(decode_layers.num_layers)]
    v_caches = [[row[layer].v_cache for row in caches] for layer in range(decode_layers.num_layers)]
    pos, start = [s.span.end - 1 for s in segments], [s.span.start for s in segments]
    return decode_layers.run(x[0].contiguous(), k_caches, v_caches, pos, start, *rope).unsqueeze(0)
