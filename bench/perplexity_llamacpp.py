#!/usr/bin/env python3
"""cyllm's perplexity next to llama.cpp's, on the same GGUF, text and context, in one run.

    python bench/perplexity_llamacpp.py -m model.gguf -f text.txt -c 512

Both sides score the same token ids with llama.cpp's method (non-overlapping
chunks of -c tokens, each from an empty cache, the second half of each chunk
scored); llama.cpp supplies its logits through llama-cpp-python (the `llamacpp`
extra; it compiles llama.cpp at install). The relative difference of the two
perplexities is printed last.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, "..", "src"))     # a checkout without installing: an installed cyllm comes first

import cyllm  # noqa: E402
from cyllm.tools.perplexity import _adds_bos, chunk_nll, format_ppl, ppl_from_sums, tokenize_for_perplexity  # noqa: E402


def chunks_of(model, text: str, ctx: int) -> list[list[int]]:
    tokens = tokenize_for_perplexity(model, text)
    bos = model.tokenizer.bos_id
    out = []
    for i in range(len(tokens) // ctx):
        chunk = tokens[i * ctx:(i + 1) * ctx]
        out.append([bos] + chunk[1:] if _adds_bos(model) else chunk)
    return out


def score(logits_of, chunks: list[list[int]], ctx: int) -> tuple[float, float]:
    total = total2 = 0.0
    count = 0
    for chunk in chunks:
        nll = chunk_nll(logits_of(chunk), chunk, ctx // 2)
        total += float(nll.sum())
        total2 += float((nll * nll).sum())
        count += len(nll)
    return ppl_from_sums(total, total2, count)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True, help="GGUF file")
    ap.add_argument("-f", "--file", required=True, help="text file")
    ap.add_argument("-c", "--ctx", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--max-chunks", type=int, default=0, help="score only the first N chunks (0 = all)")
    a = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        sys.exit("perplexity_llamacpp: llama-cpp-python is not installed (pip install llama-cpp-python)")

    with open(a.file, encoding="utf-8") as f:
        text = f.read()
    model = cyllm.load(a.model, threads=a.threads, context=a.ctx)
    chunks = chunks_of(model, text, a.ctx)
    if a.max_chunks:
        chunks = chunks[:a.max_chunks]
    print(f"{len(chunks)} chunks of {a.ctx} tokens, threads={model.threads_decode}", file=sys.stderr)

    t0 = time.perf_counter()
    ours = score(model.logits, chunks, a.ctx)
    t_ours = time.perf_counter() - t0

    llm = llama_cpp.Llama(model_path=a.model, n_ctx=a.ctx, n_batch=a.ctx, logits_all=True,
                          n_threads=model.threads_decode, n_threads_batch=model.threads_prefill,
                          verbose=False)

    def llama_logits(chunk):
        llm.reset()
        llm.eval(chunk)
        return np.array(llm.scores[:len(chunk)], dtype=np.float32)          # (len, vocab)

    t0 = time.perf_counter()
    theirs = score(llama_logits, chunks, a.ctx)
    t_theirs = time.perf_counter() - t0

    print(f"cyllm:     {format_ppl(*ours)}   ({t_ours:.1f} s)")
    print(f"llama.cpp: {format_ppl(*theirs)}   ({t_theirs:.1f} s)")
    print(f"relative difference: {abs(ours[0] - theirs[0]) / theirs[0] * 100:.3f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
