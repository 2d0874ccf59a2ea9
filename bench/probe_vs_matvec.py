#!/usr/bin/env python3
"""FP16 matvec GB/s next to the read-bandwidth probe, in one process.

    python bench/probe_vs_matvec.py LABEL            # 16384x4096 f16 matvec, 1 and 2 threads

Prints one line: per thread count, the matvec's best GB/s (median of 4 rounds), the probe's
(bench/results/matvec_cpu.md), and their ratio: how close the kernel streams to what the
probe calls the machine's read bandwidth.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from cyllm.backends.cpu import CpuBackend, measure_read_bandwidth


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("label", help="what this run is (a build, a setting): printed first")
    ap.add_argument("--threads", nargs="*", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    w = rng.random((16384, 4096)).astype(np.float16)        # (d, n), 128 MiB: from DRAM
    x = rng.random(4096).astype(np.float32)
    o = np.empty(16384, np.float32)
    res = []
    for th in args.threads:
        b = CpuBackend(th)
        for _ in range(3):
            b.matvec(o, w, x)
        mv, pr = [], []
        for _ in range(args.rounds):
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                b.matvec(o, w, x)
                ts.append(time.perf_counter() - t)
            mv.append(w.nbytes / min(ts) / 1e9)
            pr.append(measure_read_bandwidth(th, reps=3))
        res.append(f"t{th}: matvec {np.median(mv):.1f} probe {np.median(pr):.1f} "
                   f"ratio {np.median(mv) / np.median(pr):.2f}")
    print(args.label, " | ".join(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
