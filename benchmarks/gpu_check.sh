#!/usr/bin/env bash
# The GPU paths in one run on one GPU, within 8 minutes: tests/gpu, then hot / warm / cold TTFT
# for the llama-3.2-1b shape on CUDA (benchmarks/bench_gpu.py), written to benchmarks/results/gpu.md
# with the test summary appended. Exits 3 at once, saying why, where torch sees no CUDA device.
#
#   bash benchmarks/gpu_check.sh            # PYTHON=... picks another interpreter (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
OUT=${OUT:-benchmarks/results/gpu.md}

if ! torch_version=$("$PYTHON" -c 'import sys, torch; print(torch.__version__); sys.exit(0 if torch.cuda.is_available() else 1)'); then
    echo "gpu_check: no CUDA device visible to torch $torch_version; nothing checked" >&2
    exit 3
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

tests_log=$(mktemp)
set +e
timeout 240 "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$tests_log"
tests_rc=${PIPESTATUS[0]}
timeout 270 "$PYTHON" -m benchmarks.bench_gpu --out "$OUT"
bench_rc=$?
set -e
{
    echo
    echo "## tests/gpu"
    echo
    echo "\`$PYTHON -m pytest -q tests/gpu\` exited $tests_rc:"
    echo
    echo '```'
    tail -n 15 "$tests_log"
    echo '```'
} >> "$OUT"
rm -f "$tests_log"
echo "gpu_check: tests/gpu exit $tests_rc, bench_gpu exit $bench_rc; report in $OUT"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
