#!/usr/bin/env python3
"""cyllm vs llama.cpp's own llama-bench on the same GGUF files, interleaved, in one run.

    python bench/compare_llamabench.py -m a.gguf,b.gguf -t 2 -p 128 -n 32 -r 5
    python bench/compare_llamabench.py -m tinyllama-q4_k_m.gguf --llama-bench PATH --out bench/results/x.md

The machines are shared and noisy, so each repetition runs both engines back to back
on the same file (cyllm first on even reps, llama.cpp first on odd ones) and the table
reports the median of the per-repetition ratios next to the medians of each engine.
Both engines run as subprocesses with the same thread count: `cyllm bench -o json` and
`llama-bench -o json`, one repetition each (after their own warm-up), so neither keeps a
warm cache the other lacks. The roofline is cyllm bench's: bytes read per token (weights
as stored + KV) over the read bandwidth measured in the same run; llama.cpp's is the same
bytes at its own speed in the same repetition (cyllm's roofline x llama.cpp t/s / cyllm t/s),
so a decode that is already near the limit shows how much any engine could still gain.

llama-bench: --llama-bench PATH, else $LLAMA_BENCH, else the one tests/llamacpp_build.py
builds (``python tests/llamacpp_build.py --with-bench``; GGML_NATIVE=OFF with the AVX2
set; pass --native-build to build a -DGGML_NATIVE=ON copy, llama.cpp's own default,
which uses every ISA extension of this CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from shown_paths import shown

HERE = Path(__file__).resolve().parent


def llama_bench_path(arg: str | None, native: bool) -> str:
    if arg:
        return arg
    if os.environ.get("LLAMA_BENCH"):
        return os.environ["LLAMA_BENCH"]
    sys.path.insert(0, str(HERE.parent / "tests"))
    import llamacpp_build as lb
    if native:
        return str(lb.build_native_bench())
    return str(lb.llamacpp_tool("llama-bench"))


def run_cyllm(model: str, threads: int, p: int, n: int, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "cyllm", "bench", "-m", model, "-t", str(threads), "-p", str(p),
           "-n", str(n), "-r", "1", "-o", "json", "--no-progress", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"cyllm bench failed ({' '.join(cmd)}):\n{r.stderr[-2000:]}")
    rows = json.loads(r.stdout)
    out = {}
    for row in rows:
        out[row["test"]] = (row["tokens_per_s"], row.get("roofline_pct"))
    return out


def run_llama(bench: str, model: str, threads: int, p: int, n: int) -> dict:
    cmd = [bench, "-m", model, "-t", str(threads), "-p", str(p), "-n", str(n), "-r", "1", "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"llama-bench failed ({' '.join(cmd)}):\n{r.stderr[-2000:]}")
    out = {}
    for row in json.loads(r.stdout):
        test = f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}"
        out[test] = (row["avg_ts"], None)
    return out


def main(argv=None) -> int:
    from cyllm.hostinfo import cpu_description
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--models", required=True, help="comma list of GGUF files")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-p", "--n-prompt", type=int, default=128)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("-r", "--repetitions", type=int, default=5)
    ap.add_argument("--llama-bench", help="path of llama-bench")
    ap.add_argument("--native-build", action="store_true", help="build and use a GGML_NATIVE=ON llama-bench")
    ap.add_argument("--cyllm-args", default="", help="extra arguments for cyllm bench (quoted)")
    ap.add_argument("--out", help="append the markdown table to this file")
    a = ap.parse_args(argv)
    bench = llama_bench_path(a.llama_bench, a.native_build)
    extra = a.cyllm_args.split()
    models = [m for m in a.models.split(",") if m]
    tests = [t for t in (f"pp{a.n_prompt}" if a.n_prompt else None, f"tg{a.n_gen}" if a.n_gen else None) if t]
    samples = {(m, t): {"cyllm": [], "llama": [], "ratio": [], "roof": [], "lroof": []}
               for m in models for t in tests}
    for rep in range(a.repetitions):
        for m in models:
            order = ("cyllm", "llama") if rep % 2 == 0 else ("llama", "cyllm")
            got = {}
            for who in order:
                got[who] = (run_cyllm(m, a.threads, a.n_prompt, a.n_gen, extra) if who == "cyllm"
                            else run_llama(bench, m, a.threads, a.n_prompt, a.n_gen))
            for t in tests:
                s = samples[(m, t)]
                c, roof = got["cyllm"][t]
                ll = got["llama"][t][0]
                s["cyllm"].append(c)
                s["llama"].append(ll)
                s["ratio"].append(c / ll)
                if roof is not None:
                    s["roof"].append(roof)
                    s["lroof"].append(roof * ll / c)
            print(f"rep {rep + 1}/{a.repetitions} {os.path.basename(m)}: "
                  + ", ".join(f"{t} {got['cyllm'][t][0]:.1f} vs {got['llama'][t][0]:.1f}" for t in tests),
                  file=sys.stderr, flush=True)
    lines = [f"{cpu_description()}, {a.threads} threads, {a.repetitions} interleaved reps, llama-bench {shown(bench)}",
             f"command: python bench/compare_llamabench.py -m ... -t {a.threads} -p {a.n_prompt} -n {a.n_gen} "
             f"-r {a.repetitions}" + (f" --cyllm-args '{a.cyllm_args}'" if a.cyllm_args else "")
             + (" --native-build" if a.native_build else ""),
             "",
             "| file | MiB | test | cyllm t/s | llama.cpp t/s | cyllm / llama.cpp (median of per-rep ratios, range) "
             "| cyllm roofline | llama.cpp roofline |",
             "|---|---:|---|---:|---:|---|---:|---:|"]
    for m in models:
        mib = os.path.getsize(m) / 2**20
        for t in tests:
            s = samples[(m, t)]
            roof = f"{statistics.median(s['roof']):.0f}%" if s["roof"] else ""
            lroof = f"{statistics.median(s['lroof']):.0f}%" if s["lroof"] else ""
            lines.append(f"| {os.path.basename(m)} | {mib:.0f} | {t} | {statistics.median(s['cyllm']):.1f} | "
                         f"{statistics.median(s['llama']):.1f} | {statistics.median(s['ratio']):.2f} "
                         f"({min(s['ratio']):.2f}-{max(s['ratio']):.2f}) | {roof} | {lroof} |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write(text + "\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
