# Quantized-weight kernels (included by kernels.pyx before CpuKernels, which dispatches
# QuantMatrix weights here: uses its _arr, _index, _no_overlap, resolve_variant and the
# cyllm_kernels table for the f16 prefill GEMM).
#
# Weights are (rows, row_bytes) uint8 arrays of GGUF blocks (cyllm.quant.QuantMatrix.data);
# the format is a kernel id (cyllm.quant.FORMATS[name].kernel_id) or its name. x is
# quantized once per call into the format's activation blocks (an internal buffer that
# grows once and is kept: nothing allocates per token), then the rows are split over
# `threads` OpenMP threads in contiguous runs of whole 4-row groups (16 for the r16 layouts:
# _row_at). Each row is one
# C call's fixed-order work, so the bits do not depend on the thread count.

from libc.stdint cimport uint8_t, int8_t
from libc.stdint cimport uintptr_t

cdef extern from "csrc/quant.h" nogil:
    enum:
        CYLLM_QF_COUNT, CYLLM_R16
        CYLLM_QF_Q6_K_R16, CYLLM_QF_Q5_K_R16
        CYLLM_QA_Q8_0, CYLLM_QA_Q8_K
        CYLLM_QCPU_AVX2, CYLLM_QCPU_AVXVNNI, CYLLM_QCPU_AVX512VNNI
    int cyllm_qf_is_r16(int fmt) noexcept
    ctypedef struct cyllm_qformat_info:
        const char *name
        int ggml_type, block, block_bytes, act
    ctypedef struct cyllm_qfmt_kernels:
        void (*matvec_rows)(float *out, const uint8_t *w, int64_t row_bytes, const void *xq,
                            int64_t n, int64_t r0, int64_t r1, int add,
                            const void *nx, int64_t nx_bytes) noexcept nogil
        void (*gate_up_rows)(float *out, const uint8_t *wg, const uint8_t *wu, int64_t row_bytes,
                             const void *xq, int64_t n, int64_t r0, int64_t r1, int act,
                             const void *nx, int64_t nx_bytes) noexcept nogil
        void (*gemm_rows)(float *out, int64_t ldo, const uint8_t *w, int64_t row_bytes,
                          const void *xq, int64_t xq_stride, int64_t T, int64_t n,
                          int64_t r0, int64_t r1, int add) noexcept nogil
        void (*dequant_rows_f16)(uint16_t *out, const uint8_t *w, int64_t row_bytes, int64_t n,
                                 int64_t r0, int64_t r1) noexcept nogil
        void (*dequant_row_f32)(float *out, const uint8_t *w, int64_t row_bytes, int64_t r, int64_t n) noexcept nogil
    ctypedef struct cyllm_qkernels:
        const char *name
        void (*quantize_act)(void *xq, const float *x, int64_t n, int act, int64_t b0,
                             int64_t b1) noexcept nogil
        cyllm_qfmt_kernels fmt[CYLLM_QF_COUNT]
    const cyllm_qformat_info *cyllm_qformat(int fmt) noexcept
    int cyllm_qact_block(int act) noexcept
    int64_t cyllm_qact_bytes(int act, int64_t n) noexcept
    int cyllm_qcpu_features() noexcept
    const cyllm_qkernels *cyllm_qkernels_by_name(const char *name) noexcept
    const cyllm_qkernels *cyllm_qkernels_for_variant(const char *variant) noexcept
    int64_t cyllm_qpf_bytes
    void cyllm_quantize_row(int fmt, uint8_t *out, const float *x, int64_t n) noexcept nogil
    int cyllm_r16_layout(int fmt) noexcept
    void cyllm_r16_repack(int fmt, uint8_t *dst, const uint8_t *src, int64_t row_bytes, int64_t g0,
                          int64_t g1) noexcept nogil
    void cyllm_qglu(float *out, const float *g, const float *u, int64_t r0, int64_t r1,
                    int act) noexcept nogil


cdef inline Py_ssize_t _row_at(Py_ssize_t d, Py_ssize_t i, Py_ssize_t nt, int f) noexcept nogil:
    """The first row of thread i of nt over d rows of format f (row i = nt: d): whole groups
    of 4 rows, of 16 for the r16 layouts (whose kernels compute whole groups), so the split
    gives each row to one thread and decode_step's program (program.c) splits alike."""
    cdef Py_ssize_t u = CYLLM_R16 if cyllm_qf_is_r16(f) else 4
    cdef Py_ssize_t r = (((d + u - 1) // u) * i // nt) * u
    return r if r < d else d


cdef enum:
    QGEMM_CHUNKS = 2        # runs of rows per thread of the r16 group kernels' prefill (_runs)


cdef inline Py_ssize_t _runs(Py_ssize_t d, int nt, int f) noexcept nogil:
    """How many runs of rows (_row_at over this count) a prefill GEMM of d rows of format f
    hands out to nt threads as they come free: QGEMM_CHUNKS a thread where the kernel prepares
    nothing per call (the r16 group kernels: every r16 layout's but q6_k's and q5_k's), so that a
    thread that loses its core does not hold up the op's end, as the F16 GEMM's panels
    (cpu_ops.pxi _gemm); one a thread for the other tiles (q6_k's and q5_k's tokens-in-lanes
    tiles among them), which transpose x once per call."""
    if not cyllm_qf_is_r16(f) or f == CYLLM_QF_Q6_K_R16 or f == CYLLM_QF_Q5_K_R16:
        return nt
    cdef Py_ssize_t units = (d + CYLLM_R16 - 1) // CYLLM_R16
    return units if units < <Py_ssize_t>nt * QGEMM_CHUNKS else <Py_ssize_t>nt * QGEMM_CHUNKS


cdef inline void _gate_up_rows(const cyllm_qfmt_kernels *k, float *po, float *pu_out,
                               const uint8_t *pg, const uint8_t *pu, Py_ssize_t rb, const char *xq,
                               Py_ssize_t stride, Py_ssize_t T, Py_ssize_t n, Py_ssize_t d,
                               Py_ssize_t r0, Py_ssize_t r1, int glu) noexcept nogil:
    """Rows [r0, r1) of the quantized gate and up GEMMs, then their GLU (columns r0..r1)."""
    cdef Py_ssize_t t
    if r0 >= r1:
        return
    k.gemm_rows(po, d, pg, rb, xq, stride, T, n, r0, r1, 0)
    k.gemm_rows(pu_out, d, pu, rb, xq, stride, T, n, r0, r1, 0)
    for t in range(T):
        cyllm_qglu(po + t * d, po + t * d, pu_out + t * d, r0, r1, glu)


QUANT_VARIANTS = ("generic", "avx2", "avxvnni", "avx512vnni")
QUANT_FORMATS = tuple(cyllm_qformat(i).name.decode() for i in range(CYLLM_QF_COUNT))
_QFMT_ID = {name: i for i, name in enumerate(QUANT_FORMATS)}
_QACT = {"silu": CYLLM_ACT_SILU, "gelu_tanh": CYLLM_ACT_GELU_TANH}

# rows per panel of the dequantize-then-f16-GEMM prefill path (a multiple of every gemm_nr)
cdef enum:
    QPANEL_ROWS = 64


# the quantized matvecs' prefetch distance when prefetch is on (DecodeProgram.run's switch)
_qpf_on_bytes = cyllm_qpf_bytes


def _set_qprefetch(nbytes):
    """Software prefetch distance of the quantized matvecs in bytes (0 = off; benchmarks)."""
    global cyllm_qpf_bytes, _qpf_on_bytes
    cyllm_qpf_bytes = _qpf_on_bytes = _index(nbytes, "nbytes")


def quant_cpu_features():
    """Quantized-kernel features usable here: subset of ["avx2", "avxvnni", "avx512vnni"]."""
    cdef int f = cyllm_qcpu_features()
    return [n for bit, n in ((CYLLM_QCPU_AVX2, "avx2"), (CYLLM_QCPU_AVXVNNI, "avxvnni"),
                             (CYLLM_QCPU_AVX512VNNI, "avx512vnni")) if f & bit]


def quant_available_variants():
    """Quantized-kernel tables that run here (built in and supported by the CPU), best first."""
    return [v for v in ("avx512vnni", "avxvnni", "avx2", "generic")
            if cyllm_qkernels_by_name(v.encode()) != NULL]


def resolve_quant_variant(variant=None, base=None):
    """The quantized table to use: `variant`, else $CYLLM_QKERNELS, else the best one no
    wider than the main variant `base` (None: resolve_variant(None)). Raises
    BackendUnavailableError for an unknown name or a table this CPU/build cannot run."""
    source = "variant"
    if variant is None:
        variant = os.environ.get("CYLLM_QKERNELS", "").strip() or None
        source = "CYLLM_QKERNELS"
    if variant is None or (isinstance(variant, str) and variant.strip().lower() == "auto"):
        b = resolve_variant(base)
        return cyllm_qkernels_for_variant(b.encode()).name.decode()
    if not isinstance(variant, str):
        raise BackendUnavailableError(f"{source} must be a string, got {variant!r}")
    v = variant.strip().lower()
    if v not in QUANT_VARIANTS:
        raise BackendUnavailableError(
            f"unknown quantized kernel variant {variant!r} in {source} "
            f"(choose from auto, {', '.join(QUANT_VARIANTS)})")
    if cyllm_qkernels_by_name(v.encode()) == NULL:
        raise BackendUnavailableError(
            f"quantized kernel variant {v!r} cannot run here (not built into this extension, or "
            f"the CPU lacks it: it has [{', '.join(quant_cpu_features())}]); "
            f"available: {', '.join(quant_available_variants())}")
    return v


cdef inline int _qfmt(object fmt) except -1:
    """A format given as kernel id or name -> kernel id."""
    cdef Py_ssize_t f
    if isinstance(fmt, str):
        key = fmt.strip().lower()
        if key not in _QFMT_ID:
            raise InvalidArgumentError(
                f"unknown quantized format {fmt!r} (supported: {', '.join(QUANT_FORMATS)})")
        return _QFMT_ID[key]
    f = _index(fmt, "fmt")
    if f < 0 or f >= CYLLM_QF_COUNT:
        raise InvalidArgumentError(f"quantized format id {f} is out of range [0, {CYLLM_QF_COUNT})")
    return <int>f


cdef inline cnp.ndarray _qweights(object w, str name, int fmt, Py_ssize_t *cols):
    """w as a C-contiguous (rows, row_bytes) uint8 array whose row is whole blocks of fmt;
    sets cols to the elements per row."""
    if not cnp.PyArray_Check(w):
        raise InvalidArgumentError(f"{name} must be a numpy uint8 array, got {type(w).__name__}")
    cdef cnp.ndarray a = <cnp.ndarray>w
    if cnp.PyArray_TYPE(a) != cnp.NPY_UINT8:
        raise InvalidArgumentError(f"{name} must be a uint8 array of blocks, got {w.dtype}")
    if cnp.PyArray_NDIM(a) != 2 or not cnp.PyArray_IS_C_CONTIGUOUS(a):
        raise InvalidArgumentError(f"{name} must be C-contiguous (rows, row_bytes), got shape {w.shape}")
    cdef const cyllm_qformat_info *fi = cyllm_qformat(fmt)
    cdef Py_ssize_t rb = cnp.PyArray_DIM(a, 1)
    if rb < 1 or rb % fi.block_bytes:
        raise InvalidArgumentError(
            f"{name}: a row of {rb} bytes is not a whole number of {fi.name.decode()} blocks "
            f"({fi.block_bytes} bytes)")
    if cyllm_qf_is_r16(fmt) and cnp.PyArray_DIM(a, 0) % CYLLM_R16:
        # the kernels read whole groups of 16 rows
        raise InvalidArgumentError(
            f"{name}: a {fi.name.decode()} matrix has a multiple of {CYLLM_R16} rows, got {cnp.PyArray_DIM(a, 0)}")
    cols[0] = (rb // fi.block_bytes) * fi.block
    return a


def repack_r16(out, w, fmt, threads=1):
    """out (rows, row_bytes) uint8 = the quantized matrix w (the same
    shape, rows a multiple of 16) with its rows interleaved by 16 (the r16 layouts of csrc/quant.h:
    the same bytes, reordered); groups of rows split over `threads`."""
    cdef int f = _qfmt(fmt)
    cdef int lay = cyllm_r16_layout(f)
    if lay < 0:
        raise InvalidArgumentError(f"repack_r16: a quantized format (q8_0, q4_0, q4_1, q5_0, q5_1, "
                                   f"q4_k, q5_k, q6_k) only, got {fmt!r}")
    cdef Py_ssize_t n, n2
    cdef cnp.ndarray aw = _qweights(w, "w", f, &n)
    if not cnp.PyArray_Check(out) or not cnp.PyArray_ISWRITEABLE(<cnp.ndarray>out):
        raise InvalidArgumentError("out must be a writable uint8 array")
    cdef cnp.ndarray ao = _qweights(out, "out", lay, &n2)
    if cnp.PyArray_DIM(ao, 0) != cnp.PyArray_DIM(aw, 0) or n2 != n:
        raise InvalidArgumentError(f"out has shape {out.shape}, expected {w.shape}")
    _no_overlap(ao, aw, "out", "w")
    cdef Py_ssize_t groups = cnp.PyArray_DIM(aw, 0) // CYLLM_R16, rb = cnp.PyArray_DIM(aw, 1), g
    cdef Py_ssize_t nt = _index(threads, "threads")
    if nt < 1 or nt > 4096:
        raise InvalidArgumentError(f"threads must be in [1, 4096], got {nt}")
    cdef uint8_t *po = <uint8_t *>cnp.PyArray_DATA(ao)
    cdef const uint8_t *pw = <const uint8_t *>cnp.PyArray_DATA(aw)
    with nogil:
        if nt <= 1 or groups < 2:
            cyllm_r16_repack(f, po, pw, rb, 0, groups)
        else:
            for g in prange(groups, num_threads=nt, schedule="static"):
                cyllm_r16_repack(f, po, pw, rb, g, g + 1)


def quantize_rows(out, x, fmt, threads=1):
    """out (rows, row_bytes) uint8 = x (rows, cols) f32 quantized to fmt (llama.cpp's reference
    quantizers, the bytes of cyllm.quant.reference.quantize); rows split over `threads`.
    x must be finite (checked) and cols a multiple of the format's block."""
    cdef int f = _qfmt(fmt)
    if cyllm_qf_is_r16(f):
        raise InvalidArgumentError("quantize to the file format, then repack_r16: the r16 formats are layouts, not quantizers")
    cdef cnp.ndarray ax = _arr(x, "x", cnp.NPY_FLOAT32, 2, False)
    cdef Py_ssize_t rows = cnp.PyArray_DIM(ax, 0), cols = cnp.PyArray_DIM(ax, 1), n
    cdef const cyllm_qformat_info *fi = cyllm_qformat(f)
    if cols < 1 or cols % fi.block:
        raise InvalidArgumentError(
            f"quantize to {fi.name.decode()}: a row of {cols} elements is not a multiple of "
            f"the block ({fi.block})")
    if not cnp.PyArray_Check(out) or cnp.PyArray_TYPE(<cnp.ndarray>out) != cnp.NPY_UINT8 \
            or not cnp.PyArray_ISWRITEABLE(<cnp.ndarray>out):
        raise InvalidArgumentError("out must be a writable uint8 array")
    cdef cnp.ndarray ao = _qweights(out, "out", f, &n)
    if cnp.PyArray_DIM(ao, 0) != rows or n != cols:
        raise InvalidArgumentError(f"out has shape {out.shape}, expected ({rows}, {cols // fi.block * fi.block_bytes})")
    _no_overlap(ao, ax, "out", "x")
    if not np.isfinite(x).all():
        raise InvalidArgumentError(f"quantize to {fi.name.decode()}: the input holds inf or nan")
    cdef Py_ssize_t nt = _index(threads, "threads"), r, rb = cnp.PyArray_DIM(ao, 1)
    if nt < 1 or nt > 4096:
        raise InvalidArgumentError(f"threads must be in [1, 4096], got {nt}")
    if nt > rows:
        nt = rows
    cdef uint8_t *po = <uint8_t *>cnp.PyArray_DATA(ao)
    cdef const float *px = <const float *>cnp.PyArray_DATA(ax)
    with nogil:
        if nt <= 1:
            for r in range(rows):
                cyllm_quantize_row(f, po + r * rb, px + r * cols, cols)
        else:
            for r in prange(rows, num_threads=nt, schedule="dynamic", chunksize=4):
                cyllm_quantize_row(f, po + r * rb, px + r * cols, cols)


# prefill methods (QuantKernels.qmatmul's `method`): 0 = int8 GEMM on quantized x,
# 1 = 64-row panels dequantized to f16 + the main variant's f16 GEMM
QPREFILL_INT8 = 0
QPREFILL_F16 = 1


cdef class QuantKernels:
    """The quantized-weight ops on the CPU.

    QuantKernels(threads=1, variant=None, base_variant=None): variant None follows
    $CYLLM_QKERNELS, then the best table no wider than the main kernel variant
    (base_variant, resolved like CpuBackend's); the f16 prefill GEMM comes from that
    main variant.
    """
    cdef const cyllm_qkernels *qk
    cdef const cyllm_kernels *kt
    cdef int nthreads
    cdef str _variant
    cdef str _base
    cdef char *act_raw           # activation scratch (64-byte aligned inside act_raw)
    cdef char *act
    cdef Py_ssize_t act_cap
    cdef char *pan_raw           # f16 panels of the prefill path, one per thread
    cdef uint16_t *pan
    cdef Py_ssize_t pan_cap      # uint16 elements
    cdef int prefill_method[CYLLM_QF_COUNT]  # per kernel id: QPREFILL_INT8 | QPREFILL_F16

    def __cinit__(self):
        self.act_raw = NULL
        self.act = NULL
        self.act_cap = 0
        self.pan_raw = NULL
        self.pan = NULL
        self.pan_cap = 0

    def __dealloc__(self):
        free(self.act_raw)
        free(self.pan_raw)

    def __init__(self, threads=1, variant=None, base_variant=None):
        b = resolve_variant(base_variant)
        v = resolve_quant_variant(variant, b)
        self.qk = cyllm_qkernels_by_name(v.encode())
        self.kt = cyllm_kernels_by_name(b.encode())
        self._variant = v
        self._base = b
        cdef int i
        # int8 by default for every format and table, so that a token's bits do not depend on
        # whether prefill or decode computed it (a cached prefix then gives the same text as a
        # recomputed one). f16 panels can be faster: q8_0 in the avx2 table, T = 128 on 2048x2048,
        # 1 thread, 14.8 ms int8 against 12.0 ms (bench/results/cpu_quant_epyc_zen4.md);
        # CYLLM_QPREFILL=f16 chooses them for every format, at the cost of that property.
        forced = os.environ.get("CYLLM_QPREFILL", "").strip().lower()
        if forced not in ("", "int8", "f16"):
            raise InvalidArgumentError(f"CYLLM_QPREFILL must be int8 or f16, got {forced[:20]!r}")
        for i in range(CYLLM_QF_COUNT):
            self.prefill_method[i] = QPREFILL_F16 if forced == "f16" else QPREFILL_INT8
        cdef Py_ssize_t n = _index(threads, "threads")
        if n < 1 or n > 4096:
            raise InvalidArgumentError(f"threads must be in [1, 4096], got {n}")
        self.nthreads = <int>n

    @property
    def quant_variant(self):
        return self._variant

    @property
    def base_variant(self):
        return self._base

    @property
    def threads(self):
        return self.nthreads

    @threads.setter
    def threads(self, value):
        cdef Py_ssize_t n = _index(value, "threads")
        if n < 1 or n > 4096:
            raise InvalidArgumentError(f"threads must be in [1, 4096], got {n}")
        self.nthreads = <int>n

    # -- scratch ------------------------------------------------------------------
    cdef char *_act_for(self, Py_ssize_t nbytes) except NULL:
        """At least nbytes of 64-byte aligned activation scratch (grows, never shrinks)."""
        cdef char *raw
        if nbytes > self.act_cap or self.act == NULL:
            raw = <char *>malloc(nbytes + 64)
            if raw == NULL:
                raise MemoryError(f"cannot allocate {nbytes} bytes of activation scratch")
            free(self.act_raw)
            self.act_raw = raw
            self.act = <char *>((<uintptr_t>raw + 63) & ~(<uintptr_t>63))
            self.act_cap = nbytes
        return self.act

    cdef uint16_t *_panels_for(self, Py_ssize_t elems) except NULL:
        cdef char *raw
        if elems > self.pan_cap or self.pan == NULL:
            raw = <char *>malloc(elems * 2 + 64)
            if raw == NULL:
                raise MemoryError(f"cannot allocate {elems * 2} bytes of f16 panels")
            free(self.pan_raw)
            self.pan_raw = raw
            self.pan = <uint16_t *>((<uintptr_t>raw + 63) & ~(<uintptr_t>63))
            self.pan_cap = elems
        return self.pan

    cdef int _threads_for(self, Py_ssize_t rows, Py_ssize_t work_bytes) noexcept:
        cdef int nt = self.nthreads
        if work_bytes < MATVEC_PARALLEL_MIN:
            nt = 1
        if nt > rows // ROWS_PER_THREAD_MIN:
            nt = <int>(rows // ROWS_PER_THREAD_MIN)
        return nt if nt >= 1 else 1

    # -- activation -----------------------------------------------------------------
    def act_bytes(self, fmt, n):
        """Bytes of x (n,) quantized for weights of format fmt."""
        cdef int f = _qfmt(fmt)
        cdef Py_ssize_t nn = _index(n, "n")
        cdef int64_t b = cyllm_qact_bytes(cyllm_qformat(f).act, nn)
        if b < 0:
            raise InvalidArgumentError(
                f"n = {nn} is not a positive multiple of the {QUANT_FORMATS[f]} activation block "
                f"({cyllm_qact_block(cyllm_qformat(f).act)})")
        return b

    def quantize_activation(self, out, x, fmt):
        """out (act_bytes(fmt, n),) uint8 = x (n,) f32 in fmt's activation blocks
        (the layout of csrc/quant.h; cyllm.quant.reference.pack_act gives the same bytes)."""
        cdef int f = _qfmt(fmt)
        cdef cnp.ndarray ax = _arr(x, "x", cnp.NPY_FLOAT32, 1, False)
        if not cnp.PyArray_Check(out) or cnp.PyArray_TYPE(<cnp.ndarray>out) != cnp.NPY_UINT8 \
                or cnp.PyArray_NDIM(<cnp.ndarray>out) != 1 \
                or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>out) \
                or not cnp.PyArray_ISWRITEABLE(<cnp.ndarray>out):
            raise InvalidArgumentError("out must be a writable contiguous 1-D uint8 array")
        cdef cnp.ndarray ao = <cnp.ndarray>out
        cdef Py_ssize_t n = cnp.PyArray_DIM(ax, 0)
        cdef int act = cyllm_qformat(f).act
        cdef Py_ssize_t need = self.act_bytes(f, n)
        _check_len(cnp.PyArray_DIM(ao, 0), need, "out", f"act_bytes({QUANT_FORMATS[f]}, {n})")
        if (<uintptr_t>cnp.PyArray_DATA(ao)) % 4:
            raise InvalidArgumentError("out must be 4-byte aligned")
        _no_overlap(ao, ax, "out", "x")
        cdef const cyllm_qkernels *qk = self.qk
        cdef Py_ssize_t nb = n // cyllm_qact_block(act)
        with nogil:
            qk.quantize_act(cnp.PyArray_DATA(ao), <const float *>cnp.PyArray_DATA(ax), n, act, 0, nb)

    cdef const char *_quantize_x(self, cnp.ndarray ax, int f, Py_ssize_t n) except NULL:
        cdef int act = cyllm_qformat(f).act
        cdef char *buf = self._act_for(cyllm_qact_bytes(act, n))
        cdef const cyllm_qkernels *qk = self.qk
        cdef Py_ssize_t nb = n // cyllm_qact_block(act)
        with nogil:
            qk.quantize_act(buf, <const float *>cnp.PyArray_DATA(ax), n, act, 0, nb)
        return buf

    # -- decode ops -------------------------------------------------------------------
    cdef int _matvec(self, object out, object w, object fmt, object x, int add, object w2,
                     int act) except -1:
        cdef int f = _qfmt(fmt)
        cdef Py_ssize_t n, n2
        cdef str wname = "w" if w2 is None else "w_gate"
        cdef cnp.ndarray aw = _qweights(w, wname, f, &n)
        cdef cnp.ndarray au = None
        cdef cnp.ndarray ao = _arr(out, "out", cnp.NPY_FLOAT32, 1, True)
        cdef cnp.ndarray ax = _arr(x, "x", cnp.NPY_FLOAT32, 1, False)
        cdef Py_ssize_t d = cnp.PyArray_DIM(aw, 0), rb = cnp.PyArray_DIM(aw, 1)
        if w2 is not None:
            au = _qweights(w2, "w_up", f, &n2)
            if cnp.PyArray_DIM(au, 0) != d or cnp.PyArray_DIM(au, 1) != rb:
                raise InvalidArgumentError(
                    f"w_up has shape {w2.shape}, expected {w.shape} (the shape of w_gate)")
            _no_overlap(ao, au, "out", "w_up")
        _check_len(cnp.PyArray_DIM(ax, 0), n, "x", f"columns of {wname}")
        _check_len(cnp.PyArray_DIM(ao, 0), d, "out", f"rows of {wname}")
        _no_overlap(ao, ax, "out", "x")
        _no_overlap(ao, aw, "out", wname)
        if d == 0:
            return 0
        cdef const char *xq = self._quantize_x(ax, f, n)
        cdef const cyllm_qfmt_kernels *k = &self.qk.fmt[f]
        cdef float *po = <float *>cnp.PyArray_DATA(ao)
        cdef const uint8_t *pw = <const uint8_t *>cnp.PyArray_DATA(aw)
        cdef const uint8_t *pu = <const uint8_t *>cnp.PyArray_DATA(au) if au is not None else NULL
        cdef Py_ssize_t t, r0, r1
        cdef int nt = self._threads_for(d, d * rb * (2 if pu != NULL else 1))
        with nogil:
            if nt == 1:
                if pu != NULL:
                    k.gate_up_rows(po, pw, pu, rb, xq, n, 0, d, act, NULL, 0)
                else:
                    k.matvec_rows(po, pw, rb, xq, n, 0, d, add, NULL, 0)
            else:
                for t in prange(nt, num_threads=nt, schedule="static", chunksize=1):
                    r0 = _row_at(d, t, nt, f)
                    r1 = _row_at(d, t + 1, nt, f)
                    if pu != NULL:
                        k.gate_up_rows(po, pw, pu, rb, xq, n, r0, r1, act, NULL, 0)
                    else:
                        k.matvec_rows(po, pw, rb, xq, n, r0, r1, add, NULL, 0)
        return 0

    def qmatvec(self, out, w, fmt, x, add=False):
        """out (d,) f32 = w @ x (add: out += w @ x); w (d, row_bytes) uint8 blocks of fmt,
        x (n,) f32 with n = the row's elements."""
        self._matvec(out, w, fmt, x, 1 if add else 0, None, CYLLM_ACT_SILU)

    def qgate_up(self, out, w_gate, w_up, fmt, x, act="silu"):
        """out (f,) f32 = act(w_gate @ x) * (w_up @ x); act "silu" | "gelu_tanh"."""
        if act not in _QACT:
            raise InvalidArgumentError(f"act must be one of {', '.join(_QACT)}, got {act!r}")
        self._matvec(out, w_gate, fmt, x, 0, w_up, _QACT[act])

    def qmatvec_prequantized(self, out, w, fmt, xq, add=False):
        """out (d,) f32 (+)= w @ x with x already quantized by quantize_activation (xq uint8)."""
        cdef int f = _qfmt(fmt)
        cdef Py_ssize_t n
        cdef cnp.ndarray aw = _qweights(w, "w", f, &n)
        cdef cnp.ndarray ao = _arr(out, "out", cnp.NPY_FLOAT32, 1, True)
        if not cnp.PyArray_Check(xq) or cnp.PyArray_TYPE(<cnp.ndarray>xq) != cnp.NPY_UINT8 \
                or cnp.PyArray_NDIM(<cnp.ndarray>xq) != 1 \
                or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>xq):
            raise InvalidArgumentError("xq must be a contiguous 1-D uint8 array")
        cdef cnp.ndarray aq = <cnp.ndarray>xq
        _check_len(cnp.PyArray_DIM(aq, 0), self.act_bytes(f, n), "xq", "act_bytes of the row length")
        if (<uintptr_t>cnp.PyArray_DATA(aq)) % 4:
            raise InvalidArgumentError("xq must be 4-byte aligned")
        cdef Py_ssize_t d = cnp.PyArray_DIM(aw, 0), rb = cnp.PyArray_DIM(aw, 1)
        _check_len(cnp.PyArray_DIM(ao, 0), d, "out", "rows of w")
        _no_overlap(ao, aq, "out", "xq")
        _no_overlap(ao, aw, "out", "w")
        cdef const cyllm_qfmt_kernels *k = &self.qk.fmt[f]
        cdef int a = 1 if add else 0
        with nogil:
            k.matvec_rows(<float *>cnp.PyArray_DATA(ao), <const uint8_t *>cnp.PyArray_DATA(aw), rb,
                          cnp.PyArray_DATA(aq), n, 0, d, a, NULL, 0)

    # -- dequantization ---------------------------------------------------------------
    def dequantize_rows_f16(self, out, w, fmt, r0, r1):
        """out (r1 - r0, n) f16 = rows [r0, r1) of w dequantized (round to nearest even)."""
        cdef int f = _qfmt(fmt)
        cdef Py_ssize_t n
        cdef cnp.ndarray aw = _qweights(w, "w", f, &n)
        cdef cnp.ndarray ao = _arr(out, "out", cnp.NPY_FLOAT16, 2, True)
        cdef Py_ssize_t a = _index(r0, "r0"), b = _index(r1, "r1"), d = cnp.PyArray_DIM(aw, 0)
        if a < 0 or b > d or a > b:
            raise InvalidArgumentError(f"row range [{a}, {b}) is not inside [0, {d})")
        if cnp.PyArray_DIM(ao, 0) != b - a or cnp.PyArray_DIM(ao, 1) != n:
            raise InvalidArgumentError(f"out has shape {out.shape}, expected ({b - a}, {n})")
        _no_overlap(ao, aw, "out", "w")
        cdef const cyllm_qfmt_kernels *k = &self.qk.fmt[f]
        with nogil:
            k.dequant_rows_f16(<uint16_t *>cnp.PyArray_DATA(ao), <const uint8_t *>cnp.PyArray_DATA(aw),
                               cnp.PyArray_DIM(aw, 1), n, a, b)

    def dequantize_row_f32(self, out, w, fmt, row):
        """out (n,) f32 = row `row` of w dequantized (quantized embedding lookup)."""
        cdef int f = _qfmt(fmt)
        cdef Py_ssize_t n
        cdef cnp.ndarray aw = _qweights(w, "w", f, &n)
        cdef cnp.ndarray ao = _arr(out, "out", cnp.NPY_FLOAT32, 1, True)
        cdef Py_ssize_t r = _index(row, "row"), d = cnp.PyArray_DIM(aw, 0)
        if r < 0 or r >= d:
            raise InvalidArgumentError(f"row {r} is out of range [0, {d})")
        _check_len(cnp.PyArray_DIM(ao, 0), n, "out", "columns of w")
        _no_overlap(ao, aw, "out", "w")
        cdef const cyllm_qfmt_kernels *k = &self.qk.fmt[f]
        cdef Py_ssize_t rb = cnp.PyArray_DIM(aw, 1)
        with nogil:
            k.dequant_row_f32(<float *>cnp.PyArray_DATA(ao), <const uint8_t *>cnp.PyArray_DATA(aw), rb, r, n)

    # -- embedding rows ---------------------------------------------------------------
    cdef int _embed_rows(self, float *po, object w, int f, const int32_t *tok, Py_ssize_t T,
                         Py_ssize_t cols, float sc) except -1:
        """po (T, cols) = rows tok[0..T) of w dequantized, times sc (ids already checked)."""
        cdef cnp.ndarray aw = <cnp.ndarray>w
        cdef const uint8_t *pw = <const uint8_t *>cnp.PyArray_DATA(aw)
        cdef Py_ssize_t rb = cnp.PyArray_DIM(aw, 1), t, i
        cdef const cyllm_qfmt_kernels *k = &self.qk.fmt[f]
        with nogil:
            for t in range(T):
                k.dequant_row_f32(po + t * cols, pw, rb, <Py_ssize_t>tok[t], cols)
            if sc != 1.0:
                for i in range(T * cols):
                    po[i] *= sc
        return 0

    # -- prefill ----------------------------------------------------------------------
    def set_prefill_method(self, fmt, method):
        """The prefill path of format fmt: "int8" or "f16" (benchmarks; the default is
        int8, or CYLLM_QPREFILL=int8|f16's for every format)."""
        cdef int f = _qfmt(fmt)
        if method not in ("int8", "f16"):
            raise InvalidArgumentError(f"method must be 'int8' or 'f16', got {method!r}")
        self.prefill_method[f] = QPREFILL_INT8 if method == "int8" else QPREFILL_F16

    def prefill_method_of(self, fmt):
        return "int8" if self.prefill_method[_qfmt(fmt)] == QPREFILL_INT8 else "f16"

    cdef int _qgemm(self, float *po, const uint8_t *pw, Py_ssize_t rb, int f, const float *px,
                    Py_ssize_t T, Py_ssize_t n, Py_ssize_t d, int add, int method) except -1:
        """po (T, d) (+)= px (T, n) @ W.T, W = d rows of rb bytes in format f (checked by the caller)."""
        if T == 0 or d == 0:
            return 0
        cdef const cyllm_qfmt_kernels *k = &self.qk.fmt[f]
        cdef const cyllm_qkernels *qk = self.qk
        cdef const cyllm_kernels *kt = self.kt
        cdef int act = cyllm_qformat(f).act
        cdef Py_ssize_t stride = ((cyllm_qact_bytes(act, n) + 63) // 64) * 64
        cdef Py_ssize_t nbx = n // cyllm_qact_block(act)
        cdef Py_ssize_t panels, t, i, r0, r1, p0, rows, runs
        cdef char *xq
        cdef uint16_t *pan
        cdef int nt
        if method == QPREFILL_INT8:
            xq = self._act_for(T * stride)
            nt = self._threads_for(d, d * rb * T)
            with nogil:
                # each token's activation by one thread (the same bytes for any split)
                if nt == 1 or T < 2:
                    for t in range(T):
                        qk.quantize_act(xq + t * stride, px + t * n, n, act, 0, nbx)
                else:
                    for i in prange(nt, num_threads=nt, schedule="static", chunksize=1):
                        for t in range(T * i // nt, T * (i + 1) // nt):
                            qk.quantize_act(xq + t * stride, px + t * n, n, act, 0, nbx)
                if nt == 1:
                    k.gemm_rows(po, d, pw, rb, xq, stride, T, n, 0, d, add)
                else:
                    runs = _runs(d, nt, f)
                    for i in prange(runs, num_threads=nt, schedule="dynamic", chunksize=1):
                        r0 = _row_at(d, i, runs, f)
                        r1 = _row_at(d, i + 1, runs, f)
                        k.gemm_rows(po, d, pw, rb, xq, stride, T, n, r0, r1, add)
            return 0
        # f16 panels: each thread dequantizes its runs of QPANEL_ROWS rows, then the f16 GEMM
        panels = (d + QPANEL_ROWS - 1) // QPANEL_ROWS
        nt = self.nthreads if panels >= self.nthreads else <int>panels
        if nt < 1:
            nt = 1
        pan = self._panels_for(<Py_ssize_t>nt * QPANEL_ROWS * n)
        cdef Py_ssize_t ldx = _gemm_ldx(T, n)
        cdef float *pad
        if ldx != n:
            pad = <float *>self._act_for(T * ldx * sizeof(float))   # the int8 path's quantized-x scratch, free here
            with nogil:
                _copy_rows(pad, ldx, px, T, n)
            px = pad
        with nogil:
            for i in prange(nt, num_threads=nt, schedule="static", chunksize=1):
                for p0 in range(panels * i // nt, panels * (i + 1) // nt):
                    r0 = p0 * QPANEL_ROWS
                    r1 = r0 + QPANEL_ROWS
                    if r1 > d:
                        r1 = d
                    rows = r1 - r0
                    k.dequant_rows_f16(pan + i * QPANEL_ROWS * n, pw, rb, n, r0, r1)
                    kt.gemm_rows(po + r0, pan + i * QPANEL_ROWS * n, NULL, px, ldx, T, n, d, 0, rows, add)
        return 0

    cdef int _qgate_up(self, float *po, float *pu_out, const uint8_t *pg, const uint8_t *pu,
                       Py_ssize_t rb, int f, const float *px, Py_ssize_t T, Py_ssize_t n,
                       Py_ssize_t d, int glu) except -1:
        """po (T, d) = glu(px @ Wg.T) * (px @ Wu.T) by int8 GEMMs, Wg and Wu d rows of rb bytes
        in format f; pu_out (T, d) scratch. x is quantized once, and each thread runs its rows
        of both matrices, then the GLU of those columns while they are still in its cache
        (a separate pass over the two (T, d) products cost ~2 ms per TinyLlama layer). Each
        (token, row) gets the bits of qmatvec / the decode program's gate_up."""
        if T == 0 or d == 0:
            return 0
        cdef const cyllm_qfmt_kernels *k = &self.qk.fmt[f]
        cdef const cyllm_qkernels *qk = self.qk
        cdef int act = cyllm_qformat(f).act
        cdef Py_ssize_t stride = ((cyllm_qact_bytes(act, n) + 63) // 64) * 64
        cdef Py_ssize_t nbx = n // cyllm_qact_block(act)
        cdef Py_ssize_t t, r0, r1, runs
        cdef char *xq = self._act_for(T * stride)
        cdef int nt = self._threads_for(d, 2 * d * rb * T), i
        with nogil:
            if nt == 1 or T < 2:
                for t in range(T):
                    qk.quantize_act(xq + t * stride, px + t * n, n, act, 0, nbx)
            else:
                for i in prange(nt, num_threads=nt, schedule="static", chunksize=1):
                    for t in range(T * i // nt, T * (i + 1) // nt):
                        qk.quantize_act(xq + t * stride, px + t * n, n, act, 0, nbx)
            if nt == 1:
                _gate_up_rows(k, po, pu_out, pg, pu, rb, xq, stride, T, n, d, 0, d, glu)
            else:
                runs = _runs(d, nt, f)
                for i in prange(runs, num_threads=nt, schedule="dynamic", chunksize=1):
                    r0 = _row_at(d, i, runs, f)
                    r1 = _row_at(d, i + 1, runs, f)
                    _gate_up_rows(k, po, pu_out, pg, pu, rb, xq, stride, T, n, d, r0, r1, glu)
        return 0

    def qmatmul(self, out, w, fmt, x, add=False, method="int8"):
        """out (T, d) f32 = x (T, n) f32 @ w.T (add: +=); w (d, row_bytes) blocks of fmt.

        method "int8": x quantized per token, integer dot products (each (t, row) gives
        qmatvec's bits for that token); "f16": panels of 64 rows dequantized to f16 and
        fed to the main variant's f16 GEMM (the bits matmul gives on the dequantized weights
        for more than 4 tokens: matmul runs fewer as matvecs)."""
        cdef int f = _qfmt(fmt)
        cdef Py_ssize_t n
        cdef cnp.ndarray aw = _qweights(w, "w", f, &n)
        cdef cnp.ndarray ao = _arr(out, "out", cnp.NPY_FLOAT32, 2, True)
        cdef cnp.ndarray ax = _arr(x, "x", cnp.NPY_FLOAT32, 2, False)
        cdef Py_ssize_t d = cnp.PyArray_DIM(aw, 0), rb = cnp.PyArray_DIM(aw, 1)
        cdef Py_ssize_t T = cnp.PyArray_DIM(ax, 0)
        if method not in ("int8", "f16"):
            raise InvalidArgumentError(f"method must be 'int8' or 'f16', got {method!r}")
        if cnp.PyArray_DIM(ax, 1) != n:
            raise InvalidArgumentError(f"x has shape {x.shape}: expected {n} columns (columns of w)")
        if cnp.PyArray_DIM(ao, 0) != T or cnp.PyArray_DIM(ao, 1) != d:
            raise InvalidArgumentError(f"out has shape {out.shape}, expected ({T}, {d})")
        _no_overlap(ao, ax, "out", "x")
        _no_overlap(ao, aw, "out", "w")
        self._qgemm(<float *>cnp.PyArray_DATA(ao), <const uint8_t *>cnp.PyArray_DATA(aw), rb, f,
                    <const float *>cnp.PyArray_DATA(ax), T, n, d, 1 if add else 0,
                    QPREFILL_INT8 if method == "int8" else QPREFILL_F16)
