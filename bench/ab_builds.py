#!/usr/bin/env python3
"""Two cyllm builds side by side, interleaved rep by rep: pp and tg of one model.

Each rep runs one fresh process per build (its own Python and source tree), so
both see the same machine state in turn; the report gives per-build medians and
the median of the per-rep ratios B/A. This is how a change is shown not to slow
a path down on a shared, noisy machine.

    python bench/ab_builds.py --a /path/to/old/checkout --b . -m model.gguf -p 512 -n 128 -r 5

A checkout's Python is its .venv/bin/python when present (an editable install of
that tree), else this interpreter with PYTHONPATH=<tree>/src (the tree's compiled
extension must then be built in place: `python setup.py build_ext --inplace`
puts it under cython_ext/, so link or copy it to src/cyllm/_ext/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import numpy as np
import cyllm
path, p, n, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if path.startswith("synthetic:"):                       # random weights of a preset's shapes
    from cyllm.model import Model
    from cyllm.tools.synthetic import build_synthetic
    cfg, w = build_synthetic(path.split(":", 1)[1], 0)
    m = Model.from_weights(cfg, w, threads=threads, context=p + n + 8)
else:
    m = cyllm.load(path, threads=threads, context=p + n + 8)
rng = np.random.default_rng(0)
ids = rng.integers(0, m.config.vocab_size, p).tolist()
m.prefill(ids[:64], 0)                                  # warm: kernels, pages, thread team
t0 = time.perf_counter(); logits = m.prefill(ids, 0); pp = p / (time.perf_counter() - t0)
tok = int(np.argmax(logits))
for i in range(4):                                      # warm the decode path (capture)
    tok = int(np.argmax(m.forward(tok, p + i)))
t0 = time.perf_counter()
for i in range(n):
    tok = int(np.argmax(m.forward(tok, p + i)))
tg = n / (time.perf_counter() - t0)
print(json.dumps({"pp": pp, "tg": tg}))
"""


def python_of(tree: str, python: str | None = None) -> tuple[str, dict]:
    venv = os.path.join(tree, ".venv", "bin", "python")
    env = dict(os.environ)
    if python:
        return python, env
    if os.path.exists(venv):
        return venv, env
    env["PYTHONPATH"] = os.path.join(tree, "src")
    return sys.executable, env


def run(tree, python, args) -> dict:
    py, env = python_of(tree, python)
    out = subprocess.run([py, "-c", CHILD, args.model, str(args.p), str(args.n), str(args.threads)],
                         capture_output=True, text=True, env=env, cwd=tree)
    if out.returncode != 0:
        sys.exit(f"build {tree} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="checkout A (baseline)")
    ap.add_argument("--b", required=True, help="checkout B (change)")
    ap.add_argument("--a-python", help="interpreter that imports build A (default: see above)")
    ap.add_argument("--b-python", help="interpreter that imports build B")
    ap.add_argument("-m", "--model", required=True, help="a model path, or synthetic:PRESET (cyllm.tools.synthetic)")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--reps", type=int, default=5)
    args = ap.parse_args()
    res = {"a": [], "b": []}
    for rep in range(args.reps):
        order = ("a", "b") if rep % 2 == 0 else ("b", "a")
        for k in order:
            res[k].append(run(getattr(args, k), getattr(args, k + "_python"), args))
        print(f"rep {rep}: " + "  ".join(f"{k}: pp {res[k][-1]['pp']:.1f} tg {res[k][-1]['tg']:.1f}"
                                          for k in ("a", "b")), file=sys.stderr)
    print(f"| test | A median | B median | B/A median of per-rep ratios |\n|---|---:|---:|---:|")
    for test in ("pp", "tg"):
        a = [r[test] for r in res["a"]]
        b = [r[test] for r in res["b"]]
        ratio = statistics.median(y / x for x, y in zip(a, b))
        name = f"pp{args.p}" if test == "pp" else f"tg{args.n}"
        print(f"| {name} | {statistics.median(a):.1f} | {statistics.median(b):.1f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
