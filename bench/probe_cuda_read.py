#!/usr/bin/env python3
"""How fast the GPU reads gate+up's quantized tiles, with and without the dot's work.

    PYTHONPATH=src python3 -P bench/probe_cuda_read.py [--rows 11008] [--cols 4096] [--fmt q4_k]

The decode gate+up matvec (cuda/quant_matvec.cu, qmv_tile) gives a block one row tile of
32 rows and splits its items over S warps; a warp loads one item of gate and one of up
(UPI 16-byte units each, 512 contiguous bytes a warp load), waits, dots them, and loads
the next. This probe reads the same bytes in the same order with read-only kernels of its
own, so that what the access pattern costs and what the dot's work costs come apart:

  flat        a grid-stride read of both matrices (8 loads a thread in flight): the ceiling
  tile        the kernel's mapping, one item a matrix in flight, a trivial use of the words
  tile+work   the same with ~the dot's instructions on the words (2 dp4a and 2 ands a word)
  ...P2       two items a matrix in flight (the next item's loads out before the use)
  ...strided  warp w takes items w, w+S, w+2S, ... (the block's warps read adjacent items)

next to the real gate+up kernel (be.gate_up over uploaded random blocks) and the F16 one
of the same shape. Every kernel is timed as a captured graph of launches over copies of
the matrices totalling > 4x L2 (the bytes come from DRAM), plain launches (the real
kernels also under programmatic dependent launch, as decode runs them); GB/s are the
matrices' bytes per second, and % is of the copy bandwidth measured in the same run.
--defines times the real kernel built with throwaway compile switches, --carveouts under
forced shared-memory carveouts (with the blocks an SM the occupancy API then reports).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cupy as cp  # noqa: E402

import bench_cuda_quant as BQ  # noqa: E402
from cyllm.backends.cuda import CudaBackend  # noqa: E402
from cyllm.backends.cuda import quant as CQ  # noqa: E402

SRC = r"""
typedef unsigned int u32;
__device__ __forceinline__ uint4 ld16(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ int dp4a(u32 a, u32 b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
template <int UPI, int WORK>
__device__ __forceinline__ void use(const uint4 (&v)[UPI], int& a, int& b) {
#pragma unroll
    for (int j = 0; j < UPI; ++j) {
        const u32 w[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            if (WORK) {
                a = dp4a(w[t] & 0x0F0F0F0Fu, 0x01020304u + t, a);
                b = dp4a(w[t] & 0xF0F0F0F0u, 0x04030201u + j, b);
            } else {
                a ^= (int)w[t];
            }
        }
    }
}
// one row tile a block (blockIdx.x), S = blockDim.x / 32 warps, nbi items a row
template <int UPI, int P, int WORK, int STRIDED>
__device__ void tile_read(const uint4* __restrict__ g, const uint4* __restrict__ u, int* sink, int nbi) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, S = blockDim.x >> 5;
    const size_t base = (size_t)blockIdx.x * 32 * nbi * UPI;
    const int per = nbi / S;
    uint4 ga[P][UPI], ua[P][UPI];
    int a = 0, b = 0;
#define ITEM(k) (STRIDED ? warp + S * (k) : warp * per + (k))
#pragma unroll
    for (int p = 0; p < P; ++p) {
        if (p < per) {
            const size_t o = base + (size_t)ITEM(p) * UPI * 32 + lane;
#pragma unroll
            for (int j = 0; j < UPI; ++j) { ga[p][j] = ld16(g + o + 32 * j); ua[p][j] = ld16(u + o + 32 * j); }
        }
    }
    for (int k0 = 0; k0 < per; k0 += P) {
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const int k = k0 + p;
            if (k < per) {
                use<UPI, WORK>(ga[p], a, b);
                use<UPI, WORK>(ua[p], a, b);
                if (k + P < per) {
                    const size_t o = base + (size_t)ITEM(k + P) * UPI * 32 + lane;
#pragma unroll
                    for (int j = 0; j < UPI; ++j) { ga[p][j] = ld16(g + o + 32 * j); ua[p][j] = ld16(u + o + 32 * j); }
                }
            }
        }
    }
    if ((a ^ b) == 0x7fffffff) sink[0] = a;
}
#define TILE(NAME, P, WORK, STRIDED) \
extern "C" __global__ void NAME(const uint4* g, const uint4* u, int* sink, int nbi) { \
    tile_read<UPIV, P, WORK, STRIDED>(g, u, sink, nbi); }
TILE(tile_p1, 1, 0, 0)
TILE(tile_work_p1, 1, 1, 0)
TILE(tile_p2, 2, 0, 0)
TILE(tile_work_p2, 2, 1, 0)
TILE(tile_p1_strided, 1, 0, 1)
TILE(tile_work_p1_strided, 1, 1, 1)
extern "C" __global__ void flat(const uint4* __restrict__ g, const uint4* __restrict__ u, int* sink, long long n16) {
    int a = 0;
    const long long step = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * step < n16; i += 4 * step) {
        uint4 v[8];
#pragma unroll
        for (int k = 0; k < 4; ++k) { v[k] = ld16(g + i + k * step); v[4 + k] = ld16(u + i + k * step); }
#pragma unroll
        for (int k = 0; k < 8; ++k) a ^= (int)(v[k].x ^ v[k].y ^ v[k].z ^ v[k].w);
    }
    for (; i < n16; i += step) { uint4 v = ld16(g + i), w = ld16(u + i); a ^= (int)(v.x ^ w.y); }
    if (a == 0x7fffffff) sink[0] = a;
}
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=11008)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--fmt", default="q4_k", choices=["q4_k", "q4_0", "q8_0", "q6_k"])
    ap.add_argument("--warps", default="2,4,8", help="warps a block for the tile kernels")
    ap.add_argument("--defines", default="none",
                    help="comma-separated compile_defines settings for the real kernel (none, or "
                         "-DNAME+-DOTHER): gate_up timed once per setting")
    ap.add_argument("--carveouts", default="",
                    help="comma-separated shared-memory carveouts (percent, -1 = the driver's) to time "
                         "the real gate_up and a 4096x4096 matvec of the same format under, after the rest")
    ap.add_argument("--profile", action="store_true",
                    help="for ncu --profile-from-start off: launch each kernel 3 times (on different "
                         "copies) inside the profiled range instead of timing graphs")
    args = ap.parse_args(argv)
    be = CudaBackend()
    bw = be.measure_copy_bandwidth()
    l2 = cp.cuda.Device().attributes["L2CacheSize"]
    name, driver = BQ.gpu_info()
    print(f"# {name} (driver {driver}); copy bandwidth {bw:.0f} GB/s; L2 {l2 >> 20} MiB")
    d, n = args.rows, args.cols
    upi, ie = {"q4_k": (9, 256), "q4_0": (1, 32), "q8_0": (2, 32), "q6_k": (13, 256)}[args.fmt]
    if d % 32 or n % ie:
        raise SystemExit(f"error: rows must be a multiple of 32 and cols of {ie}")
    nbi = n // ie
    tiles = d // 32
    # The real kernel's matrices (the planes of q4_0/q8_0/q6_k add a few bytes the probe skips).
    gs, size = BQ.upload_copies(be, args.fmt, d, n, l2)
    us, _ = BQ.upload_copies(be, args.fmt, d, n, l2, seed=1)
    x = cp.random.standard_normal(n, dtype=cp.float32)
    o = cp.zeros(d, dtype=cp.float32)
    units = tiles * 32 * nbi * upi                                # uint4 a matrix the probe reads
    pbytes = 2 * units * 16
    ncop = BQ.copies_for(pbytes, l2)
    raw = [cp.random.randint(0, 2**31, size=(units, 4), dtype=cp.int64).astype(cp.uint32) for _ in range(2 * ncop)]
    sink = cp.zeros(1, dtype=cp.int32)
    mod = cp.RawModule(code=SRC, options=("-std=c++17", f"-DUPIV={upi}"))

    def cellp(nbytes, secs):
        gbs = nbytes / secs / 1e9
        return f"{gbs:.0f} ({100 * gbs / bw:.0f}%)", secs * 1e6

    def profiled(fns):
        for f in fns:                       # compiled and warm outside the range
            f()
        be._stream.synchronize()
        cp.cuda.profiler.start()
        for f in fns[:3]:
            f()
        be._stream.synchronize()
        cp.cuda.profiler.stop()

    def timed(nbytes, fns, pdl):
        if args.profile:
            profiled(fns)
            return "-", 0.0
        return cellp(nbytes, BQ.time_graph(be, fns, pdl))

    def probe(label, fn_of):
        fns = [fn_of(raw[2 * c], raw[2 * c + 1]) for c in range(ncop)] * 3
        c, t = timed(pbytes, fns, False)
        print(f"| {label} | {c} | {t:.2f} |", flush=True)

    sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    k = mod.get_function("flat")
    probe("flat, grid-stride", lambda g, u: (lambda: k((sm * 8,), (256,), (g, u, sink, np.int64(units)), stream=be._stream)))
    for w in [int(v) for v in args.warps.split(",") if v]:
        if nbi % w:
            continue
        for kn in ("tile_p1", "tile_work_p1", "tile_p2", "tile_work_p2", "tile_p1_strided", "tile_work_p1_strided"):
            kf = mod.get_function(kn)
            probe(f"{kn}, {w} warps", lambda g, u, kf=kf, w=w: (
                lambda: kf((tiles,), (32 * w,), (g, u, sink, np.int32(nbi)), stream=be._stream)))
    def residency():
        """(warps a block, registers, blocks an SM by the occupancy API) of the real gate+up as
        last launched (its carveout included)."""
        k = CQ.kernel(be, f"qmv_gate_up_silu_{args.fmt}", args.fmt)
        warps = CQ.matvec_warps(be, gs[0], 2)
        occ = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
            k.kernel.ptr, 32 * warps, CQ._shared_bytes(n, warps, 2))
        return warps, k.num_regs, occ

    for setting in args.defines.split(","):
        be.compile_defines = () if setting == "none" else tuple(setting.split("+"))
        for pdl in (False,) if args.profile else (False, True):
            fns = [lambda a=a, b=b: be.gate_up(o, a, b, x, "silu") for a, b in zip(gs, us)] * 3
            c, t = timed(2 * size, fns, pdl)
            warps, regs, occ = residency()
            print(f"| cyllm gate_up {args.fmt} {setting} ({'pdl' if pdl else 'plain'}; {warps} warps, "
                  f"{regs} registers, {occ} blocks an SM) | {c} | {t:.2f} |", flush=True)
    be.compile_defines = ()
    if args.carveouts:
        g4, size4 = BQ.upload_copies(be, args.fmt, 4096, 4096, l2)
        x4 = cp.random.standard_normal(4096, dtype=cp.float32)
        o4 = cp.zeros(4096, dtype=cp.float32)
        for c in [int(v) for v in args.carveouts.split(",")]:
            be.qmv_carveout = c                 # set at the next launch of each kernel
            fns = [lambda a=a, b=b: be.gate_up(o, a, b, x, "silu") for a, b in zip(gs, us)] * 3
            c1, t1 = timed(2 * size, fns, True)
            fns = [lambda a=a: be.matvec(o4, a, x4) for a in g4] * 3
            c2, t2 = timed(size4, fns, True)
            occ = residency()[2]
            print(f"| carveout {c}%: gate_up {args.fmt} (pdl; {occ} blocks an SM) | {c1} | {t1:.2f} "
                  f"| 4096x4096 matvec | {c2} | {t2:.2f} |", flush=True)
        be.qmv_carveout = None
        CQ._CARVEOUT.clear()                    # unknown again: the next launch sets the rule's
        del g4
    del gs, us
    cp.get_default_memory_pool().free_all_blocks()
    h = [(cp.random.standard_normal((d, n), dtype=cp.float32) * 0.02).astype(cp.float16)
         for _ in range(2 * BQ.copies_for(4 * d * n, l2))]
    for pdl in (False,) if args.profile else (False, True):
        fns = [lambda a=a, b=b: be.gate_up(o, a, b, x, "silu") for a, b in zip(h[0::2], h[1::2])] * 3
        c, t = timed(4 * d * n, fns, pdl)
        print(f"| cyllm gate_up f16 ({'pdl' if pdl else 'plain'}) | {c} | {t:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
