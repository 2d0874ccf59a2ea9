"""The native quantized kernels (cython_ext/quant.pxi, csrc/quant_*.c) against the NumPy
reference of the block math (cyllm.quant.reference), for every table this machine runs
plus the generic one, on awkward shapes; integer parts exact; bitwise identical for 1
and 2 threads; bad input rejected."""

import numpy as np
import pytest

from cyllm.errors import BackendUnavailableError, InvalidArgumentError
from cyllm.quant import FORMATS, QUANTIZED
from cyllm.quant import reference as R

K = pytest.importorskip("cyllm._ext.kernels")

VARIANTS = sorted(set(K.quant_available_variants()) | {"generic"})


def cols_for(fmt):
    """Row lengths: one block, two, and an odd count of blocks (pairs + a tail)."""
    b = FORMATS[fmt].block
    return [b, 2 * b, 3 * b] if b == 256 else [b, 2 * b, 7 * b, 64 * b + b]


def make(fmt, rows, cols, rng):
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 1.0, (rows, 1))).astype(np.float32)
    return R.quantize(w, fmt)


def ref_tol(wq, fmt, x):
    """Tolerance: float32 summation of the per-block terms, relative to their magnitude."""
    f = FORMATS[fmt]
    a = R.quantize_act(x, f.act)
    xd = (a["q"].reshape(-1, 32 if f.act == "q8_0" else 256) * a["d"][:, None]).reshape(-1)
    mag = np.abs(R.dequantize(wq, f, x.size).astype(np.float64)) @ np.abs(xd.astype(np.float64))
    return 4e-6 * mag + 1e-30


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_qmatvec_matches_reference(variant, fmt):
    rng = np.random.default_rng(hash((variant, fmt)) % 2**32)
    qk = K.QuantKernels(threads=1, variant=variant)
    assert qk.quant_variant == variant
    for cols in cols_for(fmt):
        for rows in (1, 3, 5, 7, 13):
            wq = make(fmt, rows, cols, rng)
            x = rng.standard_normal(cols).astype(np.float32)
            want, _ = R.qdot(wq, fmt, x)
            out = np.full(rows, np.nan, np.float32)
            qk.qmatvec(out, wq, fmt, x)
            assert np.all(np.abs(out - want) <= ref_tol(wq, fmt, x)), (cols, rows)
            base = rng.standard_normal(rows).astype(np.float32)
            out2 = base.copy()
            qk.qmatvec(out2, wq, fmt, x, add=True)
            np.testing.assert_array_equal(out2, base + out)
            # the pre-quantized entry point gives the same bits
            xq = np.zeros(qk.act_bytes(fmt, cols), np.uint8)
            qk.quantize_activation(xq, x, fmt)
            out3 = np.zeros(rows, np.float32)
            qk.qmatvec_prequantized(out3, wq, fmt, xq)
            np.testing.assert_array_equal(out3, out)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("act", ["q8_0", "q8_k"])
def test_activation_bytes_exact(variant, act):
    fmt = "q4_0" if act == "q8_0" else "q4_k"
    qk = K.QuantKernels(variant=variant)
    rng = np.random.default_rng(11)
    for n in (256, 768, 2048):
        x = (rng.standard_normal(n) * 3).astype(np.float32)
        x[:32] = 0.0                                   # amax == 0 block
        x[40] = 1e-30                                  # tiny values
        x[64:96] = np.linspace(-2.5, 2.5, 32)          # exact .5 ties after scaling
        out = np.zeros(qk.act_bytes(fmt, n), np.uint8)
        qk.quantize_activation(out, x, fmt)
        np.testing.assert_array_equal(out, R.pack_act(R.quantize_act(x, act), act))


def exact_case(fmt, rows, nblocks, rng):
    """Weights and x whose every scale is a power of two (or a small integer times one),
    so every float step of the kernels is exact: the output must equal the integer math."""
    f = FORMATS[fmt]
    b = rng.integers(0, 256, size=(rows * nblocks, f.block_bytes), dtype=np.uint8)
    pow2 = lambda k: np.array([2.0 ** -k], np.float16).view(np.uint8)     # noqa: E731
    for i in range(b.shape[0]):
        if fmt in ("q4_k", "q5_k"):
            b[i, 0:2] = pow2(rng.integers(6, 9))
            b[i, 2:4] = pow2(rng.integers(6, 9))
            b[i, 4:16] &= 0b11000111           # small 6-bit scales and mins
        elif fmt == "q6_k":
            b[i, 208:210] = pow2(rng.integers(6, 9))
            b[i, 192:208] = rng.integers(-8, 8, 16).astype(np.int8).view(np.uint8)
        else:
            b[i, 0:2] = pow2(rng.integers(4, 8))
            if fmt in ("q4_1", "q5_1"):
                b[i, 2:4] = np.array([3 * 2.0 ** -rng.integers(4, 8)], np.float16).view(np.uint8)
            if fmt == "q8_0":
                b[i, 2:] = rng.integers(-20, 21, 32).astype(np.int8).view(np.uint8)
    cols = nblocks * f.block
    blk = 32 if f.act == "q8_0" else 256
    xi = rng.integers(-12, 13, cols)
    xi[::blk] = 127                                   # amax 127 in every activation block
    x = (xi * 2.0 ** -5).astype(np.float32)          # d_x = 2^-5, q_x = xi exactly
    return b.reshape(rows, -1), x


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_integer_part_exact(variant, fmt):
    rng = np.random.default_rng(21)
    qk = K.QuantKernels(variant=variant)
    nblocks = 3 if FORMATS[fmt].block == 256 else 9
    w, x = exact_case(fmt, 11, nblocks, rng)
    a = R.quantize_act(x, FORMATS[fmt].act)
    assert np.all(a["d"] == np.float32(127 * 2.0 ** -5 / 127))
    want, _ = R.qdot(w, fmt, x)
    out = np.zeros(11, np.float32)
    qk.qmatvec(out, w, fmt, x)
    assert np.all(np.abs(want) < 2.0 ** 20)           # far inside float32's exact integers
    np.testing.assert_array_equal(out.astype(np.float64), want)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q5_1", "q4_k", "q6_k"])
def test_gate_up(variant, fmt):
    rng = np.random.default_rng(31)
    qk = K.QuantKernels(variant=variant)
    cols = cols_for(fmt)[-1]
    for rows in (1, 19, 33):
        wg, wu = make(fmt, rows, cols, rng), make(fmt, rows, cols, rng)
        x = rng.standard_normal(cols).astype(np.float32)
        g = np.zeros(rows, np.float32)
        u = np.zeros(rows, np.float32)
        qk.qmatvec(g, wg, fmt, x)
        qk.qmatvec(u, wu, fmt, x)
        out = np.zeros(rows, np.float32)
        qk.qgate_up(out, wg, wu, fmt, x)
        g64 = g.astype(np.float64)
        np.testing.assert_allclose(out, g64 / (1 + np.exp(-g64)) * u, rtol=2e-6, atol=1e-7)
        qk.qgate_up(out, wg, wu, fmt, x, act="gelu_tanh")
        gelu = 0.5 * g64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64 ** 3)))
        np.testing.assert_allclose(out, gelu * u, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_threads_bitwise_identical(variant, fmt):
    rng = np.random.default_rng(41)
    cols = FORMATS[fmt].block * (4 if FORMATS[fmt].block == 256 else 20)
    rows = 301                                         # > the parallel threshold, odd
    wq, wu = make(fmt, rows, cols, rng), make(fmt, rows, cols, rng)
    x = rng.standard_normal(cols).astype(np.float32)
    xb = rng.standard_normal((5, cols)).astype(np.float32)
    res = []
    for t in (1, 2, 3):
        qk = K.QuantKernels(threads=t, variant=variant)
        o1 = np.zeros(rows, np.float32)
        qk.qmatvec(o1, wq, fmt, x)
        o2 = np.zeros(rows, np.float32)
        qk.qgate_up(o2, wq, wu, fmt, x)
        o3 = np.zeros((5, rows), np.float32)
        qk.qmatmul(o3, wq, fmt, xb, method="int8")
        o4 = np.zeros((5, rows), np.float32)
        qk.qmatmul(o4, wq, fmt, xb, method="f16")
        res.append((o1, o2, o3, o4))
    for other in res[1:]:
        for a, b in zip(res[0], other):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_qmatmul(variant, fmt):
    from cyllm.backends.cpu import CpuBackend
    rng = np.random.default_rng(51)
    cols = cols_for(fmt)[1]
    rows, T = 70, 6
    wq = make(fmt, rows, cols, rng)
    xb = rng.standard_normal((T, cols)).astype(np.float32)
    qk = K.QuantKernels(threads=2, variant=variant)
    out = np.zeros((T, rows), np.float32)
    qk.qmatmul(out, wq, fmt, xb, method="int8")
    for t in range(T):                                 # each token: qmatvec's bits
        o = np.zeros(rows, np.float32)
        qk.qmatvec(o, wq, fmt, xb[t])
        np.testing.assert_array_equal(out[t], o)
    base = rng.standard_normal((T, rows)).astype(np.float32)
    o2 = base.copy()
    qk.qmatmul(o2, wq, fmt, xb, add=True)
    np.testing.assert_array_equal(o2, base + out)
    # f16 panels: the f16 GEMM's bits on the dequantized weights
    w16 = R.dequantize(wq, fmt, cols).astype(np.float16)
    want = np.zeros((T, rows), np.float32)
    CpuBackend(threads=2, variant=qk.base_variant).matmul(want, w16, xb)
    o3 = np.zeros((T, rows), np.float32)
    qk.qmatmul(o3, wq, fmt, xb, method="f16")
    np.testing.assert_array_equal(o3, want)


def prefill_with_decode_bits(qk, wq, fmt, xb, label=""):
    """The int8 prefill GEMM of xb (T, cols), asserting each token has qmatvec's bits."""
    out = np.zeros((xb.shape[0], wq.shape[0]), np.float32)
    qk.qmatmul(out, wq, fmt, xb, method="int8")
    for t in range(xb.shape[0]):
        o = np.zeros(wq.shape[0], np.float32)
        qk.qmatvec(o, wq, fmt, xb[t])
        np.testing.assert_array_equal(out[t], o, err_msg=f"{label} token {t}")
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_qmatmul_tiles_and_long_rows(variant, fmt):
    """Every prefill tile shape and tail (T = 19: full token groups of 4, 6 and 8 plus a
    rest; 13 rows: row tiles plus a rest), every row length of cols_for, and rows longer
    than the kernels' stack-prepared activations (n > 16384): each (t, row) has qmatvec's
    bits, and qmatvec stays within the reference's tolerance."""
    rng = np.random.default_rng(53)
    b = FORMATS[fmt].block
    qk = K.QuantKernels(threads=1, variant=variant)
    rows, T = 13, 19
    for cols in cols_for(fmt) + [b * (16384 // b + (3 if b == 32 else 1))]:
        wq = make(fmt, rows, cols, rng)
        xb = rng.standard_normal((T, cols)).astype(np.float32)
        out = prefill_with_decode_bits(qk, wq, fmt, xb, f"cols {cols}")
        want, _ = R.qdot(wq, fmt, xb[T - 1])
        assert np.all(np.abs(out[T - 1] - want) <= ref_tol(wq, fmt, xb[T - 1])), cols


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_qmatmul_long_prompt(variant, fmt):
    """More tokens than a prefill kernel prepares at once (q5_k's AVX512-VNNI GEMM
    transposes 128): every token still gets qmatvec's bits."""
    rng = np.random.default_rng(57)
    cols = cols_for(fmt)[1]
    rows, T = 9, 133
    qk = K.QuantKernels(threads=2, variant=variant)
    prefill_with_decode_bits(qk, wq=make(fmt, rows, cols, rng), fmt=fmt,
                             xb=rng.standard_normal((T, cols)).astype(np.float32))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_dequantize_rows(variant, fmt):
    rng = np.random.default_rng(61)
    cols = cols_for(fmt)[1]
    wq = make(fmt, 9, cols, rng)
    qk = K.QuantKernels(variant=variant)
    ref = R.dequantize(wq, fmt, cols)
    out = np.zeros((4, cols), np.float16)
    qk.dequantize_rows_f16(out, wq, fmt, 3, 7)
    np.testing.assert_array_equal(out, ref[3:7].astype(np.float16))
    row = np.zeros(cols, np.float32)
    qk.dequantize_row_f32(row, wq, fmt, 8)
    np.testing.assert_array_equal(row, ref[8])


def test_prefill_method_defaults(monkeypatch):
    """int8 prefill by default on every table (a token's bits then do not depend on prefill
    or decode); CYLLM_QPREFILL=int8|f16 sets every format; anything else is one clear error."""
    monkeypatch.delenv("CYLLM_QPREFILL", raising=False)
    for v in VARIANTS:
        qk = K.QuantKernels(variant=v)
        assert all(qk.prefill_method_of(f) == "int8" for f in QUANTIZED)
    monkeypatch.setenv("CYLLM_QPREFILL", "f16")
    assert K.QuantKernels(variant="generic").prefill_method_of("q4_k") == "f16"
    monkeypatch.setenv("CYLLM_QPREFILL", "int8")
    assert K.QuantKernels(variant="generic").prefill_method_of("q8_0") == "int8"
    monkeypatch.setenv("CYLLM_QPREFILL", "fastest")
    with pytest.raises(InvalidArgumentError, match="CYLLM_QPREFILL"):
        K.QuantKernels(variant="generic")


def test_variant_selection(monkeypatch):
    assert "generic" in K.quant_available_variants()
    best = K.quant_available_variants()[0]
    qk = K.QuantKernels(base_variant="generic")
    assert qk.quant_variant == "generic"
    monkeypatch.setenv("CYLLM_QKERNELS", "generic")
    assert K.QuantKernels().quant_variant == "generic"
    monkeypatch.delenv("CYLLM_QKERNELS")
    if "avx2" in K.available_variants():
        assert K.QuantKernels(base_variant="avx2").quant_variant in ("avxvnni", "avx2")
    with pytest.raises(BackendUnavailableError, match="unknown quantized kernel variant"):
        K.QuantKernels(variant="neon")
    for v in K.QUANT_VARIANTS:
        if v not in K.quant_available_variants():
            with pytest.raises(BackendUnavailableError, match="cannot run here"):
                K.QuantKernels(variant=v)
    assert best in K.QUANT_VARIANTS


def test_bad_input():
    qk = K.QuantKernels(threads=2)
    w = R.quantize(np.ones((4, 64), np.float32), "q8_0")          # (4, 68)
    x = np.ones(64, np.float32)
    out = np.zeros(4, np.float32)
    with pytest.raises(InvalidArgumentError, match="unknown quantized format"):
        qk.qmatvec(out, w, "q3_k", x)
    with pytest.raises(InvalidArgumentError, match="out of range"):
        qk.qmatvec(out, w, 99, x)
    with pytest.raises(InvalidArgumentError, match="not a whole number of q4_0 blocks"):
        qk.qmatvec(out, w, "q4_0", x)                            # 68 % 18 != 0
    with pytest.raises(InvalidArgumentError, match="uint8"):
        qk.qmatvec(out, w.view(np.int8), "q8_0", x)
    with pytest.raises(InvalidArgumentError, match="C-contiguous"):
        qk.qmatvec(out, w[:, :34], "q8_0", x[:32])
    with pytest.raises(InvalidArgumentError, match="x has length 32"):
        qk.qmatvec(out, w, "q8_0", x[:32])
    with pytest.raises(InvalidArgumentError, match="out has length 3"):
        qk.qmatvec(out[:3], w, "q8_0", x)
    with pytest.raises(InvalidArgumentError, match="float32"):
        qk.qmatvec(out, w, "q8_0", x.astype(np.float64))
    with pytest.raises(InvalidArgumentError, match="w_up has shape"):
        qk.qgate_up(out, w, w[:3], "q8_0", x)
    with pytest.raises(InvalidArgumentError, match="act must be"):
        qk.qgate_up(out, w, w, "q8_0", x, act="relu")
    with pytest.raises(InvalidArgumentError, match="row range"):
        qk.dequantize_rows_f16(np.zeros((2, 64), np.float16), w, "q8_0", 3, 5)
    with pytest.raises(InvalidArgumentError, match="out has shape"):
        qk.dequantize_rows_f16(np.zeros((2, 64), np.float16), w, "q8_0", 0, 3)
    with pytest.raises(InvalidArgumentError, match="row 4 is out of range"):
        qk.dequantize_row_f32(np.zeros(64, np.float32), w, "q8_0", 4)
    with pytest.raises(InvalidArgumentError, match="not a positive multiple"):
        qk.act_bytes("q4_k", 100)
    with pytest.raises(InvalidArgumentError, match="out has length"):
        qk.quantize_activation(np.zeros(10, np.uint8), x, "q8_0")
    with pytest.raises(InvalidArgumentError, match="xq has length"):
        qk.qmatvec_prequantized(out, w, "q8_0", np.zeros(10, np.uint8))
    with pytest.raises(InvalidArgumentError, match="method"):
        qk.qmatmul(np.zeros((1, 4), np.float32), w, "q8_0", x[None], method="fp8")
    with pytest.raises(InvalidArgumentError, match="expected \\(2, 4\\)"):
        qk.qmatmul(np.zeros((1, 4), np.float32), w, "q8_0", np.ones((2, 64), np.float32))
    with pytest.raises(InvalidArgumentError, match="must not share memory"):
        buf = np.zeros(64, np.float32)
        qk.qmatvec(buf[:4], w, "q8_0", buf)
    with pytest.raises(InvalidArgumentError, match="threads"):
        K.QuantKernels(threads=0)


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("threads", [1, 2])
def test_gate_up_batch_gives_decode_bits(fmt, threads):
    # prefill's fused gate+up (both matrices by int8 GEMM in one pass, the GLU per thread's
    # columns) against the decode op token by token: the same bits, including row counts
    # that leave a thread a partial group of 4 and a T that leaves a partial token tile
    try:
        from cyllm.backends.cpu import CpuBackend
    except Exception as e:                              # noqa: BLE001  (extension not built)
        pytest.skip(str(e))
    from cyllm.quant import QuantMatrix
    rng = np.random.default_rng(hash((fmt, threads)) % 2**32)
    be = CpuBackend(threads)
    cols = 2 * FORMATS[fmt].block if FORMATS[fmt].block == 256 else 9 * FORMATS[fmt].block
    for rows, T in ((13, 7), (70, 19)):
        wg = QuantMatrix(make(fmt, rows, cols, rng), FORMATS[fmt], (rows, cols))
        wu = QuantMatrix(make(fmt, rows, cols, rng), FORMATS[fmt], (rows, cols))
        x = rng.standard_normal((T, cols)).astype(np.float32)
        for act in ("silu", "gelu_tanh"):
            out = np.full((T, rows), np.nan, np.float32)
            be.gate_up_batch(out, wg, wu, x, act)
            for t in range(T):
                one = np.full(rows, np.nan, np.float32)
                be.gate_up(one, wg, wu, x[t], act)
                np.testing.assert_array_equal(out[t], one, err_msg=f"{fmt} rows={rows} T={T} t={t} {act}")
