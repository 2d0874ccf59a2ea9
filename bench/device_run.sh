#!/usr/bin/env bash
# One device call: GPU facts, the cuda tests (op table, ops, whole model), the kernel
# microbenchmarks, then `cyllm bench --backend cuda` on synthetic models.
# Usage on the device machine (from the repo root):
#   bash bench/device_run.sh [tests] [micro] [bench]      (default: all three)
# Logs land in $OUT (the device tool brings them back), or in /tmp/cyllm_out.
set -o pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT=${OUT:-/tmp/cyllm_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$REPO/src"
STEPS=${*:-tests micro bench}
has() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -P -c "import cupy, numpy, torch, transformers; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.log"

if has tests; then
  timeout ${TEST_TIMEOUT:-420} python3 -P -m pytest -q -p no:cacheprovider -rfE --tb=short --timeout 120 \
      tests/test_backend_ops.py tests/test_cuda_ops.py tests/test_cuda_model.py 2>&1 | tee "$OUT/test.log" | tail -n 60
fi
if has micro; then
  timeout ${MICRO_TIMEOUT:-240} python3 -P bench/bench_cuda.py --out "$OUT/cuda_ops.md" ${MICRO_ARGS:-} 2>&1 \
      | tee "$OUT/micro.log" | grep -v "^|" | tail -n 5
fi
if has bench; then
  # run from /tmp: nothing in the checkout's root may shadow the `cuda` package CuPy imports
  cd /tmp
  for spec in "llama2-7b -p 512 -n 128 -d 0,4096" "smollm2-135m -p 512 -n 128" "smollm2-135m-untied -p 512 -n 128"; do
    set -- $spec
    echo "## PYTHONPATH=src python3 -m cyllm bench --backend cuda --synthetic $* -t 1 -r 3 --no-progress" | tee -a "$OUT/bench.log"
    timeout ${BENCH_TIMEOUT:-200} python3 -P -m cyllm bench --backend cuda --synthetic "$@" -t 1 -r 3 --no-progress \
        2>&1 | tee -a "$OUT/bench.log"
  done
  cd "$REPO"
fi
echo "=== summary"
grep -E "passed|failed|error" "$OUT/test.log" 2>/dev/null | tail -n 3
grep -E "tg|pp" "$OUT/bench.log" 2>/dev/null | grep "^|" | cut -c1-200
