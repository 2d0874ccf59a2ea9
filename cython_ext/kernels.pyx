# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, embedsignature=True
"""CPU kernels of cyllm: argument checks + OpenMP loops around the C kernel tables.

Layout of the work: every op validates its arrays here (dtype, dims, contiguity,
writability, ranges) with the NumPy C API -- a few hundred ns, cheap next to a
Python method call -- then releases the GIL and calls the C kernels of the chosen
variant (csrc/kernels_generic.c, csrc/kernels_avx2.c, and csrc/kernels_avx512.c for the
avx512 variant's prefill GEMM and attention) through function pointers.
Big ops (matvec family, attention, the batched prefill GEMMs) split their
rows/heads over `threads` OpenMP threads; small vector ops run serially because
waking the team (~1-14 us) costs more than the op. Every row/head is computed by
one thread in a fixed order (long-context decode attention merges fixed cache
blocks in order), so results are bitwise identical for any thread count.
DecodeProgram (end of file) runs a whole captured decode step in one region.
"""

import os
import time

import numpy as np
cimport numpy as cnp
from cython.parallel cimport prange, threadid
from libc.stdint cimport uint16_t, int32_t, int64_t
from libc.stdlib cimport malloc, realloc, free
from libc.string cimport memset
from libc.math cimport sqrt, expf

from cyllm.errors import BackendUnavailableError, InvalidArgumentError
from cyllm.quant.matrix import QuantMatrix

cnp.import_array()


cdef extern from "csrc/kernels.h" nogil:
    ctypedef struct cyllm_kernels:
        const char *name
        void (*matvec_rows)(float *out, const uint16_t *w, const float *x,
                            int64_t n, int64_t r0, int64_t r1, int add,
                            const void *nx, int64_t nx_bytes) noexcept nogil
        void (*gate_up_rows)(float *out, const uint16_t *wg, const uint16_t *wu,
                             const float *x, int64_t n, int64_t r0, int64_t r1, int act,
                             const void *nx, int64_t nx_bytes) noexcept nogil
        void (*attention_group)(float *out, const float *q, const uint16_t *k,
                                const uint16_t *v, int64_t t_len, int64_t hd,
                                float scale, int64_t n_q, float *ml) noexcept nogil
        void (*f16_to_f32)(float *out, const uint16_t *inp, int64_t n) noexcept nogil
        void (*f32_to_f16)(uint16_t *out, const float *inp, int64_t n) noexcept nogil
        double (*sum_f32)(const float *p, int64_t n) noexcept nogil
        void (*gemm_rows)(float *out, const uint16_t *w, const uint16_t *wu, const float *x,
                          int64_t T, int64_t n, int64_t d, int64_t r0, int64_t r1,
                          int mode) noexcept nogil
        int gemm_nr
        void (*attention_rows)(float *out, const float *q, int64_t ldq, const uint16_t *k,
                               const uint16_t *v, int64_t hd, float scale, int64_t rows,
                               int64_t len0, float *work) noexcept nogil
        int64_t (*attention_rows_work)(int64_t t_max) noexcept nogil
        int attention_rows_max

    ctypedef struct cyllm_op:
        int kind, barrier, mode, dyn
        float *out
        float *out2
        const void *a
        const void *b
        const void *c
        const void *e
        uint16_t *kc
        uint16_t *vc
        int64_t d, n, n_heads, n_kv, hd, max_ctx, half, fixed, window
        int next_w
        float eps, scale
        void *xq
        int qfmt, act
        int64_t rb

    enum:
        CYLLM_OP_EMBED, CYLLM_OP_RMSNORM, CYLLM_OP_MATVEC, CYLLM_OP_GATE_UP, CYLLM_OP_ROPE,
        CYLLM_OP_CACHE_STORE, CYLLM_OP_ATTENTION, CYLLM_OP_ADD, CYLLM_OP_SWIGLU,
        CYLLM_OP_QUANTIZE, CYLLM_OP_QMATVEC, CYLLM_OP_QGATE_UP, CYLLM_OP_QEMBED, CYLLM_OP_GLU

    int CYLLM_CPU_AVX, CYLLM_CPU_AVX2, CYLLM_CPU_FMA, CYLLM_CPU_F16C, CYLLM_CPU_AVX512F
    int cyllm_cpu_features() noexcept
    int cyllm_avx2_compiled() noexcept
    int cyllm_avx512_compiled() noexcept
    int cyllm_pf_groups
    int cyllm_pf_next
    int cyllm_spin
    void cyllm_rmsnorm(float *out, const float *x, const float *w, int64_t n, float eps) noexcept
    void cyllm_rope_rows(float *v, int64_t heads, int64_t hd, int64_t half, const float *c,
                         const float *s) noexcept
    void cyllm_program_run(const cyllm_kernels *kt, const void *qk, const cyllm_op *ops, int n_ops,
                           int nt, int64_t token, int64_t pos, float *scratch) noexcept
    int64_t cyllm_attention_scratch(int64_t n_heads, int64_t hd, int64_t t_len) noexcept
    void cyllm_attention_run(const cyllm_kernels *kt, float *out, const float *q,
                             const uint16_t *kc, const uint16_t *vc, int64_t n_heads,
                             int64_t n_kv, int64_t hd, int64_t max_ctx, int64_t start,
                             int64_t pos, float scale, float *scratch, int nt) noexcept
    const cyllm_kernels *cyllm_kernels_by_name(const char *name) noexcept
    float cyllm_silu(float x) noexcept
    int CYLLM_ACT_SILU, CYLLM_ACT_GELU_TANH


# the GLU gate activations by name (the op interface's `act` argument)
ACTIVATIONS = {"silu": CYLLM_ACT_SILU, "gelu_tanh": CYLLM_ACT_GELU_TANH}


cdef inline int _act(object act) except -1:
    try:
        return ACTIVATIONS[act]
    except (KeyError, TypeError):
        raise InvalidArgumentError(f"act must be one of {', '.join(ACTIVATIONS)}, got {act!r}") from None


cdef inline float _scale(object scale, Py_ssize_t hd) except? -1:
    """An attention score scale: None -> 1/sqrt(head_dim); else a finite number > 0."""
    cdef double s
    if scale is None:
        return <float>(1.0 / sqrt(<double>hd))
    try:
        s = float(scale)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"scale must be a number, got {scale!r}") from None
    if not (s > 0 and s < 1e30):
        raise InvalidArgumentError(f"scale must be a finite number > 0, got {scale!r}")
    return <float>s


cdef inline float _factor(object scale) except? -1:
    cdef double s
    try:
        s = float(scale)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"scale must be a number, got {scale!r}") from None
    if not (s > 0 and s < 1e30):
        raise InvalidArgumentError(f"scale must be a finite number > 0, got {scale!r}")
    return <float>s


cdef inline Py_ssize_t _rope_hd(object head_dim, Py_ssize_t half) except -1:
    """The head stride of a rope op: head_dim, or 2*half when None; rotated dims fit in it."""
    if head_dim is None:
        return 2 * half
    cdef Py_ssize_t hd = _index(head_dim, "head_dim")
    if hd < 2 * half:
        raise InvalidArgumentError(f"head_dim {hd} is smaller than the {2 * half} rotated dims of the tables")
    return hd


cdef inline Py_ssize_t _window(object window) except -1:
    cdef Py_ssize_t w = _index(window, "window")
    if w < 0:
        raise InvalidArgumentError(f"window must be >= 0 (0: no window), got {w}")
    return w


def _set_spin(int polls):
    """Polls a decode-program thread spins at a barrier before it sleeps (benchmarks only)."""
    global cyllm_spin
    cyllm_spin = polls


def _set_prefetch(int groups, int across_ops=1):
    """Tuning knobs of the decode matvec's software prefetch (benchmarks only): groups
    of 4 rows ahead (0 = off), and whether the decode program prefetches across ops."""
    global cyllm_pf_groups, cyllm_pf_next
    cyllm_pf_groups = groups
    cyllm_pf_next = across_ops

cdef extern from "csrc/omp_shim.h" nogil:
    int CYLLM_OPENMP
    int omp_get_max_threads() noexcept


# Below these sizes an op runs on the calling thread: the parallel-region wake-up
# would cost more than the work (f16 matvec: 64K weights = 128 KiB, ~4 us).
cdef enum:
    MATVEC_PARALLEL_MIN = 65536      # weights read (d * n, both matrices for gate_up)
    VECTOR_PARALLEL_MIN = 65536      # elements of add / swiglu
    ROWS_PER_THREAD_MIN = 8

VARIANTS = ("generic", "avx2", "avx512")


# -- CPU / build facts -------------------------------------------------------------

def cpu_features():
    """SIMD features usable on this CPU and OS, e.g. ["avx", "avx2", "fma", "f16c", "avx512f"]."""
    cdef int f = cyllm_cpu_features()
    names = []
    for bit, name in ((CYLLM_CPU_AVX, "avx"), (CYLLM_CPU_AVX2, "avx2"), (CYLLM_CPU_FMA, "fma"),
                      (CYLLM_CPU_F16C, "f16c"), (CYLLM_CPU_AVX512F, "avx512f")):
        if f & bit:
            names.append(name)
    return names


def openmp_enabled():
    """True when the extension was compiled with OpenMP (else every loop is serial)."""
    return bool(CYLLM_OPENMP)


def omp_max_threads():
    return omp_get_max_threads()


def avx2_compiled():
    """True when the AVX2 variant was built into this extension (x86 builds only)."""
    return bool(cyllm_avx2_compiled())


def avx512_compiled():
    """True when the avx512 variant (AVX-512F prefill GEMM) was built into this extension."""
    return bool(cyllm_avx512_compiled())


def available_variants():
    """Variants that can run here, best first."""
    return [v for v in ("avx512", "avx2", "generic") if cyllm_kernels_by_name(v.encode()) != NULL]


def resolve_variant(variant=None):
    """The kernel variant to use: `variant`, else $CYLLM_KERNELS, else the best available.

    Accepts "auto" | "generic" | "avx2" | "avx512"; raises BackendUnavailableError for an
    unknown name or a variant this CPU (or this build) cannot run.
    """
    source = "variant"
    if variant is None:
        variant = os.environ.get("CYLLM_KERNELS", "").strip()
        source = "CYLLM_KERNELS"
        if not variant:
            variant = "auto"
    if not isinstance(variant, str):
        raise BackendUnavailableError(f"{source} must be a string, got {variant!r}")
    v = variant.strip().lower()
    if v == "auto":
        return available_variants()[0]
    if v not in VARIANTS:
        raise BackendUnavailableError(
            f"unknown kernel variant {variant!r} in {source} (choose from auto, {', '.join(VARIANTS)})")
    if cyllm_kernels_by_name(v.encode()) == NULL:
        if v == "avx512" and not cyllm_avx512_compiled():
            raise BackendUnavailableError(
                "kernel variant 'avx512' was not built into this extension (non-x86 target or "
                "the compiler lacks -mavx512f); use CYLLM_KERNELS=avx2 or generic")
        if v == "avx512":
            raise BackendUnavailableError(
                f"kernel variant 'avx512' needs a CPU with AVX-512F, AVX2, FMA and F16C; this CPU "
                f"has [{', '.join(cpu_features())}]; use CYLLM_KERNELS=avx2 or generic")
        if not cyllm_avx2_compiled():
            raise BackendUnavailableError(
                f"kernel variant {v!r} was not built into this extension (non-x86 target "
                "or the compiler lacks -mavx2); use CYLLM_KERNELS=generic")
        raise BackendUnavailableError(
            f"kernel variant {v!r} needs a CPU with AVX2, FMA and F16C; this CPU has "
            f"[{', '.join(cpu_features())}]; use CYLLM_KERNELS=generic")
    return v


# The default is resolved once, at import; a bad $CYLLM_KERNELS is reported when a
# backend is created (an import error would read as "extension not built").
try:
    DEFAULT_VARIANT = resolve_variant(None)
    _DEFAULT_ERROR = None
except BackendUnavailableError as _e:
    DEFAULT_VARIANT = None
    _DEFAULT_ERROR = _e


# -- argument checks ---------------------------------------------------------------

cdef inline cnp.ndarray _arr(object a, str name, int typenum, int ndim, bint writable):
    """a as an ndarray of the given dtype and rank, C-contiguous, aligned, native order."""
    if not cnp.PyArray_Check(a):
        raise InvalidArgumentError(f"{name} must be a numpy array, got {type(a).__name__}")
    cdef cnp.ndarray arr = <cnp.ndarray>a
    if cnp.PyArray_TYPE(arr) != typenum or not cnp.PyArray_ISNOTSWAPPED(arr):
        want = "float32" if typenum == cnp.NPY_FLOAT32 else "float16"
        raise InvalidArgumentError(f"{name} must be a native {want} array, got {a.dtype}")
    if cnp.PyArray_NDIM(arr) != ndim:
        raise InvalidArgumentError(f"{name} must be {ndim}-D, got shape {a.shape}")
    if not cnp.PyArray_IS_C_CONTIGUOUS(arr) or not cnp.PyArray_ISALIGNED(arr):
        raise InvalidArgumentError(f"{name} must be C-contiguous and aligned to its dtype")
    if writable and not cnp.PyArray_ISWRITEABLE(arr):
        raise InvalidArgumentError(f"{name} must be writable")
    return arr


cdef inline int _no_overlap(cnp.ndarray a, cnp.ndarray b, str na, str nb) except -1:
    """Kernels read b while writing a from several threads: the two must not overlap."""
    cdef char *a0 = <char *>cnp.PyArray_DATA(a)
    cdef char *b0 = <char *>cnp.PyArray_DATA(b)
    if a0 < b0 + cnp.PyArray_NBYTES(b) and b0 < a0 + cnp.PyArray_NBYTES(a):
        raise InvalidArgumentError(f"{na} must not share memory with {nb}")
    return 0


cdef inline Py_ssize_t _index(object value, str name) except? -1:
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r}")
    try:
        return value.__index__()
    except (AttributeError, TypeError, OverflowError):
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r}") from None


cdef inline int _check_pos(Py_ssize_t pos, Py_ssize_t max_ctx) except -1:
    if pos < 0 or pos >= max_ctx:
        raise InvalidArgumentError(f"position {pos} is out of range [0, {max_ctx})")
    return 0


cdef inline int _check_span(Py_ssize_t pos0, Py_ssize_t T, Py_ssize_t max_ctx) except -1:
    if pos0 < 0 or pos0 + T > max_ctx:
        raise InvalidArgumentError(
            f"positions {pos0}..{pos0 + T - 1} are out of range [0, {max_ctx})")
    return 0


cdef inline float _eps(object eps) except? -1:
    cdef double e
    try:
        e = float(eps)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"eps must be a number, got {eps!r}") from None
    if not e >= 0.0:
        raise InvalidArgumentError(f"eps must be >= 0, got {eps!r}")
    return <float>e


cdef inline int _check_len(Py_ssize_t got, Py_ssize_t want, str name, str what) except -1:
    if got != want:
        raise InvalidArgumentError(f"{name} has length {got}, expected {want} ({what})")
    return 0


# the quantized-weight kernels (QuantKernels): CpuKernels hands QuantMatrix weights to them
include "quant.pxi"


cdef inline tuple _qm(object w, str name):
    """(block data (rows, row_bytes) uint8, kernel id) of a QuantMatrix weight."""
    if type(w) is not QuantMatrix:
        raise InvalidArgumentError(
            f"{name} must be a float16 numpy array or a cyllm.quant.QuantMatrix, got {type(w).__name__}")
    return (<object>w).data, (<object>w).fmt.kernel_id


# -- the kernels -------------------------------------------------------------------

cdef class CpuKernels:
    """Every op of cyllm.backends.base.Backend for the CPU; cpu.CpuBackend extends it.

    CpuKernels(threads=1, variant=None): variant None follows $CYLLM_KERNELS, then
    the best variant this CPU runs ("avx2", else "generic").
    """
    cdef const cyllm_kernels *kt
    cdef int nthreads
    cdef str _variant
    cdef float *scratch          # attention partials (grown on demand, kept)
    cdef Py_ssize_t scratch_n
    cdef QuantKernels q          # the kernels of QuantMatrix weights (same threads)
    cdef dict _scr               # f32 scratch vectors by name (mixed-format gate/up), grown once

    def __cinit__(self):
        self.scratch = NULL
        self.scratch_n = 0

    def __dealloc__(self):
        free(self.scratch)

    cdef float *_scratch_for(self, Py_ssize_t n) except? NULL:
        """At least n floats of attention scratch (allocates only when the need grows)."""
        cdef float *grown
        if n > self.scratch_n:
            grown = <float *>realloc(self.scratch, n * sizeof(float))
            if grown == NULL:
                raise MemoryError(f"cannot allocate {n * 4} bytes of attention scratch")
            self.scratch = grown
            self.scratch_n = n
        return self.scratch

    def __init__(self, threads=1, variant=None):
        if variant is None:
            if _DEFAULT_ERROR is not None:
                raise _DEFAULT_ERROR
            v = DEFAULT_VARIANT
        else:
            v = resolve_variant(variant)
        self.kt = cyllm_kernels_by_name(v.encode())
        self._variant = v
        self._scr = {}
        self.q = QuantKernels(1, None, v)
        self.threads = threads

    @property
    def quant_variant(self):
        """The table of the quantized kernels ($CYLLM_QKERNELS or the best no wider than
        kernel_variant)."""
        return self.q.quant_variant

    @property
    def quant(self):
        """The QuantKernels object QuantMatrix weights are computed with."""
        return self.q

    cdef cnp.ndarray _scratch_vec(self, str name, Py_ssize_t n):
        """A float32 scratch vector of n elements (the buffer only grows)."""
        cdef cnp.ndarray a = self._scr.get(name)
        if a is None or a.shape[0] < n:
            a = np.empty(max(n, 1), np.float32)
            self._scr[name] = a
        return a[:n]

    @property
    def kernel_variant(self):
        return self._variant

    @property
    def threads(self):
        return self.nthreads

    @threads.setter
    def threads(self, value):
        cdef Py_ssize_t n = _index(value, "threads")
        if n < 1 or n > 4096:
            raise InvalidArgumentError(f"threads must be in [1, 4096], got {n}")
        self.nthreads = <int>n
        if self.q is not None:
            self.q.nthreads = <int>n

    # -- matvec family -------------------------------------------------------------
    cdef int _matvec(self, object out, object w, object x, int add) except -1:
        if not cnp.PyArray_Check(w):        # a QuantMatrix: the quantized kernels
            data, kid = _qm(w, "w")
            return self.q._matvec(out, data, kid, x, add, None, CYLLM_ACT_SILU)
        cdef cnp.ndarray ao = _arr(out, "out", cnp.NPY_FLOAT32, 1, True)
        cdef cnp.ndarray aw = _arr(w, "w", cnp.NPY_FLOAT16, 2, False)
        cdef cnp.ndarray ax = _arr(x, "x", cnp.NPY_FLOAT32, 1, False)
        cdef Py_ssize_t d = cnp.PyArray_DIM(aw, 0), n = cnp.PyArray_DIM(aw, 1)
        _check_len(cnp.PyArray_DIM(ax, 0), n, "x", "columns of w")
        _check_len(cnp.PyArray_DIM(ao, 0), d, "out", "rows of w")
        _no_overlap(ao, ax, "out", "x")
        _no_overlap(ao, aw, "out", "w")
        self._rows(<float *>cnp.PyArray_DATA(ao), <const uint16_t *>cnp.PyArray_DATA(aw), NULL,
                   <const float *>cnp.PyArray_DATA(ax), d, n, add)
        return 0

    cdef void _rows(self, float *po, const uint16_t *pw, const uint16_t *pu, const float *px,
                    Py_ssize_t d, Py_ssize_t n, int mode) noexcept:
        """Split rows over threads in contiguous chunks of whole 4-row groups.
        mode 0/1: matvec / matvec_add on pw; mode 2 + act: gate_up on (pw, pu)."""
        cdef const cyllm_kernels *kt = self.kt
        cdef Py_ssize_t groups = (d + 3) // 4, t, r0, r1
        cdef int nt = self.nthreads
        if d * n * (2 if mode >= 2 else 1) < MATVEC_PARALLEL_MIN:
            nt = 1
        if nt > d // ROWS_PER_THREAD_MIN:
            nt = <int>(d // ROWS_PER_THREAD_MIN)
        if nt < 1:
            nt = 1
        with nogil:
            if nt == 1:
                if mode >= 2:
                    kt.gate_up_rows(po, pw, pu, px, n, 0, d, mode - 2, NULL, 0)
                else:
                    kt.matvec_rows(po, pw, px, n, 0, d, mode, NULL, 0)
            else:
                for t in prange(nt, num_threads=nt, schedule="static", chunksize=1):
                    r0 = (groups * t // nt) * 4
                    r1 = (groups * (t + 1) // nt) * 4
                    if r1 > d:
                        r1 = d
                    if mode >= 2:
                        kt.gate_up_rows(po, pw, pu, px, n, r0, r1, mode - 2, NULL, 0)
                    else:
                        kt.matvec_rows(po, pw, px, n, r0, r1, mode, NULL, 0)

    def matvec(self, out, w, x):
        """out (d,) f32 = w (d, n) f16 @ x (n,) f32."""
        self._matvec(out, w, x, 0)

    def matvec_add(self, out, w, x):
        """out (d,) f32 += w (d, n) f16 @ x (n,) f32."""
        self._matvec(out, w, x, 1)

    def gate_up(self, out, w_gate, w_up, x, act="silu"):
        """out (f,) f32 = act(w_gate @ x) * (w_up @ x); w_gate, w_up (f, n) f16 or QuantMatrix;
        act "silu" | "gelu_tanh"."""
        cdef int a = _act(act)
        if not (cnp.PyArray_Check(w_gate) and cnp.PyArray_Check(w_up)):
            self._qgate_up(out, w_gate, w_up, x, a)
            return
        cdef cnp.ndarray ao = _arr(out, "out", cnp.NPY_FLOAT32, 1, True)
        cdef cnp.ndarray ag = _arr(w_gate, "w_gate", cnp.NPY_FLOAT16, 2, False)
        cdef cnp.ndarray au = _arr(w_up, "w_up", cnp.NPY_FLOAT16, 2, False)
        cdef cnp.ndarray ax = _arr(x, "x", cnp.NPY_FLOAT32, 1, False)
        cdef Py_ssize_t f = cnp.PyArray_DIM(ag, 0), n = cnp.PyArray_DIM(ag, 1)
        if cnp.PyArray_DIM(au, 0) != f or cnp.PyArray_DIM(au, 1) != n:
            raise InvalidArgumentError(
                f"w_up has shape {w_up.shape}, expected {w_gate.shape} (the shape of w_gate)")
        _check_len(cnp.PyArray_DIM(ax, 0), n, "x", "columns of w_gate")
        _check_len(cnp.PyArray_DIM(ao, 0), f, "out", "rows of w_gate")
        _no_overlap(ao, ax, "out", "x")
        _no_overlap(ao, ag, "out", "w_gate")
        _no_overlap(ao, au, "out", "w_up")
        self._rows(<float *>cnp.PyArray_DATA(ao), <const uint16_t *>cnp.PyArray_DATA(ag),
                   <const uint16_t *>cnp.PyArray_DATA(au), <const float *>cnp.PyArray_DATA(ax),
                   f, n, 2 + a)

    cdef int _qgate_up(self, object out, object wg, object wu, object x, int a) except -1:
        """gate_up with a QuantMatrix among the weights: one fused kernel when both share a
        format, else two matvecs into scratch and the GLU (what a decode program does too)."""
        cdef Py_ssize_t f
        if type(wg) is QuantMatrix and type(wu) is QuantMatrix and wg.fmt is wu.fmt:
            if wg.shape != wu.shape:
                raise InvalidArgumentError(
                    f"w_up has shape {wu.shape}, expected {wg.shape} (the shape of w_gate)")
            return self.q._matvec(out, wg.data, wg.fmt.kernel_id, x, 0, wu.data, a)
        if not cnp.PyArray_Check(wg):
            _qm(wg, "w_gate")
        if not cnp.PyArray_Check(wu):
            _qm(wu, "w_up")
        if tuple(wg.shape) != tuple(wu.shape):
            raise InvalidArgumentError(
                f"w_up has shape {tuple(wu.shape)}, expected {tuple(wg.shape)} (the shape of w_gate)")
        cdef cnp.ndarray ao = _arr(out, "out", cnp.NPY_FLOAT32, 1, True)
        f = wg.shape[0]
        _check_len(cnp.PyArray_DIM(ao, 0), f, "out", "rows of w_gate")
        cdef cnp.ndarray g = self._scratch_vec("g", f), u = self._scratch_vec("u", f)
        self._matvec(g, wg, x, 0)
        self._matvec(u, wu, x, 0)
        with nogil:
            cyllm_qglu(<float *>cnp.PyArray_DATA(ao), <const float *>cnp.PyArray_DATA(g),
                       <const float *>cnp.PyArray_DATA(u), 0, f, a)
        return 0

    # -- attention and its helpers ------------------------------------------------
    def attention(self, out, q, k_cache, v_cache, pos, window=0, scale=None):
        """out, q (n_heads*head_dim,) f32; k_cache, v_cache (n_kv, max_ctx, head_dim) f16;
        causal over cache positions max(0, pos+1-window)..pos (window 0: from 0); query head h
        reads kv head h // (n_heads // n_kv); scores scaled by scale (None: 1/sqrt(head_dim))."""
        cdef cnp.ndarray ao = _arr(out, "out", cnp.NPY_FLOAT32, 1, True)
        cdef cnp.ndarray aq = _arr(q, "q", cnp.NPY_FLOAT32, 1, False)
        cdef cnp.ndarray ak = _arr(k_cache, "k_cache", cnp.NPY_FLOAT16, 3, False)
        cdef cnp.ndarray av = _arr(v_cache, "v_cache", cnp.NPY_FLOAT16, 3, False)
        cdef Py_ssize_t n_kv = cnp.PyArray_DIM(ak, 0), max_ctx = cnp.PyArray_DIM(ak, 1)
        cdef Py_ssize_t hd = cnp.PyArray_DIM(ak, 2)
        if (cnp.PyArray_DIM(av, 0) != n_kv or cnp.PyArray_DIM(av, 1) != max_ctx
                or cnp.PyArray_DIM(av, 2) != hd):
            raise InvalidArgumentError(
                f"v_cache has shape {v_cache.shape}, expected {k_cache.shape} (the shape of k_cache)")
        if n_kv < 1 or hd < 1:
            raise InvalidArgumentError(f"k_cache has an empty dimension: shape {k_cache.shape}")
        cdef Py_ssize_t qlen = cnp.PyArray_DIM(aq, 0)
        if qlen == 0 or qlen % hd:
            raise InvalidArgumentError(f"q has length {qlen}, not a positive multiple of head_dim {hd}")
        cdef Py_ssize_t n_heads = qlen // hd
        if n_heads % n_kv:
            raise InvalidArgumentError(
                f"q holds {n_heads} heads, not a multiple of the cache's {n_kv} kv heads")
        _check_len(cnp.PyArray_DIM(ao, 0), qlen, "out", "the length of q")
        cdef Py_ssize_t p = _index(pos, "pos")
        _check_pos(p, max_ctx)
        cdef Py_ssize_t w = _window(window)
        cdef Py_ssize_t start = p + 1 - w if 0 < w < p + 1 else 0
        cdef float sc = _scale(scale, hd)
        _no_overlap(ao, aq, "out", "q")
        _no_overlap(ao, ak, "out", "k_cache")
        _no_overlap(ao, av, "out", "v_cache")

        cdef const cyllm_kernels *kt = self.kt
        cdef float *po = <float *>cnp.PyArray_DATA(ao)
        cdef const float *pq = <const float *>cnp.PyArray_DATA(aq)
        cdef const uint16_t *pk = <const uint16_t *>cnp.PyArray_DATA(ak)
        cdef const uint16_t *pv = <const uint16_t *>cnp.PyArray_DATA(av)
        # The split (runs of GQA heads; beyond CYLLM_ATT_BLOCK positions fixed cache
        # blocks merged in order) lives in C (program.c) and is shared with the captured
        # decode step, so both give the same bits, for any thread count.
        cdef int nt = self.nthreads
        if (p + 1 - start) * hd * n_heads < 16384:   # tiny: a wake-up costs more than the work
            nt = 1
        cdef float *scratch = self._scratch_for(cyllm_attention_scratch(n_heads, hd, p + 1 - start))
        with nogil:
            cyllm_attention_run(kt, po, pq, pk, pv, n_heads, n_kv, hd, max_ctx, start, p, sc,
                                scratch, nt)

    def cache_store(self, k_cache, v_cache, k, v, pos):
        """k_cache[:, pos, :] = k ; v_cache[:, pos, :] = v (f32 -> f16, round to nearest even)."""
        cdef cnp.ndarray ak = _arr(k_cache, "k_cache", cnp.NPY_FLOAT16, 3, True)
        cdef cnp.ndarray av = _arr(v_cache, "v_cache", cnp.NPY_FLOAT16, 3, True)
        cdef cnp.ndarray xk = _arr(k, "k", cnp.NPY_FLOAT32, 1, False)
        cdef cnp.ndarray xv = _arr(v, "v", cnp.NPY_FLOAT32, 1, False)
        cdef Py_ssize_t n_kv = cnp.PyArray_DIM(ak, 0), max_ctx = cnp.PyArray_DIM(ak, 1)
        cdef Py_ssize_t hd = cnp.PyArray_DIM(ak, 2)
        if (cnp.PyArray_DIM(av, 0) != n_kv or cnp.PyArray_DIM(av, 1) != max_ctx
                or cnp.PyArray_DIM(av, 2) != hd):
            raise InvalidArgumentError(
                f"v_cache has shape {v_cache.shape}, expected {k_cache.shape} (the shape of k_cache)")
        _check_len(cnp.PyArray_DIM(xk, 0), n_kv * hd, "k", "n_kv_heads * head_dim of the cache")
        _check_len(cnp.PyArray_DIM(xv, 0), n_kv * hd, "v", "n_kv_heads * head_dim of the cache")
        cdef Py_ssize_t p = _index(pos, "pos")
        _check_pos(p, max_ctx)
        cdef const cyllm_kernels *kt = self.kt
        cdef uint16_t *pk = <uint16_t *>cnp.PyArray_DATA(ak)
        cdef uint16_t *pv = <uint16_t *>cnp.PyArray_DATA(av)
        cdef const float *sk = <const float *>cnp.PyArray_DATA(xk)
        cdef const float *sv = <const float *>cnp.PyArray_DATA(xv)
        cdef Py_ssize_t h
        with nogil:
            for h in range(n_kv):
                kt.f32_to_f16(pk + (h * max_ctx + p) * hd, sk + h * hd, hd)
                kt.f32_to_f16(pv + (h * max_ctx + p) * hd, sv + h * hd, hd)

    def rope(self, q, k, cos, sin, pos, head_dim=None):
        """Rotate q (n_heads*head_dim,) and k (n_kv*head_dim,) f32 in place (HF rotate-half);
        cos, sin (max_ctx, rot/2) f32, row pos: the first rot dims of each head rotate
        (head_dim None: rot = head_dim)."""
        cdef cnp.ndarray aq = _arr(q, "q", cnp.NPY_FLOAT32, 1, True)
        cdef cnp.ndarray ak = _arr(k, "k", cnp.NPY_FLOAT32, 1, True)
        cdef cnp.ndarray ac = _arr(cos, "cos", cnp.NPY_FLOAT32, 2, False)
        cdef cnp.ndarray as_ = _arr(sin, "sin", cnp.NPY_FLOAT32, 2, False)
        cdef Py_ssize_t max_ctx = cnp.PyArray_DIM(ac, 0), half = cnp.PyArray_DIM(ac, 1)
        if cnp.PyArray_DIM(as_, 0) != max_ctx or cnp.PyArray_DIM(as_, 1) != half:
            raise InvalidArgumentError(f"sin has shape {sin.shape}, expected {cos.shape} (the shape of cos)")
        if half < 1:
            raise InvalidArgumentError(f"cos has shape {cos.shape}: head_dim/2 must be positive")
        cdef Py_ssize_t hd = _rope_hd(head_dim, half)
        cdef Py_ssize_t nq = cnp.PyArray_DIM(aq, 0), nk = cnp.PyArray_DIM(ak, 0)
        if nq % hd or nk % hd:
            raise InvalidArgumentError(
                f"q (length {nq}) and k (length {nk}) must be multiples of head_dim {hd}")
        cdef Py_ssize_t p = _index(pos, "pos")
        _check_pos(p, max_ctx)
        cdef const float *c = <const float *>cnp.PyArray_DATA(ac) + p * half
        cdef const float *s = <const float *>cnp.PyArray_DATA(as_) + p * half
        with nogil:
            cyllm_rope_rows(<float *>cnp.PyArray_DATA(aq), nq // hd, hd, half, c, s)
            cyllm_rope_rows(<float *>cnp.PyArray_DATA(ak), nk // hd, hd, half, c, s)

    # -- small vector ops (serial below VECTOR_PARALLEL_MIN) ------------------------
    def embed(self, out, table, token, scale=1.0):
        """out (dim,) f32 = table[token] * scale; table (vocab, dim) f16 or QuantMatrix."""
        cdef float sc = _factor(scale)
        cdef cnp.ndarray ao = _arr(out, "out", cnp.NPY_FLOAT32, 1, True)
        cdef Py_ssize_t tok = _index(token, "token")
        cdef int32_t t32
        if not cnp.PyArray_Check(table):
            data, kid = _qm(table, "table")
            _check_len(cnp.PyArray_DIM(ao, 0), table.cols, "out", "columns of the table")
            if tok < 0 or tok >= table.rows:
                raise InvalidArgumentError(f"token id {tok} is out of range [0, {table.rows})")
            _no_overlap(ao, data, "out", "table")
            t32 = <int32_t>tok
            self.q._embed_rows(<float *>cnp.PyArray_DATA(ao), data, kid, &t32, 1, table.cols, sc)
            return
        cdef cnp.ndarray at = _arr(table, "table", cnp.NPY_FLOAT16, 2, False)
        cdef Py_ssize_t vocab = cnp.PyArray_DIM(at, 0), dim = cnp.PyArray_DIM(at, 1)
        _check_len(cnp.PyArray_DIM(ao, 0), dim, "out", "columns of the table")
        if tok < 0 or tok >= vocab:
            raise InvalidArgumentError(f"token id {tok} is out of range [0, {vocab})")
        cdef const cyllm_kernels *kt = self.kt
        cdef float *po = <float *>cnp.PyArray_DATA(ao)
        cdef const uint16_t *pt = <const uint16_t *>cnp.PyArray_DATA(at) + tok * dim
        cdef Py_ssize_t i
        with nogil:
            kt.f16_to_f32(po, pt, dim)
            if sc != 1.0:
                for i in range(dim):
                    po[i] *= sc

    def rmsnorm(self, out, x, w, eps):
        """out (dim,) f32 = x / sqrt(mean(x^2) + eps) * w (out may alias x)."""
        cdef cnp.ndarray ao = _arr(out, "out", cnp.NPY_FLOAT32, 1, True)
        cdef cnp.ndarray ax = _arr(x, "x", cnp.NPY_FLOAT32, 1, False)
        cdef cnp.ndarray aw = _arr(w, "w", cnp.NPY_FLOAT32, 1, False)
        cdef Py_ssize_t n = cnp.PyArray_DIM(ax, 0), i
        if n < 1:
            raise InvalidArgumentError("rmsnorm of an empty vector")
        _check_len(cnp.PyArray_DIM(aw, 0), n, "w", "the length of x")
        _check_len(cnp.PyArray_DIM(ao, 0), n, "out", "the length of x")
        cdef double e
        try:
            e = float(eps)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"eps must be a number, got {eps!r}") from None
        if not e >= 0.0:
            raise InvalidArgumentError(f"eps must be >= 0, got {eps!r}")
        cdef float *po = <float *>cnp.PyArray_DATA(ao)
        cdef const float *px = <const float *>cnp.PyArray_DATA(ax)
        cdef const float *pw = <const float *>cnp.PyArray_DATA(aw)
        with nogil:
            cyllm_rmsnorm(po, px, pw, n, <float>e)

    cdef int _elementwise(self, object out, object x, object y, str xname, str yname,
                          str xlen, bint silu_x) except -1:
        """out = silu(x) * y (silu_x) or x + y, all (n,) f32; out may alias x or y."""
        cdef cnp.ndarray ao = _arr(out, "out", cnp.NPY_FLOAT32, 1, True)
        cdef cnp.ndarray ax = _arr(x, xname, cnp.NPY_FLOAT32, 1, False)
        cdef cnp.ndarray ay = _arr(y, yname, cnp.NPY_FLOAT32, 1, False)
        cdef Py_ssize_t n = cnp.PyArray_DIM(ax, 0), i
        _check_len(cnp.PyArray_DIM(ay, 0), n, yname, xlen)
        _check_len(cnp.PyArray_DIM(ao, 0), n, "out", xlen)
        cdef float *po = <float *>cnp.PyArray_DATA(ao)
        cdef const float *px = <const float *>cnp.PyArray_DATA(ax)
        cdef const float *py = <const float *>cnp.PyArray_DATA(ay)
        cdef int nt = self.nthreads if n >= VECTOR_PARALLEL_MIN else 1
        with nogil:
            if nt == 1:     # no parallel region at all: its wake-up costs more than the work
                for i in range(n):
                    po[i] = cyllm_silu(px[i]) * py[i] if silu_x else px[i] + py[i]
            else:
                for i in prange(n, num_threads=nt, schedule="static"):
                    po[i] = cyllm_silu(px[i]) * py[i] if silu_x else px[i] + py[i]
        return 0

    def swiglu(self, out, gate, up):
        """out (f,) f32 = silu(gate) * up."""
        self._elementwise(out, gate, up, "gate", "up", "the length of gate", True)

    def add(self, out, x, y):
        """out = x + y, all (n,) f32 (out may alias x or y)."""
        self._elementwise(out, x, y, "x", "y", "the length of x", False)

    # -- batched ops (prefill: row t of every (T, ...) array is one position) -------
    cdef int _qgemm_op(self, object out, object w, object wu, object x, int mode) except -1:
        """matmul / matmul_add / gate_up_batch with a QuantMatrix among the weights."""
        cdef cnp.ndarray ao = _arr(out, "out", cnp.NPY_FLOAT32, 2, True)
        cdef cnp.ndarray ax = _arr(x, "x", cnp.NPY_FLOAT32, 2, False)
        cdef Py_ssize_t T = cnp.PyArray_DIM(ax, 0), n = cnp.PyArray_DIM(ax, 1), d, f
        cdef cnp.ndarray au
        if mode >= 2:
            # gate into out, up into scratch (T, f), then out = act(out) * up
            if tuple(w.shape) != tuple(wu.shape):
                raise InvalidArgumentError(
                    f"w_up has shape {tuple(wu.shape)}, expected {tuple(w.shape)} (the shape of w_gate)")
            f = w.shape[0]
            if cnp.PyArray_DIM(ao, 0) != T or cnp.PyArray_DIM(ao, 1) != f:
                raise InvalidArgumentError(f"out has shape {out.shape}, expected ({T}, {f}) (rows of x, rows of w_gate)")
            au = self._scratch_vec("up_batch", T * f).reshape(T, f)
            self._gemm(out, w, None, x, 0)
            self._gemm(au, wu, None, x, 0)
            with nogil:
                cyllm_qglu(<float *>cnp.PyArray_DATA(ao), <const float *>cnp.PyArray_DATA(ao),
                           <const float *>cnp.PyArray_DATA(au), 0, T * f, mode - 2)
            return 0
        data, kid = _qm(w, "w")
        d = w.rows
        if n != w.cols:
            raise InvalidArgumentError(f"x has shape {x.shape}: expected {w.cols} columns (columns of w)")
        if cnp.PyArray_DIM(ao, 0) != T or cnp.PyArray_DIM(ao, 1) != d:
            raise InvalidArgumentError(f"out has shape {out.shape}, expected ({T}, {d}) (rows of x, rows of w)")
        _no_overlap(ao, ax, "out", "x")
        _no_overlap(ao, data, "out", "w")
        self.q._qgemm(<float *>cnp.PyArray_DATA(ao), <const uint8_t *>cnp.PyArray_DATA(<cnp.ndarray>data),
                      w.row_bytes, kid, <const float *>cnp.PyArray_DATA(ax), T, n, d, mode,
                      self.q.prefill_method[kid])
        return 0

    cdef int _gemm(self, object out, object w, object wu, object x, int mode) except -1:
        if not cnp.PyArray_Check(w) or (mode >= 2 and not cnp.PyArray_Check(wu)):
            return self._qgemm_op(out, w, wu, x, mode)
        cdef str wname = "w_gate" if mode == 2 else "w"
        cdef cnp.ndarray ao = _arr(out, "out", cnp.NPY_FLOAT32, 2, True)
        cdef cnp.ndarray aw = _arr(w, wname, cnp.NPY_FLOAT16, 2, False)
        cdef cnp.ndarray ax = _arr(x, "x", cnp.NPY_FLOAT32, 2, False)
        cdef cnp.ndarray au = None
        cdef Py_ssize_t d = cnp.PyArray_DIM(aw, 0), n = cnp.PyArray_DIM(aw, 1)
        cdef Py_ssize_t T = cnp.PyArray_DIM(ax, 0)
        if mode >= 2:
            au = _arr(wu, "w_up", cnp.NPY_FLOAT16, 2, False)
            if cnp.PyArray_DIM(au, 0) != d or cnp.PyArray_DIM(au, 1) != n:
                raise InvalidArgumentError(
                    f"w_up has shape {wu.shape}, expected {w.shape} (the shape of w_gate)")
            _no_overlap(ao, au, "out", "w_up")
        if cnp.PyArray_DIM(ax, 1) != n:
            raise InvalidArgumentError(f"x has shape {x.shape}: expected {n} columns (columns of {wname})")
        if cnp.PyArray_DIM(ao, 0) != T or cnp.PyArray_DIM(ao, 1) != d:
            raise InvalidArgumentError(f"out has shape {out.shape}, expected ({T}, {d}) (rows of x, rows of {wname})")
        _no_overlap(ao, ax, "out", "x")
        _no_overlap(ao, aw, "out", wname)
        if T == 0 or d == 0:
            return 0
        cdef const cyllm_kernels *kt = self.kt
        cdef float *po = <float *>cnp.PyArray_DATA(ao)
        cdef const uint16_t *pw = <const uint16_t *>cnp.PyArray_DATA(aw)
        cdef const uint16_t *pu = <const uint16_t *>cnp.PyArray_DATA(au) if mode >= 2 else NULL
        cdef const float *px = <const float *>cnp.PyArray_DATA(ax)
        # threads own runs of whole weight panels (gemm_nr rows): a row's bits do not
        # depend on the split
        cdef Py_ssize_t nr = kt.gemm_nr, panels = (d + kt.gemm_nr - 1) // kt.gemm_nr, t, r0, r1
        cdef int nt = self.nthreads
        if nt > panels:
            nt = <int>panels
        if T * d * n * (2 if mode >= 2 else 1) < MATVEC_PARALLEL_MIN:
            nt = 1
        with nogil:
            if nt == 1:
                kt.gemm_rows(po, pw, pu, px, T, n, d, 0, d, mode)
            else:
                for t in prange(nt, num_threads=nt, schedule="static", chunksize=1):
                    r0 = (panels * t // nt) * nr
                    r1 = (panels * (t + 1) // nt) * nr
                    if r1 > d:
                        r1 = d
                    kt.gemm_rows(po, pw, pu, px, T, n, d, r0, r1, mode)
        return 0

    def matmul(self, out, w, x):
        """out (T, d) f32 = x (T, n) f32 @ w.T ; w (d, n) f16."""
        self._gemm(out, w, None, x, 0)

    def matmul_add(self, out, w, x):
        """out (T, d) f32 += x (T, n) f32 @ w.T ; w (d, n) f16."""
        self._gemm(out, w, None, x, 1)

    def gate_up_batch(self, out, w_gate, w_up, x, act="silu"):
        """out (T, f) f32 = act(x @ w_gate.T) * (x @ w_up.T) ; w_gate, w_up (f, n) f16."""
        self._gemm(out, w_gate, w_up, x, 2 + _act(act))

    def embed_batch(self, out, table, tokens, scale=1.0):
        """out (T, dim) f32 = table[tokens] * scale ; tokens (T,) int32 (every id checked)."""
        cdef float sc = _factor(scale)
        cdef Py_ssize_t i
        cdef cnp.ndarray ao = _arr(out, "out", cnp.NPY_FLOAT32, 2, True)
        if not cnp.PyArray_Check(table):
            return self._qembed_batch(ao, table, tokens, sc)
        cdef cnp.ndarray at = _arr(table, "table", cnp.NPY_FLOAT16, 2, False)
        if (not cnp.PyArray_Check(tokens) or cnp.PyArray_TYPE(<cnp.ndarray>tokens) != cnp.NPY_INT32
                or not cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>tokens)
                or cnp.PyArray_NDIM(<cnp.ndarray>tokens) != 1
                or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>tokens)
                or not cnp.PyArray_ISALIGNED(<cnp.ndarray>tokens)):
            raise InvalidArgumentError("tokens must be a contiguous 1-D native int32 numpy array")
        cdef const int32_t *tok = <const int32_t *>cnp.PyArray_DATA(<cnp.ndarray>tokens)
        cdef Py_ssize_t vocab = cnp.PyArray_DIM(at, 0), dim = cnp.PyArray_DIM(at, 1)
        cdef Py_ssize_t T = cnp.PyArray_DIM(<cnp.ndarray>tokens, 0), t
        if cnp.PyArray_DIM(ao, 0) != T or cnp.PyArray_DIM(ao, 1) != dim:
            raise InvalidArgumentError(f"out has shape {out.shape}, expected ({T}, {dim}) (tokens, columns of the table)")
        for t in range(T):
            if tok[t] < 0 or tok[t] >= vocab:
                raise InvalidArgumentError(f"token id {tok[t]} is out of range [0, {vocab})")
        cdef const cyllm_kernels *kt = self.kt
        cdef float *po = <float *>cnp.PyArray_DATA(ao)
        cdef const uint16_t *pt = <const uint16_t *>cnp.PyArray_DATA(at)
        with nogil:
            for t in range(T):
                kt.f16_to_f32(po + t * dim, pt + <Py_ssize_t>tok[t] * dim, dim)
            if sc != 1.0:
                for i in range(T * dim):
                    po[i] *= sc

    cdef int _qembed_batch(self, cnp.ndarray ao, object table, object tokens, float sc) except -1:
        data, kid = _qm(table, "table")
        if (not cnp.PyArray_Check(tokens) or cnp.PyArray_TYPE(<cnp.ndarray>tokens) != cnp.NPY_INT32
                or not cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>tokens)
                or cnp.PyArray_NDIM(<cnp.ndarray>tokens) != 1
                or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>tokens)
                or not cnp.PyArray_ISALIGNED(<cnp.ndarray>tokens)):
            raise InvalidArgumentError("tokens must be a contiguous 1-D native int32 numpy array")
        cdef const int32_t *tok = <const int32_t *>cnp.PyArray_DATA(<cnp.ndarray>tokens)
        cdef Py_ssize_t vocab = table.rows, dim = table.cols, t
        cdef Py_ssize_t T = cnp.PyArray_DIM(<cnp.ndarray>tokens, 0)
        if cnp.PyArray_DIM(ao, 0) != T or cnp.PyArray_DIM(ao, 1) != dim:
            raise InvalidArgumentError(f"out has shape {(<object>ao).shape}, expected ({T}, {dim}) (tokens, columns of the table)")
        for t in range(T):
            if tok[t] < 0 or tok[t] >= vocab:
                raise InvalidArgumentError(f"token id {tok[t]} is out of range [0, {vocab})")
        _no_overlap(ao, data, "out", "table")
        return self.q._embed_rows(<float *>cnp.PyArray_DATA(ao), data, kid, tok, T, dim, sc)

    def rmsnorm_batch(self, out, x, w, eps):
        """rmsnorm of every row: out, x (T, dim) f32 (out may alias x) ; w (dim,) f32."""
        cdef cnp.ndarray ao = _arr(out, "out", cnp.NPY_FLOAT32, 2, True)
        cdef cnp.ndarray ax = _arr(x, "x", cnp.NPY_FLOAT32, 2, False)
        cdef cnp.ndarray aw = _arr(w, "w", cnp.NPY_FLOAT32, 1, False)
        cdef Py_ssize_t T = cnp.PyArray_DIM(ax, 0), n = cnp.PyArray_DIM(ax, 1), t
        if n < 1:
            raise InvalidArgumentError("rmsnorm of an empty vector")
        _check_len(cnp.PyArray_DIM(aw, 0), n, "w", "the row length of x")
        if cnp.PyArray_DIM(ao, 0) != T or cnp.PyArray_DIM(ao, 1) != n:
            raise InvalidArgumentError(f"out has shape {out.shape}, expected {x.shape} (the shape of x)")
        cdef float e = _eps(eps)
        cdef float *po = <float *>cnp.PyArray_DATA(ao)
        cdef const float *px = <const float *>cnp.PyArray_DATA(ax)
        cdef const float *pw = <const float *>cnp.PyArray_DATA(aw)
        cdef int nt = self.nthreads if T * n >= VECTOR_PARALLEL_MIN else 1
        with nogil:
            if nt == 1:
                for t in range(T):
                    cyllm_rmsnorm(po + t * n, px + t * n, pw, n, e)
            else:
                for t in prange(T, num_threads=nt, schedule="static"):
                    cyllm_rmsnorm(po + t * n, px + t * n, pw, n, e)

    def add_rows(self, out, x, b):
        """out (T, n) = x (T, n) + b (n,) on every row (out may alias x)."""
        cdef cnp.ndarray ao = _arr(out, "out", cnp.NPY_FLOAT32, 2, True)
        cdef cnp.ndarray ax = _arr(x, "x", cnp.NPY_FLOAT32, 2, False)
        cdef cnp.ndarray ab = _arr(b, "b", cnp.NPY_FLOAT32, 1, False)
        cdef Py_ssize_t T = cnp.PyArray_DIM(ax, 0), n = cnp.PyArray_DIM(ax, 1), t, i
        _check_len(cnp.PyArray_DIM(ab, 0), n, "b", "the row length of x")
        if cnp.PyArray_DIM(ao, 0) != T or cnp.PyArray_DIM(ao, 1) != n:
            raise InvalidArgumentError(f"out has shape {out.shape}, expected {x.shape} (the shape of x)")
        cdef float *po = <float *>cnp.PyArray_DATA(ao)
        cdef const float *px = <const float *>cnp.PyArray_DATA(ax)
        cdef const float *pb = <const float *>cnp.PyArray_DATA(ab)
        with nogil:
            for t in range(T):
                for i in range(n):
                    po[t * n + i] = px[t * n + i] + pb[i]

    def rope_batch(self, q, k, cos, sin, pos0, head_dim=None):
        """rope of every row in place: q (T, n_heads*hd), k (T, n_kv*hd); row t at pos0 + t;
        the first 2 * cos.shape[1] dims of each head rotate (see rope)."""
        cdef cnp.ndarray aq = _arr(q, "q", cnp.NPY_FLOAT32, 2, True)
        cdef cnp.ndarray ak = _arr(k, "k", cnp.NPY_FLOAT32, 2, True)
        cdef cnp.ndarray ac = _arr(cos, "cos", cnp.NPY_FLOAT32, 2, False)
        cdef cnp.ndarray as_ = _arr(sin, "sin", cnp.NPY_FLOAT32, 2, False)
        cdef Py_ssize_t max_ctx = cnp.PyArray_DIM(ac, 0), half = cnp.PyArray_DIM(ac, 1)
        if cnp.PyArray_DIM(as_, 0) != max_ctx or cnp.PyArray_DIM(as_, 1) != half:
            raise InvalidArgumentError(f"sin has shape {sin.shape}, expected {cos.shape} (the shape of cos)")
        if half < 1:
            raise InvalidArgumentError(f"cos has shape {cos.shape}: head_dim/2 must be positive")
        cdef Py_ssize_t hd = _rope_hd(head_dim, half), T = cnp.PyArray_DIM(aq, 0), t
        if cnp.PyArray_DIM(ak, 0) != T:
            raise InvalidArgumentError(f"k has {cnp.PyArray_DIM(ak, 0)} rows, q has {T}")
        cdef Py_ssize_t nq = cnp.PyArray_DIM(aq, 1), nk = cnp.PyArray_DIM(ak, 1)
        if nq % hd or nk % hd:
            raise InvalidArgumentError(
                f"q rows (length {nq}) and k rows (length {nk}) must be multiples of head_dim {hd}")
        cdef Py_ssize_t p0 = _index(pos0, "pos0")
        _check_span(p0, T, max_ctx)
        cdef float *pq = <float *>cnp.PyArray_DATA(aq)
        cdef float *pk = <float *>cnp.PyArray_DATA(ak)
        cdef const float *c = <const float *>cnp.PyArray_DATA(ac)
        cdef const float *s = <const float *>cnp.PyArray_DATA(as_)
        with nogil:
            for t in range(T):
                cyllm_rope_rows(pq + t * nq, nq // hd, hd, half, c + (p0 + t) * half, s + (p0 + t) * half)
                cyllm_rope_rows(pk + t * nk, nk // hd, hd, half, c + (p0 + t) * half, s + (p0 + t) * half)

    def cache_store_batch(self, k_cache, v_cache, k, v, pos0):
        """k_cache[:, pos0 + t, :] = k[t] ; same for v ; k, v (T, n_kv*hd) f32 -> f16."""
        cdef cnp.ndarray ak = _arr(k_cache, "k_cache", cnp.NPY_FLOAT16, 3, True)
        cdef cnp.ndarray av = _arr(v_cache, "v_cache", cnp.NPY_FLOAT16, 3, True)
        cdef cnp.ndarray xk = _arr(k, "k", cnp.NPY_FLOAT32, 2, False)
        cdef cnp.ndarray xv = _arr(v, "v", cnp.NPY_FLOAT32, 2, False)
        cdef Py_ssize_t n_kv = cnp.PyArray_DIM(ak, 0), max_ctx = cnp.PyArray_DIM(ak, 1)
        cdef Py_ssize_t hd = cnp.PyArray_DIM(ak, 2), T = cnp.PyArray_DIM(xk, 0), t, h
        if (cnp.PyArray_DIM(av, 0) != n_kv or cnp.PyArray_DIM(av, 1) != max_ctx
                or cnp.PyArray_DIM(av, 2) != hd):
            raise InvalidArgumentError(
                f"v_cache has shape {v_cache.shape}, expected {k_cache.shape} (the shape of k_cache)")
        if cnp.PyArray_DIM(xv, 0) != T:
            raise InvalidArgumentError(f"v has {cnp.PyArray_DIM(xv, 0)} rows, k has {T}")
        _check_len(cnp.PyArray_DIM(xk, 1), n_kv * hd, "k rows", "n_kv_heads * head_dim of the cache")
        _check_len(cnp.PyArray_DIM(xv, 1), n_kv * hd, "v rows", "n_kv_heads * head_dim of the cache")
        cdef Py_ssize_t p0 = _index(pos0, "pos0")
        _check_span(p0, T, max_ctx)
        cdef const cyllm_kernels *kt = self.kt
        cdef uint16_t *pk = <uint16_t *>cnp.PyArray_DATA(ak)
        cdef uint16_t *pv = <uint16_t *>cnp.PyArray_DATA(av)
        cdef const float *sk = <const float *>cnp.PyArray_DATA(xk)
        cdef const float *sv = <const float *>cnp.PyArray_DATA(xv)
        cdef Py_ssize_t w = n_kv * hd
        with nogil:
            for h in range(n_kv):            # per head the T rows are contiguous in the cache
                for t in range(T):
                    kt.f32_to_f16(pk + (h * max_ctx + p0 + t) * hd, sk + t * w + h * hd, hd)
                    kt.f32_to_f16(pv + (h * max_ctx + p0 + t) * hd, sv + t * w + h * hd, hd)

    def attention_batch(self, out, q, k_cache, v_cache, pos0, window=0, scale=None):
        """Causal attention of T queries: row t attends to cache positions
        max(0, pos0+t+1-window)..pos0+t (window 0: from 0); scores scaled by scale.
        out, q (T, n_heads*hd) f32. The avx512 variant computes blocks of rows as small
        GEMMs with an exact softmax; the others call the decode kernel row by row."""
        cdef cnp.ndarray ao = _arr(out, "out", cnp.NPY_FLOAT32, 2, True)
        cdef cnp.ndarray aq = _arr(q, "q", cnp.NPY_FLOAT32, 2, False)
        cdef cnp.ndarray ak = _arr(k_cache, "k_cache", cnp.NPY_FLOAT16, 3, False)
        cdef cnp.ndarray av = _arr(v_cache, "v_cache", cnp.NPY_FLOAT16, 3, False)
        cdef Py_ssize_t n_kv = cnp.PyArray_DIM(ak, 0), max_ctx = cnp.PyArray_DIM(ak, 1)
        cdef Py_ssize_t hd = cnp.PyArray_DIM(ak, 2), T = cnp.PyArray_DIM(aq, 0)
        if (cnp.PyArray_DIM(av, 0) != n_kv or cnp.PyArray_DIM(av, 1) != max_ctx
                or cnp.PyArray_DIM(av, 2) != hd):
            raise InvalidArgumentError(
                f"v_cache has shape {v_cache.shape}, expected {k_cache.shape} (the shape of k_cache)")
        if n_kv < 1 or hd < 1:
            raise InvalidArgumentError(f"k_cache has an empty dimension: shape {k_cache.shape}")
        cdef Py_ssize_t qlen = cnp.PyArray_DIM(aq, 1)
        if qlen == 0 or qlen % hd:
            raise InvalidArgumentError(f"q rows have length {qlen}, not a positive multiple of head_dim {hd}")
        cdef Py_ssize_t n_heads = qlen // hd
        if n_heads % n_kv:
            raise InvalidArgumentError(
                f"q holds {n_heads} heads, not a multiple of the cache's {n_kv} kv heads")
        if cnp.PyArray_DIM(ao, 0) != T or cnp.PyArray_DIM(ao, 1) != qlen:
            raise InvalidArgumentError(f"out has shape {out.shape}, expected {q.shape} (the shape of q)")
        cdef Py_ssize_t p0 = _index(pos0, "pos0")
        _check_span(p0, T, max_ctx)
        _no_overlap(ao, aq, "out", "q")
        _no_overlap(ao, ak, "out", "k_cache")
        _no_overlap(ao, av, "out", "v_cache")
        cdef const cyllm_kernels *kt = self.kt
        cdef float *po = <float *>cnp.PyArray_DATA(ao)
        cdef const float *pq = <const float *>cnp.PyArray_DATA(aq)
        cdef const uint16_t *pk = <const uint16_t *>cnp.PyArray_DATA(ak)
        cdef const uint16_t *pv = <const uint16_t *>cnp.PyArray_DATA(av)
        cdef Py_ssize_t group = n_heads // n_kv, items = T * n_kv, it, t, kvh, st
        cdef float sc = _scale(scale, hd)
        cdef Py_ssize_t w = _window(window)
        cdef int nt = self.nthreads
        if T * (p0 + T) * hd * n_heads < 65536:
            nt = 1
        cdef Py_ssize_t R = kt.attention_rows_max, blocks, per, h, t0
        cdef float *work
        if kt.attention_rows != NULL and T > 1 and (w == 0 or w >= p0 + T):
            # GEMM-shaped kernel: work item = (block of R query rows, one head); blocks
            # of later rows attend to more positions, so they are handed out first
            blocks = (T + R - 1) // R
            items = blocks * n_heads
            if nt > items:
                nt = <int>items
            per = kt.attention_rows_work(p0 + T) + 16
            work = self._scratch_for(per * nt)
            with nogil:
                for it in prange(items, num_threads=nt, schedule="dynamic", chunksize=1):
                    t0 = (blocks - 1 - it // n_heads) * R
                    h = it % n_heads
                    kt.attention_rows(po + t0 * qlen + h * hd, pq + t0 * qlen + h * hd, qlen,
                                      pk + (h // group) * max_ctx * hd, pv + (h // group) * max_ctx * hd,
                                      hd, sc, min(R, T - t0), p0 + t0 + 1,
                                      work + threadid() * per)
            return
        if nt > items:
            nt = <int>items
        # work item = (query row, kv head): its GQA group of heads in one kernel call, the
        # same call attention() makes for that position -- hence the same bits. Rows
        # cost ~ their position, so hand items out dynamically.
        with nogil:
            if nt == 1:
                for it in range(items):
                    t = it // n_kv
                    kvh = it % n_kv
                    st = p0 + t + 1 - w if 0 < w < p0 + t + 1 else 0     # first attended position
                    kt.attention_group(po + t * qlen + kvh * group * hd, pq + t * qlen + kvh * group * hd,
                                       pk + (kvh * max_ctx + st) * hd, pv + (kvh * max_ctx + st) * hd,
                                       p0 + t + 1 - st, hd, sc, group, NULL)
            else:
                for it in prange(items, num_threads=nt, schedule="dynamic", chunksize=1):
                    t = items // n_kv - 1 - it // n_kv       # longest rows first
                    kvh = it % n_kv
                    st = p0 + t + 1 - w if 0 < w < p0 + t + 1 else 0
                    kt.attention_group(po + t * qlen + kvh * group * hd, pq + t * qlen + kvh * group * hd,
                                       pk + (kvh * max_ctx + st) * hd, pv + (kvh * max_ctx + st) * hd,
                                       p0 + t + 1 - st, hd, sc, group, NULL)


# -- memory read bandwidth (the roofline of `cyllm bench`) --------------------------

def read_bandwidth_gbs(threads=1, nbytes=512 << 20, reps=5, variant=None):
    """Read bandwidth in GB/s (1e9 B/s), best of `reps` timed passes after one warm-up.

    Allocates `nbytes` once (far beyond the last-level cache), touches it from the
    same threads that read it (first-touch places pages near them), then times
    `threads` threads each summing a contiguous share with the variant's loads.
    """
    cdef const cyllm_kernels *kt = cyllm_kernels_by_name(resolve_variant(variant).encode())
    cdef Py_ssize_t nt_ = _index(threads, "threads")
    cdef Py_ssize_t nb = _index(nbytes, "nbytes"), nrep = _index(reps, "reps")
    if nt_ < 1 or nt_ > 4096:
        raise InvalidArgumentError(f"threads must be in [1, 4096], got {nt_}")
    if nb < (1 << 20):
        raise InvalidArgumentError(f"nbytes must be at least 1 MiB, got {nb}")
    if nrep < 1:
        raise InvalidArgumentError(f"reps must be >= 1, got {nrep}")
    cdef int nt = <int>nt_
    cdef Py_ssize_t n = nb // 4
    n -= n % (64 * nt)
    cdef float *buf = <float *>malloc(n * sizeof(float))
    cdef double *sums = <double *>malloc(nt * sizeof(double))
    if buf == NULL or sums == NULL:
        free(buf)
        free(sums)
        raise MemoryError(f"cannot allocate {nb} bytes for the bandwidth probe")
    cdef Py_ssize_t t, i, lo, hi, share = n // nt
    best = float("inf")
    try:
        with nogil:
            for t in prange(nt, num_threads=nt, schedule="static", chunksize=1):
                lo = t * share
                for i in range(lo, lo + share):
                    buf[i] = 1.0
        for rep in range(nrep + 1):           # pass 0 warms caches/TLB and the thread team
            t0 = time.perf_counter()
            with nogil:
                for t in prange(nt, num_threads=nt, schedule="static", chunksize=1):
                    sums[t] = kt.sum_f32(buf + t * share, share)
            dt = time.perf_counter() - t0
            if rep > 0 and dt < best:
                best = dt
    finally:
        free(buf)
        free(sums)
    return (n * 4) / best / 1e9


# -- captured decode step -------------------------------------------------------------

class NotCapturable(Exception):
    """The recorded ops cannot be compiled into a DecodeProgram (the caller runs them op by op)."""


# ops that run on thread 0 alone inside the program (all others split over the team);
# a QUANTIZE op is either (its mode)
cdef inline bint _serial_op(const cyllm_op *o) noexcept:
    if o.kind == CYLLM_OP_QUANTIZE:
        return o.mode == 1
    return (o.kind != CYLLM_OP_MATVEC and o.kind != CYLLM_OP_GATE_UP and o.kind != CYLLM_OP_ATTENTION
            and o.kind != CYLLM_OP_QMATVEC and o.kind != CYLLM_OP_QGATE_UP and o.kind != CYLLM_OP_GLU)


cdef inline bint _weight_op(int kind) noexcept:
    return (kind == CYLLM_OP_MATVEC or kind == CYLLM_OP_GATE_UP or kind == CYLLM_OP_QMATVEC
            or kind == CYLLM_OP_QGATE_UP)


cdef inline tuple _span(cnp.ndarray a):
    cdef size_t p = <size_t>cnp.PyArray_DATA(a)
    return (p, p + <size_t>cnp.PyArray_NBYTES(a))


cdef inline bint _hits(list xs, list ys):
    cdef tuple x, y
    for x in xs:
        for y in ys:
            if x[0] < y[1] and y[0] < x[1]:
                return True
    return False


cdef class DecodeProgram:
    """The ops of one token's forward pass, compiled to a C op array that
    cyllm_program_run (csrc/program.c) executes inside one OpenMP parallel region.

    DecodeProgram(backend, records, token, pos): records = [(op name, args), ...] as
    the model issued them for (token, pos); every record was already executed (and so
    validated) by the backend's own op. The arguments equal to the step's token (embed)
    or pos (rope, cache_store, rope_store, attention) become the per-call values; any
    other op or value raises NotCapturable. Holds a reference to every array.
    """
    cdef cyllm_op *ops
    cdef int n_ops
    cdef const cyllm_kernels *kt
    cdef const cyllm_qkernels *qk
    cdef list refs
    cdef dict qx                 # (x address, n, act) -> (activation buffer, its span) still valid
    cdef float *scratch          # attention partials for the longest context of any op
    cdef readonly Py_ssize_t max_pos      # run(pos) needs pos < max_pos
    cdef readonly Py_ssize_t vocab        # run(token) needs token < vocab
    cdef readonly int n_barriers

    def __cinit__(self):
        self.ops = NULL
        self.n_ops = 0
        self.scratch = NULL

    def __dealloc__(self):
        free(self.ops)
        free(self.scratch)

    def __init__(self, CpuKernels backend, list records, token, pos):
        self.kt = backend.kt
        self.qk = backend.q.qk
        self.refs = []
        self.qx = {}
        self.max_pos = 1 << 62
        self.vocab = 1 << 62
        cdef Py_ssize_t step_tok = _index(token, "token"), step_pos = _index(pos, "pos")
        cdef int i
        cdef list meta = []          # per op: (kind, reads, writes) byte spans
        for name, args in records:
            self._compile(name, args, step_tok, step_pos, meta)
        if not meta:
            raise NotCapturable("no ops were recorded")
        cdef int nxt = -1, j
        for i in range(self.n_ops - 1, -1, -1):     # prefetch chain: each weight op -> the next
            self.ops[i].next_w = nxt
            if _weight_op(self.ops[i].kind):
                nxt = i
        # A QUANTIZE op runs on thread 0 when its x came from a thread-0 op (rmsnorm): no
        # barrier between the two, one before the matvecs. After a split op (gate_up) a
        # barrier is due anyway, so its blocks are split over the team too.
        for i in range(self.n_ops):
            if self.ops[i].kind != CYLLM_OP_QUANTIZE:
                continue
            self.ops[i].mode = 1
            for j in range(i - 1, -1, -1):
                if _hits(meta[j][2], meta[i][1]):
                    self.ops[i].mode = 1 if _serial_op(&self.ops[j]) else 0
                    break
        cdef Py_ssize_t need = 1
        for i in range(self.n_ops):
            if self.ops[i].kind == CYLLM_OP_ATTENTION:
                need = max(need, cyllm_attention_scratch(self.ops[i].n_heads, self.ops[i].hd,
                                                         self.ops[i].max_ctx))
        self.scratch = <float *>malloc(need * sizeof(float))
        if self.scratch == NULL:
            raise MemoryError()
        # Barriers: an op joins the run since the last barrier unless it conflicts
        # (read-after-write, write-after-read/write) with an op of that run, and the
        # conflict is not between two thread-0 ops (program order covers those).
        cdef list run_ops = []
        self.n_barriers = 0
        for i in range(self.n_ops):
            kind, reads, writes = meta[i]
            serial = _serial_op(&self.ops[i])
            conflict = False
            for rs, rr, rw in run_ops:
                if (_hits(reads, rw) or _hits(writes, rr) or _hits(writes, rw)) and \
                        not (serial and rs):
                    conflict = True
                    break
            if conflict:
                self.ops[i - 1].barrier = 1
                self.n_barriers += 1
                run_ops = []
            run_ops.append((serial, reads, writes))

    cdef int _push(self, cyllm_op *o, list meta, list reads, list writes) except -1:
        cdef cyllm_op *grown = <cyllm_op *>realloc(self.ops, (self.n_ops + 1) * sizeof(cyllm_op))
        if grown == NULL:
            raise MemoryError()
        self.ops = grown
        self.ops[self.n_ops] = o[0]
        self.n_ops += 1
        meta.append((o.kind, reads, writes))
        # a quantized copy of x is stale once anything writes x
        for key in [k for k, v in self.qx.items() if _hits(writes, [v[2]])]:
            del self.qx[key]
        return 0

    cdef tuple _act_buffer(self, cnp.ndarray ax, int act, list meta):
        """The activation blocks of x (n,) in format act: the buffer a QUANTIZE op already
        filled (x unchanged since), or a new buffer and the QUANTIZE op that fills it."""
        cdef size_t px = <size_t>cnp.PyArray_DATA(ax)
        cdef Py_ssize_t n = cnp.PyArray_DIM(ax, 0)
        key = (px, n, act)
        if key in self.qx:
            return self.qx[key][:2]
        cdef int64_t nbytes = cyllm_qact_bytes(act, n)
        buf = np.zeros(nbytes + 64, np.uint8)
        self.refs.append(buf)
        cdef size_t p = (<size_t>cnp.PyArray_DATA(<cnp.ndarray>buf) + 63) & ~(<size_t>63)
        cdef cyllm_op o
        memset(&o, 0, sizeof(cyllm_op))
        o.kind = CYLLM_OP_QUANTIZE
        o.c = cnp.PyArray_DATA(ax)
        o.n = n
        o.act = act
        o.xq = <void *>p
        o.mode = 1
        span = (p, p + <size_t>nbytes)
        self._push(&o, meta, [_span(ax)], [span])
        self.qx[key] = (p, span, _span(ax))
        return (p, span)

    cdef int _compile_quant(self, str name, tuple args, list meta) except -1:
        """matvec / matvec_add / gate_up with a QuantMatrix among the weights."""
        cdef cyllm_op o
        memset(&o, 0, sizeof(cyllm_op))
        cdef cnp.ndarray ao = _arr(args[0], "out", cnp.NPY_FLOAT32, 1, True), ax, g, u, aw, au
        w = args[1]
        wu = args[2] if name == "gate_up" else None
        ax = _arr(args[3] if name == "gate_up" else args[2], "x", cnp.NPY_FLOAT32, 1, False)
        act = _act(args[4] if len(args) > 4 else "silu") if name == "gate_up" else 0
        if name == "gate_up" and not (type(w) is QuantMatrix and type(wu) is QuantMatrix and w.fmt is wu.fmt):
            # formats differ: two matvecs into scratch, then the GLU (as CpuKernels.gate_up)
            f = w.shape[0]
            g = np.zeros(f, np.float32)
            u = np.zeros(f, np.float32)
            self.refs.append((g, u))
            self._compile("matvec", (g, w, ax), 0, 0, meta)
            self._compile("matvec", (u, wu, ax), 0, 0, meta)
            o.kind = CYLLM_OP_GLU
            o.mode = act
            o.n = f
            _check_len(cnp.PyArray_DIM(ao, 0), f, "out", "rows of w_gate")
            o.out = <float *>cnp.PyArray_DATA(ao)
            o.a = cnp.PyArray_DATA(g)
            o.b = cnp.PyArray_DATA(u)
            self._push(&o, meta, [_span(g), _span(u)], [_span(ao)])
            return 0
        data, kid = _qm(w, "w")
        aw = <cnp.ndarray>data
        o.qfmt = kid
        o.d = w.rows
        o.n = w.cols
        o.rb = w.row_bytes
        _check_len(cnp.PyArray_DIM(ax, 0), o.n, "x", "columns of w")
        _check_len(cnp.PyArray_DIM(ao, 0), o.d, "out", "rows of w")
        reads = [_span(aw)]
        if name == "gate_up":
            if wu.shape != w.shape:
                raise InvalidArgumentError("w_up must have the shape of w_gate")
            au = <cnp.ndarray>wu.data
            o.kind = CYLLM_OP_QGATE_UP
            o.mode = act
            o.b = cnp.PyArray_DATA(au)
            reads.append(_span(au))
        else:
            o.kind = CYLLM_OP_QMATVEC
            o.mode = 1 if name == "matvec_add" else 0
            if o.mode:
                reads.append(_span(ao))
        if _hits([_span(ao)], [_span(aw), _span(ax)] + ([_span(au)] if name == "gate_up" else [])):
            raise InvalidArgumentError("a matvec output must not share memory with its inputs")
        p, span = self._act_buffer(ax, cyllm_qformat(kid).act, meta)
        o.xq = <void *><size_t>p
        reads.append(span)
        o.out = <float *>cnp.PyArray_DATA(ao)
        o.a = cnp.PyArray_DATA(aw)
        self.refs.append(w)
        self._push(&o, meta, reads, [_span(ao)])
        return 0

    cdef int _compile(self, str name, tuple args, Py_ssize_t step_tok, Py_ssize_t step_pos,
                      list ops) except -1:
        cdef cyllm_op o
        memset(&o, 0, sizeof(cyllm_op))
        cdef cnp.ndarray a0, a1, a2, a3, a4, a5, a6
        cdef Py_ssize_t v, hd, p
        cdef int nd
        self.refs.append(args)
        if name == "embed" and not cnp.PyArray_Check(args[1]):
            a0 = _arr(args[0], "out", cnp.NPY_FLOAT32, 1, True)
            data, kid = _qm(args[1], "table")
            a1 = <cnp.ndarray>data
            if _index(args[2], "token") != step_tok:
                raise NotCapturable("embed of a token other than the step's")
            o.kind = CYLLM_OP_QEMBED
            o.dyn = 1
            o.qfmt = kid
            o.scale = _factor(args[3] if len(args) > 3 else 1.0)
            o.out = <float *>cnp.PyArray_DATA(a0)
            o.a = cnp.PyArray_DATA(a1)
            o.n = args[1].cols
            o.rb = args[1].row_bytes
            _check_len(cnp.PyArray_DIM(a0, 0), o.n, "out", "columns of the table")
            self.vocab = min(self.vocab, args[1].rows)
            self._push(&o, ops, [_span(a1)], [_span(a0)])
        elif name in ("matvec", "matvec_add", "gate_up") and not (
                cnp.PyArray_Check(args[1]) and (name != "gate_up" or cnp.PyArray_Check(args[2]))):
            self._compile_quant(name, args, ops)
        elif name == "embed":
            a0 = _arr(args[0], "out", cnp.NPY_FLOAT32, 1, True)
            a1 = _arr(args[1], "table", cnp.NPY_FLOAT16, 2, False)
            if _index(args[2], "token") != step_tok:
                raise NotCapturable("embed of a token other than the step's")
            o.kind = CYLLM_OP_EMBED
            o.dyn = 1
            o.scale = _factor(args[3] if len(args) > 3 else 1.0)
            o.out = <float *>cnp.PyArray_DATA(a0)
            o.a = cnp.PyArray_DATA(a1)
            o.n = cnp.PyArray_DIM(a1, 1)
            _check_len(cnp.PyArray_DIM(a0, 0), o.n, "out", "columns of the table")
            self.vocab = min(self.vocab, cnp.PyArray_DIM(a1, 0))
            self._push(&o, ops, [_span(a1)], [_span(a0)])
        elif name in ("rmsnorm", "rmsnorm_batch"):
            nd = 1 if name == "rmsnorm" else 2
            a0 = _arr(args[0], "out", cnp.NPY_FLOAT32, nd, True)
            a1 = _arr(args[1], "x", cnp.NPY_FLOAT32, nd, False)
            a2 = _arr(args[2], "w", cnp.NPY_FLOAT32, 1, False)
            o.kind = CYLLM_OP_RMSNORM
            o.d = 1 if nd == 1 else cnp.PyArray_DIM(a1, 0)
            o.n = cnp.PyArray_DIM(a1, nd - 1)
            if nd == 2 and (cnp.PyArray_DIM(a0, 0) != o.d or not cnp.PyArray_IS_C_CONTIGUOUS(a0)
                            or not cnp.PyArray_IS_C_CONTIGUOUS(a1)):
                raise InvalidArgumentError("rmsnorm_batch: out and x must be contiguous and of one shape")
            _check_len(cnp.PyArray_DIM(a0, nd - 1), o.n, "out", "the length of x")
            _check_len(cnp.PyArray_DIM(a2, 0), o.n, "w", "the length of x")
            if o.n < 1:
                raise InvalidArgumentError("rmsnorm of an empty vector")
            o.eps = _eps(args[3])
            o.out = <float *>cnp.PyArray_DATA(a0)
            o.a = cnp.PyArray_DATA(a1)
            o.b = cnp.PyArray_DATA(a2)
            self._push(&o, ops, [_span(a1), _span(a2)], [_span(a0)])
        elif name in ("matvec", "matvec_add", "gate_up"):
            a0 = _arr(args[0], "out", cnp.NPY_FLOAT32, 1, True)
            a1 = _arr(args[1], "w", cnp.NPY_FLOAT16, 2, False)
            o.d = cnp.PyArray_DIM(a1, 0)
            o.n = cnp.PyArray_DIM(a1, 1)
            reads = [_span(a1)]
            if name == "gate_up":
                a2 = _arr(args[2], "w_up", cnp.NPY_FLOAT16, 2, False)
                if cnp.PyArray_DIM(a2, 0) != o.d or cnp.PyArray_DIM(a2, 1) != o.n:
                    raise InvalidArgumentError("w_up must have the shape of w_gate")
                a3 = _arr(args[3], "x", cnp.NPY_FLOAT32, 1, False)
                o.kind = CYLLM_OP_GATE_UP
                o.mode = _act(args[4] if len(args) > 4 else "silu")
                o.b = cnp.PyArray_DATA(a2)
                reads.append(_span(a2))
            else:
                a3 = _arr(args[2], "x", cnp.NPY_FLOAT32, 1, False)
                o.kind = CYLLM_OP_MATVEC
                o.mode = 1 if name == "matvec_add" else 0
                if o.mode:
                    reads.append(_span(a0))
            _check_len(cnp.PyArray_DIM(a3, 0), o.n, "x", "columns of w")
            _check_len(cnp.PyArray_DIM(a0, 0), o.d, "out", "rows of w")
            reads.append(_span(a3))
            inputs = [_span(a1), _span(a3)] + ([_span(a2)] if o.kind == CYLLM_OP_GATE_UP else [])
            if _hits([_span(a0)], inputs):
                raise InvalidArgumentError("a matvec output must not share memory with its inputs")
            o.out = <float *>cnp.PyArray_DATA(a0)
            o.a = cnp.PyArray_DATA(a1)
            o.c = cnp.PyArray_DATA(a3)
            o.rb = o.n * 2
            self._push(&o, ops, reads, [_span(a0)])
        elif name in ("rope", "rope_store"):
            a0 = _arr(args[0], "q", cnp.NPY_FLOAT32, 1, True)
            a1 = _arr(args[1], "k", cnp.NPY_FLOAT32, 1, True)
            i0 = 3 if name == "rope_store" else 2
            a2 = _arr(args[i0], "cos", cnp.NPY_FLOAT32, 2, False)
            a3 = _arr(args[i0 + 1], "sin", cnp.NPY_FLOAT32, 2, False)
            p = _index(args[7] if name == "rope_store" else args[4], "pos")
            if p != step_pos:
                raise NotCapturable(f"{name} at a position other than the step's")
            o.kind = CYLLM_OP_ROPE
            o.dyn = 1
            o.half = cnp.PyArray_DIM(a2, 1)
            if (cnp.PyArray_DIM(a3, 0) != cnp.PyArray_DIM(a2, 0) or cnp.PyArray_DIM(a3, 1) != o.half
                    or o.half < 1):
                raise InvalidArgumentError("cos and sin must have one shape (max_ctx, head_dim/2)")
            if name == "rope_store":
                hd = _rope_hd(_arr(args[5], "k_cache", cnp.NPY_FLOAT16, 3, True).shape[2], o.half)
            else:
                hd = _rope_hd(args[5] if len(args) > 5 else None, o.half)
            o.hd = hd
            if cnp.PyArray_DIM(a0, 0) % hd or cnp.PyArray_DIM(a1, 0) % hd:
                raise InvalidArgumentError("q and k lengths must be multiples of head_dim")
            o.n_heads = cnp.PyArray_DIM(a0, 0) // hd
            o.n_kv = cnp.PyArray_DIM(a1, 0) // hd
            self.max_pos = min(self.max_pos, cnp.PyArray_DIM(a2, 0))
            o.out = <float *>cnp.PyArray_DATA(a0)
            o.out2 = <float *>cnp.PyArray_DATA(a1)
            o.b = cnp.PyArray_DATA(a2)
            o.c = cnp.PyArray_DATA(a3)
            rw = [_span(a0), _span(a1)]
            self._push(&o, ops, rw + [_span(a2), _span(a3)], rw)
            if name == "rope_store":
                self._compile("cache_store", (args[5], args[6], args[1], args[2], args[7]),
                              step_tok, step_pos, ops)
        elif name == "cache_store":
            a0 = _arr(args[0], "k_cache", cnp.NPY_FLOAT16, 3, True)
            a1 = _arr(args[1], "v_cache", cnp.NPY_FLOAT16, 3, True)
            a2 = _arr(args[2], "k", cnp.NPY_FLOAT32, 1, False)
            a3 = _arr(args[3], "v", cnp.NPY_FLOAT32, 1, False)
            if _index(args[4], "pos") != step_pos:
                raise NotCapturable("cache_store at a position other than the step's")
            self._cache_fields(&o, a0, a1)
            _check_len(cnp.PyArray_DIM(a2, 0), o.n_kv * o.hd, "k", "n_kv_heads * head_dim of the cache")
            _check_len(cnp.PyArray_DIM(a3, 0), o.n_kv * o.hd, "v", "n_kv_heads * head_dim of the cache")
            o.kind = CYLLM_OP_CACHE_STORE
            o.dyn = 1
            o.c = cnp.PyArray_DATA(a2)
            o.e = cnp.PyArray_DATA(a3)
            self._push(&o, ops, [_span(a2), _span(a3)], [_span(a0), _span(a1)])
        elif name == "attention":
            a0 = _arr(args[0], "out", cnp.NPY_FLOAT32, 1, True)
            a1 = _arr(args[1], "q", cnp.NPY_FLOAT32, 1, False)
            a2 = _arr(args[2], "k_cache", cnp.NPY_FLOAT16, 3, False)
            a3 = _arr(args[3], "v_cache", cnp.NPY_FLOAT16, 3, False)
            if _index(args[4], "pos") != step_pos:
                raise NotCapturable("attention at a position other than the step's")
            self._cache_fields(&o, a2, a3)
            v = cnp.PyArray_DIM(a1, 0)
            if v == 0 or v % o.hd or (v // o.hd) % o.n_kv:
                raise InvalidArgumentError("q must hold a multiple of the cache's kv heads")
            _check_len(cnp.PyArray_DIM(a0, 0), v, "out", "the length of q")
            if _hits([_span(a0)], [_span(a1), _span(a2), _span(a3)]):
                raise InvalidArgumentError("attention out must not share memory with q or the cache")
            o.kind = CYLLM_OP_ATTENTION
            o.dyn = 1
            o.n_heads = v // o.hd
            o.window = _window(args[5] if len(args) > 5 else 0)
            o.scale = _scale(args[6] if len(args) > 6 else None, o.hd)
            o.out = <float *>cnp.PyArray_DATA(a0)
            o.a = cnp.PyArray_DATA(a1)
            self._push(&o, ops, [_span(a1), _span(a2), _span(a3)], [_span(a0)])
        elif name in ("add", "swiglu"):
            a0 = _arr(args[0], "out", cnp.NPY_FLOAT32, 1, True)
            a1 = _arr(args[1], "x", cnp.NPY_FLOAT32, 1, False)
            a2 = _arr(args[2], "y", cnp.NPY_FLOAT32, 1, False)
            o.kind = CYLLM_OP_ADD if name == "add" else CYLLM_OP_SWIGLU
            o.n = cnp.PyArray_DIM(a1, 0)
            _check_len(cnp.PyArray_DIM(a2, 0), o.n, "y", "the length of x")
            _check_len(cnp.PyArray_DIM(a0, 0), o.n, "out", "the length of x")
            o.out = <float *>cnp.PyArray_DATA(a0)
            o.a = cnp.PyArray_DATA(a1)
            o.b = cnp.PyArray_DATA(a2)
            self._push(&o, ops, [_span(a1), _span(a2)], [_span(a0)])
        else:
            raise NotCapturable(f"op {name!r} has no compiled form")
        return 0

    cdef int _cache_fields(self, cyllm_op *o, cnp.ndarray ak, cnp.ndarray av) except -1:
        o.n_kv = cnp.PyArray_DIM(ak, 0)
        o.max_ctx = cnp.PyArray_DIM(ak, 1)
        o.hd = cnp.PyArray_DIM(ak, 2)
        if (cnp.PyArray_DIM(av, 0) != o.n_kv or cnp.PyArray_DIM(av, 1) != o.max_ctx
                or cnp.PyArray_DIM(av, 2) != o.hd or o.n_kv < 1 or o.hd < 1):
            raise InvalidArgumentError("k_cache and v_cache must have one non-empty shape")
        o.kc = <uint16_t *>cnp.PyArray_DATA(ak)
        o.vc = <uint16_t *>cnp.PyArray_DATA(av)
        self.max_pos = min(self.max_pos, o.max_ctx)
        return 0

    @property
    def n_ops(self):
        return self.n_ops

    def run(self, token, pos, threads):
        """One decode step: token and pos checked, then every op in one parallel region."""
        cdef Py_ssize_t tok = _index(token, "token"), p = _index(pos, "pos")
        cdef Py_ssize_t nt = _index(threads, "threads")
        if tok < 0 or tok >= self.vocab:
            raise InvalidArgumentError(f"token id {tok} is out of range [0, {self.vocab})")
        if p < 0 or p >= self.max_pos:
            raise InvalidArgumentError(f"position {p} is out of range [0, {self.max_pos})")
        if nt < 1 or nt > 4096:
            raise InvalidArgumentError(f"threads must be in [1, 4096], got {nt}")
        with nogil:
            cyllm_program_run(self.kt, <const void *>self.qk, self.ops, self.n_ops, <int>nt, tok, p,
                              self.scratch)
