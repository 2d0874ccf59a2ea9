"""Decode matvec over quantized weights on the GPU, as a fraction of the copy bandwidth.

    PYTHONPATH=src python3 bench/bench_cuda_quant.py [--out bench/results/cuda_quant_<gpu>.md] [--quick]

For each format at Llama-2-7B shapes (4096x4096, 11008x4096, 4096x11008, 32000x4096):
GB/s of weight bytes (the file's bytes: what a token must read) of cuda_quant's matvec,
timed with CUDA events around a captured graph of many launches over copies of the
matrix totalling > 4x L2 (so the bytes come from DRAM), median of repeats; once with
plain launches and once with programmatic dependent launch (as decode_step launches
them). Against the device-to-device copy bandwidth (read + write) measured in the same
run, and the F16 matvec of the same shapes. Also: the warps-per-block choice, residual
add / gate+up / folded rmsnorm, the FP32-activation alternative (q8_0, q4_0), and the
prefill GEMM on dequantized tiles (T = 512).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import cupy as cp  # noqa: E402

from cyllm.backends.cuda import quant as CQ  # noqa: E402
from cyllm.backends.cuda import CudaBackend  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))     # bench/ (python -P leaves it out)
import cuda_switches  # noqa: E402
from shown_paths import shown  # noqa: E402
from cyllm.quant import QuantMatrix  # noqa: E402

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (32000, 4096)]
BENCH_FMTS = ["q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q5_k", "q6_k"]


def gpu_info() -> tuple[str, str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
        name, driver = [s.strip() for s in out.split(",")]
        return name, driver
    except Exception:  # noqa: BLE001
        return "unknown GPU", "unknown driver"


def random_blocks(fmt, rows, cols, seed=0):
    from test_cuda_quant import random_blocks as rb
    return rb(fmt, rows, cols, np.random.default_rng(seed))


def time_graph(be, fns, pdl: bool, reps: int = 15) -> float:
    """Median seconds per call of fns, replayed as one CUDA graph (PDL launches if pdl)."""
    s = be._stream
    with s:
        for f in fns:
            f()
        be._device_mode = pdl           # _launch uses programmatic dependent launch only then
        try:
            s.begin_capture()
            for f in fns:
                f()
            be._flush()                 # a matvec held back for the next op (prequant.py) belongs here
            g = s.end_capture()
        finally:
            be._device_mode = False
        g.launch(stream=s)
        s.synchronize()
        times = []
        for _ in range(reps):
            e0 = s.record()
            g.launch(stream=s)
            e1 = s.record()
            e1.synchronize()
            times.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3)
    return float(np.median(times)) / len(fns)


def copies_for(size, l2):
    return max(2, math.ceil(4 * l2 / size))


def upload_copies(be, fmt, d, n, l2, seed=0):
    raw = random_blocks(fmt, d, n, seed)
    qm = QuantMatrix(raw, fmt, (d, n))
    return [be.upload(qm) for _ in range(copies_for(raw.nbytes, l2))], raw.nbytes


def cell(gbs, bw):
    return f"{gbs:.0f} ({100 * gbs / bw:.0f}%)"


def bench_matvec(be, bw, l2, lines, fmts, quick):
    lines.append("\n## matvec (GB/s of weight bytes, % of copy bandwidth; graph of launches over > 4x L2)\n")
    lines.append("auto = cuda_quant's warps per block; wN = N warps; pdl = programmatic dependent launch "
                 "(as in decode_step), plain = without. F16 row: the backend's F16 matvec on the same shape.\n")
    warp_opts = [None] if quick else [None, 4, 8, 16]
    head = "| format | d x n | MiB | auto plain | " + " | ".join(
        [f"{'auto' if w is None else f'w{w}'} pdl" for w in warp_opts]) + " |"
    lines.append(head)
    lines.append("|" + "---|" * (len(warp_opts) + 4))
    summary = {}
    x = {n: cp.random.standard_normal(n, dtype=cp.float32) for _, n in SHAPES}
    out = cp.zeros(32000, dtype=cp.float32)
    for d, n in SHAPES:
        w16s = None
        for fmt in fmts + ["f16"]:
            if fmt == "f16":
                size = d * n * 2
                w16s = [(cp.random.standard_normal((d, n), dtype=cp.float32) * 0.02).astype(cp.float16)
                        for _ in range(copies_for(size, l2))]
                ws = w16s
            else:
                ws, size = upload_copies(be, fmt, d, n, l2)
            o = out[:d]
            fns = [lambda m=m: be.matvec(o, m, x[n]) for m in ws] * 3
            row = [cell(size / time_graph(be, fns, False) / 1e9, bw)]
            for wv in (warp_opts if fmt != "f16" else [None]):
                be.qmv_warps = wv
                gp = size / time_graph(be, fns, True) / 1e9
                row.append(cell(gp, bw))
                if wv is None:
                    summary[(fmt, d, n)] = gp
            be.qmv_warps = None
            if fmt == "f16":
                row += ["-"] * (len(warp_opts) - 1)
            lines.append(f"| {fmt} | {d}x{n} | {size / 2**20:.1f} | " + " | ".join(row) + " |")
            print(lines[-1], flush=True)
            del ws, fns
            cp.get_default_memory_pool().free_all_blocks()
    return summary


def bench_floor(be, lines, fmts):
    """Time per launch of a tiny matvec (4096 rows, one item per row) in a graph: the
    per-kernel chain (wait for the previous kernel, stage x, dot, reduce, retire) without bytes."""
    lines.append("\n## latency floor: us per launch, 4096 rows x one item (graph of 64 launches)\n")
    lines.append("| format | n | plain | pdl |")
    lines.append("|---|---|---|---|")
    o = cp.zeros(4096, dtype=cp.float32)
    for fmt in fmts + ["f16"]:
        n = 256 if fmt in ("q4_k", "q5_k", "q6_k") else 32 if fmt != "f16" else 256
        x = cp.random.standard_normal(n, dtype=cp.float32)
        if fmt == "f16":
            ws = [(cp.random.standard_normal((4096, n), dtype=cp.float32) * 0.02).astype(cp.float16) for _ in range(8)]
        else:
            qm = QuantMatrix(random_blocks(fmt, 4096, n), fmt, (4096, n))
            ws = [be.upload(qm) for _ in range(8)]
        fns = [lambda m=m: be.matvec(o, m, x) for m in ws] * 8
        cells = [f"{time_graph(be, fns, p) * 1e6:.2f}" for p in (False, True)]
        lines.append(f"| {fmt} | {n} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)


def bench_residency(be, bw, l2, lines):
    """Blocks per SM by the occupancy API (the next kernel's block must fit beside the running
    one for its weight loads to overlap it under PDL), and the time with the shared-memory
    carveout left to the driver, as cuda_quant computes it, and at the maximum."""
    lines.append("\n## residency at 4096x4096 (auto warps, pdl): shared-memory carveout\n")
    lines.append("| format | warps | regs | smem B | blocks/SM (API) | driver default | cuda_quant's choice | 100% |")
    lines.append("|---|---|---|---|---|---|---|---|")
    d = n = 4096
    x = cp.random.standard_normal(n, dtype=cp.float32)
    o = cp.zeros(d, dtype=cp.float32)
    for fmt in ("q4_k", "q4_0", "q8_0", "q6_k", "q5_k"):
        ws, size = upload_copies(be, fmt, d, n, l2)
        fns = [lambda m=m: be.matvec(o, m, x) for m in ws] * 3
        fns[0]()
        k = CQ.kernel(be, f"qmv_{fmt}", fmt)
        warps = CQ.matvec_warps(be, ws[0], 1)
        smem = CQ._shared_bytes(n, warps, 1)
        try:
            occ = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(k.kernel.ptr, 32 * warps, smem)
        except Exception as e:  # noqa: BLE001
            occ = f"? ({type(e).__name__})"
        cells = []
        for c in (-1, None, 100):
            be.qmv_carveout = c                 # None: the rule's (cuda_quant._carveout)
            cells.append(cell(size / time_graph(be, fns, True) / 1e9, bw))
        be.qmv_carveout = None
        CQ._CARVEOUT.clear()                    # unknown again: the next launch sets the rule's
        lines.append(f"| {fmt} | {warps} | {k.num_regs} | {smem} | {occ} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
        del ws, fns
        cp.get_default_memory_pool().free_all_blocks()


def bench_fused(be, bw, l2, lines, fmts):
    lines.append("\n## fused variants (auto warps, pdl; GB/s of weight bytes, % of copy bandwidth)\n")
    lines.append("| format | op | d x n | GB/s |")
    lines.append("|---|---|---|---|")
    for fmt in fmts:
        for op, (d, n) in (("matvec_add", (4096, 11008)), ("gate_up_silu", (11008, 4096)),
                           ("rmsnorm+matvec", (4096, 4096)), ("rmsnorm+gate_up_silu", (11008, 4096))):
            nm = 2 if "gate_up" in op else 1
            raw = random_blocks(fmt, d, n)
            qm = QuantMatrix(raw, fmt, (d, n))
            size = raw.nbytes * nm
            ws = [[be.upload(qm) for _ in range(nm)] for _ in range(copies_for(size, l2))]
            x = cp.random.standard_normal(n, dtype=cp.float32)
            xb = cp.zeros(n, dtype=cp.float32)
            nw = cp.ones(n, dtype=cp.float32)
            o = cp.zeros(d, dtype=cp.float32)
            if op == "matvec_add":
                fns = [lambda m=m: be.matvec_add(o, m[0], x) for m in ws] * 3
            elif op == "gate_up_silu":
                fns = [lambda m=m: be.gate_up(o, m[0], m[1], x, "silu") for m in ws] * 3
            elif op == "rmsnorm+matvec":
                fns = [lambda m=m: (be.rmsnorm(xb, x, nw, 1e-5), be.matvec(o, m[0], xb)) for m in ws] * 3
            else:
                fns = [lambda m=m: (be.rmsnorm(xb, x, nw, 1e-5), be.gate_up(o, m[0], m[1], xb, "silu"))
                       for m in ws] * 3
            t = time_graph(be, fns, True)
            lines.append(f"| {fmt} | {op} | {d}x{n} | {cell(size / t / 1e9, bw)} |")
            print(lines[-1], flush=True)
            del ws, fns
            cp.get_default_memory_pool().free_all_blocks()


def xf32_launch(be, out, w, x):
    """The FP32-activation matvec (measurement only): qmv_xf32_<fmt>."""
    k = CQ.kernel(be, f"qmv_xf32_{w.fmt.name}", w.fmt.name)
    warps = CQ.matvec_warps(be, w, 1)
    smem = 4 * w.cols + 4 * 32 * warps
    CQ._carveout(be, k, w.fmt.name)          # the same carveout rule as the int8 kernels
    be._launch(k, (-(-w.rows // 32),), (32 * warps,),
               (out, w.data, x, np.int32(w.rows), np.int32(w.nbi)), shared_mem=smem)


def bench_xf32(be, bw, l2, lines):
    from test_cuda_quant import deq64
    lines.append("\n## int8 vs FP32 activations (same layout and launch shape; pdl; GB/s, % of copy bandwidth)\n")
    lines.append("| format | d x n | int8 x (dp4a) | FP32 x | FP32 x check: rel err vs float64 |")
    lines.append("|---|---|---|---|---|")
    for fmt in ("q8_0", "q4_0"):
        for d, n in ((4096, 4096), (11008, 4096), (4096, 11008)):
            ws, size = upload_copies(be, fmt, d, n, l2)
            x = cp.random.standard_normal(n, dtype=cp.float32)
            o = cp.zeros(d, dtype=cp.float32)
            # correctness of the alternative before timing it (one small matrix)
            raw = random_blocks(fmt, 77, n, 3)
            wt = be.upload(QuantMatrix(raw, fmt, (77, n)))
            ot = cp.full(77, cp.nan, dtype=cp.float32)
            xf32_launch(be, ot, wt, x)
            want = deq64(raw, fmt, n) @ cp.asnumpy(x).astype(np.float64)
            err = float(np.linalg.norm(cp.asnumpy(ot) - want) / np.linalg.norm(want))
            t8 = time_graph(be, [lambda m=m: be.matvec(o, m, x) for m in ws] * 3, True)
            t32 = time_graph(be, [lambda m=m: xf32_launch(be, o, m, x) for m in ws] * 3, True)
            lines.append(f"| {fmt} | {d}x{n} | {cell(size / t8 / 1e9, bw)} | {cell(size / t32 / 1e9, bw)} | {err:.1e} |")
            print(lines[-1], flush=True)
            del ws
            cp.get_default_memory_pool().free_all_blocks()


def bench_prefill(be, lines, fmts):
    lines.append("\n## prefill GEMM on quantized weights (T = 512: dequantize tiles to FP16 + cuBLAS; "
                 "host clock over 20 calls)\n")
    lines.append("| format | T x n -> d | ms | TFLOP/s | F16 weights: ms |")
    lines.append("|---|---|---|---|---|")
    t = 512
    for d, n in ((4096, 4096), (11008, 4096)):
        x = cp.random.standard_normal((t, n), dtype=cp.float32)
        out = cp.zeros((t, d), cp.float32)
        w16 = (cp.random.standard_normal((d, n), dtype=cp.float32) * 0.02).astype(cp.float16)
        t16 = _time_host(be, lambda w=w16: be.matmul(out, w, x))
        for fmt in fmts:
            wq = be.upload(QuantMatrix(random_blocks(fmt, d, n), fmt, (d, n)))
            tq = _time_host(be, lambda w=wq: be.matmul(out, w, x))
            lines.append(f"| {fmt} | {t}x{n} -> {d} | {tq * 1e3:.3f} | {2 * t * n * d / tq / 1e12:.0f} | {t16 * 1e3:.3f} |")
            print(lines[-1], flush=True)
        cp.get_default_memory_pool().free_all_blocks()


def _time_host(be, fn, calls=20) -> float:
    """Seconds per call, host clock around many calls (cuBLAS refuses CuPy's stream capture),
    so Python's launch cost is included where it exceeds the GPU time."""
    fn()
    be.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    be.synchronize()
    return (time.perf_counter() - t0) / calls


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="markdown file for the results")
    ap.add_argument("--quick", action="store_true", help="auto warps only, fewer formats")
    ap.add_argument("--formats", default=",".join(BENCH_FMTS))
    args = ap.parse_args(argv)
    fmts = [f for f in args.formats.split(",") if f]
    be = CudaBackend()
    for line in cuda_switches.apply(be):
        print(f"experiment switch: {line}", file=sys.stderr)
    name, driver = gpu_info()
    props = cp.cuda.runtime.getDeviceProperties(be.device.id)
    l2 = int(props.get("l2CacheSize", 50 << 20))
    t0 = time.perf_counter()
    for fmt in fmts:                  # compile every format first: NVRTC stays out of the timings
        CQ._module(be, fmt)
    compile_s = time.perf_counter() - t0
    bw = be.measure_copy_bandwidth()          # GB/s, bytes read + written
    lines = [f"# cyllm quantized decode matvec on the GPU: {name}", "",
             f"- GPU: {name}, driver {driver}, {be.sm_count} SMs, L2 {l2 >> 20} MiB",
             f"- CuPy {cp.__version__}, CUDA runtime {cp.cuda.runtime.runtimeGetVersion()}, "
             f"NVRTC compile of {len(fmts)} format modules: {compile_s:.1f} s",
             f"- command: `PYTHONPATH=src python3 bench/bench_cuda_quant.py {shown(' '.join(argv or sys.argv[1:]))}`",
             f"- device-to-device copy bandwidth (read + write): **{bw:.0f} GB/s**",
             "- weights: random block bytes with finite scales (speed depends on bytes, not values)"]
    print("\n".join(lines), flush=True)
    summary = bench_matvec(be, bw, l2, lines, fmts, args.quick)
    if not args.quick:
        for section in (lambda: bench_residency(be, bw, l2, lines),
                        lambda: bench_floor(be, lines, ["q4_k", "q4_0", "q8_0", "q6_k"]),
                        lambda: bench_xf32(be, bw, l2, lines),
                        lambda: bench_fused(be, bw, l2, lines, ["q4_k", "q8_0", "q6_k"]),
                        lambda: bench_prefill(be, lines, ["q4_k", "q8_0", "q6_k", "q4_0"])):
            try:
                section()
            except Exception as e:  # noqa: BLE001 - one failed section must not lose the others
                lines.append(f"\n(section failed: {type(e).__name__}: {e})\n")
                print(lines[-1], flush=True)
                be._device_mode = False
                cp.get_default_memory_pool().free_all_blocks()
    lines.append("\n## summary: matvec with pdl, % of copy bandwidth\n")
    lines.append("| format | " + " | ".join(f"{d}x{n}" for d, n in SHAPES) + " |")
    lines.append("|---|" + "---|" * len(SHAPES))
    for fmt in fmts + ["f16"]:
        lines.append(f"| {fmt} | " + " | ".join(f"{100 * summary[(fmt, d, n)] / bw:.0f}%" for d, n in SHAPES) + " |")
    text = "\n".join(lines) + "\n"
    print("\n".join(lines[-(len(fmts) + 4):]))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
