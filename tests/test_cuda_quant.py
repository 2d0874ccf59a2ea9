"""Quantized weights on the CUDA backend (backends/cuda/quant.py, cuda/quant_matvec.cu).

Host-side (no GPU needed): the upload repack is a pure reordering (round trip), every
byte sits where the kernels' address formulas read it, and the kernel table of the .cu
file agrees with the Python one.

On a GPU (marked cuda): every format and variant against NumPy references of the block
math on awkward shapes -- rows not a multiple of the 32-row tile, one block per row, many
blocks, warps with no items. Two references: exact (the dequantized weights times the
int8-quantized activation, float64: only the kernels' float32 sums differ, and one wrong
element shows), and plain float (dequantize-then-matvec, where the activation rounding
is the only difference). The rmsnorm folded into each variant, decode through a captured
CUDA graph (with programmatic dependent launch) replayed on new inputs, the prefill
GEMM on dequantized tiles, embedding lookups. Outputs are poisoned with NaN first.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from cyllm.backends.cuda import quant as CQ
from cyllm.backends.cuda import widen as WD
from cyllm.errors import InvalidArgumentError
from cyllm.quant import FORMATS, QuantMatrix
from cyllm.quant import reference as R

FMTS = list(CQ.SUPPORTED)
CU = Path(__file__).resolve().parents[1] / "cuda" / "quant_matvec.cu"

# f16 fields of each block: (byte offset, scale of the random value, sign)
_F16_FIELDS = {
    "q8_0": [(0, 0.02, 1)], "q4_0": [(0, 0.02, 1)], "q4_1": [(0, 0.02, 1), (2, 0.15, -1)],
    "q5_0": [(0, 0.02, 1)], "q5_1": [(0, 0.01, 1), (2, 0.15, -1)],
    "q4_k": [(0, 0.002, 1), (2, 0.004, 1)], "q5_k": [(0, 0.001, 1), (2, 0.004, 1)],
    "q6_k": [(208, 0.0003, 1)],
}


def random_blocks(fmt: str, rows: int, cols: int, rng) -> np.ndarray:
    """(rows, row_bytes) uint8: random bytes (every code, scale and bit pattern) with finite f16 scales."""
    f = FORMATS[fmt]
    nbi = cols // f.block
    raw = rng.integers(0, 256, (rows, nbi, f.block_bytes), dtype=np.uint8)
    for off, scale, sign in _F16_FIELDS[fmt]:
        v = (sign * scale * rng.uniform(0.2, 1.0, (rows, nbi))).astype("<f2")
        raw[:, :, off:off + 2] = v.view(np.uint8).reshape(rows, nbi, 2)
    return raw.reshape(rows, nbi * f.block_bytes)


def deq64(data: np.ndarray, fmt: str, cols: int) -> np.ndarray:
    """(rows, cols) float64 weights from the integer/scale components of reference.decode."""
    c = R.decode(data, fmt)
    rows = data.shape[0]
    q = c["q"].astype(np.float64)
    d = c["d"].astype(np.float64)
    if FORMATS[fmt].block == 32:
        w = d[:, None] * q
        if "m" in c:
            w = w + c["m"].astype(np.float64)[:, None]
    elif fmt == "q6_k":
        sc = np.repeat(c["sc"].astype(np.float64), 16, axis=1)
        w = d[:, None] * sc * q
    else:
        sc = np.repeat(c["sc"].astype(np.float64), 32, axis=1)
        m = np.repeat(c["m"].astype(np.float64), 32, axis=1)
        w = d[:, None] * sc * q - c["dmin"].astype(np.float64)[:, None] * m
    return w.reshape(rows, cols)


def xq64(x: np.ndarray) -> np.ndarray:
    """x as the decode kernels see it, for every weight format: rounded to int8 blocks of 32
    (reference.quantize_act's q8_0; the K-quants too, whose dots take a d per 32-entry, so a
    vector prequantized by the matvec that wrote it rounds alike), float64."""
    a = R.quantize_act(x, "q8_0")
    return (a["q"].reshape(-1, 32).astype(np.float64) * a["d"].astype(np.float64)[:, None]).reshape(-1)


# -- host side ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FMTS)
def test_repack_round_trip(fmt):
    rng = np.random.default_rng(7)
    b = FORMATS[fmt].block
    for rows in (1, 5, 31, 32, 33, 70):
        for nbi in (1, 3):
            raw = random_blocks(fmt, rows, nbi * b, rng)
            flat = CQ.repack(np, raw, fmt)
            assert flat.shape == (raw.size,)
            np.testing.assert_array_equal(CQ.unpack(np, flat, fmt, rows, nbi * b), raw)


def test_repack_into_given_buffer():
    """repack writes into the buffer it is given (the upload's pool array) and returns it;
    a buffer of the wrong size or type is refused before anything is written."""
    rng = np.random.default_rng(5)
    raw = random_blocks("q4_k", 40, 512, rng)
    want = CQ.repack(np, raw, "q4_k")
    buf = np.full(raw.size, 7, np.uint8)
    assert CQ.repack(np, raw, "q4_k", out=buf) is buf
    np.testing.assert_array_equal(buf, want)
    for bad in (np.zeros(raw.size - 1, np.uint8), np.zeros(raw.size, np.int8)):
        with pytest.raises(InvalidArgumentError):
            CQ.repack(np, raw, "q4_k", out=bad)


def _kernel_reads(fmt, d, nbi, row, s):
    """Byte ranges the kernels read for item s of `row` (qgeo / qload of quant_matvec.cu), in the
    order of the block fields they stand for: units, plane A, plane B."""
    units, main, pa, pb, _ = CQ.LAYOUTS[fmt]
    ea = 0 if pa is None else pa[1] - pa[0]
    eb = 0 if pb is None else pb[1] - pb[0]
    tile, lane = divmod(row, 32)
    w = min(32, d - 32 * tile)
    t0 = 32 * tile * nbi
    items = d * nbi
    out = [(t0 * units * 16 + ((s * units + j) * w + lane) * 16, 16) for j in range(units)]
    if ea:
        out.append((items * units * 16 + t0 * ea + (s * w + lane) * ea, ea))
    if eb:
        out.append((items * (units * 16 + ea) + t0 * eb + (s * w + lane) * eb, eb))
    return out


@pytest.mark.parametrize("fmt", FMTS)
def test_repack_matches_kernel_addressing(fmt):
    rng = np.random.default_rng(11)
    f = FORMATS[fmt]
    units, main, pa, pb, _ = CQ.LAYOUTS[fmt]
    fields = [(main[0] + 16 * j, main[0] + 16 * j + 16) for j in range(units)]
    fields += [r for r in (pa, pb) if r is not None]
    for d, nbi in ((1, 2), (45, 3), (64, 1), (97, 2)):
        raw = random_blocks(fmt, d, nbi * f.block, rng).reshape(d, nbi, f.block_bytes)
        flat = CQ.repack(np, raw.reshape(d, -1), fmt)
        for row in {0, d - 1, d // 2, min(d - 1, 33)}:
            for s in range(nbi):
                for (off, n), (lo, hi) in zip(_kernel_reads(fmt, d, nbi, row, s), fields):
                    assert n == hi - lo
                    np.testing.assert_array_equal(flat[off:off + n], raw[row, s, lo:hi])
        # every byte of the block is read exactly once
        covered = np.zeros(f.block_bytes, int)
        for lo, hi in fields:
            covered[lo:hi] += 1
        assert covered.tolist() == [1] * f.block_bytes


@pytest.mark.parametrize("fmt", FMTS)
def test_expert_stack_addressing(fmt):
    """A role's experts back to back, each repacked on its own (upload_expert_stack): expert e's
    bytes start at e * stride, the offset the qmv_experts_* kernels add to every plane pointer,
    so the single-matrix address formulas read expert e's blocks; ExpertStack.matrix(e) is
    that slice, with the expert's shape."""
    rng = np.random.default_rng(13)
    f = FORMATS[fmt]
    units, main, pa, pb, _ = CQ.LAYOUTS[fmt]
    fields = [(main[0] + 16 * j, main[0] + 16 * j + 16) for j in range(units)]
    fields += [r for r in (pa, pb) if r is not None]
    E, d, nbi = 5, 45, 2
    raws = [random_blocks(fmt, d, nbi * f.block, rng) for _ in range(E)]
    flat = np.concatenate([CQ.repack(np, r, fmt) for r in raws])
    stack = CQ.ExpertStack(flat, f, d, nbi * f.block, E)
    assert stack.stride * E == flat.size and stack.nbi == nbi
    for e in (0, 3, E - 1):
        view = stack.matrix(e)
        assert view.shape == (d, nbi * f.block) and view.data.size == stack.stride
        np.testing.assert_array_equal(CQ.unpack(np, view.data, fmt, d, nbi * f.block), raws[e])
        raw = raws[e].reshape(d, nbi, f.block_bytes)
        for row in (0, 33, d - 1):
            for (off, n), (lo, hi) in zip(_kernel_reads(fmt, d, nbi, row, nbi - 1), fields):
                got = flat[e * stack.stride + off:e * stack.stride + off + n]
                np.testing.assert_array_equal(got, raw[row, nbi - 1, lo:hi])


def test_expert_roles_that_stack():
    """Which experts the cuda backend uploads as one stack a role (experts.py, _role_kind):
    quantized of one format and shape the kernels have, or float16 of one shape whose rows are
    whole 16-byte loads; anything else keeps one upload an expert (and the host routing)."""
    from cyllm.backends.cuda.experts import _role_kind, stack_kinds
    from cyllm.quant.convert import quantize_matrix
    rng = np.random.default_rng(2)

    def q(rows, cols, fmt):
        return quantize_matrix(rng.standard_normal((rows, cols)).astype(np.float16), fmt)

    assert _role_kind([q(64, 96, "q8_0") for _ in range(3)]) == "quant"
    assert _role_kind([q(64, 96, "q8_0"), q(64, 96, "q4_0")]) is None         # two formats
    assert _role_kind([q(64, 96, "q8_0"), q(32, 96, "q8_0")]) is None         # two shapes
    assert _role_kind([np.zeros((40, 64), np.float16)] * 3) == "f16"
    assert _role_kind([np.zeros((40, 60), np.float16)] * 3) is None           # rows of 60 halves
    assert _role_kind([np.zeros((40, 64), np.float32)] * 3) is None
    assert _role_kind([np.zeros((64, 96), np.float16), q(64, 96, "q8_0")]) is None
    # gate and up run in one launch: one kind, format and shape; down on its own terms
    gate, down = [q(64, 256, "q4_k")] * 2, [np.zeros((256, 64), np.float16)] * 2
    assert stack_kinds([gate, [q(64, 256, "q4_k")] * 2, down]) == ["quant", "quant", "f16"]
    assert stack_kinds([gate, [q(64, 256, "q5_k")] * 2, down]) is None
    assert stack_kinds([gate, [np.zeros((64, 256), np.float16)] * 2, down]) is None
    assert stack_kinds([[np.zeros((64, 256), np.float16)] * 2, [np.zeros((32, 256), np.float16)] * 2, down]) is None
    assert stack_kinds([gate, gate, [np.zeros((256, 60), np.float16)] * 2]) is None


def test_kernel_table_agrees():
    """Every kernel name cuda_quant builds is written whole in the .cu file, and the format
    traits (units, plane sizes, items in flight) match LAYOUTS."""
    src = CU.read_text()
    for fmt in FMTS:
        names = [f"{p}{fmt}{s}" for p in ("qmv_", "qmv_add_", "qmv_gate_up_silu_", "qmv_gate_up_gelu_")
                 for s in ("", "_norm")] + [f"qdeq_f16_{fmt}", f"qrows_f32_{fmt}"]
        names += [f"{p}{fmt}{s}" for p in ("qmv_qkv_", "qmv_qkv_rope_") for s in ("", "_norm")]
        names += [f"qmm_c{c}_{fmt}" for c in CQ.QMM_COLUMNS] + [f"qmma{c}_{fmt}" for c in CQ.QMMA_COLUMNS]
        names += [prefix + fmt for prefix in CQ._EXPERT_KERNELS.values()]
        names += [f"qmma{c}_experts_{fmt}" for c in CQ.QMMA_COLUMNS]
        # defined in the format's own module (-DQMV_<fmt>), where quant.kernel looks for them
        block = re.search(rf"#if defined\(QMV_ALL\) \|\| defined\(QMV_{fmt}\)\n(.*?)#endif", src, re.S)
        assert block, fmt
        for name in names:
            assert re.search(rf"\({name},", block.group(1)), name
        m = re.search(rf"struct QF_{fmt} {{ enum {{ UPI = (\d+),\s*EA = (\d+), EB = (\d+), IE = (\d+),\s*B = (\d+)", src)
        assert m, fmt
        upi, ea, eb, ie, u = map(int, m.groups())
        units, main, pa, pb, uu = CQ.LAYOUTS[fmt]
        assert (upi, ie, u) == (units, FORMATS[fmt].block, uu)
        assert ea == (0 if pa is None else pa[1] - pa[0]) and eb == (0 if pb is None else pb[1] - pb[0])
        assert main[1] - main[0] == 16 * units
        # the host's chunk of qmma (its shared memory) is the kernels' QmmaChunk
        kc = ie if ie > 32 else (128 if upi == 2 else 256)
        assert CQ._qmma_chunk(FORMATS[fmt]) == kc, fmt
    assert re.search(r"KC = F::IE > 32 \? F::IE : \(F::UPI == 2 \? 128 : 256\)", src)
    for name in ("qmv_qkv_pair", "qmv_qkv_pair_norm", "qmv_qkv_rope_pair", "qmv_qkv_rope_pair_norm"):
        assert re.search(rf"\({name},", src), name
    assert re.search(r'extern "C" __global__ void qx_rows\(', src)
    # each of them has its prequantized twin NAME_qx (prequant.py), made by the defining macro
    for mac in ("QMV", "QMV_QKV", "QMV_QKV_PAIR", "QMV_QKV_ROPE", "QMV_QKV_ROPE_PAIR"):
        assert re.search(rf"#define CYLLM_{mac}_DEF\(.*\n\s*CYLLM_{mac}_DEF1\(NAME##_qx,", src), mac


def test_stack_rows_rule():
    """Which q, k, v become one decode launch: one format always; v of its own format only
    where the three fit one wave of blocks and neither format is q5_k or q6_k; never k of
    another format than q, nor v of another height than k."""
    mk = lambda fmt, rows, cols=576: CQ.CudaQuantMatrix(None, FORMATS[fmt], rows, cols)   # noqa: E731
    same = CQ.stack_rows((mk("q5_0", 576), mk("q5_0", 192), mk("q5_0", 192)), sm_count=1)
    assert same is not None and same.fmt_v is same.fmt            # 30 tiles, one format: any sm_count
    pair = (mk("q5_0", 576), mk("q5_0", 192), mk("q8_0", 192))   # 18 + 6 + 6 tiles
    assert CQ.stack_rows(pair, sm_count=30).fmt_v.name == "q8_0"
    assert CQ.stack_rows(pair, sm_count=29) is None
    assert CQ.stack_rows((mk("q4_k", 512, 512), mk("q4_k", 128, 512), mk("q6_k", 128, 512)), sm_count=132) is None
    assert CQ.stack_rows((mk("q6_k", 512, 512), mk("q6_k", 128, 512), mk("q8_0", 128, 512)), sm_count=132) is None
    assert CQ.stack_rows((mk("q5_0", 576), mk("q8_0", 192), mk("q5_0", 192)), sm_count=132) is None
    assert CQ.stack_rows((mk("q5_0", 576), mk("q5_0", 192), mk("q8_0", 128)), sm_count=132) is None


def test_rope_fold_rule():
    """Where the q/k/v matvec takes rope in its tail (quant.rope_fold_pays), on an H100's 132
    SMs: the 7B shape's Q4_0 and Q4_K_M (4 warps a tile: measured faster), not its Q8_0 (8
    warps a tile: 16-warp blocks in two waves, measured slower); every format of a small
    model (one wave)."""
    from types import SimpleNamespace
    be = SimpleNamespace(sm_count=132, qmv_warps=None)

    def stack(fmt, dim, q_rows, kv_rows):
        mk = lambda rows: CQ.CudaQuantMatrix(None, FORMATS[fmt], rows, dim)   # noqa: E731
        return CQ.CudaQuantStack((mk(q_rows), mk(kv_rows), mk(kv_rows)))

    assert CQ.rope_fold_pays(be, stack("q4_0", 4096, 4096, 4096))
    assert CQ.rope_fold_pays(be, stack("q4_k", 4096, 4096, 4096))
    assert not CQ.rope_fold_pays(be, stack("q8_0", 4096, 4096, 4096))
    for fmt in ("q8_0", "q4_0", "q4_1", "q5_0"):
        assert CQ.rope_fold_pays(be, stack(fmt, 576, 576, 192))      # SmolLM2-135M


def test_balanced_carveout_rule():
    """The gate+up carveout of the 32-element 4/5-bit formats holds ceil(tiles / SMs) blocks (with the
    driver's reserve each) and is the smallest percent that does; -1 (the driver's) when the
    device did not say its capacity, 100 at most."""
    from types import SimpleNamespace
    cap = 228 * 1024                                 # an H100's or H200's shared memory an SM
    be = SimpleNamespace(sm_count=132, smem_per_sm=cap, smem_reserved_per_block=1024)
    smem = CQ._shared_bytes(4096, 4, 2)
    assert CQ._balanced_carveout(be, smem, 344) == 11           # Llama-2-7B's q4_0 gate+up: 3 blocks
    for tiles in (133, 264, 265, 344, 396, 397, 2000):
        for sm in (512, smem, 20000, 48 * 1024):
            pct = CQ._balanced_carveout(be, sm, tiles)
            need = -(-tiles // 132) * (sm + 1024)
            if need <= cap:
                assert pct * cap >= 100 * need > (pct - 1) * cap, (tiles, sm, pct)
            else:
                assert pct == 100
    assert CQ._balanced_carveout(SimpleNamespace(sm_count=132, smem_per_sm=0), smem, 344) == -1


class _Kern:
    """A kernel's carveout attribute, and every write to it."""
    def __init__(self):
        object.__setattr__(self, "writes", [])

    def __setattr__(self, name, value):
        assert name == "preferred_shared_memory_carveout"
        self.writes.append(value)


def test_matvec_carveout_by_format():
    """The K-quants' matvecs ask for the largest carveout; q8_0 and the 32-element 4/5-bit
    formats leave it to the driver (-1) unless a rule passes a value (the balanced gate+up,
    test_balanced_carveout_rule): Llama-2-7B Q8_0 decode ran 4.8% faster at depth 0 and 6.4%
    at 4096 that way on an H200 (twenty-sixth session)."""
    from types import SimpleNamespace
    be = SimpleNamespace(_matvec_carveout=None)
    for fmt, want in (("q4_k", 100), ("q5_k", 100), ("q6_k", 100), ("q8_0", -1), ("q4_0", -1),
                      ("q4_1", -1), ("q5_0", -1), ("q5_1", -1)):
        CQ._CARVEOUT.clear()
        mv = _Kern()
        CQ._carveout(be, mv, fmt)
        assert mv.writes == [want], fmt
    CQ._CARVEOUT.clear()


def test_decode_kernels_follow_the_k_quant_carveout():
    """Attention and rope_store take the carveout of the quantized matvec launched last when it
    is a K-quant's (the largest), and the driver's (-1) again after a q8_0 or q4_0 matvec, an
    FP16 one, or with match_carveout off; the attribute is written only when it changes."""
    from types import SimpleNamespace
    from cyllm.backends.cuda.backend import CudaBackend

    attn, mv = _Kern(), _Kern()
    be = SimpleNamespace(_matvec_carveout=None, match_carveout=True, _k=lambda name: attn,
                         _flush=lambda: None)
    follow = lambda: CudaBackend._same_carveout(be, "attn")       # noqa: E731
    CQ._CARVEOUT.clear()
    now = None
    for fmt, want in (("q4_k", 100), ("q6_k", 100), ("q8_0", -1), ("q4_0", -1), ("q5_k", 100), ("q4_0", -1)):
        CQ._carveout(be, mv, fmt)
        n0 = len(attn.writes)
        assert follow() is attn
        follow()
        assert attn.writes[n0:] == ([] if want == now else [want]), fmt
        now = want
    CQ._carveout(be, mv, "q4_k")
    follow()
    assert attn.writes[-1] == 100
    with pytest.raises(InvalidArgumentError):         # an FP16 matvec (refused here) resets the rule
        CudaBackend._mv(be, "matvec", np.zeros(4, np.float32), np.zeros((4, 8), np.float16), None,
                        np.zeros(7, np.float32), 4)
    follow()
    assert attn.writes[-1] == -1
    CQ._carveout(be, mv, "q4_k")
    be.match_carveout = False
    follow()
    assert attn.writes[-1] == -1
    CQ._CARVEOUT.clear()


def test_widen_keeps_every_value():
    """q5_0 blocks widened to q8_0 hold the same values: random bytes give every code and
    fifth-bit pattern; the codes lose their offset and the f16 scale is copied."""
    rng = np.random.default_rng(11)
    for rows, cols in ((1, 32), (7, 96), (33, 576)):
        raw = random_blocks("q5_0", rows, cols, rng)
        wide = WD.widen_q8_0(np, raw)
        assert wide.shape == (rows, cols // 32 * 34) and wide.dtype == np.uint8
        assert wide.nbytes == WD.widened_bytes(rows, cols)
        a, b = R.decode(raw, "q5_0"), R.decode(wide, "q8_0")
        np.testing.assert_array_equal(b["q"], a["q"])
        np.testing.assert_array_equal(b["d"], a["d"])
        np.testing.assert_array_equal(deq64(wide, "q8_0", cols), deq64(raw, "q5_0", cols))


def test_widen_rule():
    """Which matrices are uploaded as q8_0: small q5_0 ones only, and q, k and v of one width
    alike (they are one launch only when their formats agree)."""
    q5 = FORMATS["q5_0"]
    sm, cap = 132, 24
    # SmolLM2-135M (H100/H200: 132 multiprocessors): every layer matrix, not the 49152-row table
    for rows, cols in ((576, 576), (192, 576), (1536, 576), (576, 1536)):
        assert WD.widens(q5, rows, cols, sm, cap)
    assert WD.widens(q5, 2560, 960, sm, cap) and not WD.widens(q5, 960, 2560, sm, cap)   # SmolLM2-360M
    assert not WD.widens(q5, 49152, 576, sm, cap)
    assert not WD.widens(q5, 2048, 2048, sm, cap)                  # Llama-3.2-1B: bytes decide there
    assert not WD.widens(q5, 576, 1536, 16, cap)                   # fewer multiprocessors, less room
    for dim in range(256, 8193, 32):
        for kv in (dim, dim // 4, dim // 8):
            assert WD.widens(q5, kv, dim, sm, cap) == WD.widens(q5, dim, dim, sm, cap), (dim, kv)
    for name in ("q8_0", "q4_0", "q4_1", "q5_1", "q4_k", "q5_k", "q6_k"):
        assert not WD.widens(FORMATS[name], 32, 256, sm, cap)
    assert not WD.widens(q5, 32, 32, sm, 0) and not WD.widens(q5, 32, 32, 0, cap)


def test_references_agree():
    """deq64 (the tests' float64 weights) matches reference.dequantize for every format."""
    rng = np.random.default_rng(3)
    for fmt in FMTS:
        cols = 2 * FORMATS[fmt].block
        raw = random_blocks(fmt, 3, cols, rng)
        np.testing.assert_allclose(deq64(raw, fmt, cols), R.dequantize(raw, fmt, cols), rtol=1e-6, atol=1e-7)


# -- on the GPU -----------------------------------------------------------------------------------
def _cuda():
    from conftest import cuda_available
    if not cuda_available():
        pytest.skip("no CUDA GPU visible")
    import cupy as cp
    return cp


@pytest.fixture(scope="module")
def cp():
    return _cuda()


@pytest.fixture(scope="module")
def be(cp):
    from cyllm.backends.cuda import CudaBackend
    b = CudaBackend()
    b.widen_kib_per_sm = 0      # every format's own kernels (widening: test_small_matrix_widened)
    return b


def shapes(fmt):
    """(rows, cols): one block per row, a row past a tile boundary, many blocks, several tiles."""
    if FORMATS[fmt].block == 32:
        return [(1, 32), (33, 64), (45, 576), (130, 4128), (300, 4096)]
    return [(1, 256), (31, 512), (45, 2816), (97, 11008), (300, 4096)]


def poisoned(cp, n):
    return cp.full(n, np.nan, dtype=cp.float32)


def check_exact(got, want, mag, what):
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got)), f"{what}: non-finite output (unwritten element or bad read)"
    bad = np.abs(got - want) > 2e-5 * mag + 1e-30
    assert not bad.any(), f"{what}: {bad.sum()} rows off, worst {np.max(np.abs(got - want) / mag):.2e} of magnitude"


def rel(got, want) -> float:
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got))
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def silu(v):
    return v / (1.0 + np.exp(-v))


def gelu_tanh(v):
    return 0.5 * v * (1.0 + np.tanh(0.7978845608028654 * (v + 0.044715 * v ** 3)))


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FMTS)
def test_upload_is_the_file_bytes(be, cp, fmt):
    rng = np.random.default_rng(5)
    raw = random_blocks(fmt, 45, 2 * FORMATS[fmt].block, rng)
    w = be.upload(QuantMatrix(raw, fmt, (45, 2 * FORMATS[fmt].block)))
    assert isinstance(w, CQ.CudaQuantMatrix) and w.nbytes == raw.nbytes and w.shape == (45, 2 * FORMATS[fmt].block)
    np.testing.assert_array_equal(CQ.unpack(np, cp.asnumpy(w.data), fmt, *w.shape), raw)


@pytest.mark.cuda
def test_small_matrix_widened(cp):
    """Under the cap a q5_0 matrix is uploaded as q8_0 of the same values and the q8_0
    kernels give its products; over it (or with the cap at 0) it keeps its format."""
    from cyllm.backends.cuda import CudaBackend
    wb = CudaBackend()
    assert wb.widen_kib_per_sm > 0, "widening is on by default"
    rng = np.random.default_rng(29)
    fmt, d, n = "q5_0", 45, 576
    raw = random_blocks(fmt, d, n, rng)
    wb.widen_kib_per_sm = 1 << 20
    w = wb.upload(QuantMatrix(raw, fmt, (d, n)))
    assert (w.fmt.name, w.file_fmt.name) == ("q8_0", fmt)
    assert w.nbytes == WD.widened_bytes(d, n) and w.file_nbytes == raw.nbytes
    np.testing.assert_array_equal(CQ.unpack(np, cp.asnumpy(w.data), "q8_0", d, n),
                                  WD.widen_q8_0(np, raw))
    W = deq64(raw, fmt, n)
    x = rng.standard_normal(n).astype(np.float32)
    xq = xq64(x)
    out = poisoned(cp, d)
    wb.matvec(out, w, wb.upload(x))
    check_exact(wb.to_host(out), W @ xq, np.abs(W) @ np.abs(xq), f"{fmt} widened")
    wb.widen_kib_per_sm = 0
    kept = wb.upload(QuantMatrix(raw, fmt, (d, n)))
    assert kept.fmt.name == kept.file_fmt.name == fmt and kept.nbytes == raw.nbytes


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FMTS)
def test_matvec_variants(be, cp, fmt):
    """out = Wx, out += Wx, silu/gelu gate*up on every shape, and with forced warps per block
    (1: one warp walks the whole row; 3: uneven slices; 16: warps with no items)."""
    rng = np.random.default_rng(abs(hash(fmt)) % 2**32)
    for d, n in shapes(fmt):
        raw = random_blocks(fmt, d, n, rng)
        raw2 = random_blocks(fmt, d, n, rng)
        w = be.upload(QuantMatrix(raw, fmt, (d, n)))
        w2 = be.upload(QuantMatrix(raw2, fmt, (d, n)))
        W, W2 = deq64(raw, fmt, n), deq64(raw2, fmt, n)
        for warps in (None, 1, 3, 16):
            be.qmv_warps = warps
            x = rng.standard_normal(n).astype(np.float32)
            if warps == 3:      # x not 16-byte aligned: the scalar staging path
                xd = be.upload(np.concatenate([[0.0], x]).astype(np.float32))[1:]
            else:
                xd = be.upload(x)
            xq = xq64(x)
            want, mag = W @ xq, np.abs(W) @ np.abs(xq)
            out = poisoned(cp, d)
            be.matvec(out, w, xd)
            got = be.to_host(out).copy()
            check_exact(got, want, mag, f"{fmt} {d}x{n} warps={warps} matvec")
            # against the float product: off by at most the activation rounding (half a step per element)
            step = np.repeat(np.abs(x).reshape(-1, 32).max(axis=1) / 127.0, 32)
            assert np.all(np.abs(got - W @ x.astype(np.float64)) <= 0.5 * np.abs(W) @ step + 2e-5 * mag)
            base = rng.standard_normal(d).astype(np.float32)
            out = be.upload(base)
            be.matvec_add(out, w, xd)
            check_exact(be.to_host(out), base + want, mag + np.abs(base), f"{fmt} {d}x{n} add")
            want2, mag2 = W2 @ xq, np.abs(W2) @ np.abs(xq)
            for act, fn in (("silu", silu), ("gelu_tanh", gelu_tanh)):
                out = poisoned(cp, d)
                be.gate_up(out, w, w2, xd, act)
                g = be.to_host(out).copy()
                ref = fn(want) * want2
                # the product's error: from each factor, relative to its magnitude
                tol = 1e-4 * (np.abs(want2) * (mag + 1) + np.abs(want) * mag2) + 1e-6 * np.abs(ref)
                assert np.all(np.abs(g - ref) <= tol + 1e-12), (fmt, d, n, warps, act)
        be.qmv_warps = None


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FMTS)
def test_realistic_weights(be, cp, fmt):
    """Weights from the reference quantizer (llama.cpp's) of Gaussian rows: the float result
    is close to the unquantized product's dequantized counterpart."""
    rng = np.random.default_rng(17)
    d, n = 37, 2 * FORMATS[fmt].block if FORMATS[fmt].block == 256 else 96
    wf = (rng.standard_normal((d, n)) * 0.05).astype(np.float32)
    raw = R.quantize(wf, fmt)
    w = be.upload(QuantMatrix(raw, fmt, (d, n)))
    x = rng.standard_normal(n).astype(np.float32)
    out = poisoned(cp, d)
    be.matvec(out, w, be.upload(x))
    W = deq64(raw, fmt, n)
    xq = xq64(x)
    check_exact(be.to_host(out), W @ xq, np.abs(W) @ np.abs(xq), f"{fmt} realistic")


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FMTS)
def test_norm_folded(be, cp, fmt):
    """rmsnorm then each matvec variant: the norm is folded in (no rmsnorm launch) and its
    output still written."""
    rng = np.random.default_rng(23)
    eps = 1e-5
    for d, n in shapes(fmt)[1:4]:
        raw, raw2 = random_blocks(fmt, d, n, rng), random_blocks(fmt, d, n, rng)
        w = be.upload(QuantMatrix(raw, fmt, (d, n)))
        w2 = be.upload(QuantMatrix(raw2, fmt, (d, n)))
        W, W2 = deq64(raw, fmt, n), deq64(raw2, fmt, n)
        x = (rng.standard_normal(n) * 3).astype(np.float32)
        nw = rng.uniform(0.5, 1.5, n).astype(np.float32)
        inv = 1.0 / np.sqrt(np.mean(x.astype(np.float64) ** 2) + eps)
        xq = xq64(x * nw)                                   # the kernel quantizes x * nw
        want, mag = inv * (W @ xq), inv * (np.abs(W) @ np.abs(xq))
        want2 = inv * (W2 @ xq)
        xd, nwd = be.upload(x), be.upload(nw)
        for mode in ("matvec", "add", "gate_up"):
            xb = poisoned(cp, n)
            out = poisoned(cp, d) if mode != "add" else be.upload(np.ones(d, np.float32))
            be.rmsnorm(xb, xd, nwd, eps)
            assert be._pending_norm is not None
            if mode == "matvec":
                be.matvec(out, w, xb)
            elif mode == "add":
                be.matvec_add(out, w, xb)
            else:
                be.gate_up(out, w, w2, xb, "silu")
            assert be._pending_norm is None
            got = be.to_host(out).copy()
            if mode == "matvec":
                check_exact(got, want, mag, f"{fmt} norm+matvec")
            elif mode == "add":
                check_exact(got, 1.0 + want, mag + 1.0, f"{fmt} norm+add")
            else:
                assert rel(got, silu(want) * want2) < 1e-4
            np.testing.assert_allclose(be.to_host(xb), x * inv * nw, rtol=2e-6, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FMTS)
def test_qkv_stack(be, cp, fmt):
    """q, k, v of one format stacked (one qmv_qkv launch): out = [Wq x | Wk x | Wv x], with and
    without the folded norm; q's height not a multiple of the tile, k/v a few tiles; a v of
    another format stacks only where the three fit one wave (qmv_qkv_pair); a v taller than
    k gives no stack."""
    rng = np.random.default_rng(29)
    b = FORMATS[fmt].block
    n, dq, dk = 3 * b if b == 256 else 576, 70, 40
    eps = 1e-5
    raws = [random_blocks(fmt, d, n, rng) for d in (dq, dk, dk)]
    mats = tuple(be.upload(QuantMatrix(r, fmt, (r.shape[0], n))) for r in raws)
    stack = be.stack_rows(mats)
    assert stack is not None and stack.shape == (dq + 2 * dk, n) and stack.nbytes == 0
    W = np.concatenate([deq64(r, fmt, n) for r in raws])
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, n).astype(np.float32)
    xd, nwd = be.upload(x), be.upload(nw)
    out = poisoned(cp, dq + 2 * dk)
    be.matvec(out, stack, xd)
    xq = xq64(x)
    check_exact(be.to_host(out), W @ xq, np.abs(W) @ np.abs(xq), f"{fmt} qkv")
    inv = 1.0 / np.sqrt(np.mean(x.astype(np.float64) ** 2) + eps)
    xq = xq64(x * nw)
    xb, out = poisoned(cp, n), poisoned(cp, dq + 2 * dk)
    be.rmsnorm(xb, xd, nwd, eps)
    be.matvec(out, stack, xb)
    assert be._pending_norm is None
    check_exact(be.to_host(out), inv * (W @ xq), inv * (np.abs(W) @ np.abs(xq)), f"{fmt} norm+qkv")
    np.testing.assert_allclose(be.to_host(xb), x * inv * nw, rtol=2e-6, atol=1e-6)
    assert be.stack_rows((mats[0], mats[1], mats[0])) is None        # v taller than k
    # v of another format: one launch where the stack fits one wave (qmv_qkv_pair), each
    # part's x rounded to its own format's activation blocks; three launches otherwise
    other = "q8_0" if fmt != "q8_0" else "q4_0"
    raw_v = random_blocks(other, dk, n, rng)
    odd = be.upload(QuantMatrix(raw_v, other, (dk, n)))
    mixed = be.stack_rows((mats[0], mats[1], odd))
    if fmt in ("q5_k", "q6_k"):         # no pairs with these (stack_rows)
        assert mixed is None
        return
    assert mixed is not None and mixed.fmt_v.name == other and mixed.fmt.name == fmt
    assert CQ.stack_rows((mats[0], mats[1], odd), sm_count=6) is None      # 7 tiles: two waves
    Wqk, Wv = W[:dq + dk], deq64(raw_v, other, n)
    for norm in (False, True):
        out = poisoned(cp, dq + 2 * dk)
        if norm:
            xb = poisoned(cp, n)
            be.rmsnorm(xb, xd, nwd, eps)
            be.matvec(out, mixed, xb)
            scale, xs = inv, x * nw
        else:
            be.matvec(out, mixed, xd)
            scale, xs = 1.0, x
        xa = xq64(xs)
        want = scale * np.concatenate([Wqk @ xa, Wv @ xa])
        mag = scale * np.concatenate([np.abs(Wqk) @ np.abs(xa), np.abs(Wv) @ np.abs(xa)])
        check_exact(be.to_host(out), want, mag, f"{fmt}+{other} qkv pair norm={norm}")
        if norm:
            np.testing.assert_allclose(be.to_host(xb), x * inv * nw, rtol=2e-6, atol=1e-6)


def _rope64(v, n_heads, hd, c, s):
    """NumPy rope of the (n_heads * hd,) float64 vector v: pairs (j, j + hd/2) of each head."""
    h = v.reshape(n_heads, hd)
    a, b = h[:, :hd // 2], h[:, hd // 2:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=1).reshape(-1)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt,vfmt", [(f, f) for f in FMTS] + [("q5_0", "q8_0"), ("q4_k", "q8_0"), ("q8_0", "q4_k")])
@pytest.mark.parametrize("nq,nkv,hd", [(3, 1, 64), (2, 2, 128)])
def test_qkv_rope_folded(be, cp, fmt, vfmt, nq, nkv, hd, monkeypatch):
    """matvec(qkv, stack, x) then rope_store on its q/k/v views run as one qmv_qkv_rope launch
    (qmv_qkv_rope_pair where v has its own format, vfmt): q and k rotated, k and v in cache
    row pos (f16 of the same values), every other cache row untouched -- eager, with the norm
    folded in too, and replayed in a decode_step graph at two positions. Partial rotary, and
    any op in between, take the matvec and rope_store apart."""
    calls = []
    real = CQ.qmatvec_qkv_rope
    # counted once the launch returned: a refused one falls back to two launches, which
    # would pass the checks below without the fused kernel
    monkeypatch.setattr(CQ, "qmatvec_qkv_rope", lambda *a: (real(*a), calls.append(1))[0])
    monkeypatch.setattr(be, "fold_rope", True)      # whatever CYLLM_CUDA_FOLD_ROPE says
    rng = np.random.default_rng(31)
    b = max(FORMATS[fmt].block, FORMATS[vfmt].block)
    n, dq, dk, half, max_ctx, eps = (2 * b if b == 256 else 320), nq * hd, nkv * hd, hd // 2, 9, 1e-5
    fmts = (fmt, fmt, vfmt)
    raws = [random_blocks(f, d, n, rng) for f, d in zip(fmts, (dq, dk, dk))]
    stack = be.stack_rows(tuple(be.upload(QuantMatrix(r, f, (r.shape[0], n))) for f, r in zip(fmts, raws)))
    assert stack is not None and stack.fmt_v.name == vfmt
    Wqk, Wv = np.concatenate([deq64(r, fmt, n) for r in raws[:2]]), deq64(raws[2], vfmt, n)

    def plain(xv):
        """[Wq | Wk] x and Wv x with x rounded to the activation blocks, and their magnitudes."""
        a = xq64(xv)
        return (np.concatenate([Wqk @ a, Wv @ a]), np.concatenate([np.abs(Wqk) @ np.abs(a), np.abs(Wv) @ np.abs(a)]))
    ang = rng.uniform(-np.pi, np.pi, (max_ctx, half))
    cos, sin = be.upload(np.cos(ang).astype(np.float32)), be.upload(np.sin(ang).astype(np.float32))
    nw = rng.uniform(0.5, 1.5, n).astype(np.float32)
    nwd = be.upload(nw)
    fill = np.full((nkv, max_ctx, hd), 0.25, np.float16)
    kc, vc = be.upload(fill), be.upload(fill)
    out, xd, xb = poisoned(cp, dq + 2 * dk), be.upload(np.zeros(n, np.float32)), be.empty(n)
    q, k, v = out[:dq], out[dq:dq + dk], out[dq + dk:]

    def want(xv, norm, pos):
        scale = 1.0 / np.sqrt(np.mean(xv.astype(np.float64) ** 2) + eps) if norm else 1.0
        y, mag = plain(xv * nw if norm else xv)
        y, mag = scale * y, scale * mag
        c, s = np.cos(ang[pos]).astype(np.float32), np.sin(ang[pos]).astype(np.float32)
        y[:dq] = _rope64(y[:dq], nq, hd, c, s)
        y[dq:dq + dk] = _rope64(y[dq:dq + dk], nkv, hd, c, s)
        for lo, hi, nh in ((0, dq, nq), (dq, dq + dk, nkv)):    # a pair's error mixes both halves
            m = mag[lo:hi].reshape(nh, 2, half)
            mag[lo:hi] = np.repeat(m.sum(axis=1, keepdims=True), 2, axis=1).reshape(-1)
        return y, mag

    def check(y, mag, pos, what):
        got = be.to_host(out)
        check_exact(got, y, mag, what)
        kh, vh = be.to_host(kc), be.to_host(vc)
        np.testing.assert_array_equal(kh[:, pos], got[dq:dq + dk].reshape(nkv, hd).astype(np.float16))
        np.testing.assert_array_equal(vh[:, pos], got[dq + dk:].reshape(nkv, hd).astype(np.float16))
        others = np.arange(max_ctx) != pos
        assert (kh[:, others] == 0.25).all() and (vh[:, others] == 0.25).all(), f"{what}: another cache row written"

    for norm, pos in ((False, 4), (True, 8)):
        xv = (rng.standard_normal(n) * 2).astype(np.float32)
        xd.set(xv)
        if norm:
            be.rmsnorm(xb, xd, nwd, eps)
        be.matvec(out, stack, xb if norm else xd)
        assert be._pending_qkv is not None
        be.rope_store(q, k, v, cos, sin, kc, vc, pos)
        assert be._pending_qkv is None and len(calls) == 1 + norm
        check(*want(xv, norm, pos), pos, f"{fmt} folded rope, norm={norm}")
        if norm:            # the folded norm's output exists as the rmsnorm op would leave it
            inv = 1.0 / np.sqrt(np.mean(xv.astype(np.float64) ** 2) + eps)
            np.testing.assert_allclose(be.to_host(xb), xv * inv * nw, rtol=2e-6, atol=1e-6)
        kc.set(fill)
        vc.set(fill)

    def issue(token, pos):
        be.rmsnorm(xb, xd, nwd, eps)
        be.matvec(out, stack, xb)
        be.rope_store(q, k, v, cos, sin, kc, vc, pos)

    for pos in (2, 5):
        xv = (rng.standard_normal(n) * 2).astype(np.float32)
        xd.set(xv)
        be.decode_step(issue, 1, pos)
        check(*want(xv, True, pos), pos, f"{fmt} folded rope in a graph at {pos}")
        kc.set(fill)
        vc.set(fill)
    be.reset_graph()
    assert len(calls) == 4                  # the first step runs eagerly and is captured; then replayed

    # an op in between: the held matvec goes out first, unrotated, and before that op
    xv = (rng.standard_normal(n) * 2).astype(np.float32)
    xd.set(xv)
    y0, mag0 = plain(xv)
    be.matvec(out, stack, xd)
    check_exact(be.to_host(out), y0, mag0, f"{fmt} held qkv read back")
    twice = be.empty(dq + 2 * dk)
    be.matvec(out, stack, xd)
    be.add(twice, out, out)                 # reads the held matvec's output
    check_exact(be.to_host(twice), 2 * y0, 2 * mag0, f"{fmt} add after held qkv")
    # a position rope_store refuses: the matvec still goes out, the error is raised, no cache row moves
    be.matvec(out, stack, xd)
    with pytest.raises(InvalidArgumentError):
        be.rope_store(q, k, v, cos, sin, kc, vc, max_ctx)
    assert be._pending_qkv is None and len(calls) == 4
    check_exact(be.to_host(out), y0, mag0, f"{fmt} held qkv, refused position")
    assert (be.to_host(kc) == 0.25).all() and (be.to_host(vc) == 0.25).all()
    # partial rotary (the fused kernel rotates whole heads): matvec, then rope_store's own path
    rot = half // 2
    cos_p, sin_p = cp.ascontiguousarray(cos[:, :rot]), cp.ascontiguousarray(sin[:, :rot])
    be.matvec(out, stack, xd)
    be.rope_store(q, k, v, cos_p, sin_p, kc, vc, 3)
    assert len(calls) == 4
    got = be.to_host(out)
    y = y0.copy()
    c, s = np.cos(ang[3, :rot]).astype(np.float32), np.sin(ang[3, :rot]).astype(np.float32)
    for lo, nh in ((0, nq), (dq, nkv)):
        h = y[lo:lo + nh * hd].reshape(nh, hd).copy()
        a, bb = h[:, :rot].copy(), h[:, rot:2 * rot].copy()
        h[:, :rot], h[:, rot:2 * rot] = a * c - bb * s, bb * c + a * s
        y[lo:lo + nh * hd] = h.reshape(-1)
    assert rel(got, y) < 1e-4
    np.testing.assert_array_equal(be.to_host(kc)[:, 3], got[dq:dq + dk].reshape(nkv, hd).astype(np.float16))


@pytest.mark.cuda
def test_weight_loads_issued_before_pdl_wait(tmp_path):
    """In the machine code the GPU runs (nvcc for sm_90a, read back with cuobjdump), every
    decode matvec issues weight loads before its griddepcontrol.wait (ACQBULK): ptxas had
    moved all of them below it in the q4_0 kernels and q8_0's gate+up, so their weights
    streamed only after the previous kernel ended (common.cuh, pdl_wait_after_loads). The
    experts' kernels are the exception the other way: their matrices are found by ids the
    kernel before writes, so no weight load may come before their wait (expert_offset)."""
    import shutil
    import subprocess
    _cuda()
    if not (shutil.which("nvcc") and shutil.which("cuobjdump")):
        pytest.skip("needs nvcc and cuobjdump (the CUDA toolkit)")
    cu = tmp_path / "q.cu"
    cu.write_text(CQ._source())
    sass = ""
    # every format, and a pair module (qmv_qkv_pair: a wait in each format's code path)
    for i, defines in enumerate((["-DQMV_ALL"], ["-DQMV_PAIR_QK=QF_q5_0", "-DQMV_PAIR_V=QF_q8_0"])):
        cubin = tmp_path / f"q{i}.cubin"
        subprocess.run(["nvcc", "-arch=sm_90a", *defines, "-cubin", "-o", str(cubin), str(cu)],
                       check=True, capture_output=True, timeout=900)
        sass += subprocess.run(["cuobjdump", "-sass", str(cubin)], check=True, capture_output=True,
                               text=True, timeout=300).stdout
    late, seen, early, experts = [], 0, [], 0
    for fn in re.split(r"\n\s*Function : ", sass)[1:]:
        name, body = fn.split("\n", 1)
        name, lines = name.strip(), body.split("\n")
        waits = [i for i, ln in enumerate(lines) if "ACQBULK" in ln]
        if name.startswith("qmv_experts_"):
            experts += 1
            loads = [i for i, ln in enumerate(lines) if re.search(r"LDG\.E\.NA", ln)]
            if not waits or (loads and loads[0] < waits[0]):
                early.append(name)
            continue
        if not name.startswith("qmv_") or not waits:
            continue
        seen += 1
        # each wait (a kernel with several code paths has one in each) has weight loads
        # issued since the one before it, or since the start
        for lo, hi in zip([0] + waits, waits):
            if not any(re.search(r"LDG\.E\.NA", ln) for ln in lines[lo:hi]):
                late.append(name)
                break
    assert seen >= 8 * 10, f"only {seen} decode matvec kernels found in the SASS"
    for name in ("qmv_qkv_pair", "qmv_qkv_pair_norm", "qmv_qkv_rope_pair", "qmv_qkv_rope_pair_norm"):
        assert re.search(rf"Function : {name}\s*\n", sass), f"{name} missing from the pair module's SASS"
    assert not late, f"no weight load before the wait in {late}"
    assert experts >= 8 * 3 and not early, f"weights read before the ids' wait in {early}"


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["q4_0", "q5_1"])
def test_gate_up_carveout_keeps_a_balanced_wave(be, cp, fmt):
    """A gate+up of more tiles than SMs (its carveout sized for ceil(tiles / SMs) blocks) still
    has that many blocks resident an SM by the occupancy API, and computes the same products."""
    rng = np.random.default_rng(31)
    f = FORMATS[fmt]
    d, n = 32 * (2 * be.sm_count + 5), 4096                       # 2 SMs' worth of tiles and more
    raws = [random_blocks(fmt, d, n, rng) for _ in range(2)]
    wg, wu = (be.upload(QuantMatrix(r, fmt, (d, n))) for r in raws)
    x = rng.standard_normal(n).astype(np.float32)
    out = be.empty(d)
    be.gate_up(out, wg, wu, be.upload(x), "silu")
    k = CQ.kernel(be, f"qmv_gate_up_silu_{fmt}", fmt)
    warps = CQ.matvec_warps(be, wg, 2)
    want = -(-(d // 32) // be.sm_count)
    occ = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(k.kernel.ptr, 32 * warps,
                                                                  CQ._shared_bytes(n, warps, 2))
    # blocks the registers allow: an SM's register file over a block's (256-register units a warp)
    per_warp = -(-32 * max(k.num_regs, 1) // 256) * 256
    regs_cap = cp.cuda.Device().attributes["MaxRegistersPerMultiprocessor"] // (warps * per_warp)
    assert occ == min(want, regs_cap), (occ, want, regs_cap)      # enough for one wave, no more
    xq = xq64(x)
    g, u = (deq64(r, fmt, n) @ xq for r in raws)
    assert rel(be.to_host(out), silu(g) * u) < 1e-4, f.name


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q8_0", "q4_0", "q5_0"])
def test_decode_graph(be, cp, fmt):
    """A sub-block's ops inside decode_step: captured once (PDL launches), replayed with new inputs."""
    be.reset_graph()
    rng = np.random.default_rng(29)
    f = FORMATS[fmt]
    n = 8 * f.block if f.block == 256 else 576
    d, ff = n, 3 * n // 2 if f.block == 32 else 3 * n // 2 // 256 * 256
    eps = 1e-5
    ws, Ws = _upload_weights(be, fmt, {"wo": (d, n), "wg": (ff, n), "wu": (ff, n), "wd": (d, ff)}, rng)
    nw = rng.uniform(0.5, 1.5, n).astype(np.float32)
    x = be.upload(np.zeros(n, np.float32))
    xb, h, o = be.empty(n), be.empty(ff), be.empty(d)
    nwd = be.upload(nw)

    def issue(token, pos):
        be.rmsnorm(xb, x, nwd, eps)
        be.matvec(o, ws["wo"], xb)          # o = Wo norm(x)
        be.rmsnorm(xb, x, nwd, eps)
        be.gate_up(h, ws["wg"], ws["wu"], xb, "silu")
        be.matvec_add(o, ws["wd"], h)       # o += Wd h

    for step in range(3):
        xv = rng.standard_normal(n).astype(np.float32)
        x.set(xv)
        be.decode_step(issue, 1, step)
        if step:
            assert be._graph is not None
        inv = 1.0 / np.sqrt(np.mean(xv.astype(np.float64) ** 2) + eps)
        xq = xq64(xv * nw)
        want = inv * (Ws["wo"] @ xq)
        hv = silu(inv * (Ws["wg"] @ xq)) * (inv * (Ws["wu"] @ xq))
        hq = xq64(be.to_host(h).astype(np.float32))
        assert rel(be.to_host(h), hv) < 1e-4
        want = want + Ws["wd"] @ hq
        mag = inv * (np.abs(Ws["wo"]) @ np.abs(xq)) + np.abs(Ws["wd"]) @ np.abs(hq)
        check_exact(be.to_host(o), want, mag, f"{fmt} graph step {step}")
    be.reset_graph()


def _upload_weights(be, fmt, shapes, rng):
    """{name: random fmt blocks of that (rows, cols)} uploaded, and their float64 dequantized
    matrices."""
    raws = {k: random_blocks(fmt, r, c, rng) for k, (r, c) in shapes.items()}
    return ({k: be.upload(QuantMatrix(raws[k], fmt, shapes[k])) for k in shapes},
            {k: deq64(raws[k], fmt, shapes[k][1]) for k in shapes})


def _record_launches(be, monkeypatch) -> list:
    """The names of the kernels the backend launches from now on, in order."""
    launched = []
    launch = be._launch
    monkeypatch.setattr(be, "_launch", lambda k, *a, **kw: (launched.append(k), launch(k, *a, **kw)))
    return launched


# (n, ff) of the prequantized chain, items of 32 and of 256 elements. short: SmolLM2's rows,
# a warp's slice inside its first batch. long: rows of the 7B shape's kind, where the loop
# refills batches and ends on a partial one (32-element formats on 132 SMs: out += W x of 129
# tiles in one wave, ~12 items a warp; gate+up of 300 tiles, ~32 items a warp; down in one
# wave, ~19 items a warp against the 12 a _qx kernel holds in flight)
CHAIN_SHAPES = {"short": ((576, 864), (2048, 3072)), "long": ((4128, 9600), (4352, 9728))}


@pytest.mark.cuda
@pytest.mark.parametrize("rows", list(CHAIN_SHAPES))
@pytest.mark.parametrize("fmt", FMTS)
def test_decode_prequantized_chain(be, cp, fmt, rows, monkeypatch):
    """Inside decode_step a matvec hands its output to the next quantized one prequantized
    (prequant.py): out += W x, rmsnorm, gate+up reading it through the folded norm (codes of
    h * w, the norm's sum of squares from the producer), down reading gate+up's output. Each
    against NumPy, and the same ops outside decode_step, where every matvec stages its own x."""
    be.reset_graph()
    rng = np.random.default_rng(37)
    f = FORMATS[fmt]
    n, ff = CHAIN_SHAPES[rows][f.block == 256]
    eps = 1e-5
    shp = {"wa": (n, n), "wg": (ff, n), "wu": (ff, n), "wd": (n, ff)}
    ws, Ws = _upload_weights(be, fmt, shp, rng)
    nw = rng.uniform(0.5, 1.5, n).astype(np.float32)
    nwd = be.upload(nw)
    x, h, o = be.upload(np.zeros(n, np.float32)), be.empty(n), be.empty(n)
    xb, g = be.empty(n), be.empty(ff)

    def issue(token, pos):
        be.matvec_add(h, ws["wa"], x)            # producer: h += Wa x
        be.rmsnorm(xb, h, nwd, eps)
        be.gate_up(g, ws["wg"], ws["wu"], xb, "silu")   # consumer through the norm, producer
        be.matvec_add(o, ws["wd"], g)            # consumer: o += Wd g

    def expect(xv, h0, o0, hv, gv):
        """h, gate+up and down as NumPy computes them (gate+up's and down's x from the GPU's
        h and g, so that rounding at a boundary cannot differ)."""
        h_want = h0 + Ws["wa"] @ xq64(xv)
        inv = 1.0 / np.sqrt(np.mean(hv.astype(np.float64) ** 2) + eps)
        hq = xq64(hv * nw)
        g_want = silu(inv * (Ws["wg"] @ hq)) * (inv * (Ws["wu"] @ hq))
        gq = xq64(gv)
        return h_want, g_want, o0 + Ws["wd"] @ gq, np.abs(Ws["wd"]) @ np.abs(gq) + np.abs(o0)

    def run(ops, what):
        xv = rng.standard_normal(n).astype(np.float32)
        h0 = rng.standard_normal(n).astype(np.float32)
        o0 = rng.standard_normal(n).astype(np.float32)
        for a, v in ((x, xv), (h, h0), (o, o0)):
            a.set(v)
        ops()
        hv, gv, ov = (be.to_host(a).astype(np.float32) for a in (h, g, o))
        h_want, g_want, o_want, mag = expect(xv, h0, o0, hv, gv)
        assert rel(hv, h_want) < 1e-5, f"{fmt} {what}: h"
        assert rel(gv, g_want) < 1e-4, f"{fmt} {what}: gate+up"
        check_exact(ov, o_want, mag, f"{fmt} {what}: down")

    launched = _record_launches(be, monkeypatch)
    for step in range(3):
        run(lambda: be.decode_step(issue, 1, step), f"step {step}")
    if be.prequant:     # gate+up and down read their x prequantized
        for name in (f"qmv_gate_up_silu_{fmt}_norm_qx", f"qmv_add_{fmt}_qx"):
            assert CQ.kernel(be, name, fmt) in launched, name
    run(lambda: issue(1, 0), "outside decode_step")     # every matvec stages its own x
    be.reset_graph()


# (heads, kv heads, head_dim, window, K/V rows before the wait, heads a block): groups of 2,
# 3 (whole groups a block: a partial tile of 4), 5 (of 8) and 8; head_dim 32 to 256, a window,
# the kernels without early rows; head_dim 16 (the fast path, not whole 32-blocks a head) and 80
# (the generic kernel) are not handed over: wo stages attention's output itself. None: the
# plan's choice by position (one head a block at these positions below a chunk, two past it)
ATTN_HANDOVER_SHAPES = [(8, 4, 128, 0, None, None), (12, 4, 64, 40, None, 3),
                        (20, 4, 64, 0, False, 5), (16, 2, 32, 0, None, None),
                        (4, 2, 256, 100, False, None), (16, 4, 16, 0, None, None),
                        (16, 4, 80, 0, None, None)]


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q4_0", "q8_0"])
@pytest.mark.parametrize("shape", ATTN_HANDOVER_SHAPES, ids=lambda s: "h{}kv{}d{}w{}e{}b{}".format(*s))
def test_decode_attention_hands_wo_its_output_prequantized(be, cp, fmt, shape, monkeypatch):
    """Inside decode_step attention writes its output prequantized for a quantized wo
    (prequant.py): at positions of one split (the output written by the block itself) and of
    several (merged by the last block); attention against numpy_ref, wo against NumPy."""
    from cyllm.backends.numpy_ref import NumpyBackend
    be.reset_graph()
    rng = np.random.default_rng(41)
    nh, nkv, hd, window, early, hpb = shape
    max_ctx = 600
    n = nh * hd
    monkeypatch.setattr(be, "attn_v_early", early)
    monkeypatch.setattr(be, "attn_heads_per_block", hpb)
    raw = random_blocks(fmt, n, n, rng)
    wo, Wo = be.upload(QuantMatrix(raw, fmt, (n, n))), deq64(raw, fmt, n)
    kc = (rng.standard_normal((nkv, max_ctx, hd)) * 0.5).astype(np.float16)
    vc = rng.standard_normal((nkv, max_ctx, hd)).astype(np.float16)
    kd, vd = be.upload(kc), be.upload(vc)
    qd, o, h = be.empty(n), be.empty(n), be.empty(n)
    launched = _record_launches(be, monkeypatch)

    def issue(token, pos):
        be.attention(o, qd, kd, vd, pos, window)
        be.matvec_add(h, wo, o)             # h += Wo attention(q)

    for pos in (5, 6, max_ctx - 10):
        qv = rng.standard_normal(n).astype(np.float32)
        h0 = rng.standard_normal(n).astype(np.float32)
        qd.set(qv)
        h.set(h0)
        be.decode_step(issue, 1, pos)
        want = np.zeros(n, np.float32)
        NumpyBackend().attention(want, qv, kc, vc, pos, window)
        ov = be.to_host(o).astype(np.float32)
        assert rel(ov, want) < 1e-4, f"{fmt} attention at {pos}"
        oq = xq64(ov)
        check_exact(be.to_host(h), h0 + Wo @ oq, np.abs(Wo) @ np.abs(oq) + np.abs(h0), f"{fmt} wo at {pos}")
    handed = CQ.kernel(be, f"qmv_add_{fmt}_qx", fmt) in launched
    assert handed == (be.prequant and hd % 32 == 0 and hd <= 256), f"{fmt} head_dim {hd}: wo read codes: {handed}"
    be.reset_graph()


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q4_0"])
def test_decode_separate_qkv_share_the_codes(be, cp, fmt, monkeypatch):
    """q, k and v as three matvecs after a folded norm of a prequantized h (the Q4_K_M layers
    whose v has another format): k and v take q's codes and fold the same norm (prequant.py,
    _take_input); each against NumPy; the norm's output as the rmsnorm op would leave it."""
    be.reset_graph()
    rng = np.random.default_rng(43)
    n = 1024
    eps = 1e-5
    shp = {"wd": (n, n), "wq": (n, n), "wk": (256, n), "wv": (256, n)}
    ws, Ws = _upload_weights(be, fmt, shp, rng)
    nw = rng.uniform(0.5, 1.5, n).astype(np.float32)
    nwd = be.upload(nw)
    x, h, xb = be.upload(np.zeros(n, np.float32)), be.empty(n), be.empty(n)
    q, k, v = be.empty(n), be.empty(256), be.empty(256)
    launched = _record_launches(be, monkeypatch)

    def issue(token, pos):
        be.matvec_add(h, ws["wd"], x)           # h += Wd x: the producer
        be.rmsnorm(xb, h, nwd, eps)
        be.matvec(q, ws["wq"], xb)              # folds the norm, reads h's codes
        be.matvec(k, ws["wk"], xb)              # the same codes and norm
        be.matvec(v, ws["wv"], xb)

    for step in range(3):
        xv = rng.standard_normal(n).astype(np.float32)
        h0 = rng.standard_normal(n).astype(np.float32)
        x.set(xv)
        h.set(h0)
        be.decode_step(issue, 1, step)
        hv = be.to_host(h).astype(np.float32)
        assert rel(hv, h0 + Ws["wd"] @ xq64(xv)) < 1e-5
        inv = 1.0 / np.sqrt(np.mean(hv.astype(np.float64) ** 2) + eps)
        hq = xq64(hv * nw)
        for name, out in (("wq", q), ("wk", k), ("wv", v)):
            check_exact(be.to_host(out), inv * (Ws[name] @ hq), inv * (np.abs(Ws[name]) @ np.abs(hq)),
                        f"{fmt} {name} step {step}")
        np.testing.assert_allclose(be.to_host(xb), hv * inv * nw, rtol=2e-6, atol=1e-6)
    if be.prequant:
        assert launched.count(CQ.kernel(be, f"qmv_{fmt}_norm_qx", fmt)) >= 3
    be.reset_graph()


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FMTS)
def test_prefill_matmul(be, cp, fmt):
    """matmul / matmul_add / gate_up_batch on dequantized FP16 tiles (several tiles: a small tile size)."""
    rng = np.random.default_rng(31)
    old, old_few = CQ._DEQ_TILE_ELEMS, be.qmm_few_max
    CQ._DEQ_TILE_ELEMS = 64 * 4096          # tiles of 64 rows at n=4096: the loop over tiles runs
    be.qmm_few_max = 0                      # short chunks too (the few-column path: the next test)
    try:
        for d, n in shapes(fmt)[2:]:
            t = 7
            raw, raw2 = random_blocks(fmt, d, n, rng), random_blocks(fmt, d, n, rng)
            w = be.upload(QuantMatrix(raw, fmt, (d, n)))
            w2 = be.upload(QuantMatrix(raw2, fmt, (d, n)))
            W, W2 = deq64(raw, fmt, n), deq64(raw2, fmt, n)
            x = rng.standard_normal((t, n)).astype(np.float32)
            x16 = x.astype(np.float16).astype(np.float64)
            out = cp.full((t, d), np.nan, dtype=cp.float32)
            be.matmul(out, w, be.upload(x))
            assert rel(be.to_host(out), x16 @ W.T) < 2e-3
            base = rng.standard_normal((t, d)).astype(np.float32)
            out = be.upload(base)
            be.matmul_add(out, w, be.upload(x))
            assert rel(be.to_host(out), base + x16 @ W.T) < 2e-3
            out = cp.full((t, d), np.nan, dtype=cp.float32)
            be.gate_up_batch(out, w, w2, be.upload(x), "gelu_tanh")
            assert rel(be.to_host(out), gelu_tanh(x16 @ W.T) * (x16 @ W2.T)) < 5e-3
            f16 = cp.asnumpy(CQ.dequantize(be, w)).astype(np.float64)
            np.testing.assert_allclose(f16, W, rtol=1e-3, atol=1e-7)
    finally:
        CQ._DEQ_TILE_ELEMS, be.qmm_few_max = old, old_few


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FMTS)
def test_prefill_few_columns(be, cp, fmt, monkeypatch):
    """Short chunks (qmatmul_few): every column exact against the float64 product of the
    dequantized weights and that column rounded to int8 blocks, as decode's matvec is.
    The dp4a kernels (qmm): both block widths (8 and 4 columns), chunks of one column, of whole
    groups, with a partial last group and of qmm_few_max rows; 8 warps a block (warps with no
    items on short rows). The tensor-core kernels (qmma, sm_80+): both widths (16 and 32
    columns), one column, several groups, 1 to 3 warps splitting a tile's chunks (warps with
    none on short rows), the host's choice. Both: x and out rows strided (out's columns past d
    stay unwritten), x rows not 16-byte aligned (the scalar staging); matmul_add's residual,
    gate_up_batch; over qmm_few_max the FP16 tiles."""
    rng = np.random.default_rng(41)
    calls, mmas = [], []
    few, qmma = CQ.qmatmul_few, CQ._qmma_kernel
    monkeypatch.setattr(CQ, "qmatmul_few", lambda *a: calls.append(few(*a)) or calls[-1])
    monkeypatch.setattr(CQ, "_qmma_kernel", lambda *a: mmas.append(qmma(*a)) or mmas[-1])
    most = be.qmm_few_max
    smem_max = CQ.QMM_SMEM_MAX
    tensor_cores = be.compute_capability >= (8, 0)
    for d, n in shapes(fmt):
        raw, raw2 = random_blocks(fmt, d, n, rng), random_blocks(fmt, d, n, rng)
        w = be.upload(QuantMatrix(raw, fmt, (d, n)))
        w2 = be.upload(QuantMatrix(raw2, fmt, (d, n)))
        W, W2 = deq64(raw, fmt, n), deq64(raw2, fmt, n)
        # widths forced (shared memory up to the device's opt-in limit: 8 columns of 11008), then
        # the host's choice (the rows of 11008: 4 columns under QMM_SMEM_MAX)
        cases = (("qmm", 8, 1, 0, None), ("qmm", 8, 16, 1, None), ("qmm", 8, 21, 0, 8), ("qmm", 4, 4, 0, None),
                 ("qmm", 4, 11, 1, 8), ("qmm", None, 13, 0, None), ("qmm", None, most, 0, None),
                 ("mma", 16, 1, 0, None), ("mma", 16, 40, 1, 2), ("mma", 32, 21, 0, 3), ("mma", 32, 7, 1, 1),
                 ("mma", None, 16, 0, None), ("mma", None, most, 1, None))
        for kind, cols, t, skew, warps in cases:
            if kind == "mma" and not tensor_cores:
                continue
            monkeypatch.setattr(be, "qmm_mma", kind == "mma")
            monkeypatch.setattr(CQ, "QMM_COLUMNS", (cols,) if cols else (8, 4))
            monkeypatch.setattr(CQ, "QMMA_COLUMNS", (cols,) if cols else (16, 32))
            monkeypatch.setattr(CQ, "QMM_SMEM_MAX", 200 * 1024 if cols else smem_max)
            monkeypatch.setattr(be, "qmv_warps", warps if kind == "qmm" else None)
            monkeypatch.setattr(be, "qmma_warps", warps if kind == "mma" else None)
            if cols and kind == "qmm":
                k = CQ.kernel(be, f"qmm_c{cols}_{fmt}", fmt)
                if CQ._qmm_smem(n, CQ._qmm_warps(be, w, k), cols) > be.smem_per_block:
                    continue            # a GPU with less shared memory a block than an H100's
            mmas.clear()
            x = rng.standard_normal((t, n)).astype(np.float32)
            xw = cp.zeros((t, n + 8), dtype=cp.float32)          # rows 8 floats apart, skew: 4-byte aligned
            xw[:, skew:skew + n] = cp.asarray(x)
            xd = xw[:, skew:skew + n]
            xq = np.stack([xq64(r) for r in x])
            want, mag = xq @ W.T, np.abs(xq) @ np.abs(W).T
            what = f"{fmt} {d}x{n} {kind} t={t} c={cols} skew={skew} warps={warps}"
            calls.clear()
            wide = cp.full((t, d + 3), np.nan, dtype=cp.float32)
            be.matmul(wide[:, :d], w, xd)
            got = be.to_host(wide)
            check_exact(got[:, :d], want, mag, what)
            assert np.isnan(got[:, d:]).all(), what + ": wrote past the last row"
            base = rng.standard_normal((t, d)).astype(np.float32)
            out = be.upload(base)
            be.matmul_add(out, w, xd)
            check_exact(be.to_host(out), base + want, mag + np.abs(base), what + " add")
            out = cp.full((t, d), np.nan, dtype=cp.float32)
            be.gate_up_batch(out, w, w2, xd, "silu")
            want2, mag2 = xq @ W2.T, np.abs(xq) @ np.abs(W2).T
            ref = silu(want) * want2
            tol = 1e-4 * (np.abs(want2) * (mag + 1) + np.abs(want) * mag2) + 1e-6 * np.abs(ref)
            assert np.all(np.abs(be.to_host(out) - ref) <= tol + 1e-12), what + " gate_up"
            assert calls == [True] * 4, (what, calls)
            if kind == "mma":           # the tensor cores ran it, with the warps asked for
                assert all(m is not None and m[2] == (warps or m[2]) for m in mmas), (what, mmas)
            else:
                assert mmas in ([], [None] * 4), (what, mmas)
    monkeypatch.setattr(be, "qmv_warps", None)
    monkeypatch.setattr(be, "qmma_warps", None)
    x = rng.standard_normal((most + 1, n)).astype(np.float32)    # one row over qmm_few_max: the tiles
    calls.clear()
    out = cp.full((most + 1, d), np.nan, dtype=cp.float32)
    be.matmul(out, w, be.upload(x))
    assert calls == [False]
    assert rel(be.to_host(out), x.astype(np.float16).astype(np.float64) @ W.T) < 2e-3


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FMTS)
def test_embed(be, cp, fmt):
    rng = np.random.default_rng(37)
    vocab, n = 70, 2 * FORMATS[fmt].block if FORMATS[fmt].block == 256 else 96
    raw = random_blocks(fmt, vocab, n, rng)
    w = be.upload(QuantMatrix(raw, fmt, (vocab, n)))
    ref = R.dequantize(raw, fmt, n).astype(np.float64)
    out = poisoned(cp, n)
    be.embed(out, w, 69, 2.0)
    atol = 1e-6 * np.abs(ref).max()          # q*d + m cancels: compare against the row's scale
    np.testing.assert_allclose(be.to_host(out), 2.0 * ref[69], rtol=1e-6, atol=2 * atol)
    toks = np.array([3, 0, 69, 3, 41], np.int32)
    out = cp.full((5, n), np.nan, dtype=cp.float32)
    be.embed_batch(out, w, toks, 0.5)
    np.testing.assert_allclose(be.to_host(out), 0.5 * ref[toks], rtol=1e-6, atol=atol / 2)


@pytest.mark.cuda
def test_bad_input(be, cp):
    rng = np.random.default_rng(41)
    raw = random_blocks("q4_0", 40, 64, rng)
    w = be.upload(QuantMatrix(raw, "q4_0", (40, 64)))
    w2 = be.upload(QuantMatrix(random_blocks("q4_0", 40, 96, rng), "q4_0", (40, 96)))
    with pytest.raises(InvalidArgumentError):
        be.matvec(be.empty(40), w, be.empty(96))
    with pytest.raises(InvalidArgumentError):
        be.matvec(be.empty(39), w, be.empty(64))
    with pytest.raises(InvalidArgumentError):
        be.gate_up(be.empty(40), w, w2, be.empty(64), "silu")
    with pytest.raises(InvalidArgumentError):
        be.gate_up(be.empty(40), w, w, be.empty(64), "relu")
    with pytest.raises(InvalidArgumentError):
        be.matmul(be.empty((3, 40)), w, be.empty((3, 96)))


@pytest.mark.cuda
def test_mixed_gate_up(be, cp):
    """Gate and up in different formats (or one F16): split into two matvecs and the GLU product."""
    rng = np.random.default_rng(43)
    d, n = 70, 512
    rg, ru = random_blocks("q4_k", d, n, rng), random_blocks("q6_k", d, n, rng)
    wg = be.upload(QuantMatrix(rg, "q4_k", (d, n)))
    wu = be.upload(QuantMatrix(ru, "q6_k", (d, n)))
    x = rng.standard_normal(n).astype(np.float32)
    xq = xq64(x)
    out = poisoned(cp, d)
    be.gate_up(out, wg, wu, be.upload(x), "silu")
    want = silu(deq64(rg, "q4_k", n) @ xq) * (deq64(ru, "q6_k", n) @ xq)
    assert rel(be.to_host(out), want) < 1e-4
    wf = (rng.standard_normal((d, n)) * 0.05).astype(np.float16)
    out = poisoned(cp, d)
    be.gate_up(out, wg, be.upload(wf), be.upload(x), "silu")
    want = silu(deq64(rg, "q4_k", n) @ xq) * (wf.astype(np.float64) @ x)
    assert rel(be.to_host(out), want) < 1e-4
