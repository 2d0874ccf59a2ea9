"""rmsnorm and rope of the CPU kernels, decode (one row) and prefill (T rows): GB/s.

    python3 bench/bench_norm_rope.py                          # SmolLM2 and 7B widths
    python3 bench/bench_norm_rope.py --dims 4096 --heads 32 --kv-heads 8 --head-dim 128 --tokens 512

These ops run on the calling thread for one token (below the parallel threshold of
threading.pxi) and over rows for a prompt; they are small next to the matvecs, so the
question is whether they stay small. GB/s counts the f32 bytes read and written once
(rmsnorm: x, w, out; rope: q and k in and out, the cos/sin rows). Each cell reports the
median (and best) of --iters timed calls after a warm-up, and is checked first against
the float32 NumPy reference (backends/numpy_ref.py). Tests: tests/test_backend_ops.py
(rmsnorm, rmsnorm_batch, rope, rope_batch, rope_store), tests/test_ops.py.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from bench_matvec import time_calls
from cyllm.backends.cpu import CpuBackend, kernel_info
from cyllm.backends.numpy_ref import NumpyBackend


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", nargs="*", type=int, default=[576, 4096], help="rmsnorm widths")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128, help="T of the prefill (batched) ops")
    ap.add_argument("--variants", nargs="*", default=None)
    ap.add_argument("--threads", nargs="*", type=int, default=None, help="default: 1 and nproc")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args(argv)

    info = kernel_info()
    variants = args.variants or info["available_variants"]
    threads = args.threads or sorted({1, os.cpu_count() or 1})
    rng = np.random.default_rng(0)
    ref = NumpyBackend()
    T, hd, nh, nkv = args.tokens, args.head_dim, args.heads, args.kv_heads
    ctx = max(T, 64)
    cos = rng.standard_normal((ctx, hd // 2)).astype(np.float32)
    sin = rng.standard_normal((ctx, hd // 2)).astype(np.float32)
    print(f"kernels: {info}")
    print("| op | shape | variant | threads | median GB/s | best GB/s | us/call (median) | max abs err |")
    print("|---|---|---|---|---|---|---|---|")
    for v in variants:
        for t in threads:
            b = CpuBackend(t, variant=v)
            cases = []
            for dim in args.dims:
                x, w = rng.standard_normal(dim).astype(np.float32), rng.standard_normal(dim).astype(np.float32)
                X = rng.standard_normal((T, dim)).astype(np.float32)
                cases.append(("rmsnorm", f"{dim}", 3 * x.nbytes,
                              lambda be, o, x=x, w=w: be.rmsnorm(o, x, w, 1e-5), np.zeros(dim, np.float32)))
                cases.append(("rmsnorm_batch", f"{T}x{dim}", 2 * X.nbytes + w.nbytes,
                              lambda be, o, X=X, w=w: be.rmsnorm_batch(o, X, w, 1e-5), np.zeros((T, dim), np.float32)))
            q0, k0 = rng.standard_normal(nh * hd).astype(np.float32), rng.standard_normal(nkv * hd).astype(np.float32)
            Q0, K0 = rng.standard_normal((T, nh * hd)).astype(np.float32), rng.standard_normal((T, nkv * hd)).astype(np.float32)

            def rope(be, o, q0=q0, k0=k0):       # o: (q, k) buffers, refilled so every call rotates the same input
                o[0][:] = q0
                o[1][:] = k0
                be.rope(o[0], o[1], cos, sin, 7)

            def rope_batch(be, o, Q0=Q0, K0=K0):
                o[0][:] = Q0
                o[1][:] = K0
                be.rope_batch(o[0], o[1], cos, sin, 0)
            cases.append(("rope", f"{nh}+{nkv} heads x {hd}", 2 * (q0.nbytes + k0.nbytes) + 2 * cos[0].nbytes,
                          rope, (np.empty_like(q0), np.empty_like(k0))))
            cases.append(("rope_batch", f"{T} x ({nh}+{nkv}) x {hd}", 2 * (Q0.nbytes + K0.nbytes) + 2 * T * cos[0].nbytes,
                          rope_batch, (np.empty_like(Q0), np.empty_like(K0))))
            for name, shape, nbytes, fn, out in cases:
                want = tuple(np.copy(a) for a in out) if isinstance(out, tuple) else np.copy(out)
                fn(b, out)
                fn(ref, want)
                got = np.concatenate([a.ravel() for a in out]) if isinstance(out, tuple) else out.ravel()
                exp = np.concatenate([a.ravel() for a in want]) if isinstance(want, tuple) else want.ravel()
                err = float(np.max(np.abs(got - exp)))
                if err > 1e-4:
                    print(f"WRONG RESULT: {name} {v} {t} threads: max abs err {err:.2e}", file=sys.stderr)
                    return 1
                ts = time_calls(lambda: fn(b, out), args.iters, min_time=0.1)
                print(f"| {name} | {shape} | {v} | {t} | {nbytes / np.median(ts) / 1e9:.1f} | "
                      f"{nbytes / ts.min() / 1e9:.1f} | {np.median(ts) * 1e6:.1f} | {err:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
