"""Quantized weights on the CUDA backend: the device-side typed weight and the ops on it.

``CudaQuantMatrix`` is what ``CudaBackend.upload(QuantMatrix)`` returns: the file's block
bytes, reordered once on the device into the "lane = row" layout of cuda/quant_matvec.cu
(the same number of bytes: no dequantized copy is kept), plus format and shape.

Decode (one token): ``qmatvec`` runs one kernel per op -- out = W x, out += W x, or
act(Wg x) * (Wu x) -- with the activation quantized to int8 blocks of 32 (the CPU kernels'
q8_0 activation, for every format: the CPU's K-quant kernels round per 256) and a held-back
rmsnorm folded in, like the F16 ``_norm`` kernels. Inside ``decode_step`` the activation
usually comes already quantized by the matvec that wrote it (prequant.py); they go out with
programmatic dependent launch (``CudaBackend._launch``) and are captured in the step's CUDA
graph. Nothing here allocates on the decode path.

Prefill (T tokens): ``qmatmul`` dequantizes row tiles of W to FP16 into one reused
scratch tile and multiplies with cuBLAS, as the F16 path does. x stays float (FP16): rounding
it to int8 blocks as decode does was measured (H100, tests/test_cuda_quant_model.py) to move
the logits no closer to the CPU backend's -- the FP16 rounding of weights and x pushes a few
percent of the int8 codes across a rounding boundary -- while losing accuracy. That costs
the whole matrix's dequantizing whatever T is, so short chunks (a chat's next turn) go
through ``qmatmul_few`` instead: decode's kernels widened to a few columns, x rounded to
int8 blocks as decode's is.

Kernels are compiled per format on first use (one NVRTC module per format and device).

Layout (see cuda/quant_matvec.cu for the kernel side). Each row of a (d, n) matrix is
``nbi`` items (a block for the 32-element formats, a superblock for the K-quants); an item
is ``units`` 16-byte units taken from one byte range of the block, plus up to two small
fields (a 4/8-byte one, "A", and a 2-byte one, "B"). Rows are grouped in tiles of 32; in a
tile of width W the units are stored (item, unit, row-in-tile) and each small plane
(item, row-in-tile), so lane l of a warp reading unit j of item s for row 32T + l reads
512 contiguous bytes with the other lanes.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from ...errors import BackendUnavailableError, InvalidArgumentError, ModelLoadError
from ...quant.formats import FORMATS, WeightFormat
from ...quant.matrix import QuantMatrix
from . import widen
from .source import assemble

try:  # CuPy is optional: this module imports without it (the layout helpers use numpy)
    import cupy as cp
except Exception:  # noqa: BLE001 - reported by CudaBackend when it is constructed
    cp = None

TILE = 32                 # rows per tile = lanes per warp (QMV_TILE)
MAX_WARPS = 16            # warps per block of the matvec kernels

# fmt -> (16-byte units per item, their byte range in the block, plane A range, plane B range, B)
# B: items per lane loaded together (QF_<fmt>::B of the kernels); two batches are in flight
# (three in the prequantized kernels of the 16-byte-item formats: _items_in_flight).
# q4_0 at 4, not 8: twice the warps per block on rows of 4096 (16 instead of 8, 97 registers
# instead of 128 with a spill), where one launch was latency-bound with 2 warps per scheduler;
# Llama-2-7B Q4_0 decode on an H100 431 -> 477 tok/s, at depth 4096 323 -> 342. q4_1, q5_0
# and q5_1 (the same structure) at 4 too, not 8, 6, 6: SmolLM2-135M Q4_K_M, whose rows of 576
# fall back to q5_0, 957 -> 1019-1028 tok/s (bench/results/cuda_quant_model_h100.md)
LAYOUTS: dict[str, tuple] = {
    "q8_0": (2, (2, 34), None, (0, 2), 4),
    "q4_0": (1, (2, 18), None, (0, 2), 4),
    "q4_1": (1, (4, 20), (0, 4), None, 4),
    "q5_0": (1, (6, 22), (2, 6), (0, 2), 4),
    "q5_1": (1, (8, 24), (0, 8), None, 4),
    "q4_k": (9, (0, 144), None, None, 1),
    "q5_k": (11, (0, 176), None, None, 1),
    "q6_k": (13, (0, 208), None, (208, 210), 1),
}
SUPPORTED = tuple(LAYOUTS)

# mode -> kernel name prefix (whole names: <prefix><fmt>[_norm], see the table in quant_matvec.cu)
_PREFIX = {"matvec": "qmv_", "add": "qmv_add_"}
_GLU_PREFIX = {"silu": "qmv_gate_up_silu_", "gelu_tanh": "qmv_gate_up_gelu_"}
_GLU_KERNELS = {"silu": "swiglu_f32", "gelu_tanh": "geglu_f32"}       # elementwise, in elementwise.cu
_DEQ_TILE_ELEMS = 1 << 24  # FP16 scratch tile of the prefill path: 32 MiB
QMM_COLUMNS = (8, 4)       # columns a block of the few-column prefill kernels (qmm_c<C>_<fmt>), widest first
QMM_SMEM_MAX = 100 * 1024  # their staging at most this a block: two blocks an SM of an H100/H200 (228 KiB)
QMM_WARPS = 4              # and warps a block at most: small blocks, several an SM (7B Q4_K_M chunks of
                           # 32 rows on an H200: 17.2 ms a turn at 8 warps, 14.8-14.9 at 4)
QMMA_COLUMNS = (16, 32)    # columns a block of the tensor-core kernels (qmma<C>_<fmt>, sm_80+), narrowest first
QMMA_WARPS = 8             # warps a block at most, splitting a row tile's chunks (as many as the
                           # GPU's shared memory a block holds; 4 and 16 measured)


def _layout(fmt: WeightFormat):
    lay = LAYOUTS.get(fmt.name)
    if lay is None:
        raise InvalidArgumentError(
            f"the cuda backend has no kernels for {fmt.name} weights (supported: {', '.join(SUPPORTED)})")
    return lay


def _planes(fmt: WeightFormat):
    """[(byte range, bytes per element unit)] in storage order: units, plane A, plane B."""
    units, main, pa, pb, _ = _layout(fmt)
    out = [(main, 16)]
    for rng in (pa, pb):
        if rng is not None:
            out.append((rng, rng[1] - rng[0]))
    return out


def repack(xp, blocks, fmt, out=None) -> object:
    """(rows, row_bytes) uint8 block rows -> the flat kernel layout (same byte count).

    ``xp`` is numpy or cupy: the same reordering runs on the host (tests) or on the device
    (upload). Shapes: raw (rows, nbi, block_bytes); each plane (rows, NU, E) with NU units
    of E bytes per row; tile T of width W stored as (NU, W, E). Each plane is copied from
    its strided view into its place in ``out`` (allocated when None); the only temporary is
    the plane itself where its bytes cannot be viewed as E-byte units (q8_0's and q6_k's
    16-byte units start off the block's alignment: a copy of about the whole tensor).
    """
    fmt = FORMATS[fmt] if isinstance(fmt, str) else fmt
    rows, rb = blocks.shape
    nbi = rb // fmt.block_bytes
    raw = blocks.reshape(rows, nbi, fmt.block_bytes)
    if out is None:
        out = xp.empty(rows * rb, dtype=xp.uint8)
    if out.shape != (rows * rb,) or out.dtype != np.uint8:
        raise InvalidArgumentError(f"repack: out must be ({rows * rb},) uint8, got {out.shape} {out.dtype}")
    full = rows // TILE * TILE
    off = 0
    for (lo, hi), e in _planes(fmt):
        p = raw[:, :, lo:hi].reshape(rows, -1, e)                 # (rows, NU, E)
        nu = p.shape[1]
        if full:
            size = full * nu * e
            out[off:off + size].reshape(full // TILE, nu, TILE, e)[...] = \
                p[:full].reshape(full // TILE, TILE, nu, e).transpose(0, 2, 1, 3)
            off += size
        if rows > full:
            size = (rows - full) * nu * e
            out[off:off + size].reshape(nu, rows - full, e)[...] = p[full:].transpose(1, 0, 2)
            off += size
    return out


def unpack(xp, flat, fmt, rows: int, cols: int):
    """Inverse of repack: the flat kernel layout -> (rows, row_bytes) block rows."""
    fmt = FORMATS[fmt] if isinstance(fmt, str) else fmt
    nbi = cols // fmt.block
    out = xp.empty((rows, nbi, fmt.block_bytes), dtype=xp.uint8)
    full = rows // TILE * TILE
    off = 0
    for (lo, hi), e in _planes(fmt):
        nu = (hi - lo) // e * nbi
        if full:
            size = full * nu * e
            t = flat[off:off + size].reshape(full // TILE, nu, TILE, e).transpose(0, 2, 1, 3)
            out[:full, :, lo:hi] = t.reshape(full, nbi, hi - lo)
            off += size
        if rows > full:
            w = rows - full
            size = w * nu * e
            t = flat[off:off + size].reshape(nu, w, e).transpose(1, 0, 2)
            out[full:, :, lo:hi] = t.reshape(w, nbi, hi - lo)
            off += size
    return out.reshape(rows, nbi * fmt.block_bytes)


class _RowsCols:
    """What the model and the op checks ask of any weight: its 2-d shape."""

    __slots__ = ()

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def ndim(self) -> int:
        return 2


class CudaQuantMatrix(_RowsCols):
    """A quantized (rows, cols) weight on the GPU: repacked block bytes + format + shape."""

    __slots__ = ("data", "fmt", "rows", "cols", "nbi", "file_fmt")

    def __init__(self, data, fmt: WeightFormat, rows: int, cols: int, file_fmt: WeightFormat | None = None):
        self.data = data            # flat uint8 device array in the kernel layout
        self.fmt = fmt
        self.rows = int(rows)
        self.cols = int(cols)
        self.nbi = self.cols // fmt.block      # items per row: blocks, or superblocks of the K-quants
        self.file_fmt = file_fmt or fmt        # the file's format: q5_0 where widened (widen.py)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def file_nbytes(self) -> int:
        """Bytes of the matrix in the file's format (nbytes unless widened)."""
        return self.rows * (self.cols // self.file_fmt.block) * self.file_fmt.block_bytes

    def __repr__(self) -> str:
        wide = "" if self.file_fmt is self.fmt else f" widened from {self.file_fmt.name}"
        return f"CudaQuantMatrix({self.fmt.name}{wide}, shape={self.shape}, {self.nbytes} bytes)"


class CudaQuantStack(_RowsCols):
    """A layer's quantized q, k and v stacked by rows for one decode launch: ``qmv_qkv_<fmt>``
    when the three share a format, ``qmv_qkv_pair`` (a module per format pair) when v has its
    own. Holds the uploaded matrices themselves, no bytes of its own; prefill keeps using
    each matrix on its own."""

    __slots__ = ("parts", "fmt", "fmt_v", "rows", "cols", "nbi")

    def __init__(self, parts: tuple):
        self.parts = parts
        self.fmt = parts[0].fmt           # q's and k's
        self.fmt_v = parts[2].fmt
        self.rows = sum(p.rows for p in parts)
        self.cols = parts[0].cols
        self.nbi = parts[0].nbi

    @property
    def nbytes(self) -> int:
        return 0        # the parts hold the bytes

    def __repr__(self) -> str:
        v = "" if self.fmt_v is self.fmt else f" + v {self.fmt_v.name}"
        return f"CudaQuantStack({self.fmt.name}{v}, {[p.shape for p in self.parts]})"


_PAIR_HEAVY = {"q5_k", "q6_k"}      # formats stack_rows keeps out of pairs (see there)


def stack_rows(mats, sm_count: int = 0) -> CudaQuantStack | None:
    """q, k, v -> one stack when the three are quantized matrices of one width, q and k of
    one format, k and v of one height (what qmv_qkv computes); None otherwise.

    v of another format (some layers of Q4_K_M and Q5_K_M files) is stacked only where the
    three fit one wave of ``sm_count`` blocks: there a launch costs more than its bytes
    (SmolLM2-135M Q4_K_M, whose rows of 576 fall back to q5_0 and q8_0). On Llama-2-7B
    Q4_K_M such stacks measured 4-10% slower than three launches, both as one launch with
    two code paths and as q and k stacked after v's own launch
    (bench/results/cuda_quant_model_h100.md). Nor with q5_k or q6_k on either side: their
    bodies want 160-200 registers, which the pair kernels' 512-thread bound would spill
    (the single-format kernels of those two run unbounded), and such pairs were not timed."""
    if len(mats) != 3 or not all(isinstance(m, CudaQuantMatrix) for m in mats):
        return None
    q, k, v = mats
    if not (k.fmt is q.fmt and k.cols == q.cols == v.cols and k.rows == v.rows):
        return None
    stack = CudaQuantStack(tuple(mats))
    if v.fmt is not q.fmt and (_tiles(stack) > sm_count or {q.fmt.name, v.fmt.name} & _PAIR_HEAVY):
        return None
    return stack


def upload(be, qm: QuantMatrix) -> CudaQuantMatrix:
    """QuantMatrix (host block bytes) -> CudaQuantMatrix; reordered on the device.

    The result comes from CuPy's pool, where it stays for the model's life; the raw copy it
    is reordered from is allocated outside the pool and freed at once. Freed back into the
    pool, such transients were carved up by the next tensors' arrays, and the pieces left
    free could never be returned: 1.1 GiB over the file's tensors and the KV cache on a
    Llama-2-7B Q8_0 (bench/results/cuda_quant_model_h100.md). A small q5_0 matrix
    is uploaded as q8_0 of the same values where ``be.widen_kib_per_sm`` allows (widen.py)."""
    _layout(qm.fmt)
    fmt, nbytes = qm.fmt, qm.nbytes
    if widen.widens(fmt, qm.rows, qm.cols, be.sm_count, be.widen_kib_per_sm):
        fmt, nbytes = widen.Q8_0, widen.widened_bytes(qm.rows, qm.cols)
    be.check_fits(qm.nbytes + nbytes)   # the raw copy lives until the repacked one exists
    with _upload_errors(be, qm):
        flat = cp.empty(nbytes, dtype=cp.uint8)
        _repack_into(qm, fmt, flat)
    return CudaQuantMatrix(flat, fmt, qm.rows, qm.cols, file_fmt=qm.fmt)


def _repack_into(qm: QuantMatrix, fmt: WeightFormat, flat) -> None:
    """qm's blocks (widened to ``fmt`` where it differs) reordered into ``flat`` (device bytes);
    the raw copy in between outside CuPy's pool (see upload)."""
    pool = cp.get_default_memory_pool()
    if pool.free_bytes():
        pool.free_all_blocks()      # check_fits counted them, and cudaMalloc cannot use them
    with cp.cuda.using_allocator(None):         # cudaMalloc / cudaFree, no pool
        raw = cp.asarray(np.ascontiguousarray(qm.data))
        if fmt is not qm.fmt:
            raw = widen.widen_q8_0(cp, raw)
        repack(cp, raw, fmt, out=flat)
        del raw


@contextmanager
def _upload_errors(be, qm: QuantMatrix):
    """CUDA's allocation failures while uploading ``qm`` as one ModelLoadError line."""
    try:
        yield
    except (cp.cuda.memory.OutOfMemoryError, cp.cuda.runtime.CUDARuntimeError) as e:
        # the pool reports OutOfMemoryError; cudaMalloc outside it, a CUDARuntimeError
        oom = (isinstance(e, cp.cuda.memory.OutOfMemoryError)
               or getattr(e, "status", None) == cp.cuda.runtime.errorMemoryAllocation)
        what = "out of GPU memory" if oom else f"a CUDA error ({str(e).strip()})"
        raise ModelLoadError(f"{what} uploading a {qm.nbytes / 2**20:.1f} MiB {qm.fmt.name} tensor "
                             f"to {be.device_name}") from None


class ExpertStack:
    """One role (gate, up or down) of a layer's experts, quantized: E matrices of one format and
    shape back to back in one device array, expert e's at byte e * stride (each in the layout
    of CudaQuantMatrix), so one launch can pick its experts by their ids on the device."""

    __slots__ = ("data", "fmt", "rows", "cols", "nbi", "count", "stride")

    def __init__(self, data, fmt: WeightFormat, rows: int, cols: int, count: int):
        self.data = data            # (count * stride,) uint8 device array
        self.fmt, self.rows, self.cols, self.count = fmt, int(rows), int(cols), int(count)
        self.nbi = self.cols // fmt.block
        self.stride = self.rows * self.nbi * fmt.block_bytes

    @property
    def shape(self) -> tuple[int, int]:
        """One expert's matrix: (rows, cols)."""
        return (self.rows, self.cols)

    def matrix(self, e: int) -> CudaQuantMatrix:
        """Expert e's matrix: a view of the stack's bytes."""
        return CudaQuantMatrix(self.data[e * self.stride:(e + 1) * self.stride], self.fmt, self.rows, self.cols)


def upload_expert_stack(be, mats) -> ExpertStack:
    """One role of a layer's experts (QuantMatrix of one format and shape, one an expert) ->
    one device array, the file's bytes reordered expert by expert (never widened: a launch
    spans every chosen expert, so one matrix's size says nothing of its grid)."""
    first = mats[0]
    _layout(first.fmt)
    total = sum(m.nbytes for m in mats)
    be.check_fits(total + first.nbytes)
    with _upload_errors(be, first):
        flat = cp.empty(total, dtype=cp.uint8)
    stack = ExpertStack(flat, first.fmt, first.rows, first.cols, len(mats))
    for e, m in enumerate(mats):
        with _upload_errors(be, m):
            _repack_into(m, first.fmt, flat[e * stack.stride:(e + 1) * stack.stride])
    return stack


# -- kernels --------------------------------------------------------------------------------
_MODULES: dict = {}       # (device id, fmt, extra defines) -> RawModule


def _source() -> str:
    return assemble(("common.cuh", "quant_matvec.cu"))


def _module(be, fmt: str):
    """The compiled kernels of one format, or of a pair "qk+v" (qmv_qkv_pair, qmv_qkv_rope_pair)."""
    defines = tuple(be.compile_defines)         # experiments and tracing (bench/trace_cuda_decode.py)
    key = (be.device.id, fmt, defines)
    mod = _MODULES.get(key)
    if mod is None:
        src = _source()
        qk, pair, v = fmt.partition("+")
        if pair:
            which, first = (f"-DQMV_PAIR_QK=QF_{qk}", f"-DQMV_PAIR_V=QF_{v}"), "qmv_qkv_pair"
        else:
            which, first = (f"-DQMV_{fmt}",), f"qmv_{fmt}"
        errors = []
        for opts in ((), ("-DCYLLM_PLAIN_LOADS",)):
            try:
                mod = cp.RawModule(code=src, options=which + opts + defines)
                mod.get_function(first)                # forces the NVRTC compile now
                break
            except Exception as e:  # noqa: BLE001 - CompileException, or a driver refusing the cubin
                errors.append(e)
                mod = None
        if mod is None:
            first = str(errors[0]).strip().splitlines()
            raise BackendUnavailableError(
                f"the cuda {fmt} kernels failed to compile ({first[0] if first else type(errors[0]).__name__})")
        _MODULES[key] = mod
    return mod


def kernel(be, name: str, fmt: str):
    """The compiled kernel ``name`` of format (or pair "qk+v") ``fmt`` (cached on the backend)."""
    cache = be.__dict__.setdefault("_qkernels", {})
    key = (name, fmt, tuple(be.compile_defines))    # kernels built two ways in one process (sweeps)
    k = cache.get(key)
    if k is None:
        k = cache[key] = _module(be, fmt).get_function(name)
    return k


# CUfunction handle -> the shared-memory carveout (%) set on it. The attribute belongs to the
# function, which every backend of the process shares (the compiled modules are cached per
# device), so this cache is the process's too; absent = unknown, set at the next use.
_CARVEOUT: dict = {}
# formats whose matvec runs faster with the largest shared-memory carveout (percent of the
# unified L1/shared array), measured on an H100 under PDL (bench/results/cuda_quant_h100.md):
# one-wave grids (4096 rows) gain -- q4_k 4096x4096 61% -> 77% of copy bandwidth, q6_k 70 -> 80,
# q5_k 66 -> 73 -- while grids of several waves lose a little (q4_k 11008x4096 82 -> 74,
# 32000x4096 94 -> 90). The 32-element 4/5-bit formats lose at 4096x4096 too (q4_0 51 -> 46):
# the driver's choice stays for them. Asking only for room for two blocks did not help, so
# co-residency does not explain it all. The attribute is per kernel; a per-launch choice
# (cuLaunchKernelEx's preferred-carveout launch attribute, one-wave launches only) is the
# measured-best rule, not done here. q8_0 left this list: alone its 4096x4096 matvec gained
# (87 -> 93), but Llama-2-7B's Q8_0 decode with every q8_0 matvec at the driver's choice ran
# 466.7 -> 489.3 tok/s at depth 0 and 353.6 -> 376.4 at 4096 on an H200, 366.5 -> 368.9 and
# 273.8 -> 281.5 on an H100 (bench/results/cuda_quant_model_h100.md, twenty-sixth session).
_CARVEOUT_MAX = ("q4_k", "q5_k", "q6_k")
_MATCH_CARVEOUT = ("q4_k", "q5_k", "q6_k")     # measured on q4_k + q6_k (Q4_K_M); q5_k by kinship


def set_carveout(k, want: int) -> None:
    """Set kernel ``k``'s preferred shared-memory carveout (percent, -1 = the driver's choice)
    unless it already has that value."""
    fn = getattr(k, "kernel", k)                # RawKernel -> its cupy.cuda.Function
    key = getattr(fn, "ptr", None) or id(k)
    if _CARVEOUT.get(key) != want:
        k.preferred_shared_memory_carveout = want
        _CARVEOUT[key] = want


def _carveout(be, k, fmt: str, want: int | None = None) -> None:
    """Set a quantized matvec's carveout: ``want`` or the table above (``be.qmv_carveout``
    overrides both, for experiments)."""
    forced = getattr(be, "qmv_carveout", None)
    if want is None:
        want = 100 if fmt in _CARVEOUT_MAX else -1
    if forced is not None:
        want = int(forced)
    # attention and rope_store follow the K-quants' (CudaBackend._same_carveout); q8_0's decode
    # at depth 4096 was 3.6% slower with them at its then largest carveout (H100)
    be._matvec_carveout = want if fmt in _MATCH_CARVEOUT else None
    set_carveout(k, want)


# gate+up of the 32-element 4/5-bit formats over several blocks an SM: a carveout that holds
# only the blocks a balanced wave needs (ceil(tiles / SMs)), not more. Llama-2-7B's 344 tiles
# of q4_0 (4 warps, 7.2 KB a block) fit 4 blocks an SM under the driver's carveout and 3 under
# this one: alone, 65% -> 76% of copy bandwidth on an H200 and 79% -> 85% on an H100; in decode
# at depth 0, 597 -> 618 and 604 -> 619 tok/s in two H200 runs (a fixed 8%: the same 3 blocks;
# this rule itself ran on the H100 only) and +0.9% to +1.7% in three H100 runs (530 -> 535 the
# last), unchanged at depth 4096 (H100). Not q8_0: its gate+up alone gained (86% -> 91%, H200)
# and its decode, against the largest carveout it had then, not at depth (H100: +4% at depth 0,
# -4% at 4096; H200: 466.7 -> 486.9 tok/s at depth 0, 353.6 -> 349.7 at 4096), where the
# driver's choice for all its matvecs (its rule now) ran 489.3 and 376.4; nor the K-quants,
# whose matvecs keep the largest carveout (q4_k 584 vs 581, H200). Nor one-wave launches
# (small models): their next kernel's blocks must fit beside them under PDL
# (bench/results/cuda_quant_model_h100.md, eighteenth session; q8_0's figures, twenty-sixth).
_BALANCED_GATE_UP = ("q4_0", "q4_1", "q5_0", "q5_1")


def _balanced_carveout(be, smem: int, tiles: int) -> int:
    """Percent of the SM's shared-memory capacity that holds ceil(tiles / SMs) blocks of ``smem``
    bytes (the driver rounds up to the next configuration it has); -1 when unknown."""
    cap = getattr(be, "smem_per_sm", 0)
    if cap <= 0 or be.sm_count <= 0:
        return -1
    blocks = -(-tiles // be.sm_count)
    need = blocks * (smem + getattr(be, "smem_reserved_per_block", 1024))
    return max(1, min(100, -(-100 * need // cap)))


def _shared_bytes(n: int, warps: int, nm: int) -> int:
    # int8 codes (n) + one 16-byte entry per 32 elements + partial sums + sums of x^2
    return n + 16 * (n // 32) + 4 * (nm * warps * TILE + warps)


def _items_in_flight(fmt: str, nm: int, qx: bool) -> int:
    """Items of each matrix a warp holds in flight in qmv_tile (quant_matvec.cu's batch shape:
    B items a batch, P batches) over nm matrices (2: gate+up); qx: the prequantized kernel."""
    units, _, pa, pb, b = LAYOUTS[fmt]
    side = sum(hi - lo for lo, hi in (pa or (0, 0), pb or (0, 0)))    # bytes of the planes: EA + EB
    wide = qx and units == 1        # 16-byte items, prequantized: deeper (qmv_tile says why)
    if nm == 1:
        return (3 if wide else 2) * b
    if wide and side <= 4:
        return 2 * b                # gate+up, a whole batch a matrix
    return 2 * (b // 2) if b > 1 else 1     # gate+up halves the batch; the K-quants: one batch


def matvec_warps(be, w, nm: int, qx: bool = False, tiles: int | None = None) -> int:
    """Warps per block: enough that each warp's item slice is about one batch of loads.
    w: a CudaQuantMatrix or CudaQuantStack (its tiles are launched as one grid), or an
    ExpertStack with ``tiles``, the blocks of the launch over the chosen experts."""
    forced = getattr(be, "qmv_warps", None)
    if forced:
        return max(1, min(int(forced), MAX_WARPS))
    in_flight = _items_in_flight(w.fmt.name, nm, qx)
    warps = max(1, min(MAX_WARPS, -(-w.nbi // in_flight)))
    if (_tiles(w) if tiles is None else tiles) <= be.sm_count:
        # one wave with items to spare (short rows, small models): at least 8 warps, so each
        # warp's chain of loads, staging and dots is short (SmolLM2-135M decode on an H100:
        # q8_0 1314 -> 1421 tok/s, q4_0 1135 -> 1189; rows of 4096 already get 8 or more)
        warps = max(warps, min(8, w.nbi))
    else:
        # several waves of tiles: small blocks, several per SM, so one block's tail overlaps
        # the next one's loads (measured on an H100, bench/results/cuda_quant_h100.md)
        warps = min(warps, 8 if w.fmt.name == "q8_0" else 4)
    return warps


NULL_ARG = np.int64(0)    # a null pointer argument (kernels without the folded norm never read it)


def _tiles(w) -> int:
    """Row tiles of one launch over w (a matrix or a stack)."""
    parts = w.parts if isinstance(w, CudaQuantStack) else (w,)
    return sum(-(-p.rows // TILE) for p in parts)


def qkv_args_ok(out, w: CudaQuantStack, x) -> bool:
    """Shapes, dtypes and layout qmv_qkv takes: x (cols,), out (rows,), float32, contiguous."""
    return (x.shape == (w.cols,) and out.shape == (w.rows,) and x.dtype == np.float32
            and out.dtype == np.float32 and x.flags.c_contiguous and out.flags.c_contiguous)


_TAKE = object()          # qmatvec_qkv's default: take a held-back rmsnorm from the backend


def _qkv_launch(be, out, w: CudaQuantStack, x, norm, warps_per_tile: int, extra: tuple, qx=None) -> None:
    """One launch of a qmv_qkv kernel: ``warps_per_tile`` warps per row tile, tiles per block
    = 1 (qmv_qkv) or 2 (qmv_qkv_rope, ``extra`` its rope and cache arguments); the pair
    module's kernel (qmv_qkv[_rope]_pair) where v has its own format; its ``_qx`` variant
    where x comes prequantized in ``qx`` (prequant.py)."""
    wq, wk, wv = w.parts
    n = w.cols
    kind = "qmv_qkv_rope" if extra else "qmv_qkv"
    pair = w.fmt_v is not w.fmt
    name, fmt = (f"{kind}_pair", f"{w.fmt.name}+{w.fmt_v.name}") if pair else (f"{kind}_{w.fmt.name}", w.fmt.name)
    k = kernel(be, (f"{name}_norm" if norm is not None else name) + ("_qx" if qx is not None else ""), fmt)
    per_block = 1 if not extra else 2
    cap = max(1, getattr(k, "max_threads_per_block", 1024) // (32 * per_block))
    warps = min(warps_per_tile, cap)
    one = (_shared_bytes(n, warps, 1) + 15) & ~15
    smem = per_block * one + (4 * 4 * TILE if extra else 0)      # + the second tile's rows, cos, sin, pos
    allow_smem(k, smem)
    _carveout(be, k, w.fmt.name)        # a pair follows q's and k's format (the most tiles)
    head = (out, wq.data, wk.data, wv.data)
    dims = (np.int32(wq.rows), np.int32(wk.rows), np.int32(w.nbi))
    if pair:
        dims += (np.int32(wv.nbi),)
    if norm is not None:
        xn, xin, nw, eps = norm
        args = head + (xin,) + dims + (nw, np.float32(eps), NULL_ARG if xn is None else xn) + extra
    else:
        args = head + (x,) + dims + (NULL_ARG, np.float32(0.0), NULL_ARG) + extra
    args += (qx if qx is not None else NULL_ARG,)
    be._launch(k, (_tiles(w) // per_block,), (TILE * warps * per_block,), args, shared_mem=smem)


def qmatvec_qkv(be, out, w: CudaQuantStack, x, norm=_TAKE, qx=None) -> None:
    """out (dq + 2 dk,) = [Wq x | Wk x | Wv x] in one launch (a held-back rmsnorm whose
    output is x folded in, as in qmatvec; ``norm``: one taken already, with ``qx``, x
    prequantized by the held-back producer taken with it); the bits of three qmatvec calls."""
    if not qkv_args_ok(out, w, x):
        be._flush()
        raise InvalidArgumentError(f"q/k/v stack ({w.fmt.name}, v {w.fmt_v.name}): shapes {w.shape} @ "
                                   f"{tuple(x.shape)} -> {tuple(out.shape)}")
    if norm is _TAKE:
        norm, qx = be._take_input(out, x)
    _qkv_launch(be, out, w, x, norm, matvec_warps(be, w, 1, qx is not None), (), qx)


def rope_fold_pays(be, w: CudaQuantStack) -> bool:
    """Whether qmv_qkv_rope beats qmv_qkv + rope_store for this stack. Its blocks hold two
    tiles, each with qmv_qkv's warps (at most 8: 512 threads a block, so where qmv_qkv would
    give a tile more, the two kernels' sums split differently): where the grid is more than
    one wave and a tile has more than 4 warps (q8_0 on rows of 4096: 16-warp blocks, a
    register file each) it does not. Measured on an H100 (bench/results/cuda_quant_model_h100.md),
    Llama-2-7B decode: Q4_0 +1.7 to 2.1%, Q4_K_M +0.9% (4 warps a tile; 2 or 8 instead: -8%
    and -2%), Q8_0 -0.9% at 8 warps a tile and -6% at 4; SmolLM2-135M (one wave): Q4_0 and
    Q8_0 +3%."""
    return _tiles(w) // 2 <= be.sm_count or matvec_warps(be, w, 1) <= 4


def qmatvec_qkv_rope(be, out, w: CudaQuantStack, x, norm, cos, sin, k_cache, v_cache, pos, qx=None) -> None:
    """qmatvec_qkv then rope_store(q, k, v, cos, sin, k_cache, v_cache, pos) on its output, as
    one launch (qmv_qkv_rope_<fmt>, or qmv_qkv_rope_pair; the caller, RopeFolding, checked the shapes: head_dim %
    64 == 0, every dimension rotated). ``pos``: the kernel's position argument (-1: the step
    buffer)."""
    n_pos = cos.shape[0]
    n_kv, max_ctx, hd = k_cache.shape
    extra = (cos, sin, k_cache, v_cache, be._step, pos, np.int32(n_pos), np.int32(max_ctx), np.int32(hd))
    forced = getattr(be, "qkv_rope_warps", None)        # experiments (bench/sweep_cuda_decode.py --vary)
    warps = int(forced) if forced else matvec_warps(be, w, 1, qx is not None)
    _qkv_launch(be, out, w, x, norm, warps, extra, qx)


def qmatvec(be, out, w, x, mode: str = "matvec", act: str | None = None, hold: bool = False) -> None:
    """Decode matvec on quantized weights.

    mode "matvec": out (d,) = W x;  "add": out += W x;  "gate_up": w = (w_gate, w_up),
    out = act(w_gate x) * (w_up x) with act "silu" or "gelu_tanh". x (n,) float32.
    A held-back rmsnorm whose output is x is folded into the kernel, and x taken
    prequantized from a held-back matvec that writes it; ``hold``: this launch may itself
    be held back for the next op (prequant.py; the backend's own matvec ops).
    """
    if mode == "gate_up":
        if not (isinstance(w, tuple) and len(w) == 2):
            be._flush()
            raise InvalidArgumentError("gate_up: w must be the pair (w_gate, w_up)")
        w0, w1 = w
        if act not in _GLU_PREFIX:
            be._flush()
            raise InvalidArgumentError(f"act must be one of {', '.join(_GLU_PREFIX)}, got {act!r}")
        if not (isinstance(w0, CudaQuantMatrix) and isinstance(w1, CudaQuantMatrix)
                and w1.fmt is w0.fmt and w1.shape == w0.shape):
            _gate_up_split(be, out, w0, w1, x, act)
            return
        prefix, nm = _GLU_PREFIX[act], 2
    elif mode in _PREFIX:
        w0 = w1 = w
        prefix, nm = _PREFIX[mode], 1
    else:
        be._flush()
        raise InvalidArgumentError(f"qmatvec: unknown mode {mode!r}")
    d, n = w0.shape
    if x.shape != (n,) or out.shape != (d,) or x.dtype != np.float32 or out.dtype != np.float32:
        be._flush()
        raise InvalidArgumentError(f"{prefix}{w0.fmt.name}: shapes {w0.shape} @ {tuple(x.shape)} -> {tuple(out.shape)}")
    if not (x.flags.c_contiguous and out.flags.c_contiguous):
        be._flush()
        raise InvalidArgumentError(f"{prefix}{w0.fmt.name}: x and out must be contiguous")
    norm, qx = be._take_input(out, x)
    fmt = w0.fmt.name
    name = f"{prefix}{fmt}" + ("_norm" if norm is not None else "") + ("_qx" if qx is not None else "")
    k = kernel(be, name, fmt)
    warps = min(matvec_warps(be, w0, nm, qx is not None), max(1, getattr(k, "max_threads_per_block", 1024) // 32))
    smem = _shared_bytes(n, warps, nm)
    allow_smem(k, smem)
    grid, block = (-(-d // TILE),), (TILE * warps,)
    balanced = (nm == 2 and fmt in _BALANCED_GATE_UP and grid[0] > be.sm_count
                and getattr(be, "qmv_gate_up_balanced", True))      # False: the measured before
    _carveout(be, k, fmt, _balanced_carveout(be, smem, grid[0]) if balanced else None)
    if norm is not None:
        xn, xin, nw, eps = norm
        args = (out, w0.data, w1.data, xin, np.int32(d), np.int32(w0.nbi), nw, np.float32(eps),
                NULL_ARG if xn is None else xn)
    else:
        args = (out, w0.data, w1.data, x, np.int32(d), np.int32(w0.nbi), NULL_ARG, np.float32(0.0), NULL_ARG)
    args += (qx if qx is not None else NULL_ARG,)
    if hold and be._hold_producer(k, grid, block, args, smem, out):
        return
    # every kernel, folded norm or not, goes out with programmatic dependent launch under
    # decode_step: activations are read with ordered coherent loads (ld_act in common.cuh)
    be._launch(k, grid, block, args + (NULL_ARG, NULL_ARG), shared_mem=smem)


_EXPERT_KERNELS = {None: "qmv_experts_", "silu": "qmv_experts_gate_up_silu_", "gelu_tanh": "qmv_experts_gate_up_gelu_"}


def qmatvec_experts(be, out, w0: ExpertStack, w1: ExpertStack | None, ids, x, ldx: int,
                    act: str | None = None) -> None:
    """A token's chosen experts in one launch (decode; cuda/quant_matvec.cu, qmv_experts_*):
    for each rank j of ids (k,) int32 on the device, out[j] = W0[ids[j]] x[j] (w1 None), or
    act(W0[ids[j]] x[j]) * (W1[ids[j]] x[j]); out (k, rows) float32, x row j at x + j * ldx
    (0: one vector for every expert)."""
    k = ids.shape[0]
    d, n = w0.rows, w0.cols
    fmt = w0.fmt.name
    nm = 1 if w1 is None else 2
    kern = kernel(be, _EXPERT_KERNELS[act] + fmt, fmt)
    tiles = -(-d // TILE)
    warps = min(matvec_warps(be, w0, nm, tiles=tiles * k), max(1, getattr(kern, "max_threads_per_block", 1024) // 32))
    smem = _shared_bytes(n, warps, nm)
    allow_smem(kern, smem)
    _carveout(be, kern, fmt)
    args = (out, w0.data, (w0 if w1 is None else w1).data, np.int64(w0.stride), ids, np.int32(w0.count), x,
            np.int32(ldx), np.int32(d), np.int32(w0.nbi))
    be._launch(kern, (tiles, k), (TILE * warps,), args, shared_mem=smem)


# CUfunction handle -> the dynamic shared memory limit raised to. The attribute belongs to the
# function, as the carveout does (_CARVEOUT); a Python object's id could be reused by another
# kernel's object once the first is freed, a handle lives as long as its cached module
_SMEM_SET: dict = {}


def allow_smem(k, smem: int) -> None:
    """Raise the kernel's dynamic shared memory limit past the default 48 KiB: a matvec's very
    long rows (n > ~37k), the few-column prefill kernels' staging."""
    fn = getattr(k, "kernel", k)                # RawKernel -> its cupy.cuda.Function
    key = getattr(fn, "ptr", None) or id(k)
    # the default limit is 48 KiB less the kernel's static shared memory: raised from 32 KiB on
    if smem > 32 * 1024 and _SMEM_SET.get(key, 0) < smem:
        try:
            k.max_dynamic_shared_size_bytes = smem
        except Exception as e:  # noqa: BLE001 - more than the device allows
            raise InvalidArgumentError(f"a row of this length needs {smem} bytes of shared memory ({e})") from None
        _SMEM_SET[key] = smem


def _gate_up_split(be, out, wg, wu, x, act) -> None:
    """Gate and up of different formats (or one F16): two matvecs and the elementwise GLU product."""
    if wg.shape != wu.shape:
        be._flush()
        raise InvalidArgumentError(f"gate_up: gate {tuple(wg.shape)} and up {tuple(wu.shape)} differ")
    up = be._buf("qmv_up", out.shape[0], cp.float32)      # allocated in the eager step, before capture
    # a held-back rmsnorm folds into the gate matvec, whose block 0 writes x for the up matvec
    be.matvec(out, wg, x)
    be.matvec(up, wu, x)
    be._flush()                 # the up matvec may be held back (prequant.py): it goes first
    n = out.shape[0]
    be._k(_GLU_KERNELS[act])((-(-n // 256),), (256,), (out, out, up, np.int32(n)))


# -- prefill and lookups ---------------------------------------------------------------------
def dequantize_rows(be, w: CudaQuantMatrix, r0: int, nrows: int, out16) -> None:
    """Rows [r0, r0 + nrows) of w -> out16 ((nrows, cols) float16, contiguous)."""
    fmt = w.fmt.name
    groups = w.cols // 32
    if r0 % TILE:
        raise InvalidArgumentError(f"dequantize_rows: the first row {r0} is not a multiple of {TILE}")
    total = -(-nrows // TILE) * TILE * groups       # one lane per row of each 32-row tile
    kernel(be, f"qdeq_f16_{fmt}", fmt)((-(-total // 256),), (256,),
                                       (out16, w.data, np.int32(w.rows), np.int32(w.nbi),
                                        np.int32(r0), np.int32(nrows)))


def dequantize(be, w: CudaQuantMatrix):
    """The whole matrix as a new (rows, cols) float16 device array (tests, debugging)."""
    be._flush()
    out = cp.empty((w.rows, w.cols), dtype=cp.float16)
    dequantize_rows(be, w, 0, w.rows, out)
    return out


def _tile_rows(w: CudaQuantMatrix) -> int:
    return max(TILE, min(w.rows, _DEQ_TILE_ELEMS // w.cols) // TILE * TILE)


def _qmm_smem(n: int, warps: int, columns: int) -> int:
    # the staged columns (int8 codes and a 16-byte entry per 32 elements each), then the
    # partial sums of every warp
    return columns * (n + n // 2) + 4 * columns * warps * TILE


def _qmm_warps(be, w: CudaQuantMatrix, k) -> int:
    """Warps a block of qmm: about one batch of loads each (the K-quants: one superblock), at
    most QMM_WARPS, and what the kernel's registers allow."""
    forced = getattr(be, "qmv_warps", None)
    b = LAYOUTS[w.fmt.name][4]
    in_flight = 2 * b if b > 1 else 1             # qmm_body's P batches of B items
    warps = int(forced) if forced else min(QMM_WARPS, -(-w.nbi // in_flight))
    return max(1, min(warps, MAX_WARPS, getattr(k, "max_threads_per_block", 1024) // 32))


def _qmma_chunk(fmt: WeightFormat) -> int:
    """Elements of one qmma chunk (QmmaChunk in quant_matvec.cu)."""
    if fmt.block > 32:
        return fmt.block
    return 128 if LAYOUTS[fmt.name][0] == 2 else 256      # q8_0's two units an item: 4 items, else 8


def _qmma_smem(fmt: WeightFormat, columns: int, warps: int) -> int:
    # a warp: two chunk buffers (codes rows of KC + 16 bytes, a 16-byte entry per 32 elements)
    # and its rows' codes and scales (32 x 48 + 32 x 16 bytes)
    kc = _qmma_chunk(fmt)
    return warps * (2 * columns * (kc + 16 + kc // 2) + TILE * 64)


def qmma_available(be) -> bool:
    """Whether the int8 tensor-core kernels run here: sm_80 or newer, and ``be.qmm_mma``."""
    return bool(getattr(be, "qmm_mma", False)) and getattr(be, "compute_capability", (0, 0)) >= (8, 0)


def _qmma_kernel(be, w, t: int, limit: int, kind: str = ""):
    """(kernel, columns, warps, shared bytes) of the tensor-core few-column product for t
    columns (``kind`` "_experts": the grouped experts' kernel), or None: switched off
    (``be.qmm_mma``), a GPU older than sm_80, or no fit. w: a CudaQuantMatrix or ExpertStack."""
    if not qmma_available(be):
        return None
    fmt = w.fmt.name
    c = next((c for c in QMMA_COLUMNS if t <= c), QMMA_COLUMNS[-1])
    k = kernel(be, f"qmma{c}{kind}_{fmt}", fmt)
    forced = getattr(be, "qmma_warps", None)
    chunks = -(-w.cols // _qmma_chunk(w.fmt))
    warps = int(forced) if forced else min(QMMA_WARPS, chunks)
    warps = max(1, min(warps, MAX_WARPS, getattr(k, "max_threads_per_block", 1024) // 32))
    while warps > 1 and _qmma_smem(w.fmt, c, warps) > limit:
        warps -= 1
    smem = _qmma_smem(w.fmt, c, warps)
    return (k, c, warps, smem) if smem <= limit else None


def qmatmul_few(be, out, w: CudaQuantMatrix, x, beta: float) -> bool:
    """out (T, d) f32 (+)= x (T, n) f32 @ W^T over a few columns: x quantized to int8 blocks as
    decode's is, each weight item read once for C columns, on int8 tensor cores (qmma in
    quant_matvec.cu; sm_80+ and ``be.qmm_mma``, its staging a chunk at a time within the
    GPU's shared memory a block) or else with dp4a dots (qmm). False (nothing launched) when
    T is over ``be.qmm_few_max``, beta is neither 0 nor 1, x is not float32, or qmm's staging
    of even 4 columns would not fit a block's shared memory (QMM_SMEM_MAX, or less where the
    GPU allows less)."""
    t, n = x.shape
    if t > getattr(be, "qmm_few_max", 0) or beta not in (0.0, 1.0) or x.dtype != np.float32:
        return False
    fmt = w.fmt.name
    per_block = getattr(be, "smem_per_block", 48 * 1024)        # the GPU's opt-in limit
    limit = min(QMM_SMEM_MAX, per_block)
    mma = _qmma_kernel(be, w, t, per_block)
    if mma is not None:
        k, c, warps, smem = mma
    else:
        for c in QMM_COLUMNS:
            k = kernel(be, f"qmm_c{c}_{fmt}", fmt)
            warps = _qmm_warps(be, w, k)
            smem = _qmm_smem(n, warps, c)
            if smem <= limit:
                break
        else:
            return False
    ldo = be._rows(out, "matmul")
    qs = n + n // 2                               # bytes of one quantized row (qx_rows)
    qx = be._buf("qmm_qx", t * qs, cp.uint8)
    quantize_rows(be, qx, x, fmt)
    allow_smem(k, smem)
    grid = (_tiles(w) * -(-t // c),)
    k(grid, (TILE * warps,), (out, np.int32(ldo), np.int32(beta != 0.0), w.data, qx, np.int32(qs),
                              np.int32(t), np.int32(w.rows), np.int32(w.nbi)), shared_mem=smem)
    return True


def quantize_rows(be, qx, x, fmt: str) -> None:
    """x (T, n) f32 rows -> qx (T rows of n + n/2 bytes: int8 codes, then a 16-byte entry per
    32 elements), as decode's staging rounds a vector (qx_rows, in ``fmt``'s module)."""
    t, n = x.shape
    kernel(be, "qx_rows", fmt)((-(-n // 2048), t), (128,),
                               (qx, np.int32(n + n // 2), x, np.int32(be._rows(x, "matmul")), np.int32(n)))


def qmatmul_experts(be, outs, ws, work, n_work, groups: int, slots, n_used: int, qx, columns: int) -> None:
    """A mixture of experts' products over a chunk grouped by expert (cuda/moe.cu moe_group):
    for each group (expert e, first sorted position p, c columns) of work, below n_work,
    outs[i][p:p+c] = the group's rows of qx @ ws[i][e]^T, the rows of qx being its entries'
    tokens (slots[q] / n_used; slots None: rows p..p+c-1). ws: one ExpertStack, or gate and up (one
    format and shape: one launch, blockIdx.z the role); outs (entries, rows) f32; qx
    (quantize_rows) rows of ws[0].cols elements; ``groups``: the grid, at least n_work."""
    w0 = ws[0]
    if columns not in QMMA_COLUMNS:               # a kernel of other columns would read other groups
        be._flush()
        raise InvalidArgumentError(f"experts' product: groups of {columns} columns, kernels of {QMMA_COLUMNS}")
    per_block = getattr(be, "smem_per_block", 48 * 1024) - 4 * columns      # the kernel's own row[]
    found = _qmma_kernel(be, w0, columns, per_block, "_experts")
    if found is None or any(w.fmt is not w0.fmt or w.shape != w0.shape for w in ws):
        be._flush()
        raise InvalidArgumentError(f"experts' product: no tensor-core kernel for {w0.fmt.name} experts of "
                                   f"{w0.shape} here, or roles that differ")
    kern, _, warps, smem = found                  # its columns: `columns` (one of QMMA_COLUMNS)
    allow_smem(kern, smem)
    n = w0.cols
    grid = (groups, -(-w0.rows // TILE), len(ws))
    kern(grid, (TILE * warps,), (outs[0], outs[-1], np.int32(be._rows(outs[0], "experts")), w0.data, ws[-1].data,
                                 np.int64(w0.stride), work, n_work, NULL_ARG if slots is None else slots,
                                 np.int32(n_used), qx, np.int32(n + n // 2), np.int32(w0.rows), np.int32(w0.nbi)),
         shared_mem=smem)


def qmatmul(be, out, w: CudaQuantMatrix, x, beta: float = 0.0) -> None:
    """out (T, d) f32 = x (T, n) f32 @ W^T (+ beta * out). Short chunks (T up to
    ``be.qmm_few_max``) through qmatmul_few; longer ones on row tiles of W dequantized to FP16
    into one scratch tile (reused, small enough to stay in L2 between its write and the GEMM's
    read), each multiplied by cuBLAS (FP16 in, FP32 accumulate)."""
    be._flush()
    t, n = x.shape
    d = w.rows
    if w.cols != n or out.shape != (t, d):
        raise InvalidArgumentError(f"matmul: {tuple(x.shape)} @ {w.shape}^T -> {tuple(out.shape)}")
    if t == 0 or qmatmul_few(be, out, w, x, beta):
        return
    x16 = be._cast16(x)
    ldc = be._rows(out, "matmul")
    tr = _tile_rows(w)
    scratch = be._buf("qdeq_tile", min(tr, d) * n, cp.float16)
    for r0 in range(0, d, tr):
        nr = min(tr, d - r0)
        tile = scratch[:nr * n].reshape(nr, n)
        dequantize_rows(be, w, r0, nr, tile)
        o = out[:, r0:r0 + nr]
        if not be._gemm_ex(o, tile, x16, t, nr, n, ldc, beta):
            prod = cp.matmul(x16.astype(cp.float32), tile.T.astype(cp.float32))
            if beta:
                o += prod
            else:
                o[...] = prod


def qgate_up_batch(be, out, wg, wu, x, act: str = "silu") -> None:
    """out (T, f) = act(x @ Wg^T) * (x @ Wu^T) on quantized weights."""
    be._flush()
    if act not in _GLU_KERNELS:
        raise InvalidArgumentError(f"act must be one of {', '.join(_GLU_KERNELS)}, got {act!r}")
    if wg.shape != wu.shape:
        raise InvalidArgumentError(f"gate_up_batch: gate {wg.shape} and up {wu.shape} differ")
    t, f = out.shape
    up = be._buf("up", t * f, cp.float32).reshape(t, f)
    for o, w in ((out, wg), (up, wu)):
        if isinstance(w, CudaQuantMatrix):
            qmatmul(be, o, w, x)
        else:
            be.matmul(o, w, x)
    k = be._k(_GLU_KERNELS[act])
    if be._rows(out, "gate_up_batch") == f:
        k((-(-(t * f) // 256),), (256,), (out, out, up, np.int32(t * f)))
    else:
        for r in range(t):
            k((-(-f // 256),), (256,), (out[r], out[r], up[r], np.int32(f)))


def qembed(be, out, w: CudaQuantMatrix, token: int, scale: float = 1.0) -> None:
    """out (cols,) f32 = scale * row `token` of a quantized table; under decode_step the
    row is read from the step buffer (token < 0), so the captured graph serves every token."""
    _rows_f32(be, out, w, w.cols, be._step, int(token), 1, scale)


def qembed_batch(be, out, w: CudaQuantMatrix, tokens_dev, scale: float = 1.0) -> None:
    """out (T, cols) f32 row i = scale * row tokens_dev[i] (a device int32 array) of the table."""
    _rows_f32(be, out, w, be._rows(out, "embed_batch"), tokens_dev, -1, out.shape[0], scale)


def _rows_f32(be, out, w, ldo, ids, host_row, nrows, scale) -> None:
    fmt = w.fmt.name
    groups = w.cols // 32
    kernel(be, f"qrows_f32_{fmt}", fmt)((-(-groups // 128), nrows), (128,),
                                        (out, np.int32(ldo), w.data, np.int32(w.rows), np.int32(w.nbi),
                                         ids, np.int32(host_row), np.float32(scale)))


__all__ = ["CudaQuantMatrix", "CudaQuantStack", "LAYOUTS", "NULL_ARG", "SUPPORTED", "dequantize",
           "dequantize_rows", "kernel", "matvec_warps", "qembed", "qembed_batch", "qgate_up_batch",
           "qmatmul", "qmatvec", "qmatvec_qkv", "repack", "stack_rows", "unpack", "upload"]
