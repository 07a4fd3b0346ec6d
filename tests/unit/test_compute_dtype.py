"""Which dtype a model computes in: the file's, or fp32 on a CPU that lacks the file's arithmetic."""

from __future__ import annotations

import pytest

from actors.compute_dtype import resolve_compute_dtype


@pytest.mark.parametrize(
    ("setting", "file", "device", "is_native", "expected"),
    [
        ("auto", "bfloat16", "cpu", False, "float32"),  # AVX2-only: bf16 matmuls are emulated
        ("auto", "bfloat16", "cpu", True, "bfloat16"),
        ("auto", "float16", "cpu", False, "float32"),
        ("auto", "float32", "cpu", False, "float32"),
        ("auto", "bfloat16", "cuda", False, "bfloat16"),  # a GPU computes the file's dtype
        ("model", "bfloat16", "cpu", False, "bfloat16"),
        ("float32", "bfloat16", "cpu", True, "float32"),
        ("bfloat16", "bfloat16", "cuda", True, "bfloat16"),
    ],
)
def test_resolution(setting, file, device, is_native, expected):
    assert resolve_compute_dtype(setting, file, device, is_cpu_native=is_native) == expected


@pytest.mark.parametrize(
    ("setting", "file", "device", "match"),
    [
        ("fp32", "bfloat16", "cpu", "one of auto, model"),
        ("bfloat16", "float32", "cpu", "cannot hold"),  # never narrowed
        ("float16", "bfloat16", "cpu", "cannot hold"),  # nor converted between 16-bit kinds
        ("float32", "bfloat16", "cuda", "CPU only"),
    ],
)
def test_refused_settings_say_why(setting, file, device, match):
    with pytest.raises(ValueError, match=match):
        resolve_compute_dtype(setting, file, device, is_cpu_native=False)
