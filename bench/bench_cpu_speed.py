#!/usr/bin/env python3
"""cyllm CPU vs llama.cpp, interleaved: pp512, tg128, tg128 @ d2048.

The machines are shared and noisy, so instead of timing one engine after the
other (bench/compare_llamacpp.py) this alternates them rep by rep, test by test,
and reports per-engine medians plus the median of the per-rep ratios. It also
prints cyllm's op-by-op decode (CYLLM_FUSED=0 path) and the per-token time
spent outside memory traffic.

    python bench/bench_cpu_speed.py -m smollm2-f16.gguf -t 2 -r 5
    python bench/bench_cpu_speed.py -m smollm2-f16.gguf -t 2 --no-llama   # cyllm only

The F16 GGUF comes from `bench/compare_llamacpp.py --make-f16-gguf`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, "..", "src"))     # a checkout without installing: an installed cyllm comes first

import cyllm  # noqa: E402
from cyllm.backends.cpu import CpuBackend, measure_read_bandwidth  # noqa: E402


def cyllm_pp(m, ids):
    t0 = time.perf_counter()
    m.prefill(ids, 0)
    return len(ids) / (time.perf_counter() - t0)


def cyllm_tg(m, n, depth, rng, fill):
    if depth:
        m.prefill(fill, 0)
    ids = rng.integers(0, m.config.vocab_size, n).tolist()
    t0 = time.perf_counter()
    for i, t in enumerate(ids):
        m.forward(t, depth + i)
    return n / (time.perf_counter() - t0)


def llama_pp(llm, ids):
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    return len(ids) / (time.perf_counter() - t0)


def llama_tg(llm, n, depth, rng, fill):
    llm.reset()
    if depth:
        llm.eval(fill)
    ids = rng.integers(0, llm.n_vocab(), n).tolist()
    t0 = time.perf_counter()
    for t in ids:
        llm.eval([t])
    return n / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True, help="F16 GGUF (both engines load it)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--repetitions", type=int, default=5)
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-d", "--depth", type=int, default=2048)
    ap.add_argument("--no-llama", action="store_true")
    a = ap.parse_args(argv)

    rng = np.random.default_rng(0)
    ctx = a.depth + a.n_gen + 8
    m = cyllm.load(a.model, threads=a.threads, context=max(ctx, a.n_prompt))
    m_ops = cyllm.Model.from_weights(m.config, _weights_of(m), backend=CpuBackend(a.threads, fused=False),
                                     context=a.n_gen + 8)
    llm = None
    if not a.no_llama:
        import llama_cpp
        llm = llama_cpp.Llama(model_path=a.model, n_ctx=max(ctx, a.n_prompt), n_threads=a.threads,
                              n_threads_batch=a.threads, n_batch=512, n_ubatch=512, verbose=False)
    vocab = m.config.vocab_size
    prompt = rng.integers(0, vocab, a.n_prompt).tolist()
    fill = rng.integers(0, vocab, a.depth).tolist()
    tests = {
        f"pp{a.n_prompt}": (lambda: cyllm_pp(m, prompt), lambda: llama_pp(llm, prompt)),
        f"tg{a.n_gen}": (lambda: cyllm_tg(m, a.n_gen, 0, rng, fill),
                         lambda: llama_tg(llm, a.n_gen, 0, rng, fill)),
        f"tg{a.n_gen}@d{a.depth}": (lambda: cyllm_tg(m, a.n_gen, a.depth, rng, fill),
                                    lambda: llama_tg(llm, a.n_gen, a.depth, rng, fill)),
        f"tg{a.n_gen} op-by-op": (lambda: cyllm_tg(m_ops, a.n_gen, 0, rng, fill), None),
    }
    # warm-up: captures the decode program, wakes the thread pools
    cyllm_pp(m, prompt[:64])
    cyllm_tg(m, 8, 0, rng, fill)
    cyllm_tg(m_ops, 8, 0, rng, fill)
    if llm is not None:
        llama_pp(llm, prompt[:64])
        llama_tg(llm, 8, 0, rng, fill)
    res = {k: ([], []) for k in tests}
    for rep in range(a.repetitions):
        for name, (ours, theirs) in tests.items():
            res[name][0].append(ours())
            if llm is not None and theirs is not None:
                res[name][1].append(theirs())
    bw = measure_read_bandwidth(a.threads)
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else "?"
    print(f"model {a.model}: {m.weight_bytes / 1e6:.1f} MB F16, threads {a.threads}, "
          f"variant {m.backend.kernel_variant}, reps {a.repetitions}, load after {load}")
    print(f"read bandwidth (cyllm probe, {a.threads} threads): {bw:.1f} GB/s -> tg limit "
          f"{bw * 1e9 / m.weight_bytes:.0f} t/s at depth 0")
    print("| test | cyllm t/s | llama.cpp t/s | ratio (median of per-rep) | cyllm GB/s (weights) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, (ours, theirs) in res.items():
        o = statistics.median(ours)
        gbs = f"{o * m.weight_bytes / 1e9:.1f}" if name.startswith("tg") else ""
        if theirs:
            t = statistics.median(theirs)
            ratio = statistics.median(x / y for x, y in zip(ours, theirs))
            print(f"| {name} | {o:.1f} | {t:.1f} | {ratio:.2f} | {gbs} |")
        else:
            print(f"| {name} | {o:.1f} | | | {gbs} |")
    return 0


def _weights_of(model):
    """The host weights of a loaded model, by HF name (for a second model on the same arrays)."""
    w = {"model.embed_tokens.weight": model.embedding, "model.norm.weight": model.final_norm}
    if model.output is not model.embedding:
        w["lm_head.weight"] = model.output
    for i, L in enumerate(model.layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = L.attn_norm
        w[p + "post_attention_layernorm.weight"] = L.ffn_norm
        for n, a in (("q", L.wq), ("k", L.wk), ("v", L.wv), ("o", L.wo)):
            w[p + f"self_attn.{n}_proj.weight"] = a
        for n, a in (("q", L.bq), ("k", L.bk), ("v", L.bv)):
            if a is not None:
                w[p + f"self_attn.{n}_proj.bias"] = a
        w[p + "mlp.gate_proj.weight"] = L.w_gate
        w[p + "mlp.up_proj.weight"] = L.w_up
        w[p + "mlp.down_proj.weight"] = L.w_down
    return w


if __name__ == "__main__":
    sys.exit(main())
