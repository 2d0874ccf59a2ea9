"""FP16 matvec bandwidth of the CPU kernels: GB/s per variant x thread count x shape.

    python3 bench/bench_matvec.py                    # all variants, threads 1..nproc
    python3 bench/bench_matvec.py --shapes 4096x4096 --variants avx2 --markdown out.md

Bytes counted: the f16 weight matrix + x + out (the weights dominate). Each cell is
the best (and median) of --iters timed calls after a warm-up. By default the calls
rotate over copies of the matrix totalling >= 256 MiB, so weights come from DRAM as
in a real forward pass (--hot reuses one matrix: cache-resident for small shapes); beside it a check
against the float32 NumPy reference (llm.c habit: never time a wrong kernel). The
read-bandwidth column is the machine's roofline for that thread count.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import sys
import time

import numpy as np

from cyllm._ext import kernels as _k
from cyllm.backends.cpu import CpuBackend, kernel_info, measure_read_bandwidth
from cyllm.hostinfo import cpu_description

DEFAULT_SHAPES = ["4096x4096", "576x576", "1536x576", "576x1536", "49152x576"]


def time_calls(fn, iters: int, min_time: float = 0.3) -> np.ndarray:
    fn()
    fn()
    ts = []
    t_end = time.perf_counter() + min_time
    while len(ts) < iters or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
        if len(ts) >= 50 * iters:
            break
    return np.array(ts)


def check(b: CpuBackend, w: np.ndarray, x: np.ndarray) -> float:
    """Max error relative to sum |w||x| (float32 rounding scale); < 1e-5 is right."""
    out = np.zeros(w.shape[0], np.float32)
    b.matvec(out, w, x)
    want = w.astype(np.float32) @ x
    bound = np.abs(w.astype(np.float32)) @ np.abs(x)
    return float(np.max(np.abs(out - want) / (bound + 1e-30)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES, help="DxN (rows x columns)")
    ap.add_argument("--variants", nargs="*", default=None, help="default: every variant this CPU runs")
    ap.add_argument("--threads", nargs="*", type=int, default=None, help="default: 1..nproc")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--hot", action="store_true", help="reuse one matrix (cache-hot) instead of rotating copies")
    ap.add_argument("--no-bandwidth", action="store_true", help="skip the read-bandwidth roofline")
    ap.add_argument("--markdown", help="also write the table (with machine info) to this .md file")
    ap.add_argument("--wide-prefetch", choices=("on", "off", "both"), default="on",
                    help="the L2 prefetch of wide rows (x of half of L1d or more; kernels_avx2.c): "
                         "on (the default), off, or both, timed one after the other")
    args = ap.parse_args(argv)
    wide_default = _k._set_wide_prefetch(0, 0)
    _k._set_wide_prefetch(*wide_default)
    wide_settings = ("on", "off") if args.wide_prefetch == "both" else (args.wide_prefetch,)

    info = kernel_info()
    variants = args.variants or info["available_variants"]
    threads = args.threads or list(range(1, (os.cpu_count() or 1) + 1))
    rng = np.random.default_rng(0)

    roof = {}
    if not args.no_bandwidth:
        for t in threads:
            roof[t] = measure_read_bandwidth(t, 512 << 20, 5)

    header = ("| shape (d x n) | MiB | variant | threads | wide-row prefetch | best GB/s | median GB/s "
              "| us/call (median) | read BW GB/s | % of BW | ref err |")
    rows = [header, "|" + "|".join(["---"] * (header.count("|") - 1)) + "|"]
    print(f"kernels: {info}")
    print(header)
    for shape in args.shapes:
        d, n = (int(v) for v in shape.lower().split("x"))
        w = rng.standard_normal((d, n)).astype(np.float16)
        w.setflags(write=False)                       # like the mmapped weights
        copies = 1 if args.hot else max(1, -(-(256 << 20) // w.nbytes))
        ws = [w] + [w.copy() for _ in range(copies - 1)]
        nxt = [0]

        def call(b, out, x):
            i = nxt[0] = (nxt[0] + 1) % copies
            b.matvec(out, ws[i], x)
        x = rng.standard_normal(n).astype(np.float32)
        out = np.zeros(d, np.float32)
        nbytes = w.nbytes + x.nbytes + out.nbytes
        for v in variants:
            for t, wide in itertools.product(threads, wide_settings):
                _k._set_wide_prefetch(*(wide_default if wide == "on" else (0, 0)))
                try:
                    b = CpuBackend(t, variant=v)
                    err = check(b, w, x)
                    ts = time_calls(lambda: call(b, out, x), args.iters)
                finally:
                    _k._set_wide_prefetch(*wide_default)
                best, med = nbytes / ts.min() / 1e9, nbytes / np.median(ts) / 1e9
                bw = roof.get(t)
                pct = f"{bw:.1f} | {100 * best / bw:.0f}%" if bw else "- | -"
                row = (f"| {d}x{n} | {w.nbytes / 2**20:.1f} | {v} | {t} | {wide} | {best:.1f} | {med:.1f} | "
                       f"{np.median(ts) * 1e6:.1f} | {pct} | {err:.1e} |")
                print(row, flush=True)
                rows.append(row)
                if err > 1e-5:
                    print(f"WRONG RESULT: {v} {t} threads {shape}: rel err {err:.2e}", file=sys.stderr)
                    return 1
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("# FP16 matvec bandwidth, CPU kernels\n\n")
            f.write(f"- command: `python3 bench/bench_matvec.py {' '.join(argv or sys.argv[1:])}`\n")
            f.write(f"- machine: {cpu_description()}, {os.cpu_count()} logical CPUs ({platform.machine()})\n")
            f.write(f"- date: {datetime.date.today().isoformat()}\n")
            f.write(f"- kernels: {info}\n")
            f.write("- GB/s = (f16 weights + x + out bytes) / time; read BW = `measure_read_bandwidth(threads)`; "
                    + ("cache-hot (one matrix reused)" if args.hot else "weights rotate over >= 256 MiB of copies (DRAM)")
                    + "\n\n")
            f.write("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
