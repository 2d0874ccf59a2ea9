#!/usr/bin/env python3
"""Whole-model CUDA decode under several backend settings, one model load, interleaved.

    python bench/sweep_cuda_decode.py --synthetic llama2-7b --quantize q4_k,q4_0,q8_0 \
        [--vary fuse_norm=1,0 --vary qmv_warps=none,8] [--bind-vary fuse_qkv=1,0]
        [-n 128] [-d 0,4096] [-r 3] [--profile] [--out FILE.md]

For each quantize type (the synthetic F16 weights are built once and quantized per type;
or -m FILE for one file), the model is bound on the CUDA backend once; then for every
depth, rounds of -r: each round times -n decode tokens for every setting in turn (each
combination of the --vary backend attributes, re-capturing the step's graph), so a drift
of the GPU's clocks or of the host touches all settings alike. --bind-vary: attributes read
when the model is bound (e.g. fuse_qkv, which decides whether q, k and v are stacked): one model bound
per combination, all held at once, their rounds interleaved with the --vary settings.
--profile: afterwards one
more token (default settings) between cudaProfilerStart/Stop, for
`ncu --profile-from-start off` (one result per kernel of the step's graph). Reports the median tok/s and % of roofline (weight and KV bytes of a token / the
device copy bandwidth measured in the same run), as `cyllm bench` computes them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from shown_paths import shown_argv  # noqa: E402


def _value(text: str):
    """int, float, none, a tuple of names joined by '+' (q4_0+q6_k; one name: q4_0+), or of
    compiler defines (-DNAME+-DOTHER, for compile_defines: kernels built both ways)."""
    if text.strip().startswith("-D"):
        return tuple(x for x in text.strip().split("+") if x)
    t = text.strip().lower()
    if t == "none":
        return None
    if "+" in t:
        names = tuple(x for x in t.split("+") if x)
        if names and all(x.replace("_", "").isalnum() for x in names):
            return names
        raise ValueError(text)
    try:
        return int(t)
    except ValueError:
        return float(t)


def _defines(v) -> tuple:
    """A compile_defines value: none -> (), else every part a -D option."""
    if v is None:
        return ()
    if isinstance(v, tuple) and all(isinstance(x, str) and x.startswith("-D") and len(x) > 2 for x in v):
        return v
    raise ValueError(v)


def decode_tok_s(model, n: int, depth: int, rng) -> float:
    ids = rng.integers(0, model.config.vocab_size, size=n).tolist()
    t0 = time.perf_counter()
    for i, tok in enumerate(ids):
        model.forward(tok, depth + i)          # host logits: synchronised
    return n / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model")
    ap.add_argument("--synthetic")
    ap.add_argument("--quantize", default="", help="comma-separated --quantize types (empty: as loaded)")
    ap.add_argument("--vary", action="append", default=[], metavar="ATTR=V1,V2",
                    help="a backend attribute and its values (int, float, none, names joined by +, or "
                         "compile_defines=none,-DNAME+-DOTHER: the quantized kernels, built per setting; the "
                         "dense ones are built once); repeatable")
    ap.add_argument("--bind-vary", action="append", default=[], metavar="ATTR=V1,V2",
                    help="the same for attributes read when the model is bound (one model each)")
    ap.add_argument("--profile", action="store_true", help="one token under cudaProfilerStart/Stop at the end")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-d", default="0", help="depths, comma-separated")
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    axes, bind_axes = [], []
    for flag, given, out in (("--vary", a.vary, axes), ("--bind-vary", a.bind_vary, bind_axes)):
        for v in given:
            attr, eq, vals = v.partition("=")
            try:
                vals = [_value(x) for x in vals.split(",")]
                if attr == "compile_defines":
                    vals = [_defines(x) for x in vals]
                out.append((attr, vals))
            except ValueError:
                eq = ""
            if not (attr and eq):
                ap.error(f"{flag} {v!r}: expected ATTR=V1,V2 with int, float, none or name+name values "
                         "(compile_defines: none or -DNAME+-DOTHER)")
    try:
        depths = [int(d) for d in a.d.split(",")]
    except ValueError:
        ap.error(f"-d {a.d!r}: expected comma-separated integers")
    if a.n < 1 or a.r < 1 or min(depths) < 0:
        ap.error("need -n >= 1, -r >= 1 and depths >= 0")
    from cyllm.errors import CyllmError
    from cyllm.quant.convert import check_quantize_type
    try:
        qtypes = [q for q in a.quantize.split(",") if q] or [None]
        for q in qtypes:
            if q is not None:
                check_quantize_type(q)          # before minutes of loading, not after
        return sweep(a, axes, bind_axes, depths, qtypes)
    except CyllmError as e:
        print(f"sweep_cuda_decode: {e}", file=sys.stderr)
        return 2


def _combinations(axes) -> list[tuple]:
    out = [()]
    for attr, vals in axes:
        out = [s + ((attr, v),) for s in out for v in vals]
    return out


def sweep(a, axes, bind_axes, depths, qtypes) -> int:
    import copy

    from cyllm.quant.convert import quantize_weights
    from cyllm.tools.bench import (bind_model, fill_cache_to_depth, kv_bytes_read, load_source, make_backend,
                                   weight_bytes_read_per_token)
    settings = _combinations(axes)
    binds = _combinations(bind_axes)
    backend = make_backend("cuda", 1)           # no GPU or no CuPy: one clear error, before any loading
    base = load_source(a.model, a.synthetic, 0, ("cuda",), max(depths) + a.n)
    bw = backend.measure_copy_bandwidth()
    import cupy as cp
    name = cp.cuda.runtime.getDeviceProperties(backend.device.id)["name"].decode()
    lines = [f"# CUDA decode sweep: {base.label}, {name}", "",
             f"command: `{shown_argv('bench/sweep_cuda_decode.py', sys.argv[1:])}`; "
             f"copy bandwidth {bw:.0f} GB/s; -n {a.n}, median of {a.r} interleaved rounds", "",
             "| weights | depth | setting | tok/s | % of roofline |", "|---|---:|---|---:|---:|"]
    print("\n".join(lines), flush=True)
    for q in qtypes:
        weights = dict(base.weights)
        if q is not None:
            t0 = time.perf_counter()
            quantize_weights(base.config, weights, q)
            print(f"quantized to {q} in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        src = copy.copy(base)
        src.weights = weights
        models = {}
        for bs in binds:                                # one model per bind-time setting
            saved = {attr: getattr(backend, attr, None) for attr, _ in bs}
            for attr, v in bs:
                setattr(backend, attr, v)
            models[bs] = bind_model(src, backend, max(depths) + a.n + 1)
            for attr, v in saved.items():
                setattr(backend, attr, v)
        model = models[binds[0]]
        wbytes = weight_bytes_read_per_token(model)
        pool = cp.get_default_memory_pool()
        free, total = cp.cuda.runtime.memGetInfo()
        print(f"{q or base.label}: after the load ({len(models)} bound), CuPy's pool holds "
              f"{pool.total_bytes() / 2**30:.3f} GiB ({pool.used_bytes() / 2**30:.3f} in use), the device "
              f"{(total - free) / 2**30:.3f} GiB", file=sys.stderr, flush=True)
        rng = np.random.default_rng(0)
        runs = [(bs, st) for bs in binds for st in settings]
        for depth in depths:
            for m in models.values():
                fill_cache_to_depth(m, depth, 0)
            defaults = {attr: getattr(backend, attr, None) for attr, _ in axes}
            res: dict = {run: [] for run in runs}
            for _ in range(a.r):
                for bs, st in runs:
                    for attr, v in st:
                        setattr(backend, attr, v)
                    backend.reset_graph()
                    decode_tok_s(models[bs], 4, depth, rng)     # eager pass + capture
                    res[(bs, st)].append(decode_tok_s(models[bs], a.n, depth, rng))
            for attr, v in defaults.items():
                setattr(backend, attr, v)
            for bs, st in runs:
                t = statistics.median(res[(bs, st)])
                roof = bw * 1e9 / (wbytes + kv_bytes_read(models[bs], depth, a.n))
                label = " ".join(f"{k}={v}" for k, v in bs + st) or "default"
                lines.append(f"| {q or base.label} | {depth} | {label} | {t:.1f} | {100 * t / roof:.1f}% |")
                print(lines[-1], flush=True)
        if a.profile:
            backend.reset_graph()
            decode_tok_s(model, 4, 0, rng)
            cp.cuda.Device().synchronize()
            cp.cuda.profiler.start()
            decode_tok_s(model, 1, 8, rng)
            cp.cuda.profiler.stop()
        backend.reset_graph()           # the graphs hold the model
        del model, models, weights, src
        cp.get_default_memory_pool().free_all_blocks()
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
