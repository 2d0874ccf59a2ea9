"""CUDA backend properties that the op table (test_backend_ops.py) cannot express
(needs CuPy and a GPU).

The table runs every op on cuda, op by op and replayed from a CUDA graph, against
numpy_ref. Here: every matvec launch shape and the large-matrix shape rule, unaligned
views, the rmsnorm folded into the next matvec, attention over long caches (split and
tile shapes) with the kernel variants the table does not pick (V loaded early, scalar
prefill tiles), sharp score spreads, the GEMM's only error being x's FP16 rounding, row
views of larger buffers, bad arguments, memory helpers, the copy bandwidth probe and
CUDA-graph decode through cyllm's Model. Outputs are poisoned with NaN first so an
unwritten element fails, and cache rows past the position hold NaN so a kernel that
reads them fails.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.cuda

from conftest import require_cuda  # noqa: E402

cp = require_cuda()

from cyllm.backends.cuda import CudaBackend  # noqa: E402
from cyllm.backends.numpy_ref import NumpyBackend  # noqa: E402
from cyllm.errors import CyllmError, InvalidArgumentError  # noqa: E402

RNG = np.random.default_rng(1234)


@pytest.fixture(scope="module")
def be():
    return CudaBackend()


@pytest.fixture(scope="module")
def ref():
    return NumpyBackend()


def rel_err(got, want) -> float:
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert np.all(np.isfinite(got)), "non-finite output (unwritten element or bad read)"
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def f32(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def f16(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float16)


def nan_dev(shape):
    return cp.full(shape, np.nan, dtype=cp.float32)


def host(be, a):
    return np.array(be.to_host(a), copy=True)


# -- matvec family: launch shapes ----------------------------------------------------------
@pytest.mark.parametrize("unroll", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("warps", [1, 3, 8, 32])
def test_matvec_launch_shapes(ref, rows, warps, unroll):
    """Every (rows per warp, warps per block, loads in flight) the bench may pick computes the same thing."""
    b = CudaBackend()
    b.matvec_rows, b.matvec_warps, b.matvec_unroll = rows, warps, unroll
    for d, n in [(1, 8), (45, 256), (301, 2056), (67, 4096)]:
        w, x, r = f16(d, n), f32(n), f32(d)
        out = nan_dev(d)
        b.matvec(out, b.upload(w), b.upload(x))
        # d = 1 is a single sum with cancellation: the summation order shows at 1e-5
        assert rel_err(host(b, out), w.astype(np.float64) @ x) < 1e-4
        out = b.upload(r)
        b.matvec_add(out, b.upload(w), b.upload(x))
        assert rel_err(host(b, out), r + w.astype(np.float64) @ x) < 1e-4
        wu = f16(d, n)
        out = nan_dev(d)
        b.gate_up(out, b.upload(w), b.upload(wu), b.upload(x))
        want = np.zeros(d, np.float32)
        ref.gate_up(want, ref.upload(w), ref.upload(wu), x)
        assert rel_err(host(b, out), want) < 1e-4


@pytest.mark.parametrize("rule", ["large", "old"])
def test_matvec_large_shapes(ref, rule):
    """The launch shapes picked for large matrices (rows per warp, block size, loads in flight)
    compute the same thing: tall (4 rows, small blocks), square and wide (2 rows, 16 warps, 8 loads),
    with rows that do not fill the last block."""
    b = CudaBackend()
    b.matvec_shape_rule = rule
    for d, n in [(2051, 4096), (1030, 8200), (5123, 2048)]:
        assert d * n >= b._MV_LARGE
        w, x, r = f16(d, n), f32(n), f32(d)
        wd, xd = b.upload(w), b.upload(x)
        out = nan_dev(d)
        b.matvec(out, wd, xd)
        assert rel_err(host(b, out), w.astype(np.float64) @ x) < 1e-5
        out = b.upload(r)
        b.matvec_add(out, wd, xd)
        assert rel_err(host(b, out), r + w.astype(np.float64) @ x) < 1e-5
        wu = f16(d, n, scale=0.1)
        out = nan_dev(d)
        b.gate_up(out, b.upload((w * 0.1).astype(np.float16)), b.upload(wu), xd)
        want = np.zeros(d, np.float32)
        ref.gate_up(want, ref.upload((w * 0.1).astype(np.float16)), ref.upload(wu), x)
        assert rel_err(host(b, out), want) < 1e-5


def test_matvec_misaligned_views(be):
    """x at an odd offset (not 16-byte aligned) takes the scalar path and is still right."""
    d, n = 70, 128
    w = f16(d, n)
    xs = f32(n + 1)
    x_dev = be.upload(xs)[1:]
    out = nan_dev(d)
    be.matvec(out, be.upload(w), x_dev)
    assert rel_err(host(be, out), w.astype(np.float32) @ xs[1:]) < 1e-5


# -- rmsnorm folded into the next matvec ---------------------------------------------------
@pytest.mark.parametrize("op", ["matvec", "matvec_add", "gate_up"])
@pytest.mark.parametrize("d,n", [(37, 64), (300, 576), (1000, 4096), (64, 8)])
def test_norm_folded_into_matvec(ref, op, d, n):
    """rmsnorm(xb, x, w) then op(out, W, xb): same result as the two ops apart, and xb is written."""
    b = CudaBackend()
    assert b.fuse_norm
    x, nw, r = f32(n), f32(n), f32(d)
    w1, w2 = f16(d, n, scale=0.1), f16(d, n, scale=0.1)
    xd, nwd, xbd = b.upload(x), b.upload(nw), nan_dev(n)
    out = b.upload(r) if op == "matvec_add" else nan_dev(d)
    b.rmsnorm(xbd, xd, nwd, 1e-5)
    assert b._pending_norm is not None            # held back for the matvec
    if op == "gate_up":
        b.gate_up(out, b.upload(w1), b.upload(w2), xbd)
    else:
        getattr(b, op)(out, b.upload(w1), xbd)
    assert b._pending_norm is None
    xb = np.zeros(n, np.float32)
    ref.rmsnorm(xb, x, nw, 1e-5)
    want = r.copy() if op == "matvec_add" else np.zeros(d, np.float32)
    if op == "gate_up":
        ref.gate_up(want, ref.upload(w1), ref.upload(w2), xb)
    else:
        getattr(ref, op)(want, ref.upload(w1), xb)
    assert rel_err(host(b, out), want) < 1e-5
    assert rel_err(host(b, xbd), xb) < 1e-6


def test_norm_pending_is_flushed(ref):
    """A held-back rmsnorm is launched before anything else can observe its output."""
    b = CudaBackend()
    n = 256
    x, nw = f32(n), f32(n)
    want = np.zeros(n, np.float32)
    ref.rmsnorm(want, x, nw, 1e-6)
    xd, nwd = b.upload(x), b.upload(nw)
    xb = nan_dev(n)
    b.rmsnorm(xb, xd, nwd, 1e-6)
    assert rel_err(host(b, xb), want) < 1e-6          # to_host flushes
    xb2, y = nan_dev(n), nan_dev(n)
    b.rmsnorm(xb2, xd, nwd, 1e-6)
    b.add(y, xb2, xb2)                                # any other op flushes first
    assert rel_err(host(b, y), 2 * want) < 1e-6
    # the matvec writes the norm's input: it must not be folded (blocks would race)
    d = n
    wm = f16(d, n, scale=0.1)
    xd2 = b.upload(x)
    xb3 = nan_dev(n)
    b.rmsnorm(xb3, xd2, nwd, 1e-6)
    b.matvec_add(xd2, b.upload(wm), xb3)
    assert rel_err(host(b, xd2), x + wm.astype(np.float32) @ want) < 1e-5
    # in place (out is x): never held back
    xd3 = b.upload(x)
    b.rmsnorm(xd3, xd3, nwd, 1e-6)
    assert b._pending_norm is None
    assert rel_err(host(b, xd3), want) < 1e-6


def test_norm_fold_off(ref):
    b = CudaBackend()
    b.fuse_norm = False
    x, nw = f32(64), f32(64)
    xb = nan_dev(64)
    b.rmsnorm(xb, b.upload(x), b.upload(nw), 1e-5)
    assert b._pending_norm is None


def _qk_norm_rope_store(b, q, k, v, qw, kw, cos, sin, max_ctx, pos, eps):
    """The decode pattern of a model with per-head q/k norms on backend b, from host arrays:
    the norms held before rope_store, and (q, k, k_cache, v_cache) after it."""
    hd = qw.shape[0]
    qd, kd, vd = b.upload(q), b.upload(k), b.upload(v)
    n_kv = k.shape[0] // hd
    kc = b.upload(np.zeros((n_kv, max_ctx, hd), np.float16))
    vc = b.upload(np.zeros((n_kv, max_ctx, hd), np.float16))
    qh, kh = qd.reshape(-1, hd), kd.reshape(-1, hd)
    b.rmsnorm_batch(qh, qh, b.upload(qw), eps)
    b.rmsnorm_batch(kh, kh, b.upload(kw), eps)
    held = len(b._held_heads)
    b.rope_store(qd, kd, vd, b.upload(cos), b.upload(sin), kc, vc, pos)
    assert b._held_heads == []
    return held, tuple(host(b, a) for a in (qd, kd, kc, vc))


@pytest.mark.parametrize("nq,nk,hd", [(32, 8, 128), (5, 1, 64), (7, 3, 256), (4, 4, 128)])
def test_qk_norms_folded_into_rope_store(ref, nq, nk, hd):
    """Per-head q/k norms then rope_store: held back and run as one kernel, to the bit what the
    three ops give one by one, and within float rounding of numpy_ref's."""
    max_ctx, pos, eps = 40, 37, 1e-6
    q, k, v = f32(nq * hd, scale=3.0), f32(nk * hd, scale=0.5), f32(nk * hd)
    qw, kw = f32(hd), f32(hd)
    ang = np.outer(np.arange(max_ctx), RNG.uniform(0.01, 1.0, hd // 2)).astype(np.float32)
    cos, sin = np.cos(ang), np.sin(ang)
    fused, plain = CudaBackend(), CudaBackend()
    plain.fold_qk_norm = False
    held, got = _qk_norm_rope_store(fused, q, k, v, qw, kw, cos, sin, max_ctx, pos, eps)
    assert held == 2
    held, want = _qk_norm_rope_store(plain, q, k, v, qw, kw, cos, sin, max_ctx, pos, eps)
    assert held == 0
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    # numpy_ref: the same ops
    qr, kr = q.copy(), k.copy()
    for vec, w in ((qr, qw), (kr, kw)):
        heads = vec.reshape(-1, hd)
        ref.rmsnorm_batch(heads, heads.copy(), w, eps)
    kc, vc = np.zeros((nk, max_ctx, hd), np.float16), np.zeros((nk, max_ctx, hd), np.float16)
    ref.rope_store(qr, kr, v, cos, sin, kc, vc, pos)
    assert rel_err(got[0], qr) < 1e-5 and rel_err(got[1], kr) < 1e-5
    assert rel_err(got[2][:, pos], kc[:, pos]) < 1e-3
    np.testing.assert_array_equal(got[3], vc)
    assert not got[2][:, :pos].any() and not got[2][:, pos + 1:].any()


def test_qk_norms_held_are_flushed(ref):
    """A held head norm is launched before anything can observe it, and a rope_store of other
    vectors (or a head_dim the fused kernel lacks) gets the held norms first, as they were."""
    b = CudaBackend()
    hd, eps = 64, 1e-5
    x, w = f32(3 * hd), f32(hd)
    want = x.reshape(3, hd).copy()
    ref.rmsnorm_batch(want, x.reshape(3, hd), w, eps)
    xd = b.upload(x)
    xh = xd.reshape(3, hd)
    b.rmsnorm_batch(xh, xh, b.upload(w), eps)
    assert len(b._held_heads) == 1
    assert rel_err(host(b, xh), want) < 1e-6         # to_host flushes
    assert b._held_heads == []
    xd = b.upload(x)
    xh = xd.reshape(3, hd)
    y = nan_dev(3 * hd)
    b.rmsnorm_batch(xh, xh, b.upload(w), eps)
    b.add(y, xd, xd)                                   # any other op flushes first
    assert rel_err(host(b, y), 2 * want.reshape(-1)) < 1e-6
    # a matvec reading the heads takes its input (_take_norm) after the held norm, F16 or
    # quantized weights alike
    wm = f16(40, 3 * hd, scale=0.1)
    for weights in (wm, None):
        xd = b.upload(x)
        xh = xd.reshape(3, hd)
        out = nan_dev(40)
        b.rmsnorm_batch(xh, xh, b.upload(w), eps)
        assert len(b._held_heads) == 1
        if weights is None:
            from cyllm.quant import FORMATS, QuantMatrix
            from cyllm.quant.convert import quantize_rows_f32
            wq = QuantMatrix(quantize_rows_f32(wm.astype(np.float32), "q8_0"), FORMATS["q8_0"], wm.shape)
            b.matvec(out, b.upload(wq), xd)
            tol = 2e-2                                 # x rounded to int8 blocks
        else:
            b.matvec(out, b.upload(weights), xd)
            tol = 1e-5
        assert rel_err(host(b, out), wm.astype(np.float32) @ want.reshape(-1)) < tol
    # not in place, or a head_dim without a kernel: launched at once
    out = nan_dev((3, hd))
    b.rmsnorm_batch(out, b.upload(x).reshape(3, hd), b.upload(w), eps)
    assert b._held_heads == []
    z = b.upload(f32(3 * 96)).reshape(3, 96)
    b.rmsnorm_batch(z, z, b.upload(f32(96)), eps)
    assert b._held_heads == []
    # a rope_store of another q: the held norm goes out first, then rope_store's own path
    max_ctx, pos = 8, 3
    q, k, v = f32(2 * hd), f32(hd), f32(hd)
    ang = np.outer(np.arange(max_ctx), np.linspace(0.1, 1.0, hd // 2)).astype(np.float32)
    cos, sin = np.cos(ang), np.sin(ang)
    xd = b.upload(x)
    xh = xd.reshape(3, hd)
    b.rmsnorm_batch(xh, xh, b.upload(w), eps)
    qd, kd, vd = b.upload(q), b.upload(k), b.upload(v)
    kc = b.upload(np.zeros((1, max_ctx, hd), np.float16))
    vc = b.upload(np.zeros((1, max_ctx, hd), np.float16))
    b.rope_store(qd, kd, vd, b.upload(cos), b.upload(sin), kc, vc, pos)
    assert rel_err(host(b, xh), want) < 1e-6
    qr, kr = q.copy(), k.copy()
    ref.rope(qr, kr, cos, sin, pos)
    assert rel_err(host(b, qd), qr) < 1e-6


# (n_heads, n_kv_heads, head_dim, max_ctx): MHA, GQA, MQA, groups of 2, 3, 4, 5, 6, 8 and 16,
# head_dim 8 to 256, odd ones (by default a GQA group's heads go one or two a block at these
# positions: CudaBackend._attn_plan; whole groups, in tiles of 1, 2, 4 and 8, partly filled,
# and two tiles a block: test_attention_heads_per_block)
ATT_CASES = [(4, 4, 64, 50), (8, 2, 128, 300), (9, 3, 64, 1000), (6, 1, 32, 70),
             (12, 2, 128, 700), (4, 4, 256, 300), (4, 2, 6, 40), (2, 1, 40, 100),
             (3, 3, 16, 9), (32, 32, 128, 4096), (16, 16, 8, 65), (8, 4, 64, 260), (10, 2, 64, 130),
             (16, 1, 64, 300), (8, 2, 16, 300), (8, 1, 8, 80)]


# -- attention: splits, tiles and the kernel variants the table does not pick ------------------
def check_attention(be, nh, nkv, hd, max_ctx, window, softcap=0.0):
    """be.attention at positions 0, 1, a third of the cache and its last, against numpy_ref
    (with softcap: q scaled up, so that the cap binds)."""
    ref = NumpyBackend()
    kc = f16(nkv, max_ctx, hd)
    vc = f16(nkv, max_ctx, hd)
    for pos in sorted({0, 1, max_ctx // 3, max_ctx - 1}):
        kp, vp = kc.copy(), vc.copy()
        kp[:, pos + 1:] = np.nan        # rows past pos must never be read
        vp[:, pos + 1:] = np.nan
        q = f32(nh * hd, scale=4.0 if softcap else 1.0)
        out = nan_dev(nh * hd)
        be.attention(out, be.upload(q), be.upload(kp), be.upload(vp), pos, window, None, softcap)
        want = np.zeros(nh * hd, np.float32)
        ref.attention(want, q, kc, vc, pos, window, None, softcap)
        assert rel_err(host(be, out), want) < 1e-4, f"pos {pos}"


@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("v_early", [True, False])
@pytest.mark.parametrize("nh,nkv,hd,max_ctx", ATT_CASES)
def test_attention_splits(nh, nkv, hd, max_ctx, v_early, window):
    """Decode attention over caches of up to 4096 positions (the split count and chunk
    depend on max_ctx and the SM count), in both variants: the first K/V rows loaded
    before pdl_wait or each pass's rows when it runs (attn_v_early; by default chosen by
    position). Eager calls: the ordering against rope_store under PDL is exercised by
    the graph tests of test_cuda_model.py."""
    be = CudaBackend()
    be.attn_v_early = v_early
    check_attention(be, nh, nkv, hd, max_ctx, window)


@pytest.mark.parametrize("hpb", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("v_early", [True, False])
@pytest.mark.parametrize("nh,nkv,hd,max_ctx", [(8, 2, 128, 300), (10, 2, 64, 130), (16, 1, 64, 300),
                                               (9, 3, 64, 1000), (8, 1, 8, 80), (16, 2, 256, 300)])
def test_attention_heads_per_block(nh, nkv, hd, max_ctx, v_early, hpb):
    """A group's query heads over one or several blocks a split (attn_heads_per_block,
    clamped to the group: the last block partly filled, tiles of 1, 2, 4 and 8 partly filled,
    and two tiles a block: 16 heads in tiles of 8, and head_dim 256 where shared memory
    narrows a tile of 8 to 4), each block merging its own heads' splits."""
    be = CudaBackend()
    be.attn_v_early = v_early
    be.attn_heads_per_block = hpb
    check_attention(be, nh, nkv, hd, max_ctx, 37 if hpb == 3 else 0)


@pytest.mark.parametrize("variant", ["butterfly", "fold", "early"])
@pytest.mark.parametrize("hpb", [None, 1, 16])
@pytest.mark.parametrize("nh,nkv,hd,max_ctx", ATT_CASES + [(24, 3, 32, 500)])
def test_attention_staged_scores(nh, nkv, hd, max_ctx, hpb, variant):
    """The staged (long-cache) attention's scores summed across a row's lanes by one butterfly
    a batch (head_dim 64 and 128; the others fold each score) or by a fold a score
    (attn_butterfly=False), and the butterfly kernels that load their first K rows before
    pdl_wait and their first V rows before the softmax (attn_staged_early; head_dim 8 keeps
    the butterfly kernels), over whole groups (tiles of 1 to 8 heads, partly filled), one head
    a block and two tiles of 8 a block; a window where the group is odd."""
    be = CudaBackend()
    be.attn_v_early = False
    be.attn_butterfly = variant != "fold"
    be.attn_staged_early = variant == "early"
    be.attn_heads_per_block = hpb if hpb is not None else nh // nkv
    check_attention(be, nh, nkv, hd, max_ctx, 37 if (nh // nkv) % 2 else 0)


@pytest.mark.parametrize("variant", ["online", "butterfly", "fold", "early"])
@pytest.mark.parametrize("nh,nkv,hd,max_ctx", [(8, 8, 128, 300), (16, 2, 256, 700), (8, 4, 64, 260),
                                               (6, 2, 40, 90)])
def test_attention_softcap_every_path(nh, nkv, hd, max_ctx, variant):
    """Soft-capped scores (Gemma 2) on each decode path: the online softmax of short caches,
    the staged path's butterfly, fold and early-row kernels (one head a block, and the whole
    group), a window, and head_dim 40 (the generic kernel)."""
    for hpb in (1, nh // nkv):
        be = CudaBackend()
        be.attn_v_early = variant == "online"
        be.attn_butterfly = variant != "fold"
        be.attn_staged_early = variant == "early"
        be.attn_heads_per_block = hpb
        check_attention(be, nh, nkv, hd, max_ctx, 37 if hpb == 1 else 0, softcap=2.5)


@pytest.mark.parametrize("vec", [True, False])
@pytest.mark.parametrize("nh,nkv,hd,t,pos0,max_ctx", [(8, 2, 128, 100, 20, 200), (4, 2, 256, 40, 30, 80),
                                                      (3, 1, 24, 17, 0, 40)])
def test_attention_batch_softcap(ref, nh, nkv, hd, t, pos0, max_ctx, vec):
    """Prefill attention with soft-capped scores, both kernels, with and without a window."""
    be = CudaBackend()
    be.attn_batch_vec = vec
    kc, vc = f16(nkv, max_ctx, hd), f16(nkv, max_ctx, hd)
    q = f32(t, nh * hd, scale=4.0)
    for window in (0, 29):
        out = cp.full((t, nh * hd), np.nan, dtype=cp.float32)
        be.attention_batch(out, be.upload(q), be.upload(kc), be.upload(vc), pos0, window, None, 2.5)
        want = np.zeros((t, nh * hd), np.float32)
        ref.attention_batch(want, q, kc, vc, pos0, window, None, 2.5)
        assert rel_err(host(be, out), want) < 1e-4


def test_attention_peaked_scores(be, ref):
    """Large score spreads (one dominant key per split) exercise the split merge."""
    nh, nkv, hd, max_ctx = 4, 2, 64, 2000
    kc = f16(nkv, max_ctx, hd, scale=3.0)
    vc = f16(nkv, max_ctx, hd)
    q = f32(nh * hd, scale=3.0)
    out = nan_dev(nh * hd)
    be.attention(out, be.upload(q), be.upload(kc), be.upload(vc), max_ctx - 1)
    want = np.zeros(nh * hd, np.float32)
    ref.attention(want, q, kc, vc, max_ctx - 1)
    assert rel_err(host(be, out), want) < 1e-4


# -- prefill -----------------------------------------------------------------------------------
@pytest.mark.parametrize("t,d,n", [(1, 8, 8), (5, 77, 64), (33, 256, 520), (128, 1000, 4096)])
def test_matmul_only_x_rounded(be, t, d, n):
    """The GEMM's only error beyond float32 summation is x rounded to FP16 (checked against
    float64 math on the rounded x, ten times tighter than the table's bound)."""
    w, x = f16(d, n), f32(t, n)
    out = cp.full((t, d), np.nan, dtype=cp.float32)
    be.matmul(out, be.upload(w), be.upload(x))
    want = x.astype(np.float16).astype(np.float64) @ w.astype(np.float64).T
    # cuBLAS GemmEx writes f32; the cupy.matmul fallback rounds the result to f16
    tol = 1e-3 if getattr(be, "_gemm_broken", False) else 1e-4
    assert rel_err(host(be, out), want) < tol


def test_batch_row_views(be, ref):
    """The model passes row slices B.x[:T] of larger buffers: only the first T rows change."""
    t, d, n = 5, 40, 64
    w, x = f16(d, n), f32(8, n)
    xd = be.upload(x)
    outd = cp.full((8, d), 7.0, dtype=cp.float32)
    be.matmul(outd[:t], be.upload(w), xd[:t])
    got = host(be, outd)
    want = np.zeros((t, d), np.float32)
    ref.matmul(want, ref.upload(w), x[:t])
    assert rel_err(got[:t], want) < 1e-3
    np.testing.assert_array_equal(got[t:], 7.0)


# (n_heads, n_kv_heads, head_dim, T, pos0, max_ctx)
ATTB_CASES = [(4, 4, 64, 50, 0, 60), (8, 2, 128, 256, 0, 300), (8, 2, 128, 100, 256, 400),
              (9, 3, 64, 33, 7, 100), (3, 1, 24, 17, 0, 40), (6, 1, 32, 70, 5, 90),
              (4, 4, 256, 40, 30, 80), (4, 2, 6, 9, 2, 20), (2, 1, 40, 65, 1, 70),
              (32, 32, 128, 64, 300, 400), (2, 2, 16, 1, 10, 12)]


@pytest.mark.parametrize("window", [0, 29])
@pytest.mark.parametrize("vec", [True, False])
@pytest.mark.parametrize("nh,nkv,hd,t,pos0,max_ctx", ATTB_CASES)
def test_attention_batch_tiles(ref, nh, nkv, hd, t, pos0, max_ctx, vec, window):
    """Prefill attention over every head-dim class of tile (up to 256), long rows, with the
    float4 kernel and the scalar one (attn_batch_vec; the table runs the default)."""
    be = CudaBackend()
    be.attn_batch_vec = vec
    kc = f16(nkv, max_ctx, hd)
    vc = f16(nkv, max_ctx, hd)
    last = pos0 + t - 1
    kp, vp = kc.copy(), vc.copy()
    kp[:, last + 1:] = np.nan           # rows past the last query's position must never be read
    vp[:, last + 1:] = np.nan
    q = f32(t, nh * hd)
    out = cp.full((t, nh * hd), np.nan, dtype=cp.float32)
    be.attention_batch(out, be.upload(q), be.upload(kp), be.upload(vp), pos0, window)
    want = np.zeros((t, nh * hd), np.float32)
    ref.attention_batch(want, q, kc, vc, pos0, window)
    assert rel_err(host(be, out), want) < 1e-4


def test_attention_batch_peaked(be, ref):
    """Large score spreads: the online-softmax rescaling across key tiles must be exact."""
    nh, nkv, hd, t, max_ctx = 4, 2, 64, 96, 200
    kc = f16(nkv, max_ctx, hd, scale=3.0)
    vc = f16(nkv, max_ctx, hd)
    q = f32(t, nh * hd, scale=3.0)
    out = cp.full((t, nh * hd), np.nan, dtype=cp.float32)
    be.attention_batch(out, be.upload(q), be.upload(kc), be.upload(vc), 50)
    want = np.zeros((t, nh * hd), np.float32)
    ref.attention_batch(want, q, kc, vc, 50)
    assert rel_err(host(be, out), want) < 1e-4


# -- bad arguments -------------------------------------------------------------------------------
def _bad_calls():
    f32_, f16_ = np.float32, np.float16

    def z(*shape, dtype=f32_):
        return cp.zeros(shape, dtype=dtype)

    yield "embed token high", lambda b: b.embed(z(8), z(10, 8, dtype=f16_), 10)
    yield "embed token negative", lambda b: b.embed(z(8), z(10, 8, dtype=f16_), -1)
    yield "embed_batch token high", lambda b: b.embed_batch(z(2, 8), z(10, 8, dtype=f16_),
                                                            np.array([1, 10], np.int32))
    yield "embed_batch token negative", lambda b: b.embed_batch(z(2, 8), z(10, 8, dtype=f16_),
                                                                np.array([-1, 0], np.int32))
    yield "rope pos = max_ctx", lambda b: b.rope(z(32), z(16), z(16, 4), z(16, 4), 16)
    yield "rope head_dim under rotated dims", lambda b: b.rope(z(32), z(16), z(16, 4), z(16, 4), 0, 6)
    yield "rope head_dim not dividing", lambda b: b.rope(z(32), z(16), z(16, 4), z(16, 4), 0, 12)
    yield "rope_batch past the table", lambda b: b.rope_batch(z(3, 32), z(3, 16), z(16, 4), z(16, 4), 14)
    yield "cache_store pos = max_ctx", lambda b: b.cache_store(z(2, 16, 8, dtype=f16_), z(2, 16, 8, dtype=f16_),
                                                               z(16), z(16), 16)
    yield "cache_store_batch past the cache", lambda b: b.cache_store_batch(
        z(2, 16, 8, dtype=f16_), z(2, 16, 8, dtype=f16_), z(3, 16), z(3, 16), 14)
    yield "rope_store pos = max_ctx", lambda b: b.rope_store(z(32), z(16), z(16), z(16, 4), z(16, 4),
                                                             z(2, 16, 8, dtype=f16_), z(2, 16, 8, dtype=f16_), 16)
    yield "attention pos = max_ctx", lambda b: b.attention(z(32), z(32), z(2, 16, 8, dtype=f16_),
                                                           z(2, 16, 8, dtype=f16_), 16)
    yield "attention window negative", lambda b: b.attention(z(32), z(32), z(2, 16, 8, dtype=f16_),
                                                             z(2, 16, 8, dtype=f16_), 3, -1)
    yield "attention_batch past the cache", lambda b: b.attention_batch(
        z(3, 32), z(3, 32), z(2, 16, 8, dtype=f16_), z(2, 16, 8, dtype=f16_), 14)
    yield "attention_batch window negative", lambda b: b.attention_batch(
        z(3, 32), z(3, 32), z(2, 16, 8, dtype=f16_), z(2, 16, 8, dtype=f16_), 0, -1)
    yield "gate_up act unknown", lambda b: b.gate_up(z(4), z(4, 8, dtype=f16_), z(4, 8, dtype=f16_), z(8), "relu")
    yield "gate_up_batch act unknown", lambda b: b.gate_up_batch(z(3, 4), z(4, 8, dtype=f16_),
                                                                 z(4, 8, dtype=f16_), z(3, 8), "gelu")
    yield "matvec shapes", lambda b: b.matvec(z(4), z(4, 8, dtype=f16_), z(9))
    yield "matmul shapes", lambda b: b.matmul(z(3, 5), z(4, 8, dtype=f16_), z(3, 8))


@pytest.mark.parametrize("name,call", list(_bad_calls()), ids=[n for n, _ in _bad_calls()])
def test_bad_arguments(be, name, call):
    with pytest.raises(InvalidArgumentError):
        call(be)
    be.synchronize()                    # nothing was left half-launched


# -- memory helpers ----------------------------------------------------------------------------
def test_upload_roundtrip_and_fit(be):
    a = f16(13, 7)
    np.testing.assert_array_equal(host(be, be.upload(a)), a)
    e = be.empty((3, 5), np.float16)
    assert e.shape == (3, 5) and e.dtype == np.float16
    with pytest.raises(CyllmError):
        be.check_fits(1 << 50)
    be.check_fits(1 << 20)


def test_copy_bandwidth(be):
    gbs = be.measure_copy_bandwidth(64 << 20, iters=5)
    assert 10 < gbs < 100_000


# -- CUDA-graph decode --------------------------------------------------------------------------
# -- CUDA-graph decode, through cyllm's own Model (model.py) ---------------------------------
def tiny_model(backend, context=70, fuse_qkv=True):
    """cyllm's Model on the synthetic 'tiny' preset (4 heads / 2 KV heads of 16, vocab 256)."""
    from cyllm.model import Model
    from cyllm.tools.synthetic import build_synthetic
    config, weights = build_synthetic("tiny", seed=7)
    if backend.name == "cuda":
        backend.fuse_qkv = fuse_qkv
    return Model.from_weights(config, weights, backend=backend, context=context)


def eager_logits(m, token, pos):
    """Issue the model's ops directly, bypassing decode_step's graph."""
    m._issue_forward_ops(token, pos)
    return m.backend.to_host(m.state.logits).copy()


@pytest.mark.parametrize("graphs", [True, False])
def test_decode_step_matches_eager(ref, graphs):
    tokens = [5, 255, 0, 17, 17, 250, 42, 1, 99, 3]
    graph_b = CudaBackend()
    graph_b.use_graphs = graphs
    eager_m, graph_m, ref_m = tiny_model(CudaBackend()), tiny_model(graph_b), tiny_model(ref)
    for pos, tok in enumerate(tokens):
        le = eager_logits(eager_m, tok, pos)
        lg = graph_m.forward(tok, pos).copy()
        lr = ref_m.forward(tok, pos)
        assert rel_err(lg, le) < 1e-6, f"pos {pos}"
        assert rel_err(lg, lr) < 1e-3, f"pos {pos}"
    assert (graph_b._graph is not None) == graphs
    # the backend checks what it reads on the device, whatever the caller checked before
    with pytest.raises(InvalidArgumentError):
        graph_b.decode_step(graph_m._issue_forward_ops, 256, len(tokens))
    with pytest.raises(InvalidArgumentError):
        graph_b.decode_step(graph_m._issue_forward_ops, 1, 70)


def test_decode_step_jumps_positions():
    """A graph captured at one position replays right at any other (pos is read on the device)."""
    m1, m2 = tiny_model(CudaBackend(), context=600), tiny_model(CudaBackend(), context=600)
    for pos, tok in [(0, 1), (1, 2), (2, 3), (300, 4), (599, 5), (3, 6)]:
        le = eager_logits(m1, tok, pos)
        assert rel_err(m2.forward(tok, pos), le) < 1e-6, f"pos {pos}"


def test_decode_step_fused_views():
    """Graph replay through views of one qkv buffer (fused q/k/v) matches separate q/k/v matvecs."""
    m1, m2 = tiny_model(CudaBackend(), fuse_qkv=False), tiny_model(CudaBackend(), fuse_qkv=True)
    assert m1.layers[0].wqkv is None and m2.layers[0].wqkv is not None
    for pos, tok in enumerate([3, 1, 4, 1, 5, 9, 2, 6]):
        l1 = m1.forward(tok, pos).copy()
        # separate k/v matvecs read the normed vector, the fused one folds the norm: rounding differs
        # (and the f16 KV cache turns last-bit differences into f16 rounding flips)
        assert rel_err(m2.forward(tok, pos), l1) < 1e-3, f"pos {pos}"
    assert m2.backend._graph is not None


# -- a mixture of experts' decode: the layer's pre-norm taken into the router's kernel -------
@pytest.mark.parametrize("fmt,E,k,f,n", [("q4_0", 16, 4, 64, 256), ("q8_0", 6, 2, 96, 2048),
                                        ("q8_0", 40, 8, 64, 4608),      # rows past the early 16 words a lane
                                        ("q8_0", 4, 2, 32, 13312)])     # x past 48 KiB of shared memory
def test_moe_takes_the_held_norm(ref, fmt, E, k, f, n):
    """rmsnorm(xb, x) then moe(x, xb): the norm folded into moe_route_f32 gives, to the bit, the
    stream and xb of the norm launched on its own (fuse_norm off), and the numpy choice."""
    from cyllm.backends.moe import MoeScratch
    from cyllm.quant import FORMATS, QuantMatrix
    from cyllm.quant.convert import quantize_rows_f32

    def q(d, m):
        w = RNG.standard_normal((d, m)).astype(np.float32) * 0.1
        return QuantMatrix(quantize_rows_f32(w, fmt), FORMATS[fmt], (d, m))

    trios = [(q(f, n), q(f, n), q(n, f)) for _ in range(E)]
    x, nw = f32(n, scale=2.0), f32(n)
    router = f32(E, n, scale=n ** -0.5)
    runs = []
    for fold in (True, False):
        b = CudaBackend()
        b.fuse_norm = fold
        experts, rd = b.upload_experts(trios), b.upload(router)
        scratch = MoeScratch.allocate(b, 1, n, f, E, k, False)
        xd, xb = b.upload(x), nan_dev(n)
        b.rmsnorm(xb, xd, b.upload(nw), 1e-6)
        assert (b._pending_norm is not None) == fold
        b.moe(xd, xb, rd, experts, k, True, "silu", scratch)
        assert b._pending_norm is None
        runs.append((host(b, xd), host(b, xb), host(b, scratch.dev.ids)))
    for got, want in zip(*runs):
        np.testing.assert_array_equal(got, want)
    xn = np.zeros(n, np.float32)
    ref.rmsnorm(xn, x, nw, 1e-6)
    assert rel_err(runs[0][1], xn) < 1e-6
    want = x.copy()
    ref.moe(want, xn, router, [tuple(ref.upload(m) for m in t) for t in trios], k, True, "silu",
            MoeScratch.allocate(ref, 1, n, f, E, k, False))
    assert rel_err(runs[0][0], want) < 2e-2


# -- a mixture of experts' prefill: the choice of each row and the grouping by expert ---------
@pytest.mark.parametrize("E,entries,C", [(1, 1, 16), (5, 37, 32), (300, 4096, 16), (1024, 700, 32), (8, 4096, 32)])
def test_moe_group_sorts_by_expert(be, E, entries, C):
    """moe_group against numpy: a stable sort of the entries by expert, its inverse, and the
    work list of at most C positions of one expert each, experts in order (skewed ids: some
    experts get many entries, most none)."""
    from cyllm.backends.cuda.experts import GROUP_THREADS, max_groups
    from cyllm.backends.cuda.kernel_names import MOE_KERNELS
    from cyllm.backends.cuda.quant import allow_smem
    rng = np.random.default_rng(E * 7 + entries)
    ids = np.minimum((rng.pareto(1.0, entries) * 3).astype(np.int64), E - 1).astype(np.int32)
    groups = max_groups(entries, E, C)
    slots, pos = cp.full(entries, -1, cp.int32), cp.full(entries, -1, cp.int32)
    work, n_work = cp.full((groups, 4), -1, cp.int32), cp.zeros(1, cp.int32)
    k = be._k(MOE_KERNELS["group"])
    smem = 4 * (entries + 3 * E)
    allow_smem(k, smem)
    k((1,), (GROUP_THREADS,), (slots, pos, work, n_work, cp.asarray(ids), np.int32(entries), np.int32(E),
                               np.int32(C)), shared_mem=smem)
    order = np.argsort(ids, kind="stable")
    np.testing.assert_array_equal(slots.get(), order)
    np.testing.assert_array_equal(pos.get()[order], np.arange(entries))
    want = []
    counts = np.bincount(ids, minlength=E)
    start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    for e in range(E):
        want += [(e, start[e] + g, min(C, counts[e] - g)) for g in range(0, counts[e], C)]
    assert int(n_work.get()[0]) == len(want) <= groups
    np.testing.assert_array_equal(work.get()[:len(want), :3], np.array(want).reshape(-1, 3))


@pytest.mark.parametrize("E,k,norm", [(6, 2, True), (300, 8, True), (1024, 3, False), (4, 4, True),
                                      (300, 40, True), (64, 33, False)])    # ranks past a warp's lanes
def test_moe_route_rows_matches_the_host(be, E, k, norm):
    """moe_route_rows (prefill's choice of each row from the router's logits) against
    backends/moe.py route(): the same experts, best first, equal scores going to the lower id,
    and weights to float32 rounding."""
    from cyllm.backends import moe
    from cyllm.backends.cuda.experts import ROUTE_THREADS
    from cyllm.backends.cuda.kernel_names import MOE_KERNELS
    T = 9
    logits = f32(T, E, scale=3.0)
    logits[1, :] = 0.5                          # all equal: ids 0..k-1
    logits[2, E // 2:] = logits[2, :E - E // 2]  # pairs of equal scores
    ids, weights = cp.full(T * k, -1, cp.int32), cp.full(T * k, np.nan, cp.float32)
    be._k(MOE_KERNELS["route_rows"])((T,), (ROUTE_THREADS,), (ids, weights, cp.asarray(logits), np.int32(E),
                                                             np.int32(k), np.int32(norm)))
    for t in range(T):
        want_ids, want_w = np.zeros(k, np.int64), np.zeros(k, np.float32)
        moe.route(logits[t].copy(), k, norm, want_ids, want_w)
        np.testing.assert_array_equal(ids.get()[t * k:(t + 1) * k], want_ids)
        np.testing.assert_allclose(weights.get()[t * k:(t + 1) * k], want_w, rtol=1e-5)
