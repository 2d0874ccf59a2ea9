"""Quantized matvec (and prefill matmul) speed vs the FP16 matvec and the read bandwidth.

For every shape of TinyLlama-1.1B (q/o 2048x2048, gate/up 5632x2048, down 2048x5632,
output 32000x2048) and every format, the decode matvec of cyllm's quantized kernels
(cyllm._ext.kernels.QuantKernels.qmatvec, activation quantization included) is timed
at each thread count, next to the FP16 matvec of the same shape (CpuBackend.matvec)
and the memory read bandwidth measured in the same run. GB/s counts the bytes of the
weights as stored (quantized blocks, or f16). Random weights: speed depends on bytes,
not values.

    python bench/bench_quant.py                       # table on stdout
    python bench/bench_quant.py --out bench/results/quant_matvec.md
    python bench/bench_quant.py --prefill 64          # also qmatmul int8 vs f16 panels, T=64
    python bench/bench_quant.py --formats q4_k,q4_k_r16 # a format against its r16 layout
    python bench/bench_quant.py --stream-mb 300       # decode with the weights from DRAM
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from cyllm._ext import kernels as K
from cyllm.backends.cpu import CpuBackend, measure_read_bandwidth
from cyllm.hostinfo import cpu_description
from shown_paths import shown_argv
from cyllm.quant import FORMATS
from cyllm.quant.formats import R16_BASE
from cyllm.quant.reference import quantize

SHAPES = {"qo": (2048, 2048), "gate_up": (5632, 2048), "down": (2048, 5632), "output": (32000, 2048)}
QFORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")


def timeit(fn, min_time: float, reps_min: int = 5) -> float:
    """Best per-call seconds over batches of calls (after a warm-up)."""
    for _ in range(3):
        fn()
    best = float("inf")
    t_end = time.perf_counter() + min_time
    while True:
        t0 = time.perf_counter()
        for _ in range(reps_min):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps_min)
        if time.perf_counter() > t_end:
            return best


def random_quant(fmt: str, rows: int, cols: int, rng) -> np.ndarray:
    """Blocks of `fmt` with realistic scales: quantize a small random matrix and tile it
    (quantizing 65M weights with the NumPy reference would take minutes)."""
    if fmt in R16_BASE:                # an r16 layout: the file format's blocks, reordered as the backend does
        blocks = random_quant(R16_BASE[fmt], rows, cols, rng)
        out = np.empty_like(blocks)
        K.repack_r16(out, blocks, R16_BASE[fmt], 2)
        return out
    f = FORMATS[fmt]
    base = quantize((rng.standard_normal((64, cols)) * 0.02).astype(np.float32), f)
    reps = -(-rows // 64)
    return np.ascontiguousarray(np.tile(base, (reps, 1))[:rows])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--formats", default=",".join(QFORMATS))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--variant", default=None, help="quantized table (default: best here)")
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds per measurement")
    ap.add_argument("--prefill", type=int, default=0, help="also time qmatmul with T tokens")
    ap.add_argument("--stream-mb", type=int, default=0,
                    help="decode over copies of each matrix filling this many MB, one after another, so "
                         "the weights come from DRAM as in a model (default 0: one matrix, from cache)")
    ap.add_argument("--out", default=None, help="write the markdown table here")
    args = ap.parse_args(argv)
    if args.stream_mb < 0 or args.stream_mb > 16384:
        ap.error(f"--stream-mb must be in [0, 16384], got {args.stream_mb}")
    threads = [int(t) for t in args.threads.split(",")]
    fmts = [f for f in args.formats.split(",") if f]
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        ap.error(f"--shapes: unknown shape {unknown[0]!r} (choose from {', '.join(SHAPES)})")
    rng = np.random.default_rng(0)

    lines = []

    def emit(s=""):
        print(s, flush=True)
        lines.append(s)

    qk0 = K.QuantKernels(threads=1, variant=args.variant)
    emit(f"machine: {cpu_description()}, {K.omp_max_threads()} threads available; quantized kernels: {qk0.quant_variant} "
         f"(available: {', '.join(K.quant_available_variants())}), f16 kernels: {qk0.base_variant}")
    emit(f"command: {shown_argv('bench/bench_quant.py', argv if argv is not None else sys.argv[1:])}")
    emit()
    bw = {t: measure_read_bandwidth(t) for t in threads}
    emit("read bandwidth (GB/s): " + ", ".join(f"{t} thread(s) {bw[t]:.1f}" for t in threads))
    emit()
    def copies(a):
        """a and enough copies of it to fill --stream-mb (just a when 0)"""
        return [a] + [a.copy() for _ in range(int(args.stream_mb * 1e6 // a.nbytes))]

    def each(arrs, call):
        """seconds per array: one pass of call over arrs, timed"""
        return timeit(lambda: [call(a) for a in arrs], args.min_time) / len(arrs)

    if args.stream_mb:
        emit(f"decode over {args.stream_mb} MB of copies of each matrix (weights from DRAM)")
        emit()
    emit("| shape | format | bytes | " + " | ".join(
        f"{t}T GB/s | {t}T % bw | {t}T us" for t in threads) + " |")
    emit("|---|---|---:|" + "---:|---:|---:|" * len(threads))
    for sname in shapes:
        rows, cols = SHAPES[sname]
        x = rng.standard_normal(cols).astype(np.float32)
        out = np.zeros(rows, np.float32)
        w16 = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float16)
        w16s = copies(w16)
        cells = []
        for t in threads:
            cb = CpuBackend(threads=t)
            dt = each(w16s, lambda w: cb.matvec(out, w, x))
            cells.append(f"{w16.nbytes / dt / 1e9:.1f} | {100 * w16.nbytes / dt / 1e9 / bw[t]:.0f}% | {dt * 1e6:.0f}")
        emit(f"| {sname} {rows}x{cols} | f16 | {w16.nbytes} | " + " | ".join(cells) + " |")
        del w16, w16s
        for fmt in fmts:
            wq = random_quant(fmt, rows, cols, rng)
            wqs = copies(wq)
            cells = []
            for t in threads:
                qk = K.QuantKernels(threads=t, variant=args.variant)
                dt = each(wqs, lambda w: qk.qmatvec(out, w, fmt, x))
                cells.append(f"{wq.nbytes / dt / 1e9:.1f} | {100 * wq.nbytes / dt / 1e9 / bw[t]:.0f}% | {dt * 1e6:.0f}")
            emit(f"| {sname} {rows}x{cols} | {fmt} | {wq.nbytes} | " + " | ".join(cells) + " |")
            del wqs
    if args.prefill:
        T = args.prefill
        emit()
        emit(f"prefill: out (T={T}, d) = x @ W.T, ms per call (int8: integer GEMM on quantized x; "
             f"f16: 64-row panels dequantized to f16 + the f16 GEMM; f16 weights: CpuBackend.matmul)")
        emit()
        emit("| shape | format | " + " | ".join(f"{t}T int8 | {t}T f16 panels | {t}T f16 weights" for t in threads) + " |")
        emit("|---|---|" + "---:|---:|---:|" * len(threads))
        for sname in shapes:
            rows, cols = SHAPES[sname]
            xb = rng.standard_normal((T, cols)).astype(np.float32)
            ob = np.zeros((T, rows), np.float32)
            w16 = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float16)
            for fmt in fmts:
                wq = random_quant(fmt, rows, cols, rng)
                cells = []
                for t in threads:
                    qk = K.QuantKernels(threads=t, variant=args.variant)
                    cb = CpuBackend(threads=t)
                    a = timeit(lambda: qk.qmatmul(ob, wq, fmt, xb, method="int8"), args.min_time, 1)
                    b = timeit(lambda: qk.qmatmul(ob, wq, fmt, xb, method="f16"), args.min_time, 1)
                    c = timeit(lambda: cb.matmul(ob, w16, xb), args.min_time, 1)
                    cells.append(f"{a * 1e3:.2f} | {b * 1e3:.2f} | {c * 1e3:.2f}")
                emit(f"| {sname} {rows}x{cols} | {fmt} | " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            f.write("# Quantized matvec speed (bench/bench_quant.py)\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
