"""Microbenchmarks of the CUDA backend's kernels, as ratios to the copy bandwidth measured in the same run.

    PYTHONPATH=src python3 bench/bench_cuda.py [--out bench/results/cuda_ops_<gpu>.md] [--quick]

What it measures (each timed with CUDA events around a captured graph of many
launches, median of repeats, so Python launch cost stays out):
  * device-to-device copy bandwidth (bytes read + written): the roofline;
  * matvec / matvec_add / gate_up at Llama-2-7B shapes, GB/s of weights read,
    for several launch shapes (rows per warp x warps per block); weights are
    rotated over copies totalling > 4x L2 so the numbers are DRAM, not cache;
  * decode attention over a 4096-position FP16 cache (MHA and GQA);
  * a whole synthetic decode (cyllm's Model on random weights of Llama-2-7B and
    SmolLM2-135M shape) through decode_step's CUDA graph: tokens/s against the roofline
    bandwidth / (weight bytes + KV bytes read per token);
  * the prefill GEMM (matmul, T=512).
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

import cupy as cp  # noqa: E402

from cyllm.backends.cuda import CudaBackend  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))     # bench/ (python -P leaves it out)
import cuda_switches  # noqa: E402
from shown_paths import shown  # noqa: E402



def gpu_info() -> tuple[str, str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
        name, driver = [s.strip() for s in out.split(",")]
        return name, driver
    except Exception:  # noqa: BLE001
        return "unknown GPU", "unknown driver"


def rand16(shape, scale=0.02):
    return (cp.random.standard_normal(shape, dtype=cp.float32) * scale).astype(cp.float16)


def time_graph(be, fns, reps=15) -> float:
    """Median seconds per call of fns (a list of launches), replayed as one CUDA graph."""
    s = be._stream
    with s:
        for f in fns:
            f()
        s.begin_capture()
        for f in fns:
            f()
        g = s.end_capture()
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


def bench_matvec(be, bw, l2_bytes, lines, quick):
    shapes = [(4096, 4096), (12288, 4096), (11008, 4096), (4096, 11008), (32000, 4096), (576, 576), (1536, 576)]
    # (rows per warp, warps per block, loads in flight per lane); None = the backend's heuristic
    variants = [(None, None, None), (1, 8, 4), (1, 16, 4), (1, 4, 4), (1, 2, 4), (1, 8, 8), (2, 4, 4), (4, 4, 4)]
    if quick:
        variants = variants[:3]
    lines.append("\n## matvec (FP16 weights, GB/s of weight bytes; % of copy bandwidth)\n")
    head = "| op | d x n | " + " | ".join("auto" if r is None else f"r{r}w{w}u{u}" for r, w, u in variants) + " |"
    lines.append(head)
    lines.append("|" + "---|" * (len(variants) + 2))
    best = {}
    for op in ("matvec", "matvec_add", "gate_up", "norm+matvec", "norm+gate_up"):
        for d, n in shapes:
            if op != "matvec" and (d, n) in ((32000, 4096), (12288, 4096)):
                continue
            if op.startswith("norm") and n == 11008:
                continue
            gate = op.endswith("gate_up")
            nmat = 2 if gate else 1
            size = d * n * 2 * nmat
            copies = max(2, math.ceil(4 * l2_bytes / size))
            ws = [[rand16((d, n)) for _ in range(nmat)] for _ in range(copies)]
            x = cp.random.standard_normal(n, dtype=cp.float32)
            xb = cp.zeros(n, dtype=cp.float32)
            nw = cp.ones(n, dtype=cp.float32)
            out = cp.zeros(d, dtype=cp.float32)
            row = []
            for r, w, u in (variants if op == "matvec" else variants[:1]):
                be.matvec_rows, be.matvec_warps, be.matvec_unroll = r, w, u
                if op == "matvec":
                    fns = [lambda m=m: be.matvec(out, m[0], x) for m in ws] * 3
                elif op == "matvec_add":
                    fns = [lambda m=m: be.matvec_add(out, m[0], x) for m in ws] * 3
                elif op == "gate_up":
                    fns = [lambda m=m: be.gate_up(out, m[0], m[1], x) for m in ws] * 3
                elif op == "norm+matvec":
                    fns = [lambda m=m: (be.rmsnorm(xb, x, nw, 1e-5), be.matvec(out, m[0], xb)) for m in ws] * 3
                else:
                    fns = [lambda m=m: (be.rmsnorm(xb, x, nw, 1e-5), be.gate_up(out, m[0], m[1], xb))
                           for m in ws] * 3
                if op.startswith("norm"):
                    cells = []
                    for fuse in (True, False):
                        be.fuse_norm = fuse
                        t = time_graph(be, fns)
                        gbs = size / t / 1e9
                        cells.append(f"{'fused' if fuse else 'separate'} {t * 1e6:.1f} us {gbs:.0f} ({100 * gbs / bw:.0f}%)")
                    be.fuse_norm = True
                    row.append(" / ".join(cells))
                    continue
                t = time_graph(be, fns)
                gbs = size / t / 1e9
                row.append(f"{gbs:.0f} ({100 * gbs / bw:.0f}%)")
                if op == "matvec":
                    best.setdefault((d, n), []).append((gbs, r, w, u))
            be.matvec_rows = be.matvec_warps = be.matvec_unroll = None
            lines.append(f"| {op} | {d}x{n} | " + " | ".join(row) + " |")
            del ws
            cp.get_default_memory_pool().free_all_blocks()
    for (d, n), v in best.items():
        g, r, w, u = max(v, key=lambda t: t[0])
        lines.append(f"\nbest matvec {d}x{n}: rows/warp={r} warps={w} unroll={u} {g:.0f} GB/s")


def bench_attention(be, bw, lines):
    # heads a block follow CudaBackend._attn_plan (by position); each K/V row counts once,
    # however many of a group's blocks read it
    lines.append("\n## attention, context 4096 (GB/s of K+V bytes read; % of copy bandwidth)\n")
    lines.append("| heads / kv heads / head_dim | pos | K, V before the wait: us, GB/s, % | K, V in their passes: us, GB/s, % |")
    lines.append("|---|---|---|---|")
    for nh, nkv, hd in [(32, 32, 128), (32, 8, 128), (9, 3, 64)]:
        ctx = 4096
        layers = 4
        caches = [(rand16((nkv, ctx, hd), 1.0), rand16((nkv, ctx, hd), 1.0)) for _ in range(layers)]
        q = cp.random.standard_normal(nh * hd, dtype=cp.float32)
        out = cp.zeros(nh * hd, dtype=cp.float32)
        for pos in (ctx - 1, 511, 63):
            cells = []
            for ve in (True, False):
                be.attn_v_early = ve
                fns = [lambda c=c: be.attention(out, q, c[0], c[1], pos) for c in caches] * 4
                t = time_graph(be, fns)
                nbytes = 2 * nkv * (pos + 1) * hd * 2
                gbs = nbytes / t / 1e9
                cells.append(f"{t * 1e6:.1f}, {gbs:.0f}, {100 * gbs / bw:.0f}%")
            be.attn_v_early = None
            lines.append(f"| {nh}/{nkv}/{hd} | {pos} | " + " | ".join(cells) + " |")
        del caches
        cp.get_default_memory_pool().free_all_blocks()


def bench_decode(be, bw, preset, depths, lines, n_tok=128, graphs=True):
    """Decode tokens/s of cyllm's own Model (model.py) on synthetic weights of a real shape."""
    from cyllm.model import Model
    from cyllm.tools.synthetic import build_synthetic

    config, weights = build_synthetic(preset)
    ctx = max(depths) + n_tok + 8
    be.reset_graph()
    be.use_graphs = graphs
    m = Model.from_weights(config, weights, backend=be, context=ctx)
    del weights
    rows = []
    for d0 in depths:
        for i in range(3):      # warm-up: compile, capture
            m.forward(i + 1, d0 + i)
        t0 = time.perf_counter()
        for i in range(n_tok):
            m.forward((i * 7919) % config.vocab_size, d0 + i)   # includes the per-token logits copy
        dt = time.perf_counter() - t0
        tps = n_tok / dt
        per_tok = m.weight_bytes + config.kv_bytes_per_token() * (d0 + n_tok / 2)
        roof = bw / per_tok
        rows.append(f"| {preset} | tg{n_tok} @d{d0} | {'graph' if graphs else 'eager'} | {tps:.1f} | "
                    f"{roof:.1f} | {100 * tps / roof:.1f}% | {per_tok / 1e9:.3f} |")
    lines.extend(rows)
    be.use_graphs = True
    be.reset_graph()
    del m
    cp.get_default_memory_pool().free_all_blocks()


def bench_matmul(be, lines):
    lines.append("\n## prefill GEMM (matmul, FP16 in, FP32 accumulate/out)\n")
    lines.append("| T x n -> d | ms | TFLOP/s |")
    lines.append("|---|---|---|")
    for t, n, d in [(512, 4096, 4096), (512, 4096, 11008), (512, 11008, 4096)]:
        w = rand16((d, n))
        x = cp.random.standard_normal((t, n), dtype=cp.float32)
        out = cp.zeros((t, d), cp.float32)
        be.matmul(out, w, x)
        be.synchronize()
        s = be._stream
        with s:
            e0 = s.record()
            for _ in range(10):
                be.matmul(out, w, x)
            e1 = s.record()
            e1.synchronize()
        ms = cp.cuda.get_elapsed_time(e0, e1) / 10
        lines.append(f"| {t}x{n} -> {d} | {ms:.3f} | {2 * t * n * d / ms / 1e9:.0f} |")
    lines.append(f"\nGemmEx path: {'no (cupy.matmul fallback)' if getattr(be, '_gemm_broken', False) else 'yes'}")


def bench_attention_batch(be, lines):
    lines.append("\n## attention_batch (prefill, causal; FLOPs = 4 * hd * attended pairs)\n")
    lines.append("| heads / kv heads / head_dim | T | pos0 | float4: us, TFLOP/s | scalar: us, TFLOP/s |")
    lines.append("|---|---|---|---|---|")
    for nh, nkv, hd in [(32, 32, 128), (32, 8, 128), (9, 3, 64)]:
        ctx = 1024
        kc, vc = rand16((nkv, ctx, hd), 1.0), rand16((nkv, ctx, hd), 1.0)
        for t, pos0 in [(256, 0), (256, 256), (512, 0)]:
            q = cp.random.standard_normal((t, nh * hd), dtype=cp.float32)
            out = cp.zeros((t, nh * hd), dtype=cp.float32)
            pairs = sum(pos0 + i + 1 for i in range(t))
            flops = 4 * hd * pairs * nh
            cells = []
            for vec in (True, False):
                be.attn_batch_vec = vec
                dt = time_graph(be, [lambda: be.attention_batch(out, q, kc, vc, pos0)] * 5)
                cells.append(f"{dt * 1e6:.1f}, {flops / dt / 1e12:.1f}")
            be.attn_batch_vec = True
            lines.append(f"| {nh}/{nkv}/{hd} | {t} | {pos0} | " + " | ".join(cells) + " |")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="also write the markdown report here")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-7b", action="store_true")
    args = ap.parse_args(argv)

    be = CudaBackend()
    for line in cuda_switches.apply(be):
        print(f"experiment switch: {line}", file=sys.stderr)
    t_compile = time.perf_counter()
    be.warmup()
    t_compile = time.perf_counter() - t_compile
    name, driver = gpu_info()
    props = cp.cuda.runtime.getDeviceProperties(be.device.id)
    l2 = int(props.get("l2CacheSize", 50 << 20))
    bw = be.measure_copy_bandwidth() * 1e9
    lines = [f"# cyllm CUDA backend microbenchmarks: {name}", "",
             f"- GPU: {name}, driver {driver}, {be.sm_count} SMs, L2 {l2 / 2**20:.0f} MiB",
             f"- CuPy {cp.__version__}, CUDA runtime {cp.cuda.runtime.runtimeGetVersion()}, "
             f"kernel compile {t_compile:.1f} s, plain loads fallback: {be.plain_loads}",
             f"- command: `PYTHONPATH=src python3 bench/bench_cuda.py {shown(' '.join(argv or sys.argv[1:]))}`",
             f"- device-to-device copy bandwidth (read + write): **{bw / 1e9:.0f} GB/s**"]
    print("\n".join(lines), flush=True)
    n0 = len(lines)
    bench_matvec(be, bw / 1e9, l2, lines, args.quick)
    bench_attention(be, bw / 1e9, lines)
    print("\n".join(lines[n0:]), flush=True)
    n0 = len(lines)
    lines.append("\n## whole decode, synthetic weights (tokens/s; roofline = copy bandwidth / bytes per token)\n")
    lines.append("| model | test | mode | t/s | roofline t/s | % roofline | GB/token |")
    lines.append("|---|---|---|---|---|---|---|")
    for fuse in (True, False):
        be.fuse_norm = fuse
        tag = " + norm folded" if fuse else ""
        n_before = len(lines)
        bench_decode(be, bw, "smollm2-135m", [0, 2048], lines)
        if not args.skip_7b:
            bench_decode(be, bw, "llama2-7b", [0, 4096], lines)
        lines[n_before:] = [ln.replace("| graph |", f"| graph{tag} |") for ln in lines[n_before:]]
    be.fuse_norm = True
    bench_decode(be, bw, "smollm2-135m", [0], lines, n_tok=32, graphs=False)
    print("\n".join(lines[n0:]), flush=True)
    n0 = len(lines)
    bench_matmul(be, lines)
    bench_attention_batch(be, lines)
    print("\n".join(lines[n0:]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
