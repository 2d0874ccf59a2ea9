#!/usr/bin/env python3
"""cyllm vs llama.cpp on the same GGUF, same thread counts, in the same run.

The machines these run on are shared and noisy, so only ratios measured side by
side mean anything: for each thread count this runs cyllm's tests, then
llama.cpp's, back to back, and prints both with the ratio cyllm / llama.cpp.

    python bench/compare_llamacpp.py -m model-f16.gguf -t 1,2
    python bench/compare_llamacpp.py -m model-f16.gguf -t 2 -p 512 -n 128 -d 0,2048 -r 3

llama.cpp comes from the PyPI package llama-cpp-python (the `llamacpp` extra:
`pip install llama-cpp-python`); it compiles llama.cpp while installing, which
takes minutes. Never needed by the tests.

Compare like with like: cyllm computes in FP16 whatever the file stores (it
dequantizes at load), while llama.cpp runs the file's own type. For an FP16
comparison give llama.cpp an F16 GGUF; this script writes one from any model
cyllm can load (HF directory or GGUF of any type):

    python bench/compare_llamacpp.py --make-f16-gguf smollm2-f16.gguf \
        -m SmolLM2-135M-Instruct.Q4_1.gguf

The tokenizer metadata is copied from the source GGUF (or from --tokenizer-gguf
for an HF directory or a --synthetic preset with the same vocabulary); with neither,
a made-up SentencePiece vocabulary of the model's size is written. Quantized
sources give an F16 file of the dequantized values: same speed as a true F16
export (speed depends on bytes, not values), slightly different outputs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.append(os.path.join(HERE, "..", "src"))     # a checkout without installing: an installed cyllm comes first

from cyllm.tools.bench import (BenchConfig, Test, load_source, needed_context, parse_int_list,  # noqa: E402
                         plan_tests, run_bench)
from cyllm.errors import CyllmError  # noqa: E402
from cyllm.quant import QuantMatrix  # noqa: E402

WARMUP_PP = 32
WARMUP_TG = 8


# -- llama.cpp side ------------------------------------------------------------------
def import_llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        sys.exit("compare_llamacpp: llama-cpp-python is not installed.\n"
                 "  pip install llama-cpp-python   (compiles llama.cpp: takes several minutes)\n"
                 "  or: pip install 'cyllm[llamacpp]'")
    return llama_cpp


def llama_open(llama_cpp, path: str, threads: int, n_ctx: int):
    kwargs = dict(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                  n_batch=512, logits_all=False, verbose=False)
    try:
        return llama_cpp.Llama(**kwargs, n_ubatch=512)
    except TypeError:                       # older llama-cpp-python: no n_ubatch
        return llama_cpp.Llama(**kwargs)


def llama_time(llm, test: Test, n: int, rng) -> float:
    """Seconds for one run: pp = eval of n tokens from an empty cache; tg = n single-token evals."""
    vocab = llm.n_vocab()
    llm.reset()                             # n_tokens = 0: the next eval overwrites the cache
    if test.kind == "pp":
        ids = rng.integers(0, vocab, size=n).tolist()
        t0 = time.perf_counter()
        llm.eval(ids)
        return time.perf_counter() - t0
    if test.depth:
        llm.eval(rng.integers(0, vocab, size=test.depth).tolist())   # untimed: fill the cache
    ids = rng.integers(0, vocab, size=n).tolist()
    t0 = time.perf_counter()
    for tok in ids:
        llm.eval([tok])
    return time.perf_counter() - t0


def llama_bench(llama_cpp, path: str, threads: int, tests: list[Test], reps: int, seed: int) -> dict:
    """{test name: [tokens/s per repetition]} for llama.cpp at ``threads``."""
    n_ctx = needed_context(tests)
    llm = llama_open(llama_cpp, path, threads, n_ctx)
    out = {}
    for ti, test in enumerate(tests):
        rng = np.random.default_rng([seed, ti, threads, 1])
        llama_time(llm, test, min(test.n, WARMUP_PP if test.kind == "pp" else WARMUP_TG), rng)
        out[test.name] = [test.n / llama_time(llm, test, test.n, rng) for _ in range(reps)]
    del llm
    return out


# -- F16 GGUF writer -------------------------------------------------------------------
def _permute_for_llama_cpp(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF rotate-half row order -> llama.cpp's interleaved-pair order, per head.

    Within each head HF keeps the first halves of all rotary pairs, then the
    second halves; llama.cpp's llama arch wants each pair's two rows adjacent.
    (The inverse of what cyllm's GGUF loader undoes when reading.)
    """
    rows, cols = w.shape
    hd = rows // n_heads
    return np.ascontiguousarray(w.reshape(n_heads, 2, hd // 2, cols).swapaxes(1, 2).reshape(rows, cols))


def _copy_tokenizer_fields(writer, src_gguf: str, vocab_size: int) -> None:
    import gguf
    reader = gguf.GGUFReader(src_gguf)
    n_tokens = None
    copied = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        val = field.contents()
        if key == "tokenizer.ggml.tokens":
            n_tokens = len(val)
        writer.add_key_value(key, val, vtype, sub_type=sub)
        copied += 1
    if not copied:
        raise CyllmError(f"{src_gguf} has no tokenizer metadata to copy")
    if n_tokens is not None and n_tokens != vocab_size:
        raise CyllmError(f"the tokenizer in {src_gguf} has {n_tokens} tokens but the model's "
                         f"vocabulary is {vocab_size}: llama.cpp would refuse the file")


def _synthetic_spm_fields(writer, vocab_size: int) -> None:
    """A SentencePiece-style vocabulary of ``vocab_size`` made-up pieces: <unk>, <s>, </s>,
    the 256 byte tokens (so any text encodes), then filler words. Enough for llama.cpp and
    cyllm to load and run a random-weight model; speed depends on bytes, not on words."""
    import gguf
    if vocab_size < 3 + 256 + 1:
        raise CyllmError(f"a synthetic SPM vocabulary needs at least 260 tokens, the model has {vocab_size}")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    tokens += [f"\u2581w{i}" for i in range(vocab_size - len(tokens))]
    types += [gguf.TokenType.NORMAL] * (vocab_size - len(types))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(vocab_size - 259)])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)


def write_f16_gguf(out: str, config, weights: dict, tokenizer_gguf: str | None, name: str) -> None:
    """An F16 GGUF (llama or qwen2 arch) of ``weights`` that llama.cpp loads."""
    import gguf
    c = config
    arch = "qwen2" if c.arch == "qwen2" else "llama"
    w = gguf.GGUFWriter(out, arch)
    w.add_name(name)
    w.add_context_length(int(c.max_seq_len))
    w.add_embedding_length(c.dim)
    w.add_block_count(c.n_layers)
    w.add_feed_forward_length(c.ffn_dim)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_rope_dimension_count(c.head_dim)
    if c.head_dim * c.n_heads != c.dim:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(float(c.norm_eps))
    w.add_rope_freq_base(float(c.rope_theta))
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if tokenizer_gguf:
        _copy_tokenizer_fields(w, tokenizer_gguf, c.vocab_size)
    else:
        _synthetic_spm_fields(w, c.vocab_size)

    def f16(a):
        if isinstance(a, QuantMatrix):          # a quantized source: its dequantized values
            a = a.dequantize()
        return np.ascontiguousarray(a, dtype=np.float16)

    def f32(a):
        return np.ascontiguousarray(a, dtype=np.float32)

    permute = arch == "llama"
    w.add_tensor("token_embd.weight", f16(weights["model.embed_tokens.weight"]))
    w.add_tensor("output_norm.weight", f32(weights["model.norm.weight"]))
    if not c.tie_word_embeddings and "lm_head.weight" in weights:
        w.add_tensor("output.weight", f16(weights["lm_head.weight"]))
    if (c.rope_scaling or {}).get("rope_type") == "llama3":
        # llama.cpp applies llama3 scaling as per-frequency divisors in rope_freqs
        base = dataclasses.replace(c, rope_scaling=None).inv_freq().astype(np.float64)
        scaled = c.inv_freq().astype(np.float64)
        w.add_tensor("rope_freqs.weight", (base / scaled).astype(np.float32))      # (head_dim/2,)
    for i in range(c.n_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        q = f16(weights[p + "self_attn.q_proj.weight"])
        k = f16(weights[p + "self_attn.k_proj.weight"])
        if permute:
            q, k = _permute_for_llama_cpp(q, c.n_heads), _permute_for_llama_cpp(k, c.n_kv_heads)
        w.add_tensor(b + "attn_norm.weight", f32(weights[p + "input_layernorm.weight"]))
        w.add_tensor(b + "attn_q.weight", q)
        w.add_tensor(b + "attn_k.weight", k)
        w.add_tensor(b + "attn_v.weight", f16(weights[p + "self_attn.v_proj.weight"]))
        w.add_tensor(b + "attn_output.weight", f16(weights[p + "self_attn.o_proj.weight"]))
        if c.attention_bias:
            for short, hf in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
                key = p + f"self_attn.{hf}.bias"
                if key in weights:
                    w.add_tensor(b + f"attn_{short}.bias", f32(weights[key]))
        w.add_tensor(b + "ffn_norm.weight", f32(weights[p + "post_attention_layernorm.weight"]))
        w.add_tensor(b + "ffn_gate.weight", f16(weights[p + "mlp.gate_proj.weight"]))
        w.add_tensor(b + "ffn_up.weight", f16(weights[p + "mlp.up_proj.weight"]))
        w.add_tensor(b + "ffn_down.weight", f16(weights[p + "mlp.down_proj.weight"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()


# -- main -------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", help="GGUF file (an HF directory only with --make-f16-gguf)")
    ap.add_argument("--synthetic", help="synthetic preset (only with --make-f16-gguf)")
    ap.add_argument("-t", "--threads", default="1,2", help="thread counts (default 1,2)")
    ap.add_argument("-p", "--n-prompt", default="512", help="prompt sizes (default 512)")
    ap.add_argument("-n", "--n-gen", default="128", help="generation sizes (default 128)")
    ap.add_argument("-d", "--depth", default="0,2048", help="tg depths (default 0,2048)")
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    ap.add_argument("--make-f16-gguf", metavar="OUT", help="write an F16 GGUF of the model and exit")
    ap.add_argument("--tokenizer-gguf", help="GGUF whose tokenizer metadata --make-f16-gguf copies "
                    "(default: the -m GGUF's, else a made-up SentencePiece vocabulary)")
    a = ap.parse_args(argv)
    try:
        if a.make_f16_gguf:
            src = load_source(a.model, a.synthetic, a.seed)
            # no tokenizer source: a made-up SentencePiece vocabulary of the model's size
            tok_src = a.tokenizer_gguf or (a.model if a.model and a.model.endswith(".gguf") else None)
            write_f16_gguf(a.make_f16_gguf, src.config, src.weights, tok_src, src.config.name or src.label)
            print(f"wrote {a.make_f16_gguf} ({os.path.getsize(a.make_f16_gguf) / 1e6:.1f} MB)", file=sys.stderr)
            return 0
        if not a.model or not a.model.endswith(".gguf"):
            raise CyllmError("-m must be a .gguf file that both engines load")
        llama_cpp = import_llama_cpp()
        threads = parse_int_list(a.threads, "--threads", 1)
        tests = plan_tests(parse_int_list(a.n_prompt, "-p", 0), parse_int_list(a.n_gen, "-n", 0),
                           parse_int_list(a.depth, "-d", 0))
        src = load_source(a.model, None, a.seed, ["cpu"], needed_context(tests))
        rows = []
        for t in threads:
            ours = run_bench(src, BenchConfig(backends=["cpu"], threads=[t], tests=tests,
                                              repetitions=a.repetitions, seed=a.seed, overhead=False))
            theirs = llama_bench(llama_cpp, a.model, t, tests, a.repetitions, a.seed)
            for r in ours:
                lc = statistics.median(theirs[r["test"]])
                rows.append({"test": r["test"], "threads": t, "cyllm_tokens_per_s": r["tokens_per_s"],
                             "cyllm_roofline_pct": r["roofline_pct"], "llamacpp_tokens_per_s": lc,
                             "ratio": r["tokens_per_s"] / lc if lc else None,
                             "cyllm_samples": r["samples_tokens_per_s"], "llamacpp_samples": theirs[r["test"]]})
    except CyllmError as e:
        print(f"compare_llamacpp: error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"model: {a.model} ({src.weight_bytes / 1e6:.1f} MB as FP16 in cyllm), "
          f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')}")
    print("| test | threads | cyllm t/s | llama.cpp t/s | cyllm / llama.cpp | cyllm roofline |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        rf = f"{r['cyllm_roofline_pct']:.1f}%" if r["cyllm_roofline_pct"] is not None else ""
        print(f"| {r['test']} | {r['threads']} | {r['cyllm_tokens_per_s']:.2f} | "
              f"{r['llamacpp_tokens_per_s']:.2f} | {r['ratio']:.2f} | {rf} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
