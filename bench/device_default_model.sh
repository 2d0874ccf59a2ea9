#!/usr/bin/env bash
# The default model's tests on the GPU machine (tests/test_cuda_quant_model.py -k default: its
# logits against the CPU and the CUDA math, the greedy text, the perplexity within 0.5% of the
# CPU's). Its file (98 MB) is larger than what one device call carries (64 MiB), so it goes in
# two halves, in two calls made one right after the other (the machine keeps /tmp only while
# it is warm, ~30 s after a call):
#
#   here:      bash bench/device_default_model.sh split
#   call 1:    bash bench/device_default_model.sh keep      carry .carry/default_model/part.aa
#   call 2:    bash bench/device_default_model.sh test      carry .carry/default_model/part.ab,
#                                                           .carry/default_model/material
# `keep` also builds the extension, so call 2 finds it built. Output under $OUT: dm.log.
set -o pipefail
cd "$(dirname "$0")/.."
DIR=.carry/default_model
KEPT=/tmp/cyllm_default_model
OUT=${OUT:-/tmp/cyllm_out}
mkdir -p "$OUT"
case "${1:-}" in
  split)    # on the development machine: the cached file (fetched by `cyllm generate`) in two parts
    src=$(PYTHONPATH=src python3 -c 'from cyllm.default_model import default_model_path as p; print(p(download=False))') || exit 2
    [ -f "$src" ] || { echo "no cached default model at $src: run cyllm generate once" >&2; exit 2; }
    rm -rf "$DIR" && mkdir -p "$DIR/material/families"
    split -b 50000000 "$src" "$DIR/part."
    cp .carry/cuda_quant_material/ppl_text.txt "$DIR/material/" || exit 2
    touch "$DIR/material/families/.none"   # the tests want the folder; no family files here
    ls -l "$DIR" ;;
  keep)     # call 1: the first part to /tmp, and the build
    mkdir -p "$KEPT" && cp "$DIR"/part.aa "$KEPT"/ || exit 2
    bash bench/device_profile.sh build > "$OUT/build.log" 2>&1
    ls -l "$KEPT" ;;
  test)     # call 2: the file whole again (its size and sha256 checked by the tests' loader), the tests
    [ -f "$KEPT/part.aa" ] || { echo "part.aa is gone: the machine went cold between the calls" >&2; exit 2; }
    name=$(PYTHONPATH=src python3 -c 'from cyllm.default_model import FILE_NAME; print(FILE_NAME)')
    cat "$KEPT/part.aa" "$DIR"/part.ab > "$DIR/material/$name"
    PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" CYLLM_CUDA_MATERIAL="$(pwd)/$DIR/material" PYTHONUNBUFFERED=1 timeout 500 \
      python3 -P -m pytest -q -p no:cacheprovider -rfEs --tb=short -m cuda tests/test_cuda_quant_model.py \
      -k default -s 2>&1 | tee "$OUT/dm.log" | grep -E "default model|passed|failed|PPL|perplexity|Error" ;;
  *) echo "usage: bash bench/device_default_model.sh split|keep|test" >&2; exit 2 ;;
esac
