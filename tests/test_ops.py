"""CPU kernels (cyllm.backends.cpu) against the float32 NumPy reference.

Every op, both kernel variants (generic is forced per backend instance; avx2 is
skipped on CPUs without it), 1 and 2 threads, awkward sizes (tail rows/columns,
odd head dims, MQA/GQA, positions 0/1/near the end), bitwise equality across
thread counts for the threaded ops, read-only and unaligned inputs, bad inputs.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from cyllm.errors import BackendUnavailableError, InvalidArgumentError
from cyllm.backends.numpy_ref import NumpyBackend

try:
    from cyllm.backends import cpu
    from cyllm._ext import kernels as _k
except (ImportError, BackendUnavailableError) as e:      # extension not built
    pytest.skip(f"cpu kernels not built: {e}", allow_module_level=True)

VARIANTS = [
    "generic",
    pytest.param("avx2", marks=pytest.mark.skipif(
        "avx2" not in _k.available_variants(), reason="CPU (or build) without AVX2/FMA/F16C")),
    pytest.param("avx512", marks=pytest.mark.skipif(
        "avx512" not in _k.available_variants(), reason="CPU (or build) without AVX-512F")),
]
THREADS = [1, 2]
REF = NumpyBackend()


def backend(variant, threads=1):
    return cpu.CpuBackend(threads, variant=variant)


def rng_for(*key):
    return np.random.default_rng(abs(hash(key)) % (2**32))


def f16_matrix(rng, d, n, scale=1.0):
    return (rng.standard_normal((d, n)) * scale).astype(np.float16)


def f32_vec(rng, n, scale=1.0):
    return (rng.standard_normal(n) * scale).astype(np.float32)


def assert_dot_close(got, want, w, x, rel=1e-5):
    """Error bounded relative to sum |w||x| (the scale of float32 rounding in a dot)."""
    bound = np.abs(w.astype(np.float32)) @ np.abs(x)
    err = np.abs(got - want)
    assert np.all(err <= rel * bound + 1e-30), f"max rel err {np.max(err / (bound + 1e-30)):.3g}"


def unaligned_copy(a, offset=8):
    """A copy of `a` whose data pointer is `offset` bytes past a 16-byte boundary (read-only)."""
    raw = np.zeros(a.nbytes + 64, np.uint8)
    start = (-raw.ctypes.data) % 16 + offset
    view = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    view[...] = a
    assert view.ctypes.data % 16 == offset % 16
    view.setflags(write=False)
    return view


# -- matvec family --------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("d", [1, 3, 17, 64, 129])
@pytest.mark.parametrize("n", [1, 7, 15, 16, 33, 257, 1000])
def test_matvec(variant, threads, d, n):
    rng = rng_for("matvec", d, n)
    w, x = f16_matrix(rng, d, n), f32_vec(rng, n)
    b = backend(variant, threads)
    out = np.full(d, np.nan, np.float32)
    b.matvec(out, w, x)
    want = np.zeros(d, np.float32)
    REF.matvec(want, w, x)
    assert_dot_close(out, want, w, x)

    base = f32_vec(rng, d)
    out2, want2 = base.copy(), base.copy()
    b.matvec_add(out2, w, x)
    REF.matvec_add(want2, w, x)
    assert_dot_close(out2, want2, w, x)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("f,n", [(1, 1), (3, 7), (17, 33), (64, 1000), (129, 257)])
def test_gate_up(variant, threads, f, n):
    rng = rng_for("gate_up", f, n)
    wg, wu, x = f16_matrix(rng, f, n), f16_matrix(rng, f, n), f32_vec(rng, n)
    out = np.full(f, np.nan, np.float32)
    backend(variant, threads).gate_up(out, wg, wu, x)
    want = np.zeros(f, np.float32)
    REF.gate_up(want, wg, wu, x)
    # silu(g) * u: the errors of g and u scale with |Wg||x| and |Wu||x|
    g = wg.astype(np.float32) @ x
    u = wu.astype(np.float32) @ x
    bg = np.abs(wg.astype(np.float32)) @ np.abs(x)
    bu = np.abs(wu.astype(np.float32)) @ np.abs(x)
    tol = 1e-5 * (bg * np.abs(u) + bu * np.abs(g) + np.abs(g * u)) + 1e-30
    assert np.all(np.abs(out - want) <= tol)


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
        results.append((o1, o2, o3))
    want = np.zeros(d, np.float32)
    REF.matvec(want, w, x)
    assert_dot_close(results[0][0], want, w, x)
    for other in results[1:]:
        for a, c in zip(results[0], other):
            assert np.array_equal(a.view(np.uint32), c.view(np.uint32))


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


# -- attention, rope, cache -------------------------------------------------------------

ATTN_SHAPES = [  # (n_heads, n_kv_heads, head_dim)
    (1, 1, 64), (4, 1, 64), (9, 3, 64), (8, 2, 48), (4, 4, 80), (6, 2, 96), (2, 1, 40), (3, 1, 6),
]


def make_cache(rng, n_kv, max_ctx, hd):
    k = (rng.standard_normal((n_kv, max_ctx, hd)) * 1.5).astype(np.float16)
    v = rng.standard_normal((n_kv, max_ctx, hd)).astype(np.float16)
    return k, v


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("n_heads,n_kv,hd", ATTN_SHAPES)
@pytest.mark.parametrize("pos", [0, 1, 7, 8, 9, 46, 66])
def test_attention(variant, threads, n_heads, n_kv, hd, pos):
    max_ctx = 67
    rng = rng_for("attn", n_heads, n_kv, hd, pos)
    kc, vc = make_cache(rng, n_kv, max_ctx, hd)
    q = f32_vec(rng, n_heads * hd, 2.0)       # peaky softmax: exercises the max rescaling
    out = np.full(n_heads * hd, np.nan, np.float32)
    backend(variant, threads).attention(out, q, kc, vc, pos)
    want = np.zeros_like(out)
    REF.attention(want, q, kc, vc, pos)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n_heads,n_kv,hd", [(9, 3, 64), (4, 1, 80), (8, 8, 48)])
def test_attention_long_bitwise_across_threads(variant, n_heads, n_kv, hd):
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
        backend(variant, threads).attention(out, q, kc, vc, pos)
        outs.append(out)
    want = np.zeros_like(outs[0])
    REF.attention(want, q, kc, vc, pos)
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


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n_heads,n_kv,hd", [(9, 3, 64), (4, 1, 80), (2, 2, 6)])
@pytest.mark.parametrize("pos", [0, 1, 31])
def test_rope(variant, n_heads, n_kv, hd, pos):
    max_ctx, half = 32, hd // 2
    inv = 1.0 / (10000.0 ** (np.arange(half, dtype=np.float64) * 2 / hd))
    ang = np.outer(np.arange(max_ctx), inv)
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    rng = rng_for("rope", n_heads, hd, pos)
    q, k = f32_vec(rng, n_heads * hd), f32_vec(rng, n_kv * hd)
    q2, k2 = q.copy(), k.copy()
    backend(variant).rope(q, k, cos, sin, pos)
    REF.rope(q2, k2, cos, sin, pos)
    np.testing.assert_allclose(q, q2, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(k, k2, rtol=1e-6, atol=1e-6)


def special_f32(rng, n):
    """Random values plus float16 edge cases: ties, subnormals, overflow, signed zero."""
    edge = np.array([0.0, -0.0, 1.0, -1.0, 65504.0, 65519.0, 65520.0, -65520.0, 1e6, -1e6,
                     6.1035156e-05, 6.0e-05, 5.96e-08, 2.98e-08, 2.99e-08, 1e-9, -3e-6,
                     1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 2049.0, 2051.0, np.inf, -np.inf],
                    dtype=np.float32)
    vals = np.concatenate([
        edge,
        (rng.standard_normal(n) * 10.0 ** rng.uniform(-9, 5, n)).astype(np.float32),
    ])
    return vals


@pytest.mark.parametrize("variant", VARIANTS)
def test_cache_store_bitwise(variant):
    """f32 -> f16 must round exactly like numpy (nearest even), specials included."""
    rng = rng_for("cache")
    n_kv, max_ctx = 3, 5
    vals = special_f32(rng, 4000)
    hd = 2 * ((len(vals) // n_kv + 1) // 2)
    vals = np.resize(vals, n_kv * hd).astype(np.float32)
    k, v = vals, vals[::-1].copy()
    b = backend(variant)
    for pos in (0, 4):
        kc = np.zeros((n_kv, max_ctx, hd), np.float16)
        vc = np.zeros_like(kc)
        b.cache_store(kc, vc, k, v, pos)
        kr, vr = np.zeros_like(kc), np.zeros_like(vc)
        with np.errstate(over="ignore"):
            REF.cache_store(kr, vr, k, v, pos)
        assert np.array_equal(kc.view(np.uint16), kr.view(np.uint16))
        assert np.array_equal(vc.view(np.uint16), vr.view(np.uint16))
    kn = np.full(n_kv * hd, np.nan, np.float32)
    b.cache_store(kc, vc, kn, v, 1)
    assert np.isnan(kc[:, 1].astype(np.float32)).all()


@pytest.mark.parametrize("variant", VARIANTS)
def test_embed_exact(variant):
    rng = rng_for("embed")
    with np.errstate(over="ignore"):
        table = special_f32(rng, 0)[:21].astype(np.float16)
    table = np.concatenate([table, np.array([np.nan, 1e-7, -2e-7], np.float16),
                            rng.standard_normal(7 * 37 - 24).astype(np.float16)]).reshape(7, 37)
    table.setflags(write=False)
    b = backend(variant)
    for tok in (0, 3, 6, np.int64(5)):
        out = np.zeros(37, np.float32)
        b.embed(out, table, tok)
        want = table[int(tok)].astype(np.float32)
        assert np.array_equal(out, want, equal_nan=True)


# -- small vector ops ------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("n", [1, 3, 17, 576, 100_003])
def test_vector_ops(variant, threads, n):
    rng = rng_for("vec", n)
    b = backend(variant, threads)
    x, y, w = f32_vec(rng, n, 3.0), f32_vec(rng, n), f32_vec(rng, n)

    out, want = np.zeros(n, np.float32), np.zeros(n, np.float32)
    b.rmsnorm(out, x, w, 1e-5)
    REF.rmsnorm(want, x, w, 1e-5)
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=1e-7)

    b.swiglu(out, x, y)
    REF.swiglu(want, x, y)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-7)

    b.add(out, x, y)
    assert np.array_equal(out, x + y)
    xa = x.copy()
    b.add(xa, xa, y)                      # out may alias x
    assert np.array_equal(xa, x + y)
    xr = x.copy()
    b.rmsnorm(xr, xr, w, 1e-6)            # and for rmsnorm
    REF.rmsnorm(want, x, w, 1e-6)
    np.testing.assert_allclose(xr, want, rtol=2e-6, atol=1e-7)


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
    assert b.upload(v) is v and b.to_host(v) is v
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
# Sizes: T in {1, 2, 5, 17, 64, 300} (tails of every micro-kernel: 6/12 tokens, 16/32
# rows, 256-column blocks), odd d/n. The GEMM sums each output as one chain over the
# columns in order: bitwise the same for any thread count, and for avx2 and avx512.

BATCH_T = [1, 2, 5, 17, 64, 300]


def assert_rows_close(got, want, x, w, rel=2e-5):
    bound = np.abs(x) @ np.abs(w.astype(np.float32)).T           # (T, d)
    err = np.abs(got - want)
    assert np.all(err <= rel * bound + 1e-30), f"max rel err {np.max(err / (bound + 1e-30)):.3g}"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("T", BATCH_T)
@pytest.mark.parametrize("d,n", [(1, 7), (33, 17), (100, 257), (577, 300)])
def test_matmul_family(variant, T, d, n):
    rng = rng_for("matmul", T, d, n)
    w, wu = f16_matrix(rng, d, n), f16_matrix(rng, d, n)
    x = rng.standard_normal((T, n)).astype(np.float32)
    base = rng.standard_normal((T, d)).astype(np.float32)
    got = {}
    for threads in (1, 2, 3):
        b = backend(variant, threads)
        o1 = np.full((T, d), np.nan, np.float32)
        b.matmul(o1, w, x)
        o2 = base.copy()
        b.matmul_add(o2, w, x)
        o3 = np.full((T, d), np.nan, np.float32)
        b.gate_up_batch(o3, w, wu, x)
        got[threads] = (o1, o2, o3)
    w1, w2, w3 = np.zeros((T, d), np.float32), base.copy(), np.zeros((T, d), np.float32)
    REF.matmul(w1, w, x)
    REF.matmul_add(w2, w, x)
    with np.errstate(over="ignore"):                     # the reference's exp(-g) may overflow: fine
        REF.gate_up_batch(w3, w, wu, x)
    o1, o2, o3 = got[1]
    assert_rows_close(o1, w1, x, w)
    assert_rows_close(o2, w2, x, w)
    g = x @ w.astype(np.float32).T
    u = x @ wu.astype(np.float32).T
    bg = np.abs(x) @ np.abs(w.astype(np.float32)).T
    bu = np.abs(x) @ np.abs(wu.astype(np.float32)).T
    tol = 2e-5 * (bg * np.abs(u) + bu * np.abs(g) + np.abs(g * u)) + 1e-30
    assert np.all(np.abs(o3 - w3) <= tol)
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
@pytest.mark.parametrize("T", [1, 5, 64])
def test_small_batch_ops(variant, T):
    rng = rng_for("small-batch", T)
    b = backend(variant, 2)
    vocab, dim = 50, 36
    table = f16_matrix(rng, vocab, dim)
    tokens = rng.integers(0, vocab, T).astype(np.int32)
    out = np.full((T, dim), np.nan, np.float32)
    b.embed_batch(out, table, tokens)
    assert np.array_equal(out, table[tokens].astype(np.float32))
    x = rng.standard_normal((T, dim)).astype(np.float32)
    wn = f32_vec(rng, dim)
    got, want = np.zeros_like(x), np.zeros_like(x)
    b.rmsnorm_batch(got, x, wn, 1e-5)
    REF.rmsnorm_batch(want, x, wn, 1e-5)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    for t in range(T):                      # each row exactly the single-row op
        row = np.zeros(dim, np.float32)
        b.rmsnorm(row, x[t], wn, 1e-5)
        assert np.array_equal(row, got[t])
    inplace = x.copy()
    b.rmsnorm_batch(inplace, inplace, wn, 1e-5)
    assert np.array_equal(inplace, got)
    bias = f32_vec(rng, dim)
    o = x.copy()
    b.add_rows(o, o, bias)
    assert np.array_equal(o, x + bias)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n_heads,n_kv,hd", [(4, 2, 16), (3, 1, 24), (6, 6, 10)])
@pytest.mark.parametrize("T,pos0", [(1, 0), (5, 0), (12, 0), (13, 1), (17, 3), (64, 200), (300, 0)])
def test_rope_store_attention_batch(variant, n_heads, n_kv, hd, T, pos0):
    """rope_batch / cache_store_batch / attention_batch against the reference, with
    pos0 > 0 over an existing cache; each row equals the single-position ops (bitwise
    where both use the decode kernel: generic, and T == 1; avx2/avx512 prefill attention is
    GEMM-shaped)."""
    rng = rng_for("att-batch", n_heads, n_kv, hd, T, pos0)
    max_ctx = pos0 + T + 3
    b = backend(variant, 2)
    cos = rng.standard_normal((max_ctx, hd // 2)).astype(np.float32)
    sin = rng.standard_normal((max_ctx, hd // 2)).astype(np.float32)
    q = rng.standard_normal((T, n_heads * hd)).astype(np.float32)
    k = rng.standard_normal((T, n_kv * hd)).astype(np.float32)
    v = rng.standard_normal((T, n_kv * hd)).astype(np.float32)
    kc, vc = make_cache(rng, n_kv, max_ctx, hd)          # positions < pos0: an existing cache
    kc2, vc2, q2, k2 = kc.copy(), vc.copy(), q.copy(), k.copy()
    b.rope_batch(q, k, cos, sin, pos0)
    REF.rope_batch(q2, k2, cos, sin, pos0)
    np.testing.assert_allclose(q, q2, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(k, k2, rtol=1e-6, atol=1e-6)
    b.cache_store_batch(kc, vc, k, v, pos0)
    REF.cache_store_batch(kc2, vc2, k, v, pos0)
    assert np.array_equal(kc.view(np.uint16), kc2.view(np.uint16))
    assert np.array_equal(vc.view(np.uint16), vc2.view(np.uint16))
    out = np.full((T, n_heads * hd), np.nan, np.float32)
    b.attention_batch(out, q, kc, vc, pos0)
    want = np.zeros_like(out)
    REF.attention_batch(want, q, kc, vc, pos0)
    np.testing.assert_allclose(out, want, rtol=2e-4, atol=2e-5)
    for t in (0, T // 2, T - 1):
        row = np.zeros(n_heads * hd, np.float32)
        b.attention(row, q[t], kc, vc, pos0 + t)
        if pos0 + t < 256 and variant == "generic" or T == 1:   # the decode kernel: same call
            assert np.array_equal(row, out[t])
        else:
            np.testing.assert_allclose(row, out[t], rtol=2e-4, atol=2e-5)
    out1 = np.zeros_like(out)
    backend(variant, 1).attention_batch(out1, q, kc, vc, pos0)
    assert np.array_equal(out1, out)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("pos", [255, 256, 257, 700, 1023])
def test_attention_blocked_long(variant, pos):
    """Past 256 positions decode attention merges fixed cache blocks: close to the
    reference, and the same bits for 1, 2 and 3 threads."""
    rng = rng_for("att-long", pos)
    n_heads, n_kv, hd = 9, 3, 64
    kc, vc = make_cache(rng, n_kv, 1024, hd)
    q = f32_vec(rng, n_heads * hd)
    want = np.zeros(n_heads * hd, np.float32)
    REF.attention(want, q, kc, vc, pos)
    outs = []
    for threads in (1, 2, 3):
        o = np.full(n_heads * hd, np.nan, np.float32)
        backend(variant, threads).attention(o, q, kc, vc, pos)
        outs.append(o)
    np.testing.assert_allclose(outs[0], want, rtol=2e-4, atol=2e-5)
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
