"""The model's building blocks beside attention: a linear layer whose CPU kernel is chosen by speed, RMSNorm, and
the MLP's activation on the actors' kernel."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from actors import bf16_linear, bf16_weight_linear, cpu_kernels


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except for a single bf16 row on the CPU (decode at batch 1) where gemv is faster.

    Which kernel streams a bf16 weight fastest for one row depends on the CPU: where
    oneDNN has no native bf16 GEMM, torch's gemv (`mv`) streams the weight faster than
    F.linear; where it has one, the GEMM is faster (benchmarks/results/batch.md, "The
    runtime's CPU kernel choices": 90 µs against gemv's 133 on that machine).
    `_is_gemv_faster` times both once per process on the first such weight and keeps the
    answer. Both accumulate in fp32.
    """
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.numel() == x.shape[-1] and _is_gemv_faster(weight):
        y = torch.mv(weight, x.reshape(-1))
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], -1)
    return F.linear(x, weight, bias)


_gemv_choice: list[bool] = []  # decided once per process


def _is_gemv_faster(weight: torch.Tensor) -> bool:
    if not _gemv_choice:
        x = torch.zeros(weight.shape[1], dtype=weight.dtype)
        rows = x.view(1, -1)

        def best_of(run) -> float:
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
            return min(times)

        _gemv_choice.append(best_of(lambda: torch.mv(weight, x)) < best_of(lambda: F.linear(rows, weight)))
    return _gemv_choice[0]


def warm_up_kernels(params: dict[str, torch.Tensor]) -> None:
    """Make the once-per-process kernel choice on a resident layer's weights, ahead of a request."""
    for weight in params.values():
        if weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu":
            with torch.no_grad():
                _is_gemv_faster(weight.detach())
            return


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T + bias with W packed in oneDNN's layout (actors/packed_weights.py); x: [..., in] -> [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear (same parameter names) through `linear`, created uninitialised.

    Once `actors/packed_weights.py` installs a packed copy of the weight, it computes with that.
    """

    packed_weight: torch.Tensor | None = None  # the plain `weight` is then empty
    # The layout of `packed_weight`: "onednn", "bf16_linear" (bf16_linear.py) or "bf16_weights" (bf16_weight_linear.py).
    packed_kernel: str = "onednn"

    def reset_parameters(self) -> None:
        """Leave the weights as allocated: a loader or `init_weights` writes them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            if self.packed_kernel == "bf16_linear":
                return bf16_linear.linear(x, self.packed_weight, self.out_features, self.bias)
            if self.packed_kernel == "bf16_weights":
                return bf16_weight_linear.linear(x, self.packed_weight, self.out_features, self.bias)
            return packed_linear(x, self.packed_weight, self.bias)
        return linear(x, self.weight, self.bias)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] bf16, the MLP's gate and up side by side -> silu(gate) * up [..., I] in one pass of the
    actors' kernel (csrc/silu_mul.cpp), loaded wherever bf16_linear's weights are packed."""
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    y = cpu_kernels.extension().silu_mul(rows.contiguous())  # no copy where it already is
    return y.view(*gate_up.shape[:-1], y.shape[-1])


def fuse_rms_norms(model: nn.Module, enabled: bool = True) -> None:
    """Let (or stop) every RMSNorm of `model` normalise its rows in one kernel call where the actors' kernels are
    loaded: bf16 rows on AVX512-BF16 (csrc/rms_norm.cpp), fp32 rows on AVX2 (csrc/rms_norm_f32.cpp)."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.is_fused = enabled


class RMSNorm(nn.Module):
    is_fused = False  # fuse_rms_norms: rows through the actors' kernel, where it is loaded

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            if self.is_fused and x.is_contiguous() and x.device.type == "cpu" and (ext := cpu_kernels.avx2_loaded()):
                return ext.rms_norm_f32(x, self.weight, self.eps)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # As HF: normalise in fp32, cast back, then scale in the model dtype (the kernel too, in one pass).
        if self.is_fused and x.is_contiguous() and x.device.type == "cpu" and (ext := cpu_kernels.loaded()):
            return ext.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight
