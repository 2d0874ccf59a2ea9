#!/usr/bin/env bash
# One device call: GPU facts, the cuda op tests, then the kernel benchmarks.
# Usage on the device machine (from the repo root): bash bench/device_run.sh [bench args...]
# Logs land in $OUT (the device tool brings them back), or in /tmp/cyllm_out.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cyllm_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=src
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -P -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)" 2>&1 | tee "$OUT/env.log"
timeout ${TEST_TIMEOUT:-300} python3 -P -m pytest -q -p no:cacheprovider --noconftest -rfE --tb=short -m cuda tests/test_cuda_ops.py 2>&1 | tee "$OUT/test.log" | tail -n 40
timeout ${BENCH_TIMEOUT:-240} python3 -P bench/bench_cuda.py --out "$OUT/cuda_ops.md" "$@" 2>&1 | tee "$OUT/bench.log"
