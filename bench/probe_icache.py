#!/usr/bin/env python3
"""What a kernel's code size costs when the SM's instruction cache does not hold it.

    python bench/probe_icache.py [--kib 4,8,16,32,64] [--warps 1,8]

Straight-line kernels of K KiB of SASS (independent FFMA chains with immediates, one
instruction = 16 bytes) run as a grid of one block per SM (spread by the scheduler, not
pinned); each block reads clock64 before its first and after its last instruction (both
tied to the chains by operands, so nothing moves across them). Three cases per size:
  warm     the same kernel run just before (its code in the SM's instruction caches)
  evicted  another kernel of 128 KiB of code ran in between (the code comes from L2)
  16 blocks  as evicted, but the grid is 16 blocks (a one-wave grid of a small model: most
           SMs have not run the kernel for several launches)
Prints the median block's cycles and cycles per 128-byte line over the warm case.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

CHAINS = 8


def source(name: str, n_instr: int, salt: int) -> str:
    body = []
    for i in range(n_instr):
        c = i % CHAINS
        # distinct immediates: no two lines fold, and two kernels share no code
        body.append(f"x{c} = fmaf(x{c}, {1.0 + (i % 97 + salt) * 1e-6:.9f}f, {((i * 7 + salt) % 1000) * 1e-4:.6f}f);")
    decl = " ".join(f"float x{c} = a + (float)(t0 & {c + 1});" for c in range(CHAINS))
    tie = ", ".join(f'"f"(x{c})' for c in range(CHAINS))
    fake = " ".join(f"%{c + 1}" for c in range(CHAINS))
    return f"""
extern "C" __global__ void {name}(float* out, long long* cyc, float a) {{
    long long t0;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(t0));
    {decl}
    {chr(10).join(body)}
    long long t1;
    asm volatile("mov.u64 %0, %%clock64; // {fake}" : "=l"(t1) : {tie});
    if (threadIdx.x == 0) cyc[blockIdx.x] = t1 - t0;
    out[blockIdx.x * blockDim.x + threadIdx.x] = {' + '.join(f'x{c}' for c in range(CHAINS))};
}}
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kib", default="4,8,16,32,64")
    ap.add_argument("--warps", default="1,8")
    ap.add_argument("-r", type=int, default=5)
    a = ap.parse_args()
    try:
        sizes = [int(x) for x in a.kib.split(",")]
        warp_counts = [int(x) for x in a.warps.split(",")]
    except ValueError:
        ap.error("--kib and --warps take comma-separated integers")
    if min(sizes) < 1 or max(sizes) > 1024 or min(warp_counts) < 1 or max(warp_counts) > 32 or a.r < 1:
        ap.error("need 1 <= KiB <= 1024, 1 <= warps <= 32, -r >= 1")
    try:
        import cupy as cp
        sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    except Exception as e:  # noqa: BLE001 - no CuPy, no driver, no GPU: one line
        print(f"probe_icache: no CUDA device ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
              file=sys.stderr)
        return 2
    out = cp.zeros(sms * 1024, cp.float32)
    cyc = cp.zeros(sms, cp.int64)
    evict = cp.RawKernel(source("evict", 128 * 64, 500), "evict")
    print(f"{cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)['name'].decode()}, {sms} SMs\n")
    print("| code KiB | warps | warm cycles | evicted cycles | evicted, 16 blocks | extra cycles per 128 B line |")
    print("|---:|---:|---:|---:|---:|---:|")
    for kib in sizes:
        k = cp.RawKernel(source(f"code{kib}", kib * 64, kib), f"code{kib}")
        for warps in warp_counts:
            res = {"warm": [], "evicted": [], "small": []}
            for _ in range(a.r):
                for case in res:
                    blocks = 16 if case == "small" else sms
                    if case == "warm":
                        k((blocks,), (32 * warps,), (out, cyc, np.float32(1.0)))
                    else:
                        evict((sms,), (32,), (out, cyc, np.float32(1.0)))
                    cyc[:] = 0
                    k((blocks,), (32 * warps,), (out, cyc, np.float32(1.0)))
                    res[case].append(float(np.median(cyc[:blocks].get())))
            w, e, s = (statistics.median(res[c]) for c in ("warm", "evicted", "small"))
            lines = kib * 1024 / 128
            print(f"| {kib} | {warps} | {w:.0f} | {e:.0f} | {s:.0f} | {(e - w) / lines:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
