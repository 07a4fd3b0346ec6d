"""A bf16 linear layer for CPUs with AVX512-BF16: the weight read once, at the memory's speed, for any row count.

A decode step is mostly linear layers over a few rows, so its speed is how fast the weights
stream from memory. oneDNN's packed linear (packed_weights.py) streams them at 38-40% of the
single core's read bandwidth for one or two rows (benchmarks/results/bf16_linear.md). This
kernel (csrc/bf16_linear.cpp) lays each weight out as pairs of input features for 16 output
columns, `[N/16, K/2, 16]` int32, so that one VDPBF16PS adds two features' products into 16
columns' fp32 sums: the weight is read once and in order, each row of `x` is a broadcast, and
no horizontal sum is needed.

Sums are fp32 (the bias added to them) and each output is rounded to bf16 once, as `F.linear` does, but in
another order: outputs differ from `F.linear`'s by rounding only (tests/runtime/test_bf16_linear.py).
eager plain (`actor.is_weight_packed: false`) stays the parity reference.

The kernel is built with the others of actors/cpu_kernels.py; where it is not available (no
AVX512-BF16, or no build), packing falls back to oneDNN's layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from actors import cpu_kernels

COLUMNS = 16  # output columns per block: one AVX-512 register of fp32 sums


def is_packable(weight: torch.Tensor) -> bool:
    """A 2-D bf16 CPU weight with an even number of input features."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[1] % 2 == 0)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] bf16 -> [ceil(N/16), K/2, 16] int32: element [b, p, j] holds W[16b + j, 2p : 2p + 2]."""
    if not is_packable(weight):
        raise ValueError(f"a bf16 CPU weight [N, K] with K even is needed, got {weight.dtype} {list(weight.shape)} "
                         f"on {weight.device}")
    n, k = weight.shape
    n_padded = -(-n // COLUMNS) * COLUMNS
    # numpy's copies, not torch's: packing runs beside the stepping thread, and torch would split a copy this
    # large over an OpenMP team of the packing thread's own, which slows every later step (actors/threads.py).
    w = weight.detach().contiguous().view(torch.int16).numpy()  # the bf16 bits: [N, K]
    if n != n_padded:
        w = np.concatenate([w, np.zeros((n_padded - n, k), dtype=np.int16)])
    # [N/16, 16, K/2, 2] -> [N/16, K/2, 16, 2]: each input pair of 16 columns side by side.
    pairs = np.ascontiguousarray(w.reshape(n_padded // COLUMNS, COLUMNS, k // 2, 2).transpose(0, 2, 1, 3))
    return torch.from_numpy(pairs).view(torch.int32).view(n_padded // COLUMNS, k // 2, COLUMNS)


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] bf16 @ W.T (+ bias) with W packed by `pack`: [..., out_features]."""
    ext = cpu_kernels.extension()
    if ext is None:
        raise RuntimeError("the bf16 linear kernel is not available on this machine (cpu_kernels.is_available())")
    rows = x.reshape(-1, x.shape[-1])
    y = ext.bf16_linear(rows if rows.is_contiguous() else rows.contiguous(), packed, out_features, bias)
    return y.view(*x.shape[:-1], out_features)


def rows_of(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` [...] of the weight `packed` holds, as bf16 [..., K]: a tied head's table read as embeddings."""
    # Row t is column t % 16 of block t // 16, two features per int32: the same bf16 values.
    return packed[index // COLUMNS, :, index % COLUMNS].view(torch.bfloat16)  # [..., K/2] int32 -> [..., K]


@dataclass(frozen=True)
class Fused:
    """Projections of one input packed side by side (attention's q, k, v; the MLP's gate, up): one kernel call
    reads all their weights, where separate calls would each pay Python's and the thread pool's overhead
    (a decode step's k and v projections are 0.2 MB each). Each output column is summed exactly as alone."""

    packed: torch.Tensor  # [sum(sizes)/16, K/2, 16], the members' packs one after another
    sizes: tuple[int, ...]  # each member's out_features, a multiple of 16
    bias: torch.Tensor | None  # [sum(sizes)], or None where no member has one
    kernel: Callable = linear  # this module's `linear`, or bf16_weight_linear's for its layout

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [..., K] -> one view [..., size] per member, in order."""
        return self.joined(x).split(self.sizes, dim=-1)

    def joined(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., sum(sizes)]: the members' outputs side by side, contiguous."""
        return self.kernel(x, self.packed, sum(self.sizes), self.bias)


def fuse(packs: Sequence[torch.Tensor], sizes: Sequence[int], biases: Sequence[torch.Tensor | None],
         kernel: Callable = linear) -> Fused | None:
    """Packed weights of one input joined into a `Fused`, or None where they cannot be: a member whose
    out_features is not a multiple of 16 (its padded block would sit between two members' columns), or
    biases on some members only. Any layout whose blocks of 16 columns run along its first dimension joins so
    (bf16_weight_linear.py's too, with its `kernel`)."""
    if any(n % COLUMNS for n in sizes) or len({b is None for b in biases}) > 1:
        return None
    bias = None if biases[0] is None else torch.cat(list(biases))
    joined = torch.from_numpy(np.concatenate([p.numpy() for p in packs]))  # numpy's copy, as in `pack`
    return Fused(joined, tuple(sizes), bias, kernel)
