#!/usr/bin/env bash
# Quantized weights on the GPU, in a few device calls: the cuda tests on quantized files, a
# CUDA build of llama.cpp's llama-bench/llama-quantize, random-weight GGUFs of real shapes
# quantized by llama-quantize, and cyllm vs llama.cpp on the same files in one table.
#
# Usage on the device machine (repo root): bash bench/device_quant.sh STEP...   steps, in order:
#   stash   copy the carried material (.carry/cuda_quant_*) into $STATE (default /tmp/cyq; it
#           lives while the machine stays warm: 30 s between calls); join the default model
#           when all its parts have arrived (one part per call: each is ~50 MB)
#   build   the Cython extension (pip install --no-build-isolation --no-deps -e .), once per tree
#   llama   start llama.cpp's CUDA build in the background (setsid: it outlives the call,
#           ~5 min on 16 cores); $STATE/llama.done when finished
#   make    start in the background: random-weight F16 GGUFs (Llama-2-7B 13.5 GB, SmolLM2-135M),
#           then llama-quantize Q4_K_M, Q8_0, Q4_0 of each (after llama.done; 16 threads)
#   tests   the cuda tests (op table, ops, whole models, quantized kernels and models, families)
#   wait    wait for the background work (make.done, llama.done) until the deadline
#   bench   cyllm bench vs llama-bench, file by file, until the deadline (resumable)
#   table   the markdown table of every result so far ($OUT/quant_bench.md)
#   dry     print what make and bench would run (no GPU needed: tested on the CPU machine)
# Everything is skipped when already done; a later call goes on where one left off.
# $OUT gets at most 8 files: env.log test.log llama_build.log make.log bench.log quant_bench.md
# results.tar.gz (the per-run JSON) and summary.txt.
# DEADLINE_S (default 530): no new step or bench run starts after this many seconds.
#
# The lead's calls (device `run` tool; the material is built here first with
#   python tests/make_cuda_quant_material.py --wheel     # .carry/ (~135 MB in 3 folders), .whl/
# in the checkout that calls; carry at most 64 MiB per call, so the default model travels in
# two parts). Each call's command starts with the gguf wheel install of the device README.
# Call 1 (~9 min; carry ~39 MB):
#   command: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; bash bench/device_quant.sh stash build llama make tests
#   carry:   [".carry/cuda_quant_material", ".carry/cuda_quant_bench", ".whl"]
#   timeout_s: 590
# Call 2 (within 30 s of call 1; ~9 min; carry ~52 MB):
#   command: <same wheel install>; bash bench/device_quant.sh stash build wait bench table
#   carry:   [".carry/cuda_quant_default/SmolLM2-135M-Instruct.Q4_1.gguf.part0", ".whl"]
#   timeout_s: 590
# Call 3 (within 30 s; ~6-9 min; carry ~50 MB):
#   command: <same wheel install>; TESTS="tests/test_cuda_quant_model.py" bash bench/device_quant.sh stash build tests bench table
#   carry:   [".carry/cuda_quant_default/SmolLM2-135M-Instruct.Q4_1.gguf.part1", ".whl"]
#   timeout_s: 590
# If a call finds a bare machine (it went cold), start again from call 1: every step checks
# what $STATE holds. Device time: ~27 min held for the three calls (one chip counts 50%).
set -o pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT=${OUT:-/tmp/cyllm_out}
STATE=${STATE:-/tmp/cyq}
mkdir -p "$OUT" "$STATE"
T0=$(date +%s)
DEADLINE=$((T0 + ${DEADLINE_S:-530}))
export PYTHONUNBUFFERED=1 PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
export PIP_NO_INDEX=1            # no network there: a test that tries pip fails at once
STEPS=${*:-stash build llama make tests wait bench table}
PY=python3
left() { echo $((DEADLINE - $(date +%s))); }
say() { echo "=== $(date +%H:%M:%S) [$(( $(date +%s) - T0 ))s] $*"; }

{ nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>&1
  $PY -P -c "import cupy, numpy, torch; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__)" 2>&1
  $PY -P -c "import gguf; print('gguf', gguf.__version__)" 2>&1 | tail -1
  nproc; df -h /tmp | tail -1; free -g | head -2
} > "$OUT/env.log" 2>&1

for step in $STEPS; do
  if [ "$(left)" -lt 20 ] && [ "$step" != table ]; then say "deadline: skipping $step"; continue; fi
  say "$step"
  case $step in
  stash)
    $PY -P bench/device_quant.py stash "$REPO/.carry" "$STATE" 2>&1 | tee -a "$OUT/make.log" ;;
  build)
    stamp=$(cat setup.py pyproject.toml $(find cython_ext -type f | sort) | sha256sum | cut -c1-16)
    if [ "$(cat "$STATE/build.stamp" 2>/dev/null)" != "$stamp" ] || ! $PY -P -c "import cyllm.backends.cpu" 2>/dev/null; then
      MAX_JOBS=16 $PY -m pip install -q --no-build-isolation --no-deps -e . > "$STATE/build.log" 2>&1 \
        && echo "$stamp" > "$STATE/build.stamp" || { tail -20 "$STATE/build.log"; }
    fi
    $PY -P -c "import cyllm.backends.cpu as c; print('cpu extension ok')" 2>&1 | tail -1 ;;
  llama)
    if [ -f "$STATE/llama.done" ]; then echo "llama.cpp already built"
    elif [ -f "$STATE/llama.started" ] && kill -0 "$(cat "$STATE/llama.started")" 2>/dev/null; then echo "llama.cpp build running"
    else
      rm -f "$STATE/llama.failed"
      setsid bash -c '
        set -o pipefail; S="$1"; cd "$S" || exit 1
        { [ -d llama.cpp ] || tar xf "$S/bench/llama.cpp-src.tar.xz"; } &&
        cd llama.cpp &&
        cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
          -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF \
          -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF > "$S/llama_build.log" 2>&1 &&
        cmake --build build --target llama-bench llama-quantize -j 16 >> "$S/llama_build.log" 2>&1 &&
        touch "$S/llama.done" || touch "$S/llama.failed"' _ "$STATE" < /dev/null > /dev/null 2>&1 &
      echo $! > "$STATE/llama.started"
      echo "llama.cpp build started in the background"
    fi ;;
  make)
    if [ -f "$STATE/make.done" ]; then echo "bench files made"
    elif [ -f "$STATE/make.started" ] && kill -0 "$(cat "$STATE/make.started")" 2>/dev/null; then echo "make running"
    else
      setsid $PY -P bench/device_quant.py make "$STATE" --threads 16 < /dev/null >> "$STATE/make.log" 2>&1 &
      echo $! > "$STATE/make.started"
      echo "making the bench files in the background (log: make.log)"
    fi ;;
  tests)
    # the default model's tests run once stash has joined it (they skip before)
    CYLLM_CUDA_MATERIAL="$STATE/material" timeout $(( $(left) > 30 ? $(left) - 10 : 20 )) \
      $PY -P -m pytest -q -p no:cacheprovider -rfEsx ${PYTEST_EXTRA:-} --tb=short --timeout 300 -m cuda \
      ${TESTS:-tests/test_backend_ops.py tests/test_cuda_ops.py tests/test_cuda_model.py tests/test_cuda_quant.py tests/test_cuda_quant_model.py tests/test_families.py} \
      2>&1 | tee -a "$OUT/test.log" | tail -n 40 ;;
  wait)
    while [ "$(left)" -gt 60 ] && ! { [ -f "$STATE/make.done" ] && [ -f "$STATE/llama.done" ]; }; do
      [ -f "$STATE/llama.failed" ] && { echo "llama.cpp build failed"; break; }
      [ -f "$STATE/make.started" ] && ! kill -0 "$(cat "$STATE/make.started")" 2>/dev/null && [ ! -f "$STATE/make.done" ] \
        && { echo "make stopped without finishing (make.log)"; break; }
      sleep 10
    done
    ls -la "$STATE/models" 2>/dev/null ;;
  bench)
    $PY -P bench/device_quant.py bench "$STATE" --deadline "$((DEADLINE - 90))" 2>&1 | tee -a "$OUT/bench.log" ;;
  table)
    $PY -P bench/device_quant.py table "$STATE" --out "$OUT/quant_bench.md" ;;
  dry)
    $PY -P bench/device_quant.py make "$STATE" --dry-run && $PY -P bench/device_quant.py bench "$STATE" --dry-run ;;
  *) echo "unknown step $step (stash build llama make tests wait bench table dry)"; exit 2 ;;
  esac
done

cp "$STATE/make.log" "$OUT/make.log" 2>/dev/null
tail -n 200 "$STATE/llama_build.log" > "$OUT/llama_build.log" 2>/dev/null
[ -d "$STATE/results" ] && tar czf "$OUT/results.tar.gz" -C "$STATE" results 2>/dev/null
{ say "summary"
  grep -E "passed|failed|error" "$OUT/test.log" 2>/dev/null | tail -n 3
  echo "llama.cpp: $( [ -f "$STATE/llama.done" ] && echo built || { [ -f "$STATE/llama.failed" ] && echo FAILED || echo pending; })"
  echo "bench files: $(ls "$STATE/models" 2>/dev/null | grep -vc part) made; default model: $( [ -f "$STATE/material/SmolLM2-135M-Instruct.Q4_1.gguf" ] && echo joined || echo missing)"
  echo "results: $(ls "$STATE/results" 2>/dev/null | grep -c '\.json$') files"
  [ -f "$OUT/quant_bench.md" ] && cat "$OUT/quant_bench.md"
} 2>&1 | tee "$OUT/summary.txt"
