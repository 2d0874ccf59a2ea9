#!/usr/bin/env python3
"""Where a CUDA prefill spends its time: per op, the GPU time (CUDA events around each
call) and the host time of issuing it, for a few prefill chunk sizes.

    python bench/profile_cuda_prefill.py (-m FILE | --synthetic PRESET) [--quantize TYPE]
                                         [-p 512] [--chunks 256,512,1024] [-r 3] [--layers N]

For each chunk size: the wall time of `model.prefill` of P random tokens without any
instrumentation (median of -r runs), with its chunks replayed from CUDA graphs and issued op
by op (prefill_graph.py), then one instrumented run, op by op: a table of every batched
op with its calls, GPU ms (sum of event pairs) and host ms (time spent in the Python call).
The instrumented run is queued behind a kernel that keeps the GPU busy for a second, so
the event pairs time the GPU's work alone, not the gaps while the host issues it (as long
as the launch queue does not fill). When the GPU ms of all ops add up to far less than
the wall time, the prefill is bound by issuing work, not by the GPU.

``--vary ATTR=V1,V2`` repeats the whole measurement with the backend attribute ATTR at each
value (an A/B in one process, e.g. ``--vary qmm_few_max=0,64``).

``--turns N`` times a chat's next prompts instead: N prompts of 9..96 tokens (a fixed
pseudo-random sequence), each from where the one before ended (back to position 0 when the
next would not fit the cache of max(P, 512) + 16 positions), as a conversation's turns come;
the median and total time a turn with the chunks replayed from graphs (short ones padded to
a captured length) and issued op by op. The graphs' captures count: the turns that first
reach a padded length pay them. The graphs' turns are also shown by padded length (median ms).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import numpy as np  # noqa: E402


def instrument(backend, names):
    """Wrap backend.<name> for every name: returns (records, restore)."""
    import cupy as cp
    records = defaultdict(list)     # name -> [(start event, end event, host s)]
    saved = {}
    depth = [0]
    for name in names:
        fn = getattr(backend, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def wrapped(*a, _fn=fn, _name=name, **k):
            if depth[0]:            # nested: the outer op's time holds it
                return _fn(*a, **k)
            depth[0] += 1
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            t0 = time.perf_counter()
            e0.record()
            try:
                return _fn(*a, **k)
            finally:
                e1.record()
                records[_name].append((e0, e1, time.perf_counter() - t0))
                depth[0] -= 1
        setattr(backend, name, wrapped)

    def restore():
        for name in saved:
            delattr(backend, name)
    return records, restore


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model")
    ap.add_argument("--synthetic")
    ap.add_argument("--quantize")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("--chunks", default="256,512,1024")
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--turns", type=int, default=0)
    ap.add_argument("--vary", help="ATTR=V1,V2,...: the measurement once per backend attribute value")
    ap.add_argument("--layers", type=int, help="only the synthetic preset's first N layers (each "
                    "costs the same; quantizing a 48-layer mixture of experts at load takes minutes)")
    a = ap.parse_args()
    import cupy as cp
    from cyllm.tools.bench import bind_model, load_source, make_backend
    if a.layers is not None:
        from cyllm.tools.synthetic import PRESETS
        key = (a.synthetic or "").strip().lower()
        if key not in PRESETS or a.layers < 1:
            ap.error("--layers N (N >= 1) trims a --synthetic preset")
        PRESETS[key]["n_layers"] = a.layers
    src = load_source(a.model, a.synthetic, 0, ("cuda",), 0, a.quantize)
    backend = make_backend("cuda", 1)
    model = bind_model(src, backend, max(a.p, 512) + 16)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.config.vocab_size, size=a.p).tolist()
    sleeper = cp.RawKernel(r'''extern "C" __global__ void busy(long long cycles) {
        long long t0 = clock64(); while (clock64() - t0 < cycles) { } }''', "busy")
    clock_khz = cp.cuda.runtime.getDeviceProperties(0)["clockRate"]

    def busy():
        sleeper((1,), (1,), (np.int64(clock_khz * 1000),))     # ~1 s
    attr, values = None, [None]
    if a.vary:
        attr, _, vals = a.vary.partition("=")
        values = [int(v) if v.lstrip("-").isdigit() else v for v in vals.split(",")]
    for v in values:
        if attr is not None:
            setattr(backend, attr, v)
            backend.reset_graph()
            print(f"\n### {attr} = {v}")
        if a.turns:
            turns(model, backend, a.turns, src.label)
        else:
            chunks(a, model, backend, ids, busy, src.label)
    return 0


def chunks(a, model, backend, ids, busy, label: str) -> None:
    """Per chunk size: the wall times and the instrumented per-op table."""
    import cupy as cp
    from cyllm.backends.base import BATCH_OPS
    names = list(BATCH_OPS) + ["rmsnorm", "matvec"]
    print(f"# {label}: prefill of {a.p} tokens, {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    for chunk in [int(c) for c in a.chunks.split(",")]:
        backend.prefill_chunk = chunk
        model.batch = None
        graphed = {}
        for on in (True, False):            # chunks replayed from graphs, then issued op by op
            backend.prefill_graphs = on
            model.prefill(ids, 0)
            walls = []
            for _ in range(a.r):
                t0 = time.perf_counter()
                model.prefill(ids, 0)
                walls.append(time.perf_counter() - t0)
            graphed[on] = statistics.median(walls)
        wall = graphed[False]
        # the ops are timed one by one: prefill_graphs stays off (a replay calls none of them)
        records, restore = instrument(backend, names)
        busy()
        t0 = time.perf_counter()
        model.prefill(ids, 0)
        inst_wall = time.perf_counter() - t0
        restore()
        cp.cuda.Device().synchronize()
        print(f"\n## chunk {chunk}: {wall * 1e3:.2f} ms ({a.p / wall:.0f} tok/s) op by op, "
              f"{graphed[True] * 1e3:.2f} ms ({a.p / graphed[True]:.0f} tok/s) from graphs; "
              f"instrumented {inst_wall * 1e3:.2f} ms")
        print("| op | calls | GPU ms | host ms |\n|---|---:|---:|---:|")
        tot_g = tot_h = 0.0
        for name, recs in sorted(records.items(), key=lambda kv: -sum(cp.cuda.get_elapsed_time(e0, e1) for e0, e1, _ in kv[1])):
            g = sum(cp.cuda.get_elapsed_time(e0, e1) for e0, e1, _ in recs)
            h = sum(r[2] for r in recs) * 1e3
            tot_g += g
            tot_h += h
            print(f"| {name} | {len(recs)} | {g:.2f} | {h:.2f} |")
        print(f"| all | | {tot_g:.2f} | {tot_h:.2f} |")


def turns(model, backend, n: int, label: str) -> int:
    """Prompts of 9..96 tokens, each from the end of the one before (--turns)."""
    import cupy as cp
    rng = np.random.default_rng(1)
    lengths = rng.integers(9, 97, size=n).tolist()
    ids = rng.integers(0, model.config.vocab_size, size=sum(lengths)).tolist()
    print(f"# {label}: {n} prompts of 9..96 tokens ({sum(lengths)} in all) one after another, "
          f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print("| chunks | median ms a turn | total ms | tok/s |\n|---|---:|---:|---:|")
    by_rows = {}
    for on in (False, True):
        backend.prefill_graphs = False
        backend.reset_graph()
        model.batch = None
        model.prefill(ids[:64], 0)              # kernels compiled, scratch allocated, no graph
        backend.prefill_graphs = on
        walls, pos = [], 0
        for t in lengths:
            if pos + t > model.context:
                pos = 0
            # the rows the chunk runs (turns are shorter than a chunk; the model's own bound)
            rows = backend.prefill_rows(t, model.context - pos)
            t0 = time.perf_counter()
            model.prefill(ids[pos:pos + t], pos)
            walls.append(time.perf_counter() - t0)
            pos += t
            if on:
                by_rows.setdefault(rows, []).append(walls[-1])
        total = sum(walls)
        print(f"| {'graphs' if on else 'op by op'} | {statistics.median(walls) * 1e3:.2f} | "
              f"{total * 1e3:.1f} | {sum(lengths) / total:.0f} |")
    print("graphs, median ms a turn by padded rows: "
          + ", ".join(f"{r}: {statistics.median(w) * 1e3:.2f} ({len(w)})" for r, w in sorted(by_rows.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
