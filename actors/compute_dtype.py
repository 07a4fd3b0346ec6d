"""The dtype a model computes in, and widening 16-bit weights to fp32 in the memory they arrive in.

A CPU without native bf16 arithmetic (no AVX512-BF16 or AMX; AVX2-only parts) converts every
bf16 operand to fp32 inside each kernel, and torch's bf16 matmuls there run several times
slower than fp32 ones over the same weights (benchmarks/results/engine.md, SmolLM2-135M on such
a CPU: a 128-token prefill 6.3x, a decode step of 16 rows 2.6x; only a lone row is faster in
bf16, 0.78x, its bytes being half). On such a CPU the
server computes in fp32, at twice the weights' and KV cache's memory, which the ingress
accounts for (`ModelNumbers.from_config(config, dtype)`). GPUs compute the file's dtype.

Settings (`actor.compute_dtype`):

    auto      the file's dtype, except fp32 on a CPU without native arithmetic for it
    model     the file's dtype, always
    float32   fp32 wherever (a 16-bit file is widened: on CPU only)
    bfloat16 / float16   only for a file of that dtype (nothing is narrowed or converted between them)
"""

from __future__ import annotations

from weights_tool.dtypes import MODEL_DTYPES

COMPUTE_DTYPE_SETTINGS = ("auto", "model", *MODEL_DTYPES)


def check_setting(setting: str) -> None:
    """ValueError naming the settings unless `setting` is one of them."""
    if setting not in COMPUTE_DTYPE_SETTINGS:
        raise ValueError(f"compute_dtype must be one of {', '.join(COMPUTE_DTYPE_SETTINGS)}, got {setting!r}")


def resolve_compute_dtype(setting: str, file_dtype: str, device_type: str, *, is_cpu_native: bool) -> str:
    """The model dtype to build the model in; `is_cpu_native`: this CPU computes `file_dtype` natively.

    Pure: the caller probes the CPU (`cpu_computes_natively`) and says which device.
    """
    check_setting(setting)
    if setting == "model":
        return file_dtype
    if setting == "auto":
        is_widened = device_type == "cpu" and file_dtype != "float32" and not is_cpu_native
        return "float32" if is_widened else file_dtype
    if setting not in (file_dtype, "float32"):
        raise ValueError(f"compute_dtype {setting} cannot hold a {file_dtype} file's weights exactly; "
                         f"use 'model' or float32")
    if setting != file_dtype and device_type != "cpu":
        raise ValueError(f"compute_dtype {setting} differs from the file's {file_dtype}: widening is done on CPU "
                         f"only (a GPU computes the file's dtype natively)")
    return setting


def cpu_computes_natively(dtype: str) -> bool:
    """Whether this CPU has arithmetic for `dtype` (fp32 always; bf16: AVX512-BF16 or AMX; fp16: AMX-FP16)."""
    import torch  # here: the pure resolver above needs no torch

    if dtype == "float32":
        return True
    if dtype == "bfloat16":
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return torch.cpu._is_amx_fp16_supported()


def compute_dtype_for(setting: str, file_dtype: str, device_type: str) -> str:
    """`resolve_compute_dtype` with this machine's CPU probed."""
    is_native = device_type != "cpu" or cpu_computes_natively(file_dtype)
    return resolve_compute_dtype(setting, file_dtype, device_type, is_cpu_native=is_native)


def widen_in_place(t, stored) -> None:
    """Turn `t` (fp32, contiguous) whose first `t.numel()` 2-byte elements hold `stored` values into those values.

    The loader writes a 16-bit file's bytes into the leading half of each fp32 parameter
    (so the widened model needs no second copy of its weights). fp32 element i covers
    stored elements [2i, 2i + 2), so converting the range [s, e) overwrites stored
    elements [2s, 2e): disjoint from its sources [s, e) once 2s >= e, and above every
    source not yet read. So the top half goes first, then the top half of the rest, and so
    on; the last few thousand elements go through a copy.
    """
    import torch

    flat = t.view(-1)  # [N] fp32
    src = flat.view(torch.uint8)[: flat.numel() * stored.itemsize].view(stored)  # [N] the stored values
    end = flat.numel()
    while end > 4096:
        start = (end + 1) // 2
        flat[start:end].copy_(src[start:end])
        end = start
    flat[:end].copy_(src[:end].clone())
