"""GGUF loading: the real default model against transformers, synthetic files for
every tensor type and tokenizer kind, and every kind of bad file."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf import quants  # noqa: E402

from cyllm.errors import ModelLoadError, UnsupportedModelError  # noqa: E402
from cyllm.loading.gguf import load_gguf, read_gguf  # noqa: E402
from cyllm.quant import QuantMatrix  # noqa: E402
from conftest import HOST_BACKENDS


def pick_backend() -> str:
    return HOST_BACKENDS[-1]      # the compiled cpu backend when built, else the numpy reference


# ============================================================================ synthetic files

TINY = dict(dim=256, n_heads=4, n_kv=2, head_dim=64, ffn=256, n_layers=1)


def spm_vocab():
    """A small SentencePiece-style vocabulary: specials, 256 byte tokens, pieces with scores."""
    corpus = ("the quick brown fox jumps over the lazy dog while the cat sat on the mat "
              "and then another thing happened in the morning hello world")
    tokens = ["<unk>", "<s>", "</s>"]
    types = [2, 3, 3]
    scores = [0.0, 0.0, 0.0]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    scores += [0.0] * 256
    pieces = {}
    for word in corpus.split():
        w = "\u2581" + word
        for i in range(len(w)):
            for j in range(i + 1, min(len(w), i + 6) + 1):
                p = w[i:j]
                # longer pieces were merged later: lower score
                pieces.setdefault(p, -float(len(p)) - 0.001 * len(pieces))
    for p, s in pieces.items():
        tokens.append(p)
        types.append(1)
        scores.append(s)
    return tokens, types, scores


# types gguf-py cannot quantize: tests write random blocks of them with a sane scale
RANDOM_BLOCK_TYPES = (QT.Q2_K, QT.Q3_K, QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ3_XXS, QT.IQ3_S,
                      QT.IQ1_S, QT.IQ1_M, QT.IQ4_XS, QT.IQ4_NL, QT.TQ1_0)


def random_blocks(rng, t, shape) -> np.ndarray:
    """(rows, bytes) of random blocks of type t whose f16 scale (and Q2_K's min scale) is
    0.01: at byte 0 of the i-quants' blocks, last in Q3_K's and TQ1_0's, the last two f16
    of Q2_K's, the top nibbles of the last four 16-bit words of IQ1_M's."""
    block, size = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    d = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if t == QT.IQ1_M:
        bits = int(np.frombuffer(d.tobytes(), "<u2")[0])
        for k in range(4):              # nibble k of the scale: top of word k (its high byte)
            hi = raw[..., size - 8 + 2 * k + 1]
            raw[..., size - 8 + 2 * k + 1] = (hi & 0x0F) | (((bits >> (4 * k)) & 0xF) << 4)
    elif t in (QT.Q3_K, QT.TQ1_0):
        raw[..., size - 2:] = d
    elif t == QT.Q2_K:
        raw[..., size - 4:] = np.concatenate([d, d])
    else:
        raw[..., :2] = d
    return raw.reshape(shape[0], -1)


def write_tiny_gguf(path: Path, qtype=QT.F16, arch="llama", tokenizer="spm", seed=0,
                    raw_override: dict | None = None, n_vocab=None, tied=False, extra=None):
    """A 1-layer llama GGUF; matrices in ``qtype``. Returns {gguf_name: float32 HF-order source}."""
    rng = np.random.default_rng(seed)
    c = TINY
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", c["n_layers"])
    w.add_uint32(f"{arch}.embedding_length", c["dim"])
    w.add_uint32(f"{arch}.feed_forward_length", c["ffn"])
    w.add_uint32(f"{arch}.attention.head_count", c["n_heads"])
    w.add_uint32(f"{arch}.attention.head_count_kv", c["n_kv"])
    w.add_uint32(f"{arch}.context_length", 512)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_uint32(f"{arch}.rope.dimension_count", c["head_dim"])
    if tokenizer == "spm":
        toks, types, scores = spm_vocab()
        w.add_string("tokenizer.ggml.model", "llama")
        w.add_array("tokenizer.ggml.tokens", toks)
        w.add_array("tokenizer.ggml.scores", [float(s) for s in scores])
        w.add_array("tokenizer.ggml.token_type", types)
        w.add_uint32("tokenizer.ggml.bos_token_id", 1)
        w.add_uint32("tokenizer.ggml.eos_token_id", 2)
        w.add_uint32("tokenizer.ggml.unknown_token_id", 0)
        w.add_bool("tokenizer.ggml.add_bos_token", True)
        vocab = len(toks)
    else:
        vocab = n_vocab or 320
    d, f, q, kv = c["dim"], c["ffn"], c["n_heads"] * c["head_dim"], c["n_kv"] * c["head_dim"]
    shapes = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,),
              "blk.0.attn_norm.weight": (d,), "blk.0.ffn_norm.weight": (d,),
              "blk.0.attn_q.weight": (q, d), "blk.0.attn_k.weight": (kv, d),
              "blk.0.attn_v.weight": (kv, d), "blk.0.attn_output.weight": (d, q),
              "blk.0.ffn_gate.weight": (f, d), "blk.0.ffn_up.weight": (f, d),
              "blk.0.ffn_down.weight": (d, f)}
    if not tied:
        shapes["output.weight"] = (vocab, d)
    src = {}
    for name, shape in shapes.items():
        a = (rng.standard_normal(shape) * (0.05 if len(shape) == 2 else 1.0)).astype(np.float32)
        src[name] = a
        t = (raw_override or {}).get(name, qtype if len(shape) == 2 else QT.F32)
        if t == QT.F32:
            w.add_tensor(name, a)
        elif t == QT.F16:
            w.add_tensor(name, a.astype(np.float16))
        elif t in (QT.Q4_K, QT.Q5_K, QT.Q6_K):
            raw = kquant_bytes(rng, t, shape)
            w.add_tensor(name, raw, raw_dtype=t)
        elif t in RANDOM_BLOCK_TYPES:      # no quantizer in gguf-py: random blocks
            w.add_tensor(name, random_blocks(rng, t, shape), raw_dtype=t)
        else:
            w.add_tensor(name, quants.quantize(a, t), raw_dtype=t)
    for name, a in (extra or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return src


def kquant_bytes(rng, t, shape):
    """Random but well-formed K-quant blocks (gguf-py cannot quantize these): sane f16 scales."""
    _, bsize = gguf.GGML_QUANT_SIZES[t]
    rows, cols = shape
    nb = cols // 256
    raw = rng.integers(0, 256, size=(rows, nb, bsize), dtype=np.uint8)
    scale = np.full((rows, nb), 0.01, dtype=np.float16).view(np.uint8).reshape(rows, nb, 2)
    if t in (QT.Q4_K, QT.Q5_K):       # d, dmin first
        raw[:, :, 0:2] = scale
        raw[:, :, 2:4] = scale
    else:                             # Q6_K: d last
        raw[:, :, bsize - 2:bsize] = scale
    return raw.reshape(rows, nb * bsize)


def hf_from_gguf_rows(a, n_heads):
    """Reference un-permutation written from llama.cpp's forward permutation (HF -> GGUF):
    w.reshape(n_head, 2, rows/n_head/2, cols).swapaxes(1, 2). We invert it by brute force."""
    rows = a.shape[0]
    perm = np.arange(rows).reshape(n_heads, 2, rows // n_heads // 2).swapaxes(1, 2).reshape(-1)
    out = np.empty_like(a)
    out[perm] = a       # GGUF row r holds HF row perm[r]
    return out


def gguf_from_hf_rows(w, n_heads):
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ============================================================================ tensor types

@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q5_K, QT.Q6_K])
def test_tensor_types_dequantize(tmp_path, qtype, monkeypatch):
    """Float matrices load as float16; with CYLLM_QUANT=native, native block formats as
    QuantMatrix views of the file (q/k: a row-permuted copy) whose blocks dequantize (gguf
    package) to the file's values."""
    monkeypatch.setenv("CYLLM_QUANT", "native")
    p = tmp_path / f"tiny-{qtype.name}.gguf"
    src = write_tiny_gguf(p, qtype=qtype)
    cfg, weights, tok = load_gguf(p)
    assert cfg.n_layers == 1 and cfg.dim == 256 and cfg.head_dim == 64 and not cfg.tie_word_embeddings
    gf = read_gguf(p)
    quantized = qtype not in (QT.F32, QT.F16, QT.BF16)
    for gname, hname, heads in [("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", 0),
                                ("token_embd.weight", "model.embed_tokens.weight", 0),
                                ("output.weight", "lm_head.weight", 0),
                                ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", 4),
                                ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", 2)]:
        got = weights[hname]
        if quantized:
            assert isinstance(got, QuantMatrix) and got.fmt.ggml_type == int(qtype)
            if not heads:      # stays in the memory map
                assert not got.data.flags.writeable and not got.data.flags.owndata
            got = quants.dequantize(got.data, qtype).reshape(got.shape).astype(np.float16)
        assert got.dtype == np.float16 and got.shape == src[gname].shape
        info = gf.tensors[gname]
        raw = np.frombuffer(gf.buf, np.uint8, info.nbytes, info.offset)
        if qtype in (QT.F32, QT.F16):
            ref = raw.view(np.float32 if qtype == QT.F32 else np.float16).astype(np.float32)
        else:
            ref = quants.dequantize(raw, qtype)
        ref = ref.reshape(got.shape)
        if heads:
            ref = hf_from_gguf_rows(ref, heads)
        np.testing.assert_array_equal(got, ref.astype(np.float16))
        if qtype not in (QT.Q4_K, QT.Q5_K, QT.Q6_K):
            # independent: values come back near what was quantized (HF row order for q/k too,
            # because the file holds the source rows as written: no permutation applied there)
            want = src[gname] if not heads else hf_from_gguf_rows(src[gname], heads)
            tol = {QT.F32: 1e-3, QT.F16: 1e-3, QT.BF16: 2e-3, QT.Q8_0: 3e-3,
                   QT.Q4_0: 0.04, QT.Q4_1: 0.04}[qtype]
            assert np.abs(got.astype(np.float32) - want).max() < tol
    assert weights["model.norm.weight"].dtype == np.float32
    np.testing.assert_array_equal(weights["model.norm.weight"], src["output_norm.weight"])


# types without a native kernel -> the native format they load as (loading/gguf.py
# CONVERT_TO_NATIVE), and how far the converted matrix may sit from the file's values:
# requantized, a relative Frobenius error of 1 / (levels - 1) of the target's grid, the
# rounding error of values spread evenly over it (measured here: q5_k 1.0-2.5%, q6_k
# 1.0-1.4%); re-encoded (quant/transcode.py), none -- IQ4_XS's scales rounded to f16 aside
CONVERTED = {QT.IQ2_XXS: "q5_k", QT.IQ1_S: "q5_k", QT.IQ3_S: "q4_k", QT.IQ3_XXS: "q6_k",
             QT.Q2_K: "q6_k", QT.IQ2_XS: "q6_k", QT.IQ2_S: "q6_k", QT.IQ1_M: "q6_k",
             QT.Q3_K: "q6_k", QT.IQ4_NL: "q8_0", QT.IQ4_XS: "q8_0"}
CONVERSION_ERROR = {"q5_k": 1 / 31, "q6_k": 1 / 63}
# bound on each value's error, relative to the value (IQ3_S: to its sub-block's largest
# magnitude, 15 units, since the rounded min is an offset of every value)
REENCODED = {QT.Q3_K: 0.0, QT.IQ4_NL: 0.0, QT.IQ4_XS: 2.0 ** -11, QT.IQ1_M: 0.0, QT.IQ3_XXS: 0.0,
             QT.IQ3_S: 2.0 ** -11}


@pytest.mark.parametrize("qtype", list(CONVERTED), ids=lambda t: t.name)
def test_types_without_a_kernel_convert_to_a_native_format(tmp_path, qtype, monkeypatch, capsys):
    """A matrix of a type without a kernel loads as the native format of CONVERTED, one notice
    on stderr saying so, and its values are the file's (gguf-py's dequantizer, llama.cpp's own
    Python code, is the reference): exactly where re-encoded, else up to that format's rounding."""
    from cyllm.quant import reference as R
    monkeypatch.setenv("CYLLM_QUANT", "native")
    p = tmp_path / f"tiny-{qtype.name}.gguf"
    write_tiny_gguf(p, qtype=QT.F16, tokenizer=None, raw_override={"blk.0.ffn_up.weight": qtype})
    _, weights, _ = load_gguf(p)
    got = weights["model.layers.0.mlp.up_proj.weight"]
    target = CONVERTED[qtype]
    assert isinstance(got, QuantMatrix) and got.fmt.name == target
    assert f"1 {qtype.name} -> {target.upper()}" in capsys.readouterr().err
    info = read_gguf(p).tensors["blk.0.ffn_up.weight"]
    raw = np.frombuffer(read_gguf(p).buf, np.uint8, info.nbytes, info.offset)
    ref = quants.dequantize(raw, qtype).reshape(got.shape).astype(np.float64)
    ours = R.dequantize(got.data, target, got.shape[1]).astype(np.float64)
    assert np.all(np.isfinite(ref)) and np.abs(ref).max() > 0
    if qtype in REENCODED:
        scale = np.abs(ref)
        if qtype == QT.IQ3_S:
            scale = np.repeat(np.abs(ref).reshape(-1, 32).max(axis=1), 32).reshape(ref.shape)
        assert np.all(np.abs(ours - ref) <= REENCODED[qtype] * scale), f"{qtype.name} -> {target}"
        return
    err = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    assert err < CONVERSION_ERROR[target], f"{qtype.name} -> {target}: relative error {err:.4f}"


def test_iq3s_scale_too_large_to_reencode_is_requantized(tmp_path, monkeypatch):
    """An IQ3_S block whose d is finite but above 4367 has no q4_k form with the same values
    (its min, 15 d, overflows f16): its row is requantized instead of refused, up to q4_k's
    rounding, and every other row is still re-encoded exactly."""
    from cyllm.quant import reference as R
    monkeypatch.setenv("CYLLM_QUANT", "native")
    p = tmp_path / "big-IQ3_S.gguf"
    write_tiny_gguf(p, qtype=QT.F16, tokenizer=None, raw_override={"blk.0.ffn_up.weight": QT.IQ3_S})
    gf = read_gguf(p)
    info = gf.tensors["blk.0.ffn_up.weight"]
    at = info.offset + 5 * gguf.GGML_QUANT_SIZES[QT.IQ3_S][1]          # block 5's d
    del gf
    data = bytearray(p.read_bytes())
    data[at:at + 2] = np.float16(5000.0).tobytes()
    p.write_bytes(bytes(data))
    _, weights, _ = load_gguf(p)
    got = weights["model.layers.0.mlp.up_proj.weight"]
    assert got.fmt.name == "q4_k"
    raw = np.frombuffer(read_gguf(p).buf, np.uint8, info.nbytes, info.offset)
    ref = quants.dequantize(raw, QT.IQ3_S).reshape(got.shape).astype(np.float64)
    ours = R.dequantize(got.data, "q4_k", got.shape[1]).astype(np.float64)
    assert np.all(np.isfinite(ours)) and np.abs(ref).max() > 10000
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 1 / 15
    big = np.abs(ref).max(axis=1) > 10000                               # (rows,): block 5's row
    assert big.sum() == 1
    scale = np.repeat(np.abs(ref[~big]).reshape(-1, 32).max(axis=1), 32).reshape(ref[~big].shape)
    assert np.all(np.abs(ours[~big] - ref[~big]) <= 2.0 ** -11 * scale)   # IQ3_S's exact bound


def test_iq4xs_scale_beyond_q8_0_is_refused_in_one_line(tmp_path, monkeypatch):
    """An IQ4_XS block whose d times its sub-block scale is beyond f16 has no Q8_0 form of the
    same values; its row is requantized, and where its codes reach the IQ4_NL table's -127 (as
    random codes here do) q8_0's scale is that product again. One line saying so, no numpy
    overflow warnings on the way."""
    import warnings
    monkeypatch.setenv("CYLLM_QUANT", "native")
    p = tmp_path / "big-IQ4_XS.gguf"
    write_tiny_gguf(p, qtype=QT.F16, tokenizer=None, raw_override={"blk.0.ffn_up.weight": QT.IQ4_XS})
    gf = read_gguf(p)
    at = gf.tensors["blk.0.ffn_up.weight"].offset + 3 * gguf.GGML_QUANT_SIZES[QT.IQ4_XS][1]   # block 3's d
    del gf
    data = bytearray(p.read_bytes())
    data[at:at + 2] = np.float16(60000.0).tobytes()
    data[at + 2:at + 8] = bytes(6)            # every sub-block scale ls = 0: d * (0 - 32) overflows
    p.write_bytes(bytes(data))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ModelLoadError) as e:
            load_gguf(p)
    assert "beyond what Q8_0 can" in one_line(e)


def test_qk_permutation_is_undone(tmp_path):
    """A q/k matrix written the way llama.cpp's converter does comes back in HF order."""
    rng = np.random.default_rng(1)
    c = TINY
    q_hf = rng.standard_normal((c["n_heads"] * c["head_dim"], c["dim"])).astype(np.float16)
    k_hf = rng.standard_normal((c["n_kv"] * c["head_dim"], c["dim"])).astype(np.float16)
    p = tmp_path / "perm.gguf"
    src = write_tiny_gguf(p, qtype=QT.F16)
    # rewrite the file with our own q/k (permuted like llama.cpp) in place of the random ones
    gf = read_gguf(p)
    data = bytearray(p.read_bytes())
    for name, w, heads in [("blk.0.attn_q.weight", q_hf, c["n_heads"]), ("blk.0.attn_k.weight", k_hf, c["n_kv"])]:
        info = gf.tensors[name]
        data[info.offset:info.offset + info.nbytes] = np.ascontiguousarray(gguf_from_hf_rows(w, heads)).tobytes()
    del gf
    p2 = tmp_path / "perm2.gguf"
    p2.write_bytes(bytes(data))
    _, weights, _ = load_gguf(p2)
    np.testing.assert_array_equal(weights["model.layers.0.self_attn.q_proj.weight"], q_hf)
    np.testing.assert_array_equal(weights["model.layers.0.self_attn.k_proj.weight"], k_hf)
    assert src  # the unpermuted v is untouched
    assert weights["model.layers.0.self_attn.v_proj.weight"].dtype == np.float16


def test_pre_tokenizers_of_glm4_and_hunyuan_dense():
    """The text pieces of llama.cpp's regexes for these tokenizer.ggml.pre names (its
    llama-vocab.cpp): glm4 is Llama 3's split; hunyuan-dense isolates runs of up to three
    digits, then runs of CJK ideographs and kana, then splits the rest its own way (a
    punctuation mark keeps the Latin letters after it)."""
    from cyllm.loading.gguf_tokenizer import _byte_level_pre_tokenizer, known_pre_tokenizer

    def pieces(pre, text):
        return [text[a:b] for _, (a, b) in _byte_level_pre_tokenizer(pre).pre_tokenize_str(text)]
    assert known_pre_tokenizer("glm4") and known_pre_tokenizer("hunyuan-dense")
    assert pieces("glm4", "Hello, world! 12345") == pieces("llama-bpe", "Hello, world! 12345") == \
        ["Hello", ",", " world", "!", " ", "123", "45"]
    assert pieces("hunyuan-dense", "Hello, world! 12345 \u4f60\u597dabc") == \
        ["Hello", ",", " world", "!", " ", "123", "45", " ", "\u4f60\u597d", "abc"]
    assert pieces("hunyuan-dense", "see www.example.com now") == ["see", " www", ".example", ".com", " now"]
    assert pieces("hunyuan-dense", "\u30ab\u30bf\u3072\u3089\u6f22x") == ["\u30ab\u30bf\u3072\u3089\u6f22", "x"]
    assert pieces("hunyuan-dense", "a\n\n  b?!\n") == ["a", "\n\n", " ", " b", "?!\n"]


def test_f16_matrices_are_zero_copy(tmp_path):
    p = tmp_path / "f16.gguf"
    write_tiny_gguf(p, qtype=QT.F16)
    _, weights, _ = load_gguf(p)
    v = weights["model.layers.0.self_attn.v_proj.weight"]
    assert not v.flags.owndata and not v.flags.writeable


def test_tied_embeddings(tmp_path):
    p = tmp_path / "tied.gguf"
    write_tiny_gguf(p, qtype=QT.Q8_0, tied=True)
    cfg, weights, _ = load_gguf(p)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in weights


def test_llama3_rope_freqs(tmp_path):
    """rope_freqs holds divisors of the base frequencies: used as they are, whatever their values."""
    from cyllm.rope import llama3_inv_freq
    hd = TINY["head_dim"]
    base = 1.0 / (10000.0 ** (np.arange(0, hd, 2) / hd))
    params = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    freqs = (base / llama3_inv_freq(base, params)).astype(np.float32)
    p = tmp_path / "l3.gguf"
    write_tiny_gguf(p, tokenizer=None, extra={"rope_freqs.weight": freqs})
    cfg, weights, _ = load_gguf(p)
    assert cfg.rope_scaling["rope_type"] == "llama3"
    assert "rope_freqs.weight" not in weights
    np.testing.assert_allclose(cfg.inv_freq(), base / freqs, rtol=1e-5)
    # values that match no published setting are still the file's truth (the old reader refused them)
    odd = np.linspace(1, 3, hd // 2, dtype=np.float32)
    p2 = tmp_path / "odd.gguf"
    write_tiny_gguf(p2, tokenizer=None, extra={"rope_freqs.weight": odd})
    cfg2, _, _ = load_gguf(p2)
    np.testing.assert_allclose(cfg2.inv_freq(), base / odd, rtol=1e-5)
    p3 = tmp_path / "bad.gguf"
    write_tiny_gguf(p3, tokenizer=None, extra={"rope_freqs.weight": np.zeros(hd // 2, np.float32) - 1})
    with pytest.raises(ModelLoadError) as e:
        load_gguf(p3)
    assert "rope_freqs" in one_line(e)


# ============================================================================ tokenizers

# no text with a leading space: transformers' GGUF conversion then drops SentencePiece's dummy
# prefix, which llama.cpp keeps (" Hi" -> "__Hi"); cyllm follows llama.cpp, checked against
# llama.cpp's own tokenizer test vectors in tests/test_families.py
SPM_TEXTS = ["the quick brown fox", "Hello world", "two  inner  spaces", "new\nline and\ttab",
             "unknown: ünï 日本 🙂", "thethethe catmat", "", "trailing space "]


def test_spm_tokenizer_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    p = tmp_path / "spm.gguf"
    write_tiny_gguf(p, qtype=QT.F16, tokenizer="spm")
    _, _, tok = load_gguf(p)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=p.name)
    assert tok.bos_id == 1 and tok.add_bos
    for s in SPM_TEXTS:
        assert tok.encode(s) == ref.encode(s), s
        ids = tok.encode(s, add_special_tokens=False)
        assert tok.decode(ids) == ref.decode(ids), s
    assert tok.decode(tok.encode("the cat sat on the mat", add_special_tokens=False)) == "the cat sat on the mat"


def test_spm_merges_derived_are_bounded(monkeypatch):
    """A vocabulary whose pieces split many ways (every a/b string) would derive merges without
    end: past MAX_SPM_MERGES it is refused, in one line, before they are built."""
    from itertools import product

    from cyllm.errors import TokenizerError
    from cyllm.loading import gguf_tokenizer as gt
    tokens = ["".join(p) for n in range(1, 7) for p in product("ab", repeat=n)]
    scores = -np.arange(len(tokens), dtype=np.float32)
    merges = gt._spm_merges(tokens, scores, "x.gguf")
    assert len(merges) == sum(len(t) - 1 for t in tokens)        # every split of every piece
    monkeypatch.setattr(gt, "MAX_SPM_MERGES", len(merges) - 1)
    with pytest.raises(TokenizerError, match="more than"):
        gt._spm_merges(tokens, scores, "x.gguf")


# ============================================================================ bad files

def one_line(e) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg
    return msg


@pytest.mark.parametrize("content", [b"", b"GGUF", b"GGUF\x03\x00\x00\x00", b"GGU", b"not a gguf file at all, no",
                                     b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 16,
                                     b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1 << 40)])
def test_garbage_files(tmp_path, content):
    p = tmp_path / "bad.gguf"
    p.write_bytes(content)
    with pytest.raises(ModelLoadError) as e:
        load_gguf(p)
    one_line(e)


def test_truncated_files(tmp_path):
    p = tmp_path / "full.gguf"
    write_tiny_gguf(p, qtype=QT.Q8_0)
    data = p.read_bytes()
    gf = read_gguf(p)
    end = max(t.offset + t.nbytes for t in gf.tensors.values())   # the writer pads past the data
    del gf
    for cut in (30, 200, len(data) // 3, end - 1):
        t = tmp_path / f"cut{cut}.gguf"
        t.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError) as e:
            load_gguf(t)
        assert "truncated" in one_line(e) or "not a GGUF" in one_line(e)


def test_unsupported_architecture(tmp_path):
    p = tmp_path / "neox.gguf"
    write_tiny_gguf(p, arch="gptneox", tokenizer=None)
    with pytest.raises(UnsupportedModelError) as e:
        load_gguf(p)
    assert "gptneox" in one_line(e)


@pytest.mark.parametrize("qtype,field", [(QT.Q8_0, 0), (QT.Q4_0, 0), (QT.Q4_1, 2), (QT.Q4_K, 2),
                                         (QT.Q5_K, 0), (QT.Q6_K, 208)], ids=lambda v: getattr(v, "name", str(v)))
def test_native_block_with_an_inf_scale_is_refused_at_load(tmp_path, qtype, field, monkeypatch):
    """A native block whose d (or m/dmin) is inf or nan is refused at load, naming the tensor
    and block: the kernels would read it as it is and the int8 rounding of the next activation
    would turn the NaNs into finite noise (the text wrong with no sign of it)."""
    monkeypatch.setenv("CYLLM_QUANT", "native")
    p = tmp_path / f"inf-{qtype.name}.gguf"
    write_tiny_gguf(p, qtype=qtype, tokenizer=None)
    gf = read_gguf(p)
    info = gf.tensors["blk.0.ffn_up.weight"]
    at = info.offset + 7 * gguf.GGML_QUANT_SIZES[qtype][1] + field            # block 7's field
    del gf
    data = bytearray(p.read_bytes())
    data[at:at + 2] = np.float16(np.inf).tobytes()
    p.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError) as e:
        load_gguf(p)
    msg = one_line(e)
    assert "blk.0.ffn_up.weight" in msg and "block 7" in msg and "inf or nan" in msg


@pytest.mark.parametrize("qtype", list(REENCODED), ids=lambda t: t.name)
def test_reencoded_type_with_a_nan_scale_is_one_clear_error(tmp_path, qtype, monkeypatch):
    """A re-encoded type (no float round trip) still refuses a block whose scale is inf or
    nan, as the requantizing path does, naming the tensor."""
    monkeypatch.setenv("CYLLM_QUANT", "native")
    p = tmp_path / f"nan-{qtype.name}.gguf"
    write_tiny_gguf(p, qtype=QT.F16, tokenizer=None, raw_override={"blk.0.ffn_up.weight": qtype})
    gf = read_gguf(p)
    info = gf.tensors["blk.0.ffn_up.weight"]
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    block = info.offset + 5 * size                                          # block 5
    del gf
    data = bytearray(p.read_bytes())
    if qtype == QT.IQ1_M:           # the scale's exponent bits: top nibbles of words 2 and 3
        data[block + 53] = (data[block + 53] & 0x0F) | 0xC0
        data[block + 55] = (data[block + 55] & 0x0F) | 0x70
    else:
        at = block + (size - 2 if qtype == QT.Q3_K else 0)
        data[at:at + 2] = np.float16(np.nan).tobytes()
    p.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError) as e:
        load_gguf(p)
    msg = one_line(e)
    assert "blk.0.ffn_up.weight" in msg and "inf or nan" in msg


def test_unsupported_tensor_type(tmp_path):
    p = tmp_path / "tq1.gguf"
    write_tiny_gguf(p, qtype=QT.F16, tokenizer=None, raw_override={"blk.0.ffn_up.weight": QT.TQ1_0})
    with pytest.raises(UnsupportedModelError) as e:
        load_gguf(p)
    msg = one_line(e)
    assert "TQ1_0" in msg and "blk.0.ffn_up.weight" in msg


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError):
        load_gguf(tmp_path / "nope.gguf")


def test_load_dispatch_and_cli_style_error(tmp_path):
    """cyllm.load on a file that only starts with the magic: a clean error, no traceback."""
    import cyllm
    p = tmp_path / "magic.gguf"
    p.write_bytes(b"GGUF" + b"\x00" * 40)
    with pytest.raises(ModelLoadError) as e:
        cyllm.load(str(p), backend="numpy")
    one_line(e)


# ============================================================================ the real model

PROMPTS = ["The capital of France is", "Once upon a time, there was a little",
           "def fibonacci(n):", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"]
TOKENIZER_TEXTS = ["Hello world", "12345 and 3.14159, 1e10 2024-01-01", "  two  spaces\n\nnewline\ttab   ",
                   "héllo wörld 日本語 🙂 Ünïcödé ß", "<|im_start|>user\nhi<|im_end|>\n", "don't I'll we've",
                   "def f(x):\n    return x**2  # comment\n", "Привет, мир!", "", " leading", "\n\n\n"]


@pytest.fixture(scope="module")
def real_path():
    from cyllm.default_model import default_model_path
    return default_model_path()


@pytest.fixture(scope="module")
def ours(real_path):
    """The real GGUF through cyllm's loader, tokenizer and model, with its Q4_1/Q8_0 blocks
    dequantized to f16 as transformers dequantizes them: these tests check the reading of
    the file and the model's math; the native quantized kernels (which also round x to
    int8 blocks, as llama.cpp does) are checked against llama.cpp in test_quant_perplexity.py."""
    from cyllm.loading import load_path
    from cyllm.model import Model
    from cyllm.quant import QuantMatrix
    from cyllm.quant.convert import dequantize_f16
    cfg, weights, tok = load_path(real_path)
    weights = {k: dequantize_f16(v) if isinstance(v, QuantMatrix) else v for k, v in weights.items()}
    return Model(cfg, weights, tok, backend=pick_backend())


@pytest.fixture(scope="module")
def hf(real_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")   # transformers needs it to load GGUF
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(real_path.parent), gguf_file=real_path.name, dtype=torch.float32)
    model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(real_path.parent), gguf_file=real_path.name)
    return model, tok


def test_real_config(ours):
    c = ours.config
    assert (c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.vocab_size) == \
        (30, 576, 9, 3, 64, 1536, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0
    assert ours.tokenizer.bos_id == 1 and 2 in ours.tokenizer.eos_ids


def test_real_tokenizer_matches_transformers(ours, hf):
    _, ref = hf
    for s in TOKENIZER_TEXTS:
        assert ours.tokenizer.encode(s) == ref.encode(s), s
        assert ours.tokenizer.decode(ours.tokenizer.encode(s)) == s
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.tokenizer.apply_chat_template(msgs) == ref.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True)


def test_real_logits_match_transformers(ours, hf):
    import torch
    model, _ = hf
    ids = ours.tokenizer.encode("The quick brown fox jumps over the lazy dog. Paris is the capital of")
    got = ours.logits(ids)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float().numpy()
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel < 1e-2, rel
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.95


def test_real_greedy_matches_transformers(ours, hf):
    import torch
    model, _ = hf
    eos = set(ours.tokenizer.eos_ids)
    for prompt in PROMPTS:
        ids = ours.tokenizer.encode(prompt)
        logits = ours.prefill(ids, 0)
        mine = []
        pos = len(ids)
        for _ in range(16):
            t = int(np.argmax(logits))
            mine.append(t)
            if t in eos:
                break
            logits = ours.forward(t, pos)
            pos += 1
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                 eos_token_id=sorted(eos), pad_token_id=sorted(eos)[0])
        theirs = out[0, len(ids):].tolist()
        assert mine == theirs, prompt
