"""benchmarks/gpu_check.sh and bench_gpu: refused clearly without CUDA; the harness itself runs on the CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
def test_gpu_check_says_why_and_exits_3_without_cuda():
    out = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True,
                         env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 3
    assert "no CUDA device visible to torch" in out.stderr and "nothing checked" in out.stderr


def test_bench_gpu_measures_cold_warm_and_hot_on_the_cpu_harness(tmp_path, ray_cluster):
    # On the session's cluster (`--address`), as a second driver: starting one of its own is what a GPU
    # check does, and most of what this check would cost.
    report = tmp_path / "gpu.md"
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_gpu", "--device", "cpu", "--preset", "tiny", "--dtype", "float32",
         "--repeats", "1", "--prompt-tokens", "16", "--cache-dir", str(tmp_path), "--out", str(report),
         "--address", ray_cluster.get_runtime_context().gcs_address],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {line.split("|")[1].strip() for line in report.read_text().splitlines() if line.startswith("| ")}
    assert {"cold", "warm", "hot"} <= rows
