"""Every quantized format with rows interleaved by 16 (the r16 layouts of
cython_ext/csrc/quant.h, made by the CPU backend at load where the AVX512-VNNI kernels run).

The layout is checked against the NumPy reference's own reading of it (reference.unpack_r16
gives the file's rows back), its kernels against the reference block math for 1-3 threads,
decode against prefill bitwise, the generic table against the plain format bitwise, and the
backend's repack switch.
"""

import numpy as np
import pytest

from cyllm.errors import InvalidArgumentError, ModelLoadError
from cyllm.quant import QuantMatrix
from cyllm.quant import reference as R
from cyllm.quant.formats import FORMATS, R16_OF

K = pytest.importorskip("cyllm._ext.kernels")

VARIANTS = sorted(set(K.quant_available_variants()) | {"generic"})


FMTS = sorted(R16_OF)          # every quantized format: q4_0, q4_1, q4_k, q5_0, q5_1, q5_k, q6_k, q8_0


def make(fmt, rows, cols, rng):
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 1.0, (rows, 1))).astype(np.float32)
    return R.quantize(w, fmt)


def repacked(wq, fmt, threads=1):
    out = np.empty_like(wq)
    K.repack_r16(out, wq, fmt, threads)
    return out


def tol(wq, fmt, x):
    act = FORMATS[fmt].act
    blk = 32 if act == "q8_0" else 256
    a = R.quantize_act(x, act)
    xd = (a["q"].reshape(-1, blk) * a["d"][:, None]).reshape(-1).astype(np.float64)
    return 4e-6 * (np.abs(R.dequantize(wq, fmt, x.size).astype(np.float64)) @ np.abs(xd)) + 1e-30


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rows,cols", [(16, 256), (48, 768), (64, 2048)])
def test_repack_is_a_reordering_the_reference_reads_back(fmt, rows, cols):
    rng = np.random.default_rng(rows)
    wq = make(fmt, rows, cols, rng)
    r16 = repacked(wq, fmt, threads=2)
    assert r16.shape == wq.shape and sorted(r16.ravel()) == sorted(wq.ravel())
    np.testing.assert_array_equal(R.unpack_r16(r16, R16_OF[fmt], cols), wq)
    np.testing.assert_array_equal(repacked(wq, fmt, threads=1), r16)
    np.testing.assert_array_equal(QuantMatrix(r16, R16_OF[fmt], (rows, cols)).dequantize(),
                                  R.dequantize(wq, fmt, cols))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_matvec_on_cut_groups_matches_reference(variant, fmt):
    rng = np.random.default_rng(7)
    lay = R16_OF[fmt].name
    for rows, cols in ((32, 256), (48, 768), (64, 1280)):
        wq = make(fmt, rows, cols, rng)
        r16 = repacked(wq, fmt)
        x = rng.standard_normal(cols).astype(np.float32)
        want, _ = R.qdot(wq, fmt, x)
        for threads in (1, 2, 3):
            qk = K.QuantKernels(threads=threads, variant=variant)
            out = np.full(rows, np.nan, np.float32)
            qk.qmatvec(out, r16, lay, x)
            assert np.all(np.abs(out - want) <= tol(wq, fmt, x)), (variant, rows, cols, threads)
            if threads == 1:
                first = out.copy()
            np.testing.assert_array_equal(out, first)           # any split of the rows
            base = rng.standard_normal(rows).astype(np.float32)
            acc = base.copy()
            qk.qmatvec(acc, r16, lay, x, add=True)
            np.testing.assert_array_equal(acc, base + out)
        # (any split of 1-3 threads: whole groups of 16, each row computed once)
        qk = K.QuantKernels(threads=1, variant=variant)
        if variant == "generic":
            plain = np.zeros(rows, np.float32)
            qk.qmatvec(plain, wq, fmt, x)
            np.testing.assert_array_equal(first, plain)         # generic: the format's own bits


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_gate_up_and_rows_give_decode_bits(variant, fmt):
    rng = np.random.default_rng(11)
    rows, cols, T = 48, 512, 9
    lay = R16_OF[fmt].name
    wg, wu = make(fmt, rows, cols, rng), make(fmt, rows, cols, rng)
    g16, u16 = repacked(wg, fmt), repacked(wu, fmt)
    X = rng.standard_normal((T, cols)).astype(np.float32)
    for threads in (1, 2):
        qk = K.QuantKernels(threads=threads, variant=variant)
        out = np.full((T, rows), np.nan, np.float32)
        qk.qmatmul(out, g16, lay, X)
        for t in range(T):
            o = np.zeros(rows, np.float32)
            qk.qmatvec(o, g16, lay, X[t])
            np.testing.assert_array_equal(out[t], o)
            gu = np.zeros(rows, np.float32)
            qk.qgate_up(gu, g16, u16, lay, X[t], "silu")
            g = np.zeros(rows, np.float32)
            u = np.zeros(rows, np.float32)
            qk.qmatvec(g, g16, lay, X[t])
            qk.qmatvec(u, u16, lay, X[t])
            np.testing.assert_allclose(gu, g / (1 + np.exp(-g.astype(np.float64))) * u, rtol=1e-5, atol=1e-6)
    qk = K.QuantKernels(threads=1, variant=variant)
    e = np.zeros(cols, np.float32)
    for r in (0, 15, 16, 47):
        qk.dequantize_row_f32(e, g16, lay, r)
        np.testing.assert_array_equal(e, R.dequantize(wg[r:r + 1], fmt, cols)[0])
    h = np.zeros((5, cols), np.float16)
    qk.dequantize_rows_f16(h, g16, lay, 14, 19)
    np.testing.assert_array_equal(h, R.dequantize(wg[14:19], fmt, cols).astype(np.float16))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_long_prefill_gives_decode_bits(variant, fmt):
    """Prompts long enough for the prefill tiles (q6_k: 16 tokens in a vector's lanes, a short
    last block on the group kernel, 128 tokens transposed at a time), rows split over 1-3
    threads, with and without add: every (row, token) is decode's."""
    rng = np.random.default_rng(13)
    rows, cols = 48, 768
    lay = R16_OF[fmt].name
    wq = make(fmt, rows, cols, rng)
    w16 = repacked(wq, fmt)
    for T in (30, 37, 156):
        X = rng.standard_normal((T, cols)).astype(np.float32)
        dec = np.zeros((T, rows), np.float32)
        one = K.QuantKernels(threads=1, variant=variant)
        for t in range(T):
            one.qmatvec(dec[t], w16, lay, X[t])
        for threads in (1, 2, 3):
            qk = K.QuantKernels(threads=threads, variant=variant)
            out = np.full((T, rows), np.nan, np.float32)
            qk.qmatmul(out, w16, lay, X)
            np.testing.assert_array_equal(out, dec, err_msg=f"{variant} {fmt} T={T} threads={threads}")
            base = rng.standard_normal((T, rows)).astype(np.float32)
            acc = base.copy()
            qk.qmatmul(acc, w16, lay, X, add=True)
            np.testing.assert_array_equal(acc, base + dec)


def test_bad_input():
    rng = np.random.default_rng(3)
    wq = make("q4_k", 20, 256, rng)
    with pytest.raises(InvalidArgumentError, match="multiple of 16"):
        K.repack_r16(np.empty_like(wq), wq, "q4_k")
    with pytest.raises(InvalidArgumentError, match="a quantized format"):
        K.repack_r16(np.empty((16, 18), np.uint8), np.zeros((16, 18), np.uint8), "q4_0_r16")
    qk = K.QuantKernels(threads=1, variant="generic")
    with pytest.raises(InvalidArgumentError, match="multiple of 16"):
        qk.qmatvec(np.zeros(20, np.float32), wq, "q4_k_r16", np.zeros(256, np.float32))
    for lay in [f.name for f in R16_OF.values()]:
        with pytest.raises(InvalidArgumentError, match="layouts"):
            K.quantize_rows(np.empty((16, 144), np.uint8), np.zeros((16, 256), np.float32), lay)
    with pytest.raises(ModelLoadError, match="multiple of 16"):
        QuantMatrix(np.zeros((20, 144), np.uint8), R16_OF["q4_k"], (20, 256))
    m = QuantMatrix(repacked(make("q4_0", 48, 256, rng), "q4_0"), R16_OF["q4_0"], (48, 256))
    assert m[16:48].shape == (32, 256)
    with pytest.raises(InvalidArgumentError, match="multiple of 16"):
        m[8:40]
    with pytest.raises(InvalidArgumentError):
        m.take_rows(np.arange(48))


@pytest.mark.parametrize("fmt", FMTS)
def test_cpu_backend_repacks_where_avx512vnni_runs(monkeypatch, fmt):
    from cyllm.backends.cpu import CpuBackend
    rng = np.random.default_rng(5)
    wq = make(fmt, 48, 512, rng)
    qm = QuantMatrix(wq, fmt, (48, 512))
    be = CpuBackend(threads=2)
    up = be.upload(qm)
    if be.quant_variant == "avx512vnni":
        assert up.fmt is R16_OF[fmt] and up.data is not wq
        np.testing.assert_array_equal(R.unpack_r16(up.data, up.fmt, 512), wq)
    else:
        assert up is qm
    assert be.upload(QuantMatrix(make(fmt, 20, 256, rng), fmt, (20, 256))).fmt.name == fmt   # rows % 16
    monkeypatch.setenv("CYLLM_REPACK", "0")
    assert be.upload(qm) is qm
    monkeypatch.setenv("CYLLM_REPACK", "yes")
    with pytest.raises(InvalidArgumentError, match="CYLLM_REPACK"):
        be.upload(qm)
