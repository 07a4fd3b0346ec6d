"""An fp32 linear layer over bf16 weights, for CPUs with AVX2 but no bf16 arithmetic: half the bytes a step reads.

Such a CPU computes a bf16 file in fp32 (compute_dtype.py), since torch's bf16 kernels there
convert every operand inside each matmul and run several times slower. Widened, the weights
take twice their file's memory, and a decode step, which streams every weight once for a few
rows, takes twice as long as their bytes need. This kernel (csrc/bf16_weight_linear.cpp) keeps
the weights as bf16 and widens them in registers: a bf16 value is the top half of its fp32, so
one 256-bit load of 16 columns and two unpacks with zeros give two ymm of fp32 weights.

Layout: W [N, K] -> [ceil(N/16), K, 16] int16, input feature k's 16 output columns side by side, in
the order the unpacks need (`LANE_ORDER`). Its products and fp32 sums are exactly those of the
widened weight, in another order than `F.linear`'s: outputs differ by rounding only
(tests/runtime/test_bf16_weight_linear.py). Only weights whose every value is a bf16 (a widened bf16
file) are packed: narrowing them is exact.

Built with the AVX2 kernels of actors/cpu_kernels.py; where they are not available, fp32 stays plain.
"""

from __future__ import annotations

import numpy as np
import torch

from actors import cpu_kernels

COLUMNS = 16  # output columns per block: two AVX2 registers of fp32 sums
# Memory position p of a block holds column LANE_ORDER[p]: VPUNPCKLWD takes positions 0-3 and 8-11 (columns
# 0-7), VPUNPCKHWD positions 4-7 and 12-15 (columns 8-15).
LANE_ORDER = (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)
# Where column j sits within its block: the inverse of LANE_ORDER (a tensor: embedding lookups index it every step).
POSITION = torch.tensor([LANE_ORDER.index(j) for j in range(COLUMNS)])


def is_packable(weight: torch.Tensor) -> bool:
    """A 2-D fp32 CPU weight whose every value is a bf16 (its low 16 bits zero): narrowing it loses nothing."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2 or weight.numel() == 0:
        return False
    low = weight.detach().contiguous().view(torch.int32).numpy() & 0xFFFF
    return not low.any()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] fp32 holding bf16 values -> [ceil(N/16), K, 16] int16: [b, k, p] = bf16 of W[16b + LANE_ORDER[p], k]."""
    if not is_packable(weight):
        raise ValueError(f"an fp32 CPU weight [N, K] of bf16 values is needed, got {weight.dtype} "
                         f"{list(weight.shape)} on {weight.device}")
    n, k = weight.shape
    n_padded = -(-n // COLUMNS) * COLUMNS
    # numpy's copies, not torch's: packing runs beside the stepping thread (actors/threads.py, bf16_linear.pack).
    high = (weight.detach().contiguous().view(torch.int32).numpy() >> 16).astype(np.int16)  # [N, K] the bf16 bits
    if n != n_padded:
        high = np.concatenate([high, np.zeros((n_padded - n, k), dtype=np.int16)])
    # [N/16, 16, K] -> [N/16, K, 16], each block's columns in LANE_ORDER.
    blocks = high.reshape(n_padded // COLUMNS, COLUMNS, k)[:, list(LANE_ORDER)]
    return torch.from_numpy(np.ascontiguousarray(blocks.transpose(0, 2, 1)))


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp32 @ W.T (+ bias) with W packed by `pack`: [..., out_features] fp32."""
    ext = cpu_kernels.avx2_extension()
    if ext is None:
        raise RuntimeError("the bf16-weight linear kernel is not available on this machine "
                           "(cpu_kernels.avx2_extension())")
    rows = x.reshape(-1, x.shape[-1])
    y = ext.bf16_weight_linear(rows if rows.is_contiguous() else rows.contiguous(), packed, out_features, bias)
    return y.view(*x.shape[:-1], out_features)


def rows_of(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` [...] of the weight `packed` holds, as fp32 [..., K]: a tied head's table read as embeddings."""
    bits = packed[index // COLUMNS, :, POSITION.to(index.device)[index % COLUMNS]]  # [..., K] int16: the bf16 bits
    return (bits.to(torch.int32) << 16).view(torch.float32)
