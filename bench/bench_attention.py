"""Attention over the f16 KV cache: time and GB/s per context length, per variant/threads.

    python3 bench/bench_attention.py                         # SmolLM2 shape: 9 heads, 3 kv heads, hd 64
    python3 bench/bench_attention.py --heads 32 --kv-heads 8 --head-dim 128 --ctx 4096

GB/s counts the unique cache bytes one call needs (K and V of every kv head over
positions 0..pos, read once); query heads of one GQA group re-read the same rows,
mostly from cache. Each cell is checked against the float32 NumPy reference first.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from cyllm.backends.cpu import CpuBackend, kernel_info
from cyllm.backends.numpy_ref import NumpyBackend


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--ctx", nargs="*", type=int, default=[128, 512, 2048, 8192])
    ap.add_argument("--variants", nargs="*", default=None)
    ap.add_argument("--threads", nargs="*", type=int, default=None)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args(argv)

    info = kernel_info()
    variants = args.variants or info["available_variants"]
    threads = args.threads or list(range(1, (os.cpu_count() or 1) + 1))
    nh, nkv, hd = args.heads, args.kv_heads, args.head_dim
    max_ctx = max(args.ctx)
    rng = np.random.default_rng(0)
    kc = rng.standard_normal((nkv, max_ctx, hd)).astype(np.float16)
    vc = rng.standard_normal((nkv, max_ctx, hd)).astype(np.float16)
    q = rng.standard_normal(nh * hd).astype(np.float32)
    out = np.zeros(nh * hd, np.float32)
    ref = NumpyBackend()

    print(f"kernels: {info}")
    print(f"shape: {nh} heads, {nkv} kv heads, head_dim {hd}")
    print("| context | KV MiB | variant | threads | us/call (best) | us/call (median) | GB/s (best) | ref err |")
    print("|---|---|---|---|---|---|---|---|")
    for ctx in args.ctx:
        pos = ctx - 1
        want = np.zeros_like(out)
        ref.attention(want, q, kc[:, :ctx], vc[:, :ctx], pos)
        nbytes = 2 * nkv * ctx * hd * 2
        for v in variants:
            for t in threads:
                b = CpuBackend(t, variant=v)
                b.attention(out, q, kc, vc, pos)
                err = float(np.max(np.abs(out - want)))
                if err > 1e-4:
                    print(f"WRONG RESULT: {v} {t} threads ctx {ctx}: max abs err {err:.2e}", file=sys.stderr)
                    return 1
                ts = []
                for _ in range(args.iters):
                    t0 = time.perf_counter()
                    b.attention(out, q, kc, vc, pos)
                    ts.append(time.perf_counter() - t0)
                ts = np.array(ts)
                print(f"| {ctx} | {nbytes / 2**20:.2f} | {v} | {t} | {ts.min() * 1e6:.1f} | "
                      f"{np.median(ts) * 1e6:.1f} | {nbytes / ts.min() / 1e9:.1f} | {err:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
