"""FP16 prefill GEMM of the CPU kernels: GFLOP/s per variant x thread count x shape.

    python3 bench/bench_gemm.py                                  # T=128 on SmolLM2 and 7B shapes
    python3 bench/bench_gemm.py --tokens 512 --shapes 4096x4096 --variants avx512 avx2 --threads 8
    python3 bench/bench_gemm.py --markdown bench/results/gemm_cpu.md

Times CpuBackend.matmul (out (T, d) = x (T, n) @ w (d, n)^T, f16 weights, f32
activations and accumulation): the prompt-processing GEMM of every projection.
GFLOP/s = 2*T*d*n / time; each cell reports the median (and best) of --iters timed
calls after a warm-up, and is checked first against the float32 NumPy reference
(backends/numpy_ref.py): a wrong kernel is never timed. Tests of the kernel:
tests/test_backend_ops.py (matmul, matmul_add, gate_up_batch), tests/test_ops.py.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

import numpy as np

from bench_matvec import time_calls
from cyllm.backends.cpu import CpuBackend, kernel_info
from cyllm.hostinfo import cpu_description

DEFAULT_SHAPES = ["576x576", "1536x576", "4096x4096", "11008x4096"]


def check(b: CpuBackend, w: np.ndarray, x: np.ndarray) -> float:
    """Max error relative to sum |x||w| (float32 rounding scale); < 1e-5 is right."""
    out = np.zeros((x.shape[0], w.shape[0]), np.float32)
    b.matmul(out, w, x)
    w32 = w.astype(np.float32)
    want = x @ w32.T
    bound = np.abs(x) @ np.abs(w32).T
    return float(np.max(np.abs(out - want) / (bound + 1e-30)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES, help="DxN (weight rows x columns)")
    ap.add_argument("--tokens", type=int, default=128, help="T, the prompt rows of x")
    ap.add_argument("--variants", nargs="*", default=None, help="default: every variant this CPU runs")
    ap.add_argument("--threads", nargs="*", type=int, default=None, help="default: 1..nproc")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--markdown", help="also write the table (with machine info) to this .md file")
    args = ap.parse_args(argv)

    info = kernel_info()
    variants = args.variants or info["available_variants"]
    threads = args.threads or list(range(1, (os.cpu_count() or 1) + 1))
    rng = np.random.default_rng(0)
    T = args.tokens
    header = "| T | shape (d x n) | variant | threads | median GFLOP/s | best GFLOP/s | ms/call (median) | ref err |"
    rows = [header, "|" + "|".join(["---"] * (header.count("|") - 1)) + "|"]
    print(f"kernels: {info}")
    print(header)
    for shape in args.shapes:
        d, n = (int(v) for v in shape.lower().split("x"))
        w = (rng.standard_normal((d, n)) * 0.05).astype(np.float16)
        w.setflags(write=False)                       # like the mmapped weights
        x = rng.standard_normal((T, n)).astype(np.float32)
        out = np.zeros((T, d), np.float32)
        flops = 2.0 * T * d * n
        for v in variants:
            for t in threads:
                b = CpuBackend(t, variant=v)
                err = check(b, w, x)
                if err > 1e-5:
                    print(f"WRONG RESULT: {v} {t} threads {shape}: rel err {err:.2e}", file=sys.stderr)
                    return 1
                ts = time_calls(lambda: b.matmul(out, w, x), args.iters)
                row = (f"| {T} | {d}x{n} | {v} | {t} | {flops / np.median(ts) / 1e9:.1f} | "
                       f"{flops / ts.min() / 1e9:.1f} | {np.median(ts) * 1e3:.2f} | {err:.1e} |")
                print(row, flush=True)
                rows.append(row)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("# FP16 prefill GEMM, CPU kernels\n\n")
            f.write(f"- command: `python3 bench/bench_gemm.py {' '.join(argv or sys.argv[1:])}`\n")
            f.write(f"- machine: {cpu_description()}, {os.cpu_count()} logical CPUs ({platform.machine()})\n")
            f.write(f"- date: {datetime.date.today().isoformat()}\n")
            f.write(f"- kernels: {info}\n")
            f.write("- GFLOP/s = 2 T d n / time (f16 weights, f32 x and accumulation)\n\n")
            f.write("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
