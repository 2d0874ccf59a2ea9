"""CPU backend properties that the op table (test_backend_ops.py) cannot express.

The table compares every op, every variant, 1 and 2 threads against numpy_ref. Here:
bitwise equality across thread counts (and of a batched row with the decode op),
read-only, memory-mapped and unaligned inputs, kernel variant forcing through
CYLLM_KERNELS, the bandwidth probe, and bad arguments.
"""

import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

from cyllm.errors import BackendUnavailableError, InvalidArgumentError
from cyllm.backends.numpy_ref import NumpyBackend

try:
    from cyllm.backends import cpu
    from cyllm._ext import kernels as _k
except (ImportError, BackendUnavailableError) as e:      # extension not built
    pytest.skip(f"cpu kernels not built: {e}", allow_module_level=True)

VARIANTS = list(_k.available_variants())   # generic, and avx2/avx512 where this CPU runs them
REF = NumpyBackend()


def backend(variant, threads=1):
    return cpu.CpuBackend(threads, variant=variant)


def rng_for(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))   # the same data every run


def f16_matrix(rng, d, n, scale=1.0):
    return (rng.standard_normal((d, n)) * scale).astype(np.float16)


def f32_vec(rng, n, scale=1.0):
    return (rng.standard_normal(n) * scale).astype(np.float32)


def unaligned_copy(a, offset=8):
    """A copy of `a` whose data pointer is `offset` bytes past a 16-byte boundary (read-only)."""
    raw = np.zeros(a.nbytes + 64, np.uint8)
    start = (-raw.ctypes.data) % 16 + offset
    view = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    view[...] = a
    assert view.ctypes.data % 16 == offset % 16
    view.setflags(write=False)
    return view


# -- bitwise the same for any thread count ------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("d,n", [(1031, 257), (4099, 61), (576, 576), (1536, 576)])
def test_matvec_bitwise_across_threads(variant, d, n):
    """Large enough to take the threaded path; every row is summed in a fixed order."""
    rng = rng_for("bitwise", d, n)
    w, wu, x = f16_matrix(rng, d, n), f16_matrix(rng, d, n), f32_vec(rng, n)
    base = f32_vec(rng, d)
    results = []
    for threads in (1, 2, 3):
        b = backend(variant, threads)
        o1 = np.zeros(d, np.float32)
        b.matvec(o1, w, x)
        o2 = base.copy()
        b.matvec_add(o2, w, x)
        o3 = np.zeros(d, np.float32)
        b.gate_up(o3, w, wu, x)
        o4 = np.zeros(d, np.float32)
        b.gate_up(o4, w, wu, x, "gelu_tanh")
        results.append((o1, o2, o3, o4))
    for other in results[1:]:
        for a, c in zip(results[0], other):
            assert np.array_equal(a.view(np.uint32), c.view(np.uint32))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("d,n", [(67, 300), (1031, 257), (130, 4133)])
def test_matvec_wide_row_prefetch_keeps_the_bits(variant, d, n):
    """Rows whose x fills half of L1d prefetch their weights into L2 (kernels_avx2.c): a hint
    only, so the wide loop (forced here on every row) gives the plain loop's bits, within the
    reference's tolerance, at 1 and 2 threads, for matvec, matvec_add and gate_up."""
    rng = rng_for("wide", d, n)
    w, wu, x = f16_matrix(rng, d, n), f16_matrix(rng, d, n), f32_vec(rng, n)
    base = f32_vec(rng, d)

    def run(threads):
        b = backend(variant, threads)
        o1, o2, o3 = np.zeros(d, np.float32), base.copy(), np.zeros(d, np.float32)
        b.matvec(o1, w, x)
        b.matvec_add(o2, w, x)
        b.gate_up(o3, w, wu, x)
        return o1, o2, o3

    dflt = _k._set_wide_prefetch(0, 0)            # never wide
    try:
        plain = [run(t) for t in (1, 2)]
        _k._set_wide_prefetch(4, 256)             # every row wide, 256 bytes ahead
        wide = [run(t) for t in (1, 2)]
    finally:
        _k._set_wide_prefetch(*dflt)
    for p, q in zip(plain, wide):
        for a, c in zip(p, q):
            assert np.array_equal(a.view(np.uint32), c.view(np.uint32))
    want = w.astype(np.float64) @ x.astype(np.float64)
    np.testing.assert_allclose(wide[0][0], want, rtol=1e-4, atol=1e-3 * np.abs(want).max())


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("d,n", [(67, 1024), (45, 3072), (33, 288)])
def test_gemm_padded_x_keeps_the_bits(variant, d, n):
    """x whose rows are a multiple of 4 KiB is copied into longer rows before the F16 GEMMs
    (gemm_x.pxi): the same FMA chains over the same values, so never / when needed / always
    padding give the same bits (matmul, matmul_add, gate_up_batch, and the f16 panels of a
    quantized matrix), at 1 and 2 threads, within the reference's tolerance."""
    from cyllm.quant import reference as R
    rng = rng_for("gemm pad", d, n)
    T = 13                                            # a full micro-kernel of tokens and a tail
    w, wu = f16_matrix(rng, d, n), f16_matrix(rng, d, n)
    xs = rng.standard_normal((4, T, n)).astype(np.float32)     # one x an op: a stale copy shows
    base = rng.standard_normal((T, d)).astype(np.float32)
    wq = R.quantize(w.astype(np.float32), "q8_0")

    def run(threads):
        b = backend(variant, threads)
        o1, o2, o3 = np.zeros((T, d), np.float32), base.copy(), np.zeros((T, d), np.float32)
        b.matmul(o1, w, xs[0])
        b.matmul_add(o2, w, xs[1])
        b.gate_up_batch(o3, w, wu, xs[2])
        o4 = np.zeros((T, d), np.float32)
        b.quant.qmatmul(o4, wq, "q8_0", xs[3], method="f16")
        return o1, o2, o3, o4

    dflt = _k._set_gemm_pad(0)
    try:
        outs = {}
        for mode in (0, 1, 2):
            _k._set_gemm_pad(mode)
            # padding happens where the mode says so
            assert _k._gemm_row_stride(T, n) == (n + 16 if mode == 2 or (mode == 1 and n % 1024 == 0) else n)
            outs[mode] = [run(t) for t in (1, 2)]
    finally:
        _k._set_gemm_pad(dflt)
    for mode in (1, 2):
        for p, q in zip(outs[0], outs[mode]):
            for a, c in zip(p, q):
                assert np.array_equal(a.view(np.uint32), c.view(np.uint32))
    want = xs[0].astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(outs[2][1][0], want, rtol=1e-4, atol=1e-3 * np.abs(want).max())
    with pytest.raises(ValueError):
        _k._set_gemm_pad(3)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("d,n", [(67, 300), (1031, 257)])
def test_gemm_of_a_few_tokens_gives_matvec_bits(variant, d, n):
    """Up to 4 tokens the F16 GEMMs run as the tokens' matvecs over runs of rows
    (CpuKernels._few_tokens): each row of matmul / matmul_add / gate_up_batch (silu, gelu_tanh) is
    then the matvec's bits for that token, at 1 and 2 threads and with runs of 4 rows; 5 tokens
    take the GEMM (other bits on the x86 tables); all within the reference's tolerance."""
    rng = rng_for("few", d, n)
    w, wu = f16_matrix(rng, d, n), f16_matrix(rng, d, n)
    dflt = _k._set_gemm_few(4, 262144)
    try:
        for T in (1, 2, 4, 5):
            x = rng.standard_normal((T, n)).astype(np.float32)
            base = rng.standard_normal((T, d)).astype(np.float32)
            for threads, run_bytes in ((1, 262144), (2, 262144), (2, 1)):
                _k._set_gemm_few(4, run_bytes)
                b = backend(variant, threads)
                o1, o2 = np.zeros((T, d), np.float32), base.copy()
                o3, o4 = np.zeros((T, d), np.float32), np.zeros((T, d), np.float32)
                b.matmul(o1, w, x)
                b.matmul_add(o2, w, x)
                b.gate_up_batch(o3, w, wu, x)
                b.gate_up_batch(o4, w, wu, x, act="gelu_tanh")
                for t in range(T):
                    m1, m2 = np.zeros(d, np.float32), base[t].copy()
                    m3, m4 = np.zeros(d, np.float32), np.zeros(d, np.float32)
                    b.matvec(m1, w, x[t])
                    b.matvec_add(m2, w, x[t])
                    b.gate_up(m3, w, wu, x[t])
                    b.gate_up(m4, w, wu, x[t], act="gelu_tanh")
                    same = [np.array_equal(a[t].view(np.uint32), c.view(np.uint32))
                            for a, c in ((o1, m1), (o2, m2), (o3, m3), (o4, m4))]
                    if T <= 4:
                        assert all(same), (T, threads, run_bytes, same)
                    elif variant != "generic":          # (generic's GEMM sums as its matvec does)
                        assert not all(same), (T, threads, run_bytes, same)
                want = x.astype(np.float64) @ w.astype(np.float64).T
                np.testing.assert_allclose(o1, want, rtol=1e-4, atol=1e-3 * np.abs(want).max())
    finally:
        _k._set_gemm_few(*dflt)
    with pytest.raises(ValueError):
        _k._set_gemm_few(-1, 1)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T", [1, 3, 6])
def test_gemm_of_empty_rows(variant, T):
    """x with no columns: every product is an empty sum (0; act(0) * 0 for gate_up), on the
    few-token and the GEMM path alike."""
    b = backend(variant, 2)
    w, x = np.zeros((5, 0), np.float16), np.zeros((T, 0), np.float32)
    out = np.full((T, 5), np.nan, np.float32)
    b.matmul(out, w, x)
    assert np.array_equal(out, np.zeros((T, 5), np.float32))
    out = np.full((T, 5), 2.0, np.float32)
    b.matmul_add(out, w, x)
    assert np.array_equal(out, np.full((T, 5), 2.0, np.float32))
    out = np.full((T, 5), np.nan, np.float32)
    b.gate_up_batch(out, w, w, x)
    assert np.array_equal(out, np.zeros((T, 5), np.float32))


@pytest.mark.parametrize("variant", VARIANTS)
def test_matvec_readonly_and_unaligned(variant, tmp_path):
    rng = rng_for("ro")
    d, n = 67, 131
    w, x = f16_matrix(rng, d, n), f32_vec(rng, n)
    b = backend(variant, 2)
    want = np.zeros(d, np.float32)
    b.matvec(want, w, x)

    ro = w.copy()
    ro.setflags(write=False)
    got = np.zeros(d, np.float32)
    b.matvec(got, ro, x)
    assert np.array_equal(got, want)

    path = tmp_path / "w.bin"
    w.tofile(path)
    mm = np.memmap(path, dtype=np.float16, mode="r", shape=(d, n))
    got = np.zeros(d, np.float32)
    b.matvec(got, mm, x)
    assert np.array_equal(got, want)

    # mmap'd safetensors data is only 8-byte aligned
    wu, xu = unaligned_copy(w, 8), unaligned_copy(x, 8)
    assert wu.ctypes.data % 16 == 8
    got = np.zeros(d, np.float32)
    b.matvec(got, wu, xu)
    assert np.array_equal(got, want)
    wu2 = unaligned_copy(w, 2)       # 2-byte aligned float16 is still a valid array
    got = np.zeros(d, np.float32)
    b.matvec(got, wu2, x)
    assert np.array_equal(got, want)
    # upload keeps a read-only C-contiguous f16 matrix as is (no copy)
    assert b.upload(mm) is mm or np.shares_memory(b.upload(mm), mm)
    assert b.upload(ro) is ro


# -- attention -----------------------------------------------------------

def make_cache(rng, n_kv, max_ctx, hd):
    k = (rng.standard_normal((n_kv, max_ctx, hd)) * 1.5).astype(np.float16)
    v = rng.standard_normal((n_kv, max_ctx, hd)).astype(np.float16)
    return k, v


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n_heads,n_kv,hd,window", [(9, 3, 64, 0), (4, 1, 80, 0), (8, 8, 48, 0), (9, 3, 64, 700)])
def test_attention_long_bitwise_across_threads(variant, n_heads, n_kv, hd, window):
    """Past the 256-position block, over a running max that moves many times (a sharper
    input than the table's): close to the reference and the same bits for 1, 2, 3 threads."""
    max_ctx = 1100
    rng = rng_for("attn-long", n_heads, n_kv, hd)
    kc, vc = make_cache(rng, n_kv, max_ctx, hd)
    # scores that keep rising make the running max move many times
    kc[:, :, 0] = np.linspace(-4, 4, max_ctx, dtype=np.float32).astype(np.float16)
    q = f32_vec(rng, n_heads * hd)
    q[::hd] = 3.0
    pos = max_ctx - 1
    outs = []
    for threads in (1, 2, 3):
        out = np.zeros(n_heads * hd, np.float32)
        backend(variant, threads).attention(out, q, kc, vc, pos, window)
        outs.append(out)
    want = np.zeros_like(outs[0])
    REF.attention(want, q, kc, vc, pos, window)
    np.testing.assert_allclose(outs[0], want, rtol=1e-4, atol=2e-5)
    for o in outs[1:]:
        assert np.array_equal(o.view(np.uint32), outs[0].view(np.uint32))


@pytest.mark.parametrize("variant", VARIANTS)
def test_attention_unaligned_readonly_cache(variant):
    rng = rng_for("attn-ro")
    kc, vc = make_cache(rng, 3, 40, 64)
    q = f32_vec(rng, 9 * 64)
    b = backend(variant, 2)
    want = np.zeros_like(q)
    b.attention(want, q, kc, vc, 39)
    got = np.zeros_like(q)
    b.attention(got, unaligned_copy(q), unaligned_copy(kc), unaligned_copy(vc), 39)
    assert np.array_equal(got, want)


# -- backend object, variants, bad input --------------------------------------------------

def test_backend_basics():
    from cyllm.backends import get_backend
    b = get_backend("cpu", 2)
    assert b.name == "cpu" and b.threads == 2
    assert b.kernel_variant in ("avx512", "avx2", "generic")
    b.set_threads(1)
    assert b.threads == 1
    with pytest.raises(InvalidArgumentError):
        b.set_threads(0)
    v = np.ones(5, np.float32)
    assert b.to_host(v) is v
    # vectors are copied (a vector read from a file's map keeps its whole page-cache folio
    # resident: CpuBackend.upload), matrices are not
    uv = b.upload(v)
    assert uv is not v and not np.shares_memory(uv, v) and uv.dtype == np.float32
    np.testing.assert_array_equal(uv, v)
    m = np.ones((3, 4), np.float16)
    assert b.upload(m) is m
    assert b.upload(np.ones((3, 4))).dtype == np.float32          # f64 -> f32
    assert b.upload(np.ones(3, np.float16)).dtype == np.float32   # f16 vector -> f32
    assert b.upload(np.ones((4, 6), np.float16)[:, ::2]).flags.c_contiguous
    e = b.empty((2, 3))
    assert e.shape == (2, 3) and e.dtype == np.float32
    b.synchronize()
    info = cpu.kernel_info()
    assert {"variant", "cpu_features", "openmp", "max_threads"} <= set(info)
    assert isinstance(info["cpu_features"], list) and isinstance(info["openmp"], bool)
    with pytest.raises(BackendUnavailableError):
        cpu.CpuBackend(1, variant="sse9")


def test_read_bandwidth_probe():
    gbs = cpu.measure_read_bandwidth(1, nbytes=8 << 20, reps=1)
    assert 0.1 < gbs < 10_000
    assert backend("generic").measure_read_bandwidth(2, nbytes=4 << 20, reps=1) > 0
    with pytest.raises(InvalidArgumentError):
        cpu.measure_read_bandwidth(0)


def _run_with_env(env_value):
    env = dict(os.environ, CYLLM_KERNELS=env_value)
    code = ("from cyllm.backends.cpu import CpuBackend, kernel_info\n"
            "try:\n"
            "    print(CpuBackend(1).kernel_variant, kernel_info()['variant'])\n"
            "except Exception as e:\n"
            "    print(type(e).__name__)\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_env_forces_generic():
    assert _run_with_env("generic") == ["generic", "generic"]
    assert _run_with_env("no-such-variant") == ["BackendUnavailableError"]


@pytest.mark.skipif("avx2" not in _k.available_variants(), reason="CPU without AVX2")
def test_env_forces_avx2():
    assert _run_with_env("avx2") == ["avx2", "avx2"]


@pytest.mark.skipif("avx512" not in _k.available_variants(), reason="CPU without AVX-512F")
def test_env_forces_avx512():
    assert _run_with_env("avx512") == ["avx512", "avx512"]


def _bad_calls():
    f32, f16 = np.float32, np.float16
    w = np.zeros((4, 8), f16)
    x = np.zeros(8, f32)
    out = np.zeros(4, f32)
    kc = np.zeros((2, 16, 8), f16)
    q = np.zeros(32, f32)
    cos = np.zeros((16, 4), f32)
    ro = np.zeros(4, f32)
    ro.setflags(write=False)
    buf = np.zeros(40, f32)
    yield "matvec x f64", lambda b: b.matvec(out, w, x.astype(np.float64))
    yield "matvec w f32", lambda b: b.matvec(out, w.astype(f32), x)
    yield "matvec x short", lambda b: b.matvec(out, w, x[:7])
    yield "matvec out long", lambda b: b.matvec(np.zeros(5, f32), w, x)
    yield "matvec w strided", lambda b: b.matvec(out, np.zeros((4, 16), f16)[:, ::2], x)
    yield "matvec w 1-D", lambda b: b.matvec(out, w.ravel(), x)
    yield "matvec out read-only", lambda b: b.matvec(ro, w, x)
    yield "matvec list", lambda b: b.matvec(out, w, [0.0] * 8)
    yield "matvec out aliases x", lambda b: b.matvec(buf[:4], np.zeros((4, 8), f16), buf[:8])
    yield "matvec big-endian", lambda b: b.matvec(out, w, x.astype(">f4"))
    yield "matvec misaligned", lambda b: b.matvec(
        out, w, np.frombuffer(np.zeros(40, np.uint8).tobytes(), f32, 8, 1))
    yield "matvec_add shape", lambda b: b.matvec_add(out, w, np.zeros(9, f32))
    yield "gate_up shapes", lambda b: b.gate_up(out, w, np.zeros((4, 9), f16), x)
    yield "embed token high", lambda b: b.embed(np.zeros(8, f32), w, 4)
    yield "embed token negative", lambda b: b.embed(np.zeros(8, f32), w, -1)
    yield "embed token float", lambda b: b.embed(np.zeros(8, f32), w, 1.5)
    yield "embed out length", lambda b: b.embed(np.zeros(7, f32), w, 0)
    yield "attention pos = max_ctx", lambda b: b.attention(np.zeros(32, f32), q, kc, kc.copy(), 16)
    yield "attention pos negative", lambda b: b.attention(np.zeros(32, f32), q, kc, kc.copy(), -1)
    yield "attention heads not multiple", lambda b: b.attention(
        np.zeros(24, f32), np.zeros(24, f32), kc, kc.copy(), 0)
    yield "attention q not head_dim multiple", lambda b: b.attention(
        np.zeros(30, f32), np.zeros(30, f32), kc, kc.copy(), 0)
    yield "attention v shape", lambda b: b.attention(
        np.zeros(32, f32), q, kc, np.zeros((2, 15, 8), f16), 0)
    yield "attention out is q", lambda b: b.attention(q, q, kc, kc.copy(), 0)
    yield "attention cache f32", lambda b: b.attention(np.zeros(32, f32), q, kc.astype(f32), kc, 0)
    yield "cache_store pos = max_ctx", lambda b: b.cache_store(
        kc.copy(), kc.copy(), np.zeros(16, f32), np.zeros(16, f32), 16)
    yield "cache_store k length", lambda b: b.cache_store(
        kc.copy(), kc.copy(), np.zeros(15, f32), np.zeros(16, f32), 0)
    yield "cache_store read-only", lambda b: b.cache_store(
        np.zeros((2, 16, 8), f16).copy().view(), _readonly(kc), np.zeros(16, f32), np.zeros(16, f32), 0)
    yield "rope pos = max_ctx", lambda b: b.rope(q.copy(), np.zeros(16, f32), cos, cos.copy(), 16)
    yield "rope k not head multiple", lambda b: b.rope(q.copy(), np.zeros(12, f32), cos, cos.copy(), 0)
    yield "rope sin shape", lambda b: b.rope(q.copy(), np.zeros(16, f32), cos, np.zeros((16, 3), f32), 0)
    yield "rmsnorm w length", lambda b: b.rmsnorm(out, out.copy(), np.zeros(5, f32), 1e-5)
    yield "rmsnorm empty", lambda b: b.rmsnorm(np.zeros(0, f32), np.zeros(0, f32), np.zeros(0, f32), 1e-5)
    yield "rmsnorm eps", lambda b: b.rmsnorm(out, out.copy(), out.copy(), "x")
    yield "swiglu length", lambda b: b.swiglu(out, out.copy(), np.zeros(3, f32))
    yield "add dtype", lambda b: b.add(out, out.copy(), np.zeros(4, np.float16))
    # the parameters of model families
    yield "gate_up act unknown", lambda b: b.gate_up(out, w, w.copy(), x, "relu")
    yield "gate_up act None", lambda b: b.gate_up(out, w, w.copy(), x, None)
    yield "attention window negative", lambda b: b.attention(np.zeros(32, f32), q, kc, kc.copy(), 0, -1)
    yield "attention window float", lambda b: b.attention(np.zeros(32, f32), q, kc, kc.copy(), 0, 2.5)
    yield "attention scale zero", lambda b: b.attention(np.zeros(32, f32), q, kc, kc.copy(), 0, 0, 0.0)
    yield "attention scale inf", lambda b: b.attention(np.zeros(32, f32), q, kc, kc.copy(), 0, 0, np.inf)
    yield "attention scale string", lambda b: b.attention(np.zeros(32, f32), q, kc, kc.copy(), 0, 0, "x")
    yield "rope head_dim under rotated dims", lambda b: b.rope(q.copy(), np.zeros(16, f32), cos, cos.copy(), 0, 6)
    yield "rope head_dim not dividing", lambda b: b.rope(q.copy(), np.zeros(16, f32), cos, cos.copy(), 0, 12)
    yield "embed scale nan", lambda b: b.embed(np.zeros(8, f32), w, 0, float("nan"))
    yield "embed scale negative", lambda b: b.embed(np.zeros(8, f32), w, 0, -2.0)


def _readonly(a):
    a = a.copy()
    a.setflags(write=False)
    return a


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name,call", list(_bad_calls()), ids=[n for n, _ in _bad_calls()])
def test_bad_arguments(variant, name, call):
    with pytest.raises(InvalidArgumentError):
        call(backend(variant, 2))


# -- batched (prefill) ops -------------------------------------------------------------
# The GEMM sums each output as one chain over the columns in order: bitwise the same for
# any thread count, and for avx2 and avx512. Shapes: tails of the micro-kernels (6/12
# tokens, 16/32 rows, 256-column blocks), all large enough to take the threaded path.

@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T,d,n", [(1, 600, 257), (5, 100, 257), (17, 577, 300), (64, 100, 257), (300, 33, 300)])
def test_matmul_family_bitwise_across_threads(variant, T, d, n):
    rng = rng_for("matmul", T, d, n)
    w, wu = f16_matrix(rng, d, n), f16_matrix(rng, d, n)
    x = rng.standard_normal((T, n)).astype(np.float32)
    base = rng.standard_normal((T, d)).astype(np.float32)
    got = {}
    for threads in (1, 2, 3):
        b = backend(variant, threads)
        outs = [np.full((T, d), np.nan, np.float32), base.copy(),
                np.full((T, d), np.nan, np.float32), np.full((T, d), np.nan, np.float32)]
        b.matmul(outs[0], w, x)
        b.matmul_add(outs[1], w, x)
        b.gate_up_batch(outs[2], w, wu, x)
        b.gate_up_batch(outs[3], w, wu, x, "gelu_tanh")
        got[threads] = outs
    for threads in (2, 3):
        for a, c in zip(got[1], got[threads]):
            assert np.array_equal(a.view(np.uint32), c.view(np.uint32))


@pytest.mark.skipif(not {"avx2", "avx512"} <= set(_k.available_variants()), reason="needs avx2 and avx512")
def test_matmul_avx2_avx512_same_bits():
    rng = rng_for("matmul-isa")
    w, x = f16_matrix(rng, 200, 600), rng.standard_normal((37, 600)).astype(np.float32)
    outs = []
    for v in ("avx2", "avx512"):
        o = np.zeros((37, 200), np.float32)
        backend(v, 2).matmul(o, w, x)
        outs.append(o)
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T,dim", [(1, 36), (5, 36), (64, 36), (20, 4096)])
def test_rmsnorm_batch_rows_bitwise(variant, T, dim):
    """Each row is exactly the single-row op, in place or not, threaded or not."""
    rng = rng_for("rmsnorm-batch", T, dim)
    b = backend(variant, 2)
    x = rng.standard_normal((T, dim)).astype(np.float32)
    wn = f32_vec(rng, dim)
    got = np.full_like(x, np.nan)
    b.rmsnorm_batch(got, x, wn, 1e-5)
    for t in range(T):
        row = np.zeros(dim, np.float32)
        b.rmsnorm(row, x[t], wn, 1e-5)
        assert np.array_equal(row, got[t])
    inplace = x.copy()
    b.rmsnorm_batch(inplace, inplace, wn, 1e-5)
    assert np.array_equal(inplace, got)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n_heads,n_kv,hd,rot", [(4, 2, 16, 8), (3, 1, 24, 24), (6, 6, 10, 4)])
@pytest.mark.parametrize("T,pos0,window", [(1, 0, 0), (5, 0, 0), (12, 0, 0), (13, 1, 0), (17, 3, 0),
                                           (64, 200, 0), (300, 0, 0), (20, 0, 8), (10, 50, 16),
                                           (64, 200, 100)])
def test_batch_rows_match_decode_ops(variant, n_heads, n_kv, hd, rot, T, pos0, window):
    """Row t of rope_batch / cache_store_batch / attention_batch is the decode op at
    position pos0 + t: bitwise where both make the same kernel call (rope, cache stores;
    attention on generic under 256 attended positions, and T == 1; avx2/avx512 prefill
    attention is GEMM-shaped); attention_batch is the same bits for 1 and 2 threads."""
    rng = rng_for("att-batch", n_heads, n_kv, hd, T, pos0, window)
    max_ctx = pos0 + T + 3
    b = backend(variant, 2)
    cos = rng.standard_normal((max_ctx, rot // 2)).astype(np.float32)
    sin = rng.standard_normal((max_ctx, rot // 2)).astype(np.float32)
    q = rng.standard_normal((T, n_heads * hd)).astype(np.float32)
    k = rng.standard_normal((T, n_kv * hd)).astype(np.float32)
    v = rng.standard_normal((T, n_kv * hd)).astype(np.float32)
    kc, vc = make_cache(rng, n_kv, max_ctx, hd)          # positions < pos0: an existing cache
    kc1, vc1, q1, k1 = kc.copy(), vc.copy(), q.copy(), k.copy()
    b.rope_batch(q, k, cos, sin, pos0, hd)
    b.cache_store_batch(kc, vc, k, v, pos0)
    for t in range(T):
        b.rope(q1[t], k1[t], cos, sin, pos0 + t, hd)
        b.cache_store(kc1, vc1, k1[t], v[t], pos0 + t)
    assert np.array_equal(q.view(np.uint32), q1.view(np.uint32))
    assert np.array_equal(k.view(np.uint32), k1.view(np.uint32))
    assert np.array_equal(kc.view(np.uint16), kc1.view(np.uint16))
    assert np.array_equal(vc.view(np.uint16), vc1.view(np.uint16))
    out = np.full((T, n_heads * hd), np.nan, np.float32)
    b.attention_batch(out, q, kc, vc, pos0, window)
    for t in (0, T // 2, T - 1):
        row = np.zeros(n_heads * hd, np.float32)
        b.attention(row, q[t], kc, vc, pos0 + t, window)
        span = min(pos0 + t + 1, window or pos0 + t + 1)
        if span <= 256 and variant == "generic" or T == 1:   # the decode kernel: same call
            assert np.array_equal(row, out[t])
        else:
            np.testing.assert_allclose(row, out[t], rtol=2e-4, atol=2e-5)
    out1 = np.zeros_like(out)
    backend(variant, 1).attention_batch(out1, q, kc, vc, pos0, window)
    assert np.array_equal(out1, out)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("pos,window", [(255, 0), (256, 0), (257, 0), (700, 0), (1023, 0), (700, 300),
                                        (1023, 1000)])
def test_attention_blocked_long_bitwise(variant, pos, window):
    """Past 256 positions decode attention merges fixed cache blocks: the same bits for
    1, 2 and 3 threads (the table checks the values)."""
    rng = rng_for("att-long", pos, window)
    n_heads, n_kv, hd = 9, 3, 64
    kc, vc = make_cache(rng, n_kv, 1024, hd)
    q = f32_vec(rng, n_heads * hd)
    outs = []
    for threads in (1, 2, 3):
        o = np.full(n_heads * hd, np.nan, np.float32)
        backend(variant, threads).attention(o, q, kc, vc, pos, window)
        outs.append(o)
    assert np.all(np.isfinite(outs[0]))
    for o in outs[1:]:
        assert np.array_equal(o, outs[0])


def test_batch_bad_arguments():
    b = backend("generic", 1)
    f32, f16 = np.float32, np.float16
    w = np.zeros((4, 8), f16)
    x = np.zeros((3, 8), f32)
    with pytest.raises(InvalidArgumentError):
        b.matmul(np.zeros((3, 5), f32), w, x)                 # wrong out shape
    with pytest.raises(InvalidArgumentError):
        b.matmul(np.zeros((3, 4), f32), w, np.zeros((3, 7), f32))
    with pytest.raises(InvalidArgumentError):
        b.matmul(np.zeros((3, 4), f32), w.astype(f32), x)
    with pytest.raises(InvalidArgumentError):
        b.gate_up_batch(np.zeros((3, 4), f32), w, np.zeros((5, 8), f16), x)
    buf = np.zeros((3, 8), f32)
    with pytest.raises(InvalidArgumentError):
        b.matmul(buf[:, :4], w, buf)                           # not contiguous
    table = np.zeros((10, 8), f16)
    with pytest.raises(InvalidArgumentError):
        b.embed_batch(np.zeros((2, 8), f32), table, np.array([1, 10], np.int32))
    with pytest.raises(InvalidArgumentError):
        b.embed_batch(np.zeros((2, 8), f32), table, np.array([1, 2], np.int64))
    kc = np.zeros((2, 16, 8), f16)
    with pytest.raises(InvalidArgumentError):
        b.cache_store_batch(kc, kc.copy(), np.zeros((3, 16), f32), np.zeros((3, 16), f32), 14)
    with pytest.raises(InvalidArgumentError):
        b.attention_batch(np.zeros((3, 32), f32), np.zeros((3, 32), f32), kc, kc, -1)
    with pytest.raises(InvalidArgumentError):
        b.rope_batch(np.zeros((3, 32), f32), np.zeros((3, 16), f32),
                     np.zeros((16, 4), f32), np.zeros((16, 4), f32), 14)
    with pytest.raises(InvalidArgumentError):      # head_dim smaller than the rotated dims
        b.rope_batch(np.zeros((3, 32), f32), np.zeros((3, 16), f32),
                     np.zeros((16, 4), f32), np.zeros((16, 4), f32), 0, 4)
    with pytest.raises(InvalidArgumentError):
        b.gate_up_batch(np.zeros((3, 4), f32), w, w.copy(), x, "gelu")
    with pytest.raises(InvalidArgumentError):
        b.attention_batch(np.zeros((3, 32), f32), np.zeros((3, 32), f32), kc, kc.copy(), 0, -3)
    with pytest.raises(InvalidArgumentError):
        b.attention_batch(np.zeros((3, 32), f32), np.zeros((3, 32), f32), kc, kc.copy(), 0, 0, -1.0)
    with pytest.raises(InvalidArgumentError):
        b.embed_batch(np.zeros((2, 8), f32), table, np.array([1, 2], np.int32), np.inf)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt,fmt_down,f,n", [("q4_k", "q6_k", 256, 512), ("q8_0", "q8_0", 96, 160),
                                               ("f16", "f16", 40, 72), ("q4_0", "q8_0", 64, 96)])
@pytest.mark.parametrize("threads", [1, 2])
def test_moe_decode_rows_match_prefill_bitwise(variant, fmt, fmt_down, f, n, threads):
    """The experts of a token in one C call (moe_experts: all chosen gate/up rows, then all
    down rows, weighted and added in rank order) give the bits of the prefill op's row for it
    (the rows grouped by expert through the GEMM kernels, the same float32 scaling and adds),
    for quantized experts (the int8 kernels give a row the decode kernel's bits) and as the
    experts one call at a time would; float16 experts: within the GEMM's rounding."""
    from cyllm.backends.moe import MoeScratch
    from cyllm.quant import QuantMatrix
    from cyllm.quant.convert import quantize_rows_f32
    rng = rng_for("moe", fmt, fmt_down, f, n)
    b = backend(variant, threads)
    E, k, T = 7, 3, 9

    def weight(rows, cols, kind):
        w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.1
        return w.astype(np.float16) if kind == "f16" else b.upload(QuantMatrix(quantize_rows_f32(w, kind), kind,
                                                                            (rows, cols)))
    experts = tuple((weight(f, n, fmt), weight(f, n, fmt), weight(n, f, fmt_down)) for _ in range(E))
    router = (rng.standard_normal((E, n)) * n ** -0.5).astype(np.float32)
    x = rng.standard_normal((T, n)).astype(np.float32)
    start = rng.standard_normal((T, n)).astype(np.float32)
    batch = start.copy()
    b.moe_batch(batch, x, router, experts, k, True, "silu", MoeScratch.allocate(b, T, n, f, E, k, True))
    one = MoeScratch.allocate(b, 1, n, f, E, k, False)
    for t in range(T):
        row = start[t].copy()
        b.moe(row, x[t], router, experts, k, True, "silu", one)
        slow = start[t].copy()
        b.moe_experts, real = None, b.moe_experts        # the experts one call at a time
        try:
            b.moe(slow, x[t], router, experts, k, True, "silu", one)
        finally:
            del b.moe_experts
        assert real is not None
        if fmt == "f16":
            np.testing.assert_allclose(row, batch[t], rtol=1e-5, atol=1e-5)
        else:
            assert np.array_equal(row.view(np.uint32), batch[t].view(np.uint32)), t
        assert np.array_equal(row.view(np.uint32), slow.view(np.uint32)), t


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("E,k,n,norm", [(128, 8, 2048, True), (8, 2, 96, True), (60, 4, 33, False), (5, 5, 7, True)])
def test_moe_route_is_the_reference_choice(E, k, n, norm, threads):
    """CpuKernels.moe_route (program.c, the choice a decode program makes) picks the experts
    of the highest router probabilities, best first, with their weights (renormalized where
    asked), as float64 arithmetic does wherever two probabilities are not within float32
    rounding of each other; the same rows for any thread count."""
    rng = rng_for("moe_route", E, k, n, norm)
    b = backend("generic" if "generic" in VARIANTS else VARIANTS[0], threads)
    T = 37
    router = (rng.standard_normal((E, n)) * n ** -0.5).astype(np.float32)
    x = rng.standard_normal((T, n)).astype(np.float32)
    scores, ids = np.zeros((T, E), np.float32), np.zeros((T, k), np.int64)
    weights = np.zeros((T, k), np.float32)
    b.moe_route(router, x, k, norm, scores, ids, weights)
    p = np.exp((x.astype(np.float64) @ router.astype(np.float64).T))
    p /= p.sum(-1, keepdims=True)
    for t in range(T):
        order = np.argsort(-p[t], kind="stable")
        margins = -np.diff(p[t, order][:k + 1])
        if margins.min() < 1e-5:
            continue                                    # a near-tie: either order is right
        assert ids[t].tolist() == order[:k].tolist(), t
        want = p[t, order[:k]] / (p[t, order[:k]].sum() if norm else 1.0)
        np.testing.assert_allclose(weights[t], want, rtol=1e-5)
        np.testing.assert_allclose(scores[t, order[k:]], p[t, order[k:]], rtol=1e-5, atol=1e-9)
    again = np.zeros_like(ids)
    backend("generic" if "generic" in VARIANTS else VARIANTS[0], 3 - threads).moe_route(
        router, x, k, norm, scores.copy(), again, weights.copy())
    assert np.array_equal(again, ids)


def test_moe_route_bad_input_and_nan():
    """Wrong shapes, k out of range and overlapping outputs are one-line errors; a router
    product of NaN still gives k distinct experts in range."""
    b = backend(VARIANTS[0], 2)
    f32 = np.float32
    router, x = np.ones((6, 16), f32), np.ones((3, 16), f32)
    ok = dict(scores=np.zeros((3, 6), f32), ids=np.zeros((3, 2), np.int64), weights=np.zeros((3, 2), f32))
    bad = [((router, x, 0, True), {}), ((router, x, 7, True), {}),
           ((router, np.ones((3, 15), f32), 2, True), {}),
           ((router, x, 2, True), dict(scores=np.zeros((2, 6), f32))),
           ((router, x, 2, True), dict(ids=np.zeros((3, 3), np.int64))),
           ((router, x, 2, True), dict(ids=np.zeros((3, 2), np.int32))),
           ((router.astype(np.float16), x, 2, True), {})]
    for args, over in bad:
        kw = {**{k: v.copy() for k, v in ok.items()}, **over}
        with pytest.raises(InvalidArgumentError):
            b.moe_route(*args, kw["scores"], kw["ids"], kw["weights"])
    flat = np.zeros(3 * 6 + 3 * 2, f32)
    with pytest.raises(InvalidArgumentError):       # weights inside scores
        b.moe_route(router, x, 2, True, flat[:18].reshape(3, 6), ok["ids"].copy(), flat[12:18].reshape(3, 2))
    nan = x.copy()
    nan[1] = np.nan
    ids = np.full((3, 4), -7, np.int64)
    b.moe_route(router, nan, 4, True, np.zeros((3, 6), f32), ids, np.zeros((3, 4), f32))
    assert all(len(set(r)) == 4 and min(r) >= 0 and max(r) < 6 for r in ids.tolist())


def test_moe_expert_not_a_trio_is_one_clear_error():
    """An expert that is not a (gate, up, down) tuple: one clear error from the C call, the
    first chosen expert included (it was unpacked before any check)."""
    from cyllm.backends.moe import MoeScratch
    from cyllm.errors import InvalidArgumentError
    rng = rng_for("moe-trio")
    b = backend(VARIANTS[0], 1)
    E, k, f, n = 3, 2, 16, 32
    w = lambda r, c: (rng.standard_normal((r, c)) * 0.1).astype(np.float16)   # noqa: E731
    router = (rng.standard_normal((E, n)) * n ** -0.5).astype(np.float32)
    x = rng.standard_normal(n).astype(np.float32)
    for bad in ((w(f, n), w(f, n)), [w(f, n), w(f, n), w(n, f)]):
        experts = tuple(bad for _ in range(E))
        with pytest.raises(InvalidArgumentError, match=r"\(gate, up, down\) tuple"):
            b.moe(np.zeros(n, np.float32), x, router, experts, k, True, "silu",
                  MoeScratch.allocate(b, 1, n, f, E, k, False))
