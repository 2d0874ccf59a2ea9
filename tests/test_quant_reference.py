"""cyllm.quant reference (NumPy) against the gguf package and llama.cpp's quantizers,
and the typed weight's validation."""

import ctypes
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as GT  # noqa: E402

from cyllm.errors import InvalidArgumentError, ModelLoadError  # noqa: E402
from cyllm.quant import FORMATS, QUANTIZED, QuantMatrix, act_bytes, format_by_ggml_type, format_by_name  # noqa: E402
from cyllm.quant import reference as R  # noqa: E402

# byte offsets of the f16 scale fields per format (random blocks get finite scales there)
SCALE_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2),
                "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def random_blocks(fmt, n_blocks, rng, scale=0.01):
    """Random block bytes of `fmt` whose f16 fields are finite (any bytes are a valid block
    apart from inf/nan scales)."""
    f = FORMATS[fmt]
    b = rng.integers(0, 256, size=(n_blocks, f.block_bytes), dtype=np.uint8)
    for off in SCALE_FIELDS[fmt]:
        h = (rng.standard_normal(n_blocks) * scale).astype("<f2")
        b[:, off:off + 2] = h.view(np.uint8).reshape(-1, 2)
    return b


def rel_rmse(a, b):
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


def test_format_table_matches_gguf():
    for name, f in FORMATS.items():
        t = GT(f.ggml_type)
        block, type_size = gguf.GGML_QUANT_SIZES[t]
        assert (f.block, f.block_bytes) == (block, type_size), name
        assert format_by_ggml_type(f.ggml_type) is f
        assert format_by_name(name.upper()) is f
    assert FORMATS["q4_k"].act == "q8_k" and FORMATS["q4_0"].act == "q8_0"
    assert act_bytes("q8_0", 64) == 64 + 2 * 8 and act_bytes("q8_k", 512) == 512 + 2 * (4 + 32)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_dequantize_matches_gguf(fmt):
    rng = np.random.default_rng(1)
    b = random_blocks(fmt, 64, rng)
    ref = gguf.quants.dequantize(b.reshape(-1), GT(FORMATS[fmt].ggml_type))
    ours = R.dequantize(b, fmt)
    np.testing.assert_array_equal(ours, ref.reshape(-1))


@pytest.mark.parametrize("fmt", ["f16", "bf16", "f32"])
def test_dequantize_float_formats(fmt):
    x = np.random.default_rng(2).standard_normal(64).astype(np.float32)
    raw = {"f16": x.astype("<f2"), "f32": x.astype("<f4"),
           "bf16": gguf.quants.quantize(x, GT.BF16)}[fmt].view(np.uint8)
    want = gguf.quants.dequantize(raw, GT(FORMATS[fmt].ggml_type)) if fmt != "f16" else x.astype(np.float16)
    np.testing.assert_array_equal(R.dequantize(raw, fmt), np.asarray(want, np.float32).reshape(-1))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_quantize_32_blocks_bit_exact_with_gguf(fmt):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((12, 320)) * rng.uniform(0.001, 5, (12, 1))).astype(np.float32)
    x[0, :32] = 0.0                      # an all-zero block
    x[1, 32:64] = 1.5                    # a constant block
    ours = R.quantize(x, fmt)
    ref = gguf.quants.quantize(x, GT(FORMATS[fmt].ggml_type))
    np.testing.assert_array_equal(ours, ref)


# Round-trip error bounds, relative RMSE on N(0, 1) rows, measured with llama.cpp's
# reference quantizers (identical bytes, see test_k_quants_match_llama_cpp): q4_k 0.069,
# q5_k 0.035, q6_k 0.017.
K_RMSE = {"q4_k": 0.072, "q5_k": 0.037, "q6_k": 0.018}


@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k"])
def test_k_quant_round_trip(fmt):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((16, 1024)).astype(np.float32)
    q = R.quantize(x, fmt)
    assert q.shape == (16, FORMATS[fmt].row_bytes(1024))
    y = R.dequantize(q, fmt, 1024)
    # the gguf package decodes our bytes to the same values (layout check)
    np.testing.assert_array_equal(y.reshape(-1), gguf.quants.dequantize(q.reshape(-1), GT(FORMATS[fmt].ggml_type)))
    assert rel_rmse(y, x) < K_RMSE[fmt]
    # zero rows stay exactly zero; a scaled copy of a row scales its error
    z = R.dequantize(R.quantize(np.zeros((1, 256), np.float32), fmt), fmt)
    assert not z.any()


def test_k_quants_beat_plain_min_max():
    """The scale/min search must beat a naive min/max quantizer even though the naive one
    keeps its per-32 scale and min in float32 (q4_k stores them in 6 bits): 0.071 vs 0.077."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 2048)).astype(np.float32)
    sub = x.reshape(-1, 32)
    lo, hi = sub.min(1, keepdims=True), sub.max(1, keepdims=True)
    naive = np.rint((sub - lo) / (hi - lo) * 15) * (hi - lo) / 15 + lo
    y = R.dequantize(R.quantize(x, "q4_k"), "q4_k", 2048)
    assert rel_rmse(y, x) < 0.95 * rel_rmse(naive.reshape(x.shape), x)


def _ggml_lib():
    path = os.environ.get("CYLLM_GGML_LIB")
    if not path:
        pytest.skip("set CYLLM_GGML_LIB to a llama.cpp libggml-base.so to compare quantizers")
    return ctypes.CDLL(path)


@pytest.mark.parametrize("fmt,fn", [("q4_k", "quantize_row_q4_K_ref"), ("q5_k", "quantize_row_q5_K_ref"),
                                    ("q6_k", "quantize_row_q6_K_ref"), ("q4_0", "quantize_row_q4_0_ref"),
                                    ("q8_0", "quantize_row_q8_0_ref")])
def test_k_quants_match_llama_cpp(fmt, fn):
    """Bytes identical with llama.cpp's reference quantizers (what llama-quantize writes
    without an importance matrix). Needs a libggml-base built with no -ffp-contract
    (GGML_NATIVE=OFF: ggml-base has no FMA)."""
    lib = _ggml_lib()
    rng = np.random.default_rng(6)
    for x in (rng.standard_normal(256 * 64) * 0.02, rng.standard_t(3, 256 * 64),
              rng.uniform(-1, 0.3, 256 * 64)):
        x = x.astype(np.float32)
        out = np.zeros(FORMATS[fmt].row_bytes(x.size), np.uint8)
        getattr(lib, fn)(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
                         ctypes.c_int64(x.size))
        np.testing.assert_array_equal(R.quantize(x[None], fmt).reshape(-1), out)


def test_quantize_act_matches_definition():
    rng = np.random.default_rng(7)
    x = rng.standard_normal(512).astype(np.float32)
    x[:32] = 0
    for act in ("q8_0", "q8_k"):
        a = R.quantize_act(x, act)
        blk = 32 if act == "q8_0" else 256
        xb = x.reshape(-1, blk)
        amax = np.abs(xb).max(1)
        np.testing.assert_array_equal(a["d"], (amax / np.float32(127)).astype(np.float32))
        assert np.abs(a["q"].astype(np.int32)).max() <= 127
        # dequantized activation within half a step
        err = np.abs(a["q"].reshape(-1, blk) * a["d"][:, None] - xb).max(1)
        assert np.all(err <= a["d"] * 0.5 + 1e-7)
        packed = R.pack_act(a, act)
        assert packed.size == act_bytes(act, 512)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_qdot_matches_float_math(fmt):
    rng = np.random.default_rng(8)
    f = FORMATS[fmt]
    cols = 2 * f.block if f.block == 256 else 5 * f.block
    w = R.quantize(rng.standard_normal((6, cols)).astype(np.float32), f)
    x = rng.standard_normal(cols).astype(np.float32)
    out, isum = R.qdot(w, f, x)
    a = R.quantize_act(x, f.act)
    xd = (a["q"].reshape(-1, f.act == "q8_0" and 32 or 256).astype(np.float64)
          * a["d"][:, None].astype(np.float64)).reshape(-1)
    want = R.dequantize(w, f, cols).astype(np.float64) @ xd
    np.testing.assert_allclose(out, want, rtol=1e-9, atol=1e-9 * np.abs(want).max())
    assert isum.dtype == np.int64


def test_quant_matrix_validation():
    f = FORMATS["q4_k"]
    data = np.zeros((3, f.row_bytes(512)), np.uint8)
    m = QuantMatrix(data, "q4_k", (3, 512))
    assert m.shape == (3, 512) and m.row_bytes == 288 and m.nbytes == 864
    assert np.shares_memory(m.data, data)
    flat = QuantMatrix(data.reshape(-1), f, (3, 512), name="blk.0.ffn_up.weight")
    assert np.shares_memory(flat.data, data)
    with pytest.raises(ModelLoadError, match="not a multiple of the q4_k block"):
        QuantMatrix(data, "q4_k", (3, 500))
    with pytest.raises(ModelLoadError, match="needs 864 bytes"):
        QuantMatrix(data[:2], "q4_k", (3, 512))
    with pytest.raises(ModelLoadError, match="uint8"):
        QuantMatrix(data.view(np.int8), "q4_k", (3, 512))
    with pytest.raises(ModelLoadError, match="empty"):
        QuantMatrix(data, "q4_k", (0, 512))
    with pytest.raises(InvalidArgumentError, match="unknown weight format"):
        QuantMatrix(data, "q3_x", (3, 512))
    with pytest.raises(ModelLoadError, match="not a native cyllm weight format"):
        format_by_ggml_type(10)          # Q2_K
    buf = bytes(1000)
    m = QuantMatrix.from_buffer(buf, 100, "q8_0", (2, 64))
    assert m.data.shape == (2, 68) and not m.data.flags.writeable
    with pytest.raises(ModelLoadError, match="beyond the end"):
        QuantMatrix.from_buffer(buf, 900, "q8_0", (2, 64))
    with pytest.raises(ModelLoadError, match="not a multiple"):
        QuantMatrix.from_buffer(buf, 0, "q8_0", (2, 48))
    np.testing.assert_array_equal(QuantMatrix(R.quantize(np.ones((2, 256), np.float32), "q6_k"),
                                              "q6_k", (2, 256)).dequantize(), np.ones((2, 256)))


def test_quantize_rejects_bad_input():
    with pytest.raises(InvalidArgumentError, match="multiple of 256"):
        R.quantize(np.zeros((2, 100), np.float32), "q4_k")
    with pytest.raises(InvalidArgumentError, match="inf or nan"):
        R.quantize(np.full((1, 32), np.inf, np.float32), "q8_0")
    with pytest.raises(InvalidArgumentError, match="not a block format"):
        R.quantize(np.zeros((1, 32), np.float32), "f16")


def test_quantize_weights_pool_and_team_agree(monkeypatch):
    """quantize_weights (--quantize at load) gives small matrices one thread each, several at a
    time, and large ones the whole team: either way every matrix holds the bytes gguf's own
    quantizer writes (its 32-element formats), and the two ways agree on every matrix."""
    from gguf.quants import quantize as gguf_quantize

    from cyllm.quant import convert
    from cyllm.tools.synthetic import build_synthetic
    config, base = build_synthetic("tiny")
    floats = {k: v for k, v in base.items() if v.ndim == 2}
    pooled = convert.quantize_weights(config, dict(base), "q4_0", threads=2)
    monkeypatch.setattr(convert, "_SMALL_MATRIX", 0)            # every matrix to the team
    teamed = convert.quantize_weights(config, dict(base), "q4_0", threads=2)
    checked = 0
    for name, a in floats.items():
        p, t = pooled[name], teamed[name]
        assert isinstance(p, QuantMatrix) and isinstance(t, QuantMatrix), name
        np.testing.assert_array_equal(p.data, t.data)
        if p.fmt.block == 32:
            want = gguf_quantize(a.astype(np.float32), GT[p.fmt.name.upper()])
            np.testing.assert_array_equal(p.data, want.reshape(p.data.shape))
            checked += 1
    assert checked >= 2
