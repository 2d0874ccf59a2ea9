#!/usr/bin/env python3
"""Where a mixture of experts' time goes on the CPU backend, in-process.

    python bench/profile_moe_cpu.py -m q3b-q4_k_m.gguf [-t 2] [-n 32] [-r 5] [-p 512]

- decode as one program a token (the router, the choice and the chosen experts in C:
  DecodeProgram's moe op) against op by op (Backend.data_dependent_steps: the step's ops
  issued from Python, the chosen experts in one C call), interleaved rounds of -n tokens,
  median tok/s of -r rounds; op by op, the share of a token inside the moe op;
- prefill of -p tokens: ms, and the share of the routing (router product, choice).
bench/make_blocks.py --shape qwen3-30b-a3b writes such a model's blocks.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


def _timed(fn, spent: list):
    """fn, adding the seconds each call takes to spent[0]."""
    def timed(*args):
        t0 = time.perf_counter()
        fn(*args)
        spent[0] += time.perf_counter() - t0
    return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", type=int, default=32, help="tokens a round")
    ap.add_argument("-r", type=int, default=5, help="rounds")
    ap.add_argument("-p", type=int, default=512, help="prompt tokens of the prefill")
    a = ap.parse_args()
    import numpy as np

    import cyllm
    from cyllm.backends import moe
    m = cyllm.load(a.model, backend="cpu", threads=a.threads)
    if not m.config.moe:
        sys.exit("not a mixture of experts")
    b, pos = m.backend, 8
    m.prefill(list(range(3, 11)))

    def decode(n: int) -> float:
        nonlocal pos
        t0 = time.perf_counter()
        for _ in range(n):
            m.forward(9, pos)
            pos += 1
        return time.perf_counter() - t0

    def op_by_op(on: bool) -> None:
        b.data_dependent_steps = on

    decode(4)
    op_by_op(True)
    inside = [0.0]
    b.moe = _timed(b.moe, inside)
    total = decode(a.n)
    del b.moe
    op_by_op(False)
    print(f"op by op: {1e3 * total / a.n:.2f} ms a token, {1e3 * inside[0] / a.n:.2f} of them in the moe op")

    rates = {"one program a token": [], "op by op": []}
    for _ in range(a.r):
        for name in rates:
            op_by_op(name == "op by op")
            decode(2)                                   # the program is captured or set aside
            rates[name].append(a.n / decode(a.n))
    op_by_op(False)
    for name, v in rates.items():
        print(f"{name}: median {statistics.median(v):.1f} tok/s ({', '.join(f'{x:.0f}' for x in v)})")

    ids = np.random.default_rng(0).integers(3, m.config.vocab_size - 8, a.p).tolist()
    m.logits(ids[:16])
    routing = [0.0]
    real_route = moe._route_rows
    moe._route_rows = _timed(real_route, routing)
    try:
        t0 = time.perf_counter()
        m.prefill(ids, 0)
        total = time.perf_counter() - t0
    finally:
        moe._route_rows = real_route
    print(f"prefill of {a.p}: {1e3 * total:.0f} ms, routing {1e3 * routing[0]:.0f} ms "
          f"({100 * routing[0] / total:.1f}%)")


if __name__ == "__main__":
    main()
