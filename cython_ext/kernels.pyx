# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, embedsignature=True
"""CPU kernels of cyllm: argument checks + OpenMP loops around the C kernel tables.

Layout of the work: every op validates its arrays here (dtype, dims, contiguity,
writability, ranges) with the NumPy C API -- a few hundred ns, cheap next to a
Python method call -- then releases the GIL and calls the C kernels of the chosen
variant (csrc/kernels_generic.c, csrc/kernels_avx2.c) through function pointers.
Big ops (matvec family, attention) split their rows/heads over `threads` OpenMP
threads; small vector ops run serially because waking the team (~1-14 us) costs
more than the op. Every row/head is computed by one thread in a fixed order, so
results are bitwise identical for any thread count.
"""

import os
import time

cimport numpy as cnp
from cython.parallel cimport prange
from libc.stdint cimport uint16_t, int64_t
from libc.stdlib cimport malloc, free
from libc.math cimport sqrt, expf

from cyllm.errors import BackendUnavailableError, InvalidArgumentError

cnp.import_array()


cdef extern from "csrc/kernels.h" nogil:
    ctypedef struct cyllm_kernels:
        const char *name
        void (*matvec_rows)(float *out, const uint16_t *w, const float *x,
                            int64_t n, int64_t r0, int64_t r1, int add) noexcept nogil
        void (*gate_up_rows)(float *out, const uint16_t *wg, const uint16_t *wu,
                             const float *x, int64_t n, int64_t r0, int64_t r1) noexcept nogil
        void (*attention_group)(float *out, const float *q, const uint16_t *k,
                                const uint16_t *v, int64_t t_len, int64_t hd,
                                float scale, int64_t n_q) noexcept nogil
        void (*f16_to_f32)(float *out, const uint16_t *inp, int64_t n) noexcept nogil
        void (*f32_to_f16)(uint16_t *out, const float *inp, int64_t n) noexcept nogil
        double (*sum_f32)(const float *p, int64_t n) noexcept nogil

    int CYLLM_CPU_AVX, CYLLM_CPU_AVX2, CYLLM_CPU_FMA, CYLLM_CPU_F16C, CYLLM_CPU_AVX512F
    int cyllm_cpu_features() noexcept
    int cyllm_avx2_compiled() noexcept
    const cyllm_kernels *cyllm_kernels_by_name(const char *name) noexcept
    float cyllm_silu(float x) noexcept

cdef extern from "csrc/omp_shim.h" nogil:
    int CYLLM_OPENMP
    int omp_get_max_threads() noexcept


# Below these sizes an op runs on the calling thread: the parallel-region wake-up
# would cost more than the work (f16 matvec: 64K weights = 128 KiB, ~4 us).
cdef enum:
    MATVEC_PARALLEL_MIN = 65536      # weights read (d * n, both matrices for gate_up)
    VECTOR_PARALLEL_MIN = 65536      # elements of add / swiglu
    ROWS_PER_THREAD_MIN = 8

VARIANTS = ("generic", "avx2")


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


def available_variants():
    """Variants that can run here, best first."""
    return [v for v in ("avx2", "generic") if cyllm_kernels_by_name(v.encode()) != NULL]


def resolve_variant(variant=None):
    """The kernel variant to use: `variant`, else $CYLLM_KERNELS, else the best available.

    Accepts "auto" | "generic" | "avx2"; raises BackendUnavailableError for an
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


cdef inline int _check_len(Py_ssize_t got, Py_ssize_t want, str name, str what) except -1:
    if got != want:
        raise InvalidArgumentError(f"{name} has length {got}, expected {want} ({what})")
    return 0


# -- the kernels -------------------------------------------------------------------

cdef class CpuKernels:
    """Every op of cyllm.backends.base.Backend for the CPU; cpu.CpuBackend extends it.

    CpuKernels(threads=1, variant=None): variant None follows $CYLLM_KERNELS, then
    the best variant this CPU runs ("avx2", else "generic").
    """
    cdef const cyllm_kernels *kt
    cdef int nthreads
    cdef str _variant

    def __init__(self, threads=1, variant=None):
        if variant is None:
            if _DEFAULT_ERROR is not None:
                raise _DEFAULT_ERROR
            v = DEFAULT_VARIANT
        else:
            v = resolve_variant(variant)
        self.kt = cyllm_kernels_by_name(v.encode())
        self._variant = v
        self.threads = threads

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

    # -- matvec family -------------------------------------------------------------
    cdef int _matvec(self, object out, object w, object x, int add) except -1:
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
        mode 0/1: matvec / matvec_add on pw; mode 2: gate_up on (pw, pu)."""
        cdef const cyllm_kernels *kt = self.kt
        cdef Py_ssize_t groups = (d + 3) // 4, t, r0, r1
        cdef int nt = self.nthreads
        if d * n * (2 if mode == 2 else 1) < MATVEC_PARALLEL_MIN:
            nt = 1
        if nt > d // ROWS_PER_THREAD_MIN:
            nt = <int>(d // ROWS_PER_THREAD_MIN)
        if nt < 1:
            nt = 1
        with nogil:
            if nt == 1:
                if mode == 2:
                    kt.gate_up_rows(po, pw, pu, px, n, 0, d)
                else:
                    kt.matvec_rows(po, pw, px, n, 0, d, mode)
            else:
                for t in prange(nt, num_threads=nt, schedule="static", chunksize=1):
                    r0 = (groups * t // nt) * 4
                    r1 = (groups * (t + 1) // nt) * 4
                    if r1 > d:
                        r1 = d
                    if mode == 2:
                        kt.gate_up_rows(po, pw, pu, px, n, r0, r1)
                    else:
                        kt.matvec_rows(po, pw, px, n, r0, r1, mode)

    def matvec(self, out, w, x):
        """out (d,) f32 = w (d, n) f16 @ x (n,) f32."""
        self._matvec(out, w, x, 0)

    def matvec_add(self, out, w, x):
        """out (d,) f32 += w (d, n) f16 @ x (n,) f32."""
        self._matvec(out, w, x, 1)

    def gate_up_silu(self, out, w_gate, w_up, x):
        """out (f,) f32 = silu(w_gate @ x) * (w_up @ x); w_gate, w_up (f, n) f16."""
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
                   f, n, 2)

    # -- attention and its helpers ------------------------------------------------
    def attention(self, out, q, k_cache, v_cache, pos):
        """out, q (n_heads*head_dim,) f32; k_cache, v_cache (n_kv, max_ctx, head_dim) f16;
        causal over cache positions 0..pos; query head h reads kv head h // (n_heads // n_kv)."""
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
        _no_overlap(ao, aq, "out", "q")
        _no_overlap(ao, ak, "out", "k_cache")
        _no_overlap(ao, av, "out", "v_cache")

        cdef const cyllm_kernels *kt = self.kt
        cdef float *po = <float *>cnp.PyArray_DATA(ao)
        cdef const float *pq = <const float *>cnp.PyArray_DATA(aq)
        cdef const uint16_t *pk = <const uint16_t *>cnp.PyArray_DATA(ak)
        cdef const uint16_t *pv = <const uint16_t *>cnp.PyArray_DATA(av)
        # Work item = a run of query heads of one GQA group (they share K/V, which the
        # avx2 kernel widens once per run). Groups are split only when there are fewer
        # kv heads than threads; a head's bits never depend on the split.
        cdef Py_ssize_t group = n_heads // n_kv, it, kvh, h0, nq
        cdef int nt = self.nthreads
        # fewest splits that give every thread the same number of items (3 kv heads on
        # 2 threads: 6 items of 2+1 heads), else one head per item
        cdef Py_ssize_t splits = 1
        while splits < group and (n_kv * splits) % nt != 0:
            splits += 1
        cdef Py_ssize_t chunk = (group + splits - 1) // splits
        splits = (group + chunk - 1) // chunk
        cdef Py_ssize_t items = n_kv * splits
        cdef float scale = <float>(1.0 / sqrt(<double>hd))
        if nt > items:
            nt = <int>items
        if (p + 1) * hd * n_heads < 16384:   # tiny: a wake-up costs more than the work
            nt = 1
        with nogil:
            if nt == 1:
                for it in range(items):
                    kvh = it // splits
                    h0 = kvh * group + (it % splits) * chunk
                    nq = min(chunk, (kvh + 1) * group - h0)
                    kt.attention_group(po + h0 * hd, pq + h0 * hd, pk + kvh * max_ctx * hd,
                                       pv + kvh * max_ctx * hd, p + 1, hd, scale, nq)
            else:
                for it in prange(items, num_threads=nt, schedule="static", chunksize=1):
                    kvh = it // splits
                    h0 = kvh * group + (it % splits) * chunk
                    nq = min(chunk, (kvh + 1) * group - h0)
                    kt.attention_group(po + h0 * hd, pq + h0 * hd, pk + kvh * max_ctx * hd,
                                       pv + kvh * max_ctx * hd, p + 1, hd, scale, nq)

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

    def rope(self, q, k, cos, sin, pos):
        """Rotate q (n_heads*head_dim,) and k (n_kv*head_dim,) f32 in place (HF rotate-half);
        cos, sin (max_ctx, head_dim/2) f32, row pos."""
        cdef cnp.ndarray aq = _arr(q, "q", cnp.NPY_FLOAT32, 1, True)
        cdef cnp.ndarray ak = _arr(k, "k", cnp.NPY_FLOAT32, 1, True)
        cdef cnp.ndarray ac = _arr(cos, "cos", cnp.NPY_FLOAT32, 2, False)
        cdef cnp.ndarray as_ = _arr(sin, "sin", cnp.NPY_FLOAT32, 2, False)
        cdef Py_ssize_t max_ctx = cnp.PyArray_DIM(ac, 0), half = cnp.PyArray_DIM(ac, 1)
        if cnp.PyArray_DIM(as_, 0) != max_ctx or cnp.PyArray_DIM(as_, 1) != half:
            raise InvalidArgumentError(f"sin has shape {sin.shape}, expected {cos.shape} (the shape of cos)")
        if half < 1:
            raise InvalidArgumentError(f"cos has shape {cos.shape}: head_dim/2 must be positive")
        cdef Py_ssize_t hd = 2 * half
        cdef Py_ssize_t nq = cnp.PyArray_DIM(aq, 0), nk = cnp.PyArray_DIM(ak, 0)
        if nq % hd or nk % hd:
            raise InvalidArgumentError(
                f"q (length {nq}) and k (length {nk}) must be multiples of head_dim {hd} (2 * cos.shape[1])")
        cdef Py_ssize_t p = _index(pos, "pos")
        _check_pos(p, max_ctx)
        cdef const float *c = <const float *>cnp.PyArray_DATA(ac) + p * half
        cdef const float *s = <const float *>cnp.PyArray_DATA(as_) + p * half
        with nogil:
            _rope_rows(<float *>cnp.PyArray_DATA(aq), nq // hd, half, c, s)
            _rope_rows(<float *>cnp.PyArray_DATA(ak), nk // hd, half, c, s)

    # -- small vector ops (serial below VECTOR_PARALLEL_MIN) ------------------------
    def embed(self, out, table, token):
        """out (dim,) f32 = table[token]; table (vocab, dim) f16."""
        cdef cnp.ndarray ao = _arr(out, "out", cnp.NPY_FLOAT32, 1, True)
        cdef cnp.ndarray at = _arr(table, "table", cnp.NPY_FLOAT16, 2, False)
        cdef Py_ssize_t vocab = cnp.PyArray_DIM(at, 0), dim = cnp.PyArray_DIM(at, 1)
        _check_len(cnp.PyArray_DIM(ao, 0), dim, "out", "columns of the table")
        cdef Py_ssize_t tok = _index(token, "token")
        if tok < 0 or tok >= vocab:
            raise InvalidArgumentError(f"token id {tok} is out of range [0, {vocab})")
        cdef const cyllm_kernels *kt = self.kt
        cdef float *po = <float *>cnp.PyArray_DATA(ao)
        cdef const uint16_t *pt = <const uint16_t *>cnp.PyArray_DATA(at) + tok * dim
        with nogil:
            kt.f16_to_f32(po, pt, dim)

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
        cdef double ss = 0.0
        cdef float scale
        with nogil:
            for i in range(n):
                ss += <double>px[i] * px[i]
            # mean in double, then one f32 scale, applied as (x * scale) * w like the reference
            scale = <float>(1.0 / sqrt(<double>(<float>(ss / n) + <float>e)))
            for i in range(n):
                po[i] = (px[i] * scale) * pw[i]

    def swiglu(self, out, gate, up):
        """out (f,) f32 = silu(gate) * up."""
        cdef cnp.ndarray ao = _arr(out, "out", cnp.NPY_FLOAT32, 1, True)
        cdef cnp.ndarray ag = _arr(gate, "gate", cnp.NPY_FLOAT32, 1, False)
        cdef cnp.ndarray au = _arr(up, "up", cnp.NPY_FLOAT32, 1, False)
        cdef Py_ssize_t n = cnp.PyArray_DIM(ag, 0), i
        _check_len(cnp.PyArray_DIM(au, 0), n, "up", "the length of gate")
        _check_len(cnp.PyArray_DIM(ao, 0), n, "out", "the length of gate")
        cdef float *po = <float *>cnp.PyArray_DATA(ao)
        cdef const float *pg = <const float *>cnp.PyArray_DATA(ag)
        cdef const float *pu = <const float *>cnp.PyArray_DATA(au)
        cdef int nt = self.nthreads if n >= VECTOR_PARALLEL_MIN else 1
        with nogil:
            if nt == 1:
                for i in range(n):
                    po[i] = cyllm_silu(pg[i]) * pu[i]
            else:
                for i in prange(n, num_threads=nt, schedule="static"):
                    po[i] = cyllm_silu(pg[i]) * pu[i]

    def add(self, out, x, y):
        """out = x + y, all (n,) f32 (out may alias x or y)."""
        cdef cnp.ndarray ao = _arr(out, "out", cnp.NPY_FLOAT32, 1, True)
        cdef cnp.ndarray ax = _arr(x, "x", cnp.NPY_FLOAT32, 1, False)
        cdef cnp.ndarray ay = _arr(y, "y", cnp.NPY_FLOAT32, 1, False)
        cdef Py_ssize_t n = cnp.PyArray_DIM(ax, 0), i
        _check_len(cnp.PyArray_DIM(ay, 0), n, "y", "the length of x")
        _check_len(cnp.PyArray_DIM(ao, 0), n, "out", "the length of x")
        cdef float *po = <float *>cnp.PyArray_DATA(ao)
        cdef const float *px = <const float *>cnp.PyArray_DATA(ax)
        cdef const float *py = <const float *>cnp.PyArray_DATA(ay)
        cdef int nt = self.nthreads if n >= VECTOR_PARALLEL_MIN else 1
        with nogil:
            if nt == 1:
                for i in range(n):
                    po[i] = px[i] + py[i]
            else:
                for i in prange(n, num_threads=nt, schedule="static"):
                    po[i] = px[i] + py[i]


cdef void _rope_rows(float *v, Py_ssize_t heads, Py_ssize_t half,
                     const float *c, const float *s) noexcept nogil:
    # rotate-half: element i pairs with i + half inside each head
    cdef Py_ssize_t h, i
    cdef float x1, x2
    cdef float *row
    for h in range(heads):
        row = v + h * 2 * half
        for i in range(half):
            x1 = row[i]
            x2 = row[i + half]
            row[i] = x1 * c[i] - x2 * s[i]
            row[i + half] = x2 * c[i] + x1 * s[i]


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
