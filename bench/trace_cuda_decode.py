#!/usr/bin/env python3
"""Where one captured CUDA decode token spends its time, kernel by kernel, in the model.

    python bench/trace_cuda_decode.py --synthetic llama2-7b --quantize q4_k [-c 4736] [--pos 64] [--tokens 5]
                                      [--layers N]

The kernels are compiled with -DCYLLM_TRACE (cuda/common.cuh): thread 0 of every block of
the quantized matvecs (a mixture of experts' too), rope_store, attention, the standalone
norms and a mixture of experts' router and sum records the global timer when the block
starts, when its pdl_wait returns and when it ends (plus its SM). One token's graph is
replayed with the records on; the blocks are grouped into launches (one kernel tag, each
block index once) and each launch is shown with

  exposed   its last block's end minus the previous launch's last end: the time the token
            would lose without it, if nothing else moved
  lag       its first pdl_wait return minus the previous launch's last end (the cost of
            the kernel boundary under programmatic dependent launch)
  wait med  its blocks' median pdl_wait return, the same way: well above lag, most blocks
            got past the wait late (placed late, or busy before it: weight loads that
            ptxas had moved below the wait showed up this way)
  after     its last end minus its first pdl_wait return (work on the critical path)
  pre       its first block start before the previous launch's last end (overlap bought by
            the early launch)
  pre med   the same for its median block, and early: the share of its blocks that started
            before that end (blocks that find no room beside the previous kernel's start
            late, and their weight loads go out only then)

then the same averaged per position in a layer. No nsys on the device machines; this is
the timeline the profiler would give, at the granularity of %globaltimer (printed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import numpy as np  # noqa: E402

from cyllm.errors import CyllmError  # noqa: E402

CAP = 1 << 18       # records (cuda/common.cuh trace_end)
WIDTH = 8           # a record's u64s: id, start, wait return, end, then TRACE_MARKS stage marks
_FMT = {(2, 0): "q8_0", (1, 0): "q4_0", (1, 4): "q4_1/q5_0", (1, 8): "q5_1", (9, 0): "q4_k",
        (11, 0): "q5_k", (13, 0): "q6_k"}
_MODE = {0: "matvec", 1: "add", 2: "gate_up", 3: "gate_up_gelu"}


_OTHER = {0x1000: "attention", 0x1001: "rope_store", 0x1002: "rmsnorm", 0x1003: "rmsnorm rows",
          0x1004: "moe_route", 0x1005: "moe_route (choice)", 0x1006: "moe_combine",
          0x1007: "qknorm_rope_store"}


def tag_name(tag: int) -> str:
    if tag in _OTHER:
        return _OTHER[tag]
    qx = " qx" if tag & 0x2000 else ""       # x came prequantized (a _qx kernel)
    experts = "experts " if tag & 0x4000 else ""     # a mixture of experts' chosen experts
    tag &= ~0x6000
    fmt = _FMT.get((tag >> 8, (tag >> 4) & 15), f"fmt{tag >> 8}")
    name = "qkv" if tag & 1 else _MODE[(tag >> 2) & 3]
    return f"{experts}{name}{'+norm' if tag & 2 else ''} {fmt}{qx}"


def stages(g: np.ndarray) -> list[float] | None:
    """Median over a launch's blocks that marked every stage (cuda/common.cuh TRACE_MARK) of
    the time from the wait return to mark 1, between marks, and from the last mark to the
    end, us; None where no block marked them all."""
    if g.shape[1] <= 4:
        return None
    marks = g[:, 4:]
    done = (marks > 0).all(axis=1) & (g[:, 2] > 0)
    if not done.any():
        return None
    t = np.concatenate([g[done][:, 2:3], marks[done], g[done][:, 3:4]], axis=1).astype(np.int64)
    return [float(v) / 1000 for v in np.median(np.diff(t, axis=1), axis=0)]


def launches(rec: np.ndarray) -> list[dict]:
    """Records (n, 4) -> launches. A launch holds each block index once and launches of one
    kernel never overlap, so a block (in order of start) joins the first launch of its tag
    that lacks its index."""
    tags = (rec[:, 0] >> 40).astype(np.int64)
    out = []
    for tag in np.unique(tags):
        r = rec[tags == tag]
        r = r[np.argsort(r[:, 1])]
        groups: list[tuple[set, list]] = []
        for row in r:
            bid = int(row[0] & 0xFFFFFFFF)
            for seen, rows in groups:
                if bid not in seen:
                    break
            else:
                seen, rows = set(), []
                groups.append((seen, rows))
            seen.add(bid)
            rows.append(row)
        for _, rows in groups:
            g = np.array(rows)
            waits = g[:, 2][g[:, 2] > 0]
            out.append({"tag": int(tag), "name": tag_name(int(tag)), "blocks": len(g),
                        "sms": len(np.unique((g[:, 0] >> 32) & 0xFF)),
                        "start": int(g[:, 1].min()), "start_med": int(np.median(g[:, 1])),
                        "starts": np.sort(g[:, 1]), "wait": int(waits.min()) if len(waits) else None,
                        "wait_med": int(np.median(waits)) if len(waits) else None,
                        "end": int(g[:, 3].max()), "stages": stages(g)})
    out.sort(key=lambda x: x["end"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model")
    ap.add_argument("--synthetic")
    ap.add_argument("--quantize", default="")
    ap.add_argument("-c", "--context", type=int, default=4736, help="KV cache positions (the bench's -d 4096 -p 512 -n 128)")
    ap.add_argument("--pos", type=int, default=64, help="position of the traced tokens")
    ap.add_argument("--tokens", type=int, default=5, help="tokens traced (the per-layer table is their median)")
    ap.add_argument("--show", type=int, default=24, help="launches of the last token printed one by one")
    ap.add_argument("--dump", help="save the last token's block records here (.npy: rows of tag<<40 | sm<<32 |"
                                   " block, start ns, wait-return ns (0: none), end ns, stage marks ns)")
    ap.add_argument("--layers", type=int, help="only the synthetic preset's first N layers (each costs the same)")
    a = ap.parse_args()
    if a.layers is not None:
        from cyllm.tools.synthetic import PRESETS
        key = (a.synthetic or "").strip().lower()
        if key not in PRESETS or a.layers < 1:
            ap.error("--layers N (N >= 1) trims a --synthetic preset")
        PRESETS[key]["n_layers"] = a.layers
    if a.tokens < 1 or a.pos < 4 or a.pos + a.tokens > a.context:
        ap.error(f"need --tokens >= 1 and 4 <= --pos, --pos + --tokens <= --context ({a.context})")
    try:
        return trace(a)
    except CyllmError as e:
        print(f"trace_cuda_decode: {e}", file=sys.stderr)
        return 2


def trace(a) -> int:
    from cyllm.backends.cuda import quant as cuda_quant
    from cyllm.quant.convert import quantize_weights
    from cyllm.tools.bench import bind_model, load_source, make_backend
    be = make_backend("cuda", 1)                # no GPU or no CuPy: one clear error, before any loading
    import cupy as cp
    src = load_source(a.model, a.synthetic, 0, ("cuda",), a.context)
    if a.quantize:
        quantize_weights(src.config, src.weights, a.quantize)
    be.compile_defines = tuple(be.compile_defines) + ("-DCYLLM_TRACE",)
    be._module, be._kernels = None, {}          # anything compiled already: again, with the records
    be.__dict__.pop("_qkernels", None)
    model = bind_model(src, be, a.context)
    rng = np.random.default_rng(0)
    for i in range(4):                          # eager pass + capture: every module compiled
        model.forward(int(rng.integers(0, model.config.vocab_size)), a.pos - 4 + i)
    modules = [be._module] + list(cuda_quant._MODULES.values())
    bufs = [cp.zeros(WIDTH * CAP, dtype=cp.uint64) for _ in modules]    # one per module: each has its own counter
    zero = np.zeros(1, dtype=np.uint32)

    def set_globals(on: bool) -> None:
        for mod, buf in zip(modules, bufs):
            p = np.array([buf.data.ptr if on else 0], dtype=np.uint64)
            mod.get_global("cyllm_trace_buf").copy_from_host(p.ctypes.data, 8)
            mod.get_global("cyllm_trace_cnt").copy_from_host(zero.ctypes.data, 4)

    name = cp.cuda.runtime.getDeviceProperties(be.device.id)["name"].decode()
    print(f"# decode timeline: {src.label} {a.quantize or ''}, {name}, pos {a.pos}, context {a.context}\n")
    per_kind: dict = {}
    totals = []
    grain = None
    for t in range(a.tokens):
        set_globals(True)
        cp.cuda.Device().synchronize()
        model.forward(int(rng.integers(0, model.config.vocab_size)), a.pos + t)
        cp.cuda.Device().synchronize()
        set_globals(False)
        rec = np.concatenate([b.get().reshape(CAP, WIDTH) for b in bufs])
        rec = rec[rec[:, 3] > 0]
        for b in bufs:
            b.fill(0)
        ts = np.unique(np.concatenate([rec[:, 1], rec[:, 3]]))
        d = np.diff(ts)
        grain = int(d[d > 0].min()) if len(d) else None
        ls = launches(rec)
        t0 = min(x["start"] for x in ls)
        totals.append((ls[-1]["end"] - t0) / 1000)
        prev_end = None
        seq = []
        for x in ls:
            x["exposed"] = (x["end"] - prev_end) / 1000 if prev_end is not None else None
            x["lag"] = (x["wait"] - prev_end) / 1000 if (prev_end is not None and x["wait"]) else None
            x["wait_med"] = (x["wait_med"] - prev_end) / 1000 if (prev_end is not None and x["wait_med"]) else None
            x["after"] = (x["end"] - x["wait"]) / 1000 if x["wait"] else None
            x["pre"] = (prev_end - x["start"]) / 1000 if prev_end is not None else None
            x["pre_med"] = (prev_end - x["start_med"]) / 1000 if prev_end is not None else None
            x["early"] = 100.0 * float(np.mean(x["starts"] < prev_end)) if prev_end is not None else None
            prev_end = x["end"]
            seq.append(x)
        for x in seq[1:]:
            per_kind.setdefault(x["name"], []).append(x)
        if t == a.tokens - 1:
            if a.dump:
                np.save(a.dump, rec)
            print("| # | kernel | blocks | SMs | start us | exposed us | lag us | wait med us | after us | pre us |")
            print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
            for i, x in enumerate(seq[:a.show]):
                f = lambda v: "" if v is None else f"{v:.2f}"     # noqa: E731
                print(f"| {i} | {x['name']} | {x['blocks']} | {x['sms']} | {(x['start'] - t0) / 1000:.2f} | "
                      f"{f(x['exposed'])} | {f(x['lag'])} | {f(x['wait_med'])} | {f(x['after'])} | {f(x['pre'])} |")
    print(f"\nglobaltimer step seen: {grain} ns; traced span of a token (first block start to last end): "
          f"{statistics.median(totals):.1f} us (median of {len(totals)})\n")
    print("| kernel | launches | exposed us (median) | sum us per token | lag us | wait med us | after us | pre us "
          "| pre med us | early % |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k, xs in sorted(per_kind.items(), key=lambda kv: -sum(x["exposed"] for x in kv[1])):
        med = lambda key: statistics.median([x[key] for x in xs if x[key] is not None] or [0])  # noqa: E731
        print(f"| {k} | {len(xs) // a.tokens} | {med('exposed'):.2f} | {sum(x['exposed'] for x in xs) / a.tokens:.1f} | "
              f"{med('lag'):.2f} | {med('wait_med'):.2f} | {med('after'):.2f} | {med('pre'):.2f} | "
              f"{med('pre_med'):.2f} | {med('early'):.0f} |")
    staged = {k: [x["stages"] for x in xs if x["stages"]] for k, xs in per_kind.items()}
    staged = {k: v for k, v in staged.items() if v}
    if staged:
        # attention.cu's marks: q staged, scores, softmax, V summed per warp, then the output;
        # at short caches (online softmax): q staged, a warp's rows, folded in the warp, every
        # warp's partials in shared memory, then the output. moe.cu's moe_route_f32 (the
        # blocks that do not choose): the folded norm found, warp 0's row summed, the rows
        # fenced, the counter's answer
        print("\nStages of the blocks that marked them (median over launches of each launch's median),"
              " us from the wait return:\n")
        print("| kernel | to mark 1 | 1 to 2 | 2 to 3 | 3 to 4 | 4 to end |")
        print("|---|---:|---:|---:|---:|---:|")
        for k, v in staged.items():
            print(f"| {k} | " + " | ".join(f"{m:.2f}" for m in np.median(np.array(v), axis=0)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
