#!/usr/bin/env python3
"""The F16 prefill GEMM's switches side by side in one process, rounds interleaved.

    python bench/ab_gemm_switch.py pad --shapes 2048x2048 5632x2048 --tokens 128 --threads 1 2
    python bench/ab_gemm_switch.py few --shapes 2048x2048 --tokens 2 4 6 8 --copies 40
    python bench/ab_gemm_switch.py few -m tinyllama-f16.gguf --tokens 2 3 4 6 --threads 2

`pad` toggles the copy of x into rows one cache line longer (kernels._set_gemm_pad 0 / 1:
never / when a row is a multiple of 4 KiB); `few` toggles the few-token path
(kernels._set_gemm_few 0 / its default: the GEMM / the tokens' matvecs). Without -m it times
CpuBackend.matmul on each DxN shape (over --copies copies of the matrix, so that several
copies outgrow the caches as a model's weights do) and prints GFLOP/s and ms a call; with -m
it times the model's prefill of a random prompt of each --tokens length (no cache reuse).
Each cell: the median of --rounds rounds, the two settings alternating in order each round;
the last column is the second setting's speedup over the first.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from cyllm._ext import kernels as K
from cyllm.errors import CyllmError


def shape(text: str) -> tuple[int, int]:
    """DxN -> (D, N), both >= 1 (argparse type)."""
    try:
        d, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is DxN, e.g. 2048x2048, got {text!r}") from None
    if d < 1 or n < 1:
        raise argparse.ArgumentTypeError(f"a shape's sizes must be >= 1, got {text!r}")
    return d, n


def settings(switch: str):
    """(label, apply) of the switch's off and on settings; apply returns the previous state."""
    if switch == "pad":
        return [("off", lambda: K._set_gemm_pad(0)), ("on", lambda: K._set_gemm_pad(1))]
    dflt = K._set_gemm_few(0, 1)
    K._set_gemm_few(*dflt)
    return [("GEMM", lambda: K._set_gemm_few(0, dflt[1])), ("matvecs", lambda: K._set_gemm_few(*dflt))]


def restore(switch: str, state) -> None:
    if switch == "pad":
        K._set_gemm_pad(state)
    else:
        K._set_gemm_few(*state)


def alternate(sets, rounds: int, timed) -> dict:
    res = {label: [] for label, _ in sets}
    for r in range(rounds):
        for label, apply in (sets if r % 2 == 0 else sets[::-1]):
            apply()
            res[label].append(timed())
    return {label: float(np.median(v)) for label, v in res.items()}


def shapes_table(args, sets) -> None:
    from cyllm.backends.cpu import CpuBackend
    rng = np.random.default_rng(0)
    print("| shape | T | threads | " + " | ".join(f"{lab} GFLOP/s (ms)" for lab, _ in sets) + " | second / first |")
    print("|---|---:|---:|" + "---:|" * (len(sets) + 1))
    for d, n in args.shapes:
        ws = [rng.standard_normal((d, n)).astype(np.float16) for _ in range(args.copies)]
        for T in args.tokens:
            x = rng.standard_normal((T, n)).astype(np.float32)
            out = np.zeros((T, d), np.float32)
            for th in args.threads:
                b = CpuBackend(th)

                def timed():
                    b.matmul(out, ws[0], x)
                    t0 = time.perf_counter()
                    for w in ws:
                        b.matmul(out, w, x)
                    return (time.perf_counter() - t0) / len(ws)

                med = alternate(sets, args.rounds, timed)
                cells = " | ".join(f"{2 * T * d * n / s / 1e9:.1f} ({s * 1e3:.2f})" for s in med.values())
                a, b2 = list(med.values())
                print(f"| {d}x{n} | {T} | {th} | {cells} | {a / b2:.3f} |")


def model_table(args, sets) -> None:
    import cyllm
    rng = np.random.default_rng(0)
    for k, th in enumerate(args.threads):
        m = cyllm.load(args.model, threads=th)
        if k == 0:                      # after the first load: a bad path prints no table
            print("| prompt tokens | threads | " + " | ".join(f"{lab} prefill ms" for lab, _ in sets)
                  + " | second / first |")
            print("|---:|---:|" + "---:|" * (len(sets) + 1))
        for T in args.tokens:
            def timed():
                ids = [int(i) for i in rng.integers(100, min(30000, m.config.vocab_size), T)]
                for _ in m.generate(ids, max_tokens=1, temperature=0.0):
                    pass
                s = m.last_stats
                assert s.cached_tokens == 0, "a prompt came from the cache"
                return s.prefill_s

            med = alternate(sets, args.rounds, timed)
            a, b2 = list(med.values())
            print(f"| {T} | {th} | " + " | ".join(f"{v * 1e3:.1f}" for v in med.values()) + f" | {a / b2:.3f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("switch", choices=["pad", "few"])
    ap.add_argument("-m", "--model", help="a model path: time its prefill instead of single GEMMs")
    ap.add_argument("--shapes", nargs="*", type=shape, default=[(2048, 2048)],
                    help="DxN (weight rows x columns)")
    ap.add_argument("--tokens", nargs="*", type=int, default=[128], help="T, prompt tokens")
    ap.add_argument("--threads", nargs="*", type=int, default=[1, 2])
    ap.add_argument("--copies", type=int, default=1, help="copies of each matrix timed in turn")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.copies < 1 or min(args.tokens) < 1 or min(args.threads) < 1:
        ap.error("--rounds, --copies, --tokens and --threads must be >= 1")
    state = K._set_gemm_pad(1) if args.switch == "pad" else K._set_gemm_few(0, 1)
    restore(args.switch, state)
    sets = settings(args.switch)
    try:
        (model_table if args.model else shapes_table)(args, sets)
    except CyllmError as e:                     # a model that does not load: one line
        print(f"ab_gemm_switch: {e}", file=sys.stderr)
        return 2
    finally:
        restore(args.switch, state)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
