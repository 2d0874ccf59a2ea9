#!/usr/bin/env bash
# One device call that says where the CUDA backend's time goes, with no llama.cpp and no
# carried material (synthetic random-weight models, quantized at load):
#   build    the Cython extension (the CPU side the model code imports)
#   tests    the cuda kernel and op tests (quantized kernels, the op table, ops, small models)
#   prefill  bench/profile_cuda_prefill.py: per-op GPU and host time of a 512-token prefill
#   decode   cyllm bench --backend cuda on SmolLM2-135M (F16 and quantized) and the 7B shape
#   models   the whole-model quantized tests (tests/test_cuda_quant_model.py) on the family
#            files of tests/make_cuda_quant_material.py, carried in .carry/cuda_quant_material,
#            and the family tests against transformers on cuda
#   q7b      cyllm bench --backend cuda, Llama-2-7B shape quantized at load (q4_k = the Q4_K_M
#            recipe, q8_0, q4_0) and F16: pp512, tg128, tg128 at depth 4096
#   small    the same on SmolLM2-135M (untied: 163 M parameters), F16, q8_0, q4_0, q4_k
#   rows     the decode cells the README quotes, as it says they were made: bench/sweep_cuda_decode.py
#            on the 7B shape (q8_0, q4_0, q4_k; -r 3, depths 0 and 4096) and on SmolLM2 (F16 and
#            the three; -r 5), one process each (~400 s after the build: q4_k's quantization at load
#            alone takes ~90 s, a SmolLM2 sweep ~40 s)
#   moe      bench/trace_cuda_decode.py on 4 of Qwen3-30B-A3B's layers (Q4_0), then cyllm bench on
#            the whole shape (pp512, tg64)
#   qknorm   bench/sweep_cuda_decode.py on the Qwen3-8B shape (Q4_0), q/k norms folded or not
#   ncu      one decode token under ncu per weight type (NCU_MODEL, default smollm2-135m-untied;
#            NCU_TYPES, default "f16 q4_0 q4_k"; NCU_KERNELS, an ncu -k regex such as
#            'attn|qmv_add', default every kernel; NCU_CAP, seconds per type, default 200;
#            NCU_SET=memory for DRAM bytes and throughput, L2 hit rate, occupancy instead of stalls):
#            bench/ncu_table.py's table of time, instructions a warp and stall reasons per kernel
#            (logs kept as $OUT/ncu_<type>.csv). The 7B shape under ncu needs a filter or
#            NCU_CAP=450: its whole token (~290 launches, each replayed per metric pass) did
#            not finish in 200 s; -k 'attn|qmv_add_q4_0|qmv_qkv' on q4_0 took ~165 s.
# Usage on the device machine (repo root): bash bench/device_profile.sh [STEP...]
# Device call: command `bash bench/device_profile.sh [STEP...]`, timeout_s 590 (carry
# .carry/cuda_quant_material, .whl (the gguf wheel) and .carry/llamacpp-cache for `models`:
# the device reaches no package index, so the family tests' llama.cpp converter comes as the
# extraction tests/llamacpp_tools.py leaves, `cp -a ~/.cache/cyllm-tests/llama.cpp-0.3.36
# .carry/llamacpp-cache/`). Output under $OUT: profile.log (everything) and summary.txt (the tables).
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cyllm_out}
mkdir -p "$OUT"
T0=$(date +%s)
DEADLINE=$((T0 + ${DEADLINE_S:-560}))
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1 PYTHONPATH="$(pwd)/src${PYTHONPATH:+:$PYTHONPATH}" PIP_NO_INDEX=1
[ -d .carry/llamacpp-cache ] && export CYLLM_TEST_CACHE="$(pwd)/.carry/llamacpp-cache"
PY=python3
left() { echo $((DEADLINE - $(date +%s))); }
say() { echo "=== $(date +%H:%M:%S) [$(( $(date +%s) - T0 ))s] $*"; }
run() {   # run CMD... with the time left (at most $1 seconds)
  local cap=$1; shift
  local t=$(( $(left) < cap ? $(left) : cap ))
  [ "$t" -gt 15 ] || { echo "skipped (deadline): $*"; return; }
  timeout "$t" "$@"
}
bench() { run "$1" $PY -P -m cyllm.tools.cli bench --backend cuda --no-progress -r 3 "${@:2}" 2>&1 | grep -E '^\||bandwidth|error'; }

{
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
for step in ${*:-build tests prefill decode}; do
  say "$step"
  case $step in
  build)
    MAX_JOBS=16 $PY -m pip install -q --no-build-isolation --no-deps -e . > /tmp/build.log 2>&1 || tail -20 /tmp/build.log ;;
  tests)     # three of the four files took 196 s on a warm H100; a fresh machine compiles every variant first
    run 330 $PY -P -m pytest -q -p no:cacheprovider -x --tb=short -m cuda \
      ${TESTS:-tests/test_cuda_quant.py tests/test_backend_ops.py tests/test_cuda_ops.py tests/test_cuda_model.py} 2>&1 | tail -n 15 ;;
  prefill)
    run 90 $PY -P bench/profile_cuda_prefill.py --synthetic llama2-7b -p 512 --chunks 256,512 -r 3
    run 90 $PY -P bench/profile_cuda_prefill.py --synthetic tinyllama-1.1b --quantize q4_0 -p 512 --chunks 512 -r 3 ;;
  decode)
    bench 60 --synthetic smollm2-135m-untied -p 512 -n 128
    for q in q8_0 q4_0; do bench 60 --synthetic smollm2-135m-untied --quantize $q -p 512 -n 128; done
    CYLLM_CUDA_PDL=0 bench 60 --synthetic smollm2-135m-untied --quantize q4_0 -p 0 -n 128
    bench 150 --synthetic llama2-7b --quantize q4_0 -p 512 -n 128 -d 0,4096 ;;
  models)
    CYLLM_CUDA_MATERIAL="$(pwd)/.carry/cuda_quant_material" run 240 $PY -P -m pytest -q -p no:cacheprovider \
      -rfEx --tb=short -m cuda tests/test_cuda_quant_model.py tests/test_families.py 2>&1 | tail -n 25 ;;
  q7b)
    for q in q8_0 q4_0; do bench 100 --synthetic llama2-7b --quantize $q -p 512 -n 128 -d 0,4096; done
    bench 60 --synthetic llama2-7b -p 512 -n 128
    bench 330 --synthetic llama2-7b --quantize q4_k -p 512 -n 128 -d 0,4096 ;;
  small)
    bench 40 --synthetic smollm2-135m-untied -p 512 -n 128
    for q in q8_0 q4_0 q4_k; do bench 40 --synthetic smollm2-135m-untied --quantize $q -p 512 -n 128; done ;;
  rows)
    for q in q8_0 q4_0 q4_k; do
      run 170 $PY -P bench/sweep_cuda_decode.py --synthetic llama2-7b --quantize $q -n 128 -r 3 -d 0,4096 2>&1 \
        | grep -E '^\| [fq]|copy bandwidth|rror'
    done
    for q in f16 q8_0 q4_0 q4_k; do
      quant=(); [ "$q" = f16 ] || quant=(--quantize "$q")
      run 60 $PY -P bench/sweep_cuda_decode.py --synthetic smollm2-135m-untied "${quant[@]}" -n 128 -r 5 2>&1 \
        | grep -E '^\| [a-z]|copy bandwidth|rror' | grep -v '^| weights'
    done ;;
  moe)       # a mixture of experts' decode: where a Qwen3-30B-A3B layer goes (4 of its layers),
             # then the whole shape's pp512 and tg64 (~75 s, the quantizing at load included)
    run 120 $PY -P bench/trace_cuda_decode.py --synthetic qwen3-30b-a3b --layers 4 --quantize q4_0 --tokens 2 --show 12
    bench 150 --synthetic qwen3-30b-a3b --quantize q4_0 -p 512 -n 64 ;;
  qknorm)    # per-head q/k norms folded into rope_store or not, Qwen3-8B shape (~80 s)
    run 120 $PY -P bench/sweep_cuda_decode.py --synthetic qwen3-8b --quantize q4_0 --vary fold_qk_norm=0,1 \
      -n 64 -r 3 -d 0 2>&1 | grep -E '^\| [fq]|copy bandwidth|rror' ;;
  ncu)
    for q in ${NCU_TYPES:-f16 q4_0 q4_k}; do
      quant=(); [ "$q" = f16 ] || quant=(--quantize "$q")
      kfilter=(); [ -n "${NCU_KERNELS:-}" ] && kfilter=(-k "regex:$NCU_KERNELS")
      run "${NCU_CAP:-200}" ncu --clock-control none --cache-control none --profile-from-start off --csv \
        --log-file "$OUT/ncu_$q.csv" --metrics "$($PY bench/ncu_table.py --metrics --set "${NCU_SET:-stalls}")" "${kfilter[@]}" \
        $PY -P bench/sweep_cuda_decode.py --synthetic "${NCU_MODEL:-smollm2-135m-untied}" "${quant[@]}" \
        -n 16 -r 1 --profile > /dev/null 2>&1
      $PY bench/ncu_table.py "$OUT/ncu_$q.csv"
    done ;;
  esac
done
say done
} 2>&1 | tee "$OUT/profile.log"
grep -E '^\||^#|^===|passed|failed|bandwidth' "$OUT/profile.log" > "$OUT/summary.txt"
