#!/usr/bin/env python3
"""FP16 matvec GB/s next to the read-bandwidth probe, in one process (usage: probe_vs_matvec.py LABEL)."""
import time, sys, numpy as np
from cyllm.backends.cpu import CpuBackend, measure_read_bandwidth
w = np.random.rand(16384, 4096).astype(np.float16); x = np.random.rand(4096).astype(np.float32); o = np.empty(16384, np.float32)
res = []
for th in (1, 2):
    b = CpuBackend(th)
    for _ in range(3): b.matvec(o, w, x)
    mv = []; pr = []
    for _ in range(4):
        ts = []
        for _ in range(5):
            t = time.perf_counter(); b.matvec(o, w, x); ts.append(time.perf_counter() - t)
        mv.append(w.nbytes / min(ts) / 1e9)
        pr.append(measure_read_bandwidth(th, reps=3))
    res.append(f"t{th}: matvec {np.median(mv):.1f} probe {np.median(pr):.1f} ratio {np.median(mv)/np.median(pr):.2f}")
print(sys.argv[1], " | ".join(res))
