# CpuKernels: every op of the backend interface on the CPU (cpu.CpuBackend extends it).
# Reference: backends/numpy_ref.py; tests: tests/test_backend_ops.py, tests/test_ops.py,
# tests/test_cpu_fused.py; benchmarks: bench/bench_matvec.py, bench_gemm.py,
# bench_attention.py, bench_norm_rope.py. Included by kernels.pyx.

cdef inline void _few_tokens_run(const cyllm_kernels *kt, float *po, const uint16_t *pw,
                                 const uint16_t *pu, const float *px, Py_ssize_t T, Py_ssize_t d,
                                 Py_ssize_t n, int mode, Py_ssize_t r0, Py_ssize_t r1) noexcept nogil:
    """Rows [r0, r1) of every token's matvec (CpuKernels._few_tokens), two tokens a pass."""
    cdef Py_ssize_t t
    for t in range(0, T - 1, 2):
        kt.rows2(po + t * d, d, pw, pu, px + t * n, n, n, r0, r1, mode)
    if T % 2:
        t = T - 1
        if mode >= 2:
            kt.gate_up_rows(po + t * d, pw, pu, px + t * n, n, r0, r1, mode - 2, NULL, 0)
        else:
            kt.matvec_rows(po + t * d, pw, px + t * n, n, r0, r1, mode, NULL, 0)


cdef inline int _expert_fmt(object w) except -2:
    """An expert matrix's kernel id (range-checked) if it is a QuantMatrix, else -1 (float16)."""
    return _qfmt(w.fmt.kernel_id) if type(w) is QuantMatrix else -1


cdef inline int _check_trio(object trio) except -1:
    """An expert must be a (gate, up, down) tuple: one clear error otherwise, before any unpacking."""
    if not isinstance(trio, tuple) or len(<tuple>trio) != 3:
        raise InvalidArgumentError(f"an expert must be a (gate, up, down) tuple, got {type(trio).__name__}")
    return 0


cdef bint _expert_ptrs(object trio, Py_ssize_t f, Py_ssize_t n, int fmt_gu, int fmt_dn, cnp.ndarray ao,
                       const void **gate, const void **up, const void **down) except -1:
    """One expert's (gate, up, down) as the one-call experts run them (moe_experts, a decode
    program's moe): gate and up of kernel id fmt_gu, down of fmt_dn (-1: float16 arrays), of
    shapes (f, n), (f, n), (n, f), none overlapping out; their data into *gate, *up, *down.
    False where the expert is of another kind, format or shape (the caller then runs the
    experts one at a time). Runs per token outside a recorded step: no Python objects made."""
    cdef cnp.ndarray a
    cdef int r, fmt
    cdef Py_ssize_t rows, cols
    cdef const void **slots[3]
    slots[0], slots[1], slots[2] = gate, up, down
    _check_trio(trio)
    for r in range(3):
        w = (<tuple>trio)[r]
        fmt = fmt_dn if r == 2 else fmt_gu
        rows, cols = (n, f) if r == 2 else (f, n)
        if fmt >= 0:
            # C-typed comparisons: a Python int of the sizes would be made each token
            if type(w) is not QuantMatrix or <int>w.fmt.kernel_id != fmt or <Py_ssize_t>w.rows != rows \
                    or <Py_ssize_t>w.cols != cols:
                return False
            a = <cnp.ndarray>w.data
        elif cnp.PyArray_Check(w):
            a = <cnp.ndarray>w
            if cnp.PyArray_TYPE(a) != cnp.NPY_FLOAT16 or cnp.PyArray_NDIM(a) != 2 \
                    or cnp.PyArray_DIM(a, 0) != rows or cnp.PyArray_DIM(a, 1) != cols \
                    or not cnp.PyArray_IS_C_CONTIGUOUS(a):
                return False
        else:
            return False
        _no_overlap(ao, a, "out", "an expert's matrix")
        slots[r][0] = cnp.PyArray_DATA(a)
    return True


cdef class CpuKernels:
    """Every op of cyllm.backends.base.Backend for the CPU; cpu.CpuBackend extends it.

    CpuKernels(threads=1, variant=None): variant None follows $CYLLM_KERNELS, then
    the best variant this CPU runs ("avx2", else "generic").

    One op at a time per instance: the ops keep scratch buffers here (the model's lock
    serialises its steps); two threads that call ops of one instance at once must not.
    """
    cdef const cyllm_kernels *kt
    cdef int nthreads
    cdef str _variant
    cdef float *scratch          # attention partials (grown on demand, kept)
    cdef Py_ssize_t scratch_n
    cdef QuantKernels q          # the kernels of QuantMatrix weights (same threads)
    cdef dict _scr               # f32 scratch vectors by name (mixed-format gate/up), grown once
    cdef char *moe_raw           # activation blocks of moe_experts (64-byte aligned inside moe_raw)
    cdef Py_ssize_t moe_cap

    def __cinit__(self):
        self.scratch = NULL
        self.scratch_n = 0
        self.moe_raw = NULL
        self.moe_cap = 0

    def __dealloc__(self):
        free(self.scratch)
        free(self.moe_raw)

    cdef char *_moe_act_for(self, Py_ssize_t nbytes) except NULL:
        """At least nbytes of 64-byte aligned scratch for moe_experts' activation blocks."""
        cdef char *raw
        if nbytes > self.moe_cap or self.moe_raw == NULL:
            raw = <char *>malloc(nbytes + 64)
            if raw == NULL:
                raise MemoryError(f"cannot allocate {nbytes} bytes of activation scratch")
            free(self.moe_raw)
            self.moe_raw = raw
            self.moe_cap = nbytes
        return <char *>((<uintptr_t>self.moe_raw + 63) & ~(<uintptr_t>63))

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
        """A float32 scratch vector of n elements starting on a cache line (the buffer only
        grows)."""
        cdef cnp.ndarray a = self._scr.get(name)
        if a is None or a.shape[0] < n + 16:
            a = np.empty(max(n, 1) + 16, np.float32)
            self._scr[name] = a
        cdef Py_ssize_t off = <Py_ssize_t>((64 - <uintptr_t>cnp.PyArray_DATA(a) % 64) % 64) // 4
        return a[off:off + n]

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

    def moe_route(self, router, x, n_used, norm, scores, ids, weights):
        """The experts each row of x (T, n) f32 chooses, as a decode program chooses them
        (program.c, cyllm_moe_route): router (E, n) f32; rows 0..T-1 of scores (>= T, E) f32
        (the probabilities), ids (>= T, k) int64 and weights (>= T, k) f32 written, k = n_used.
        Rows split over the threads (each row's bits do not depend on who computes it)."""
        cdef cnp.ndarray ar = _arr(router, "router", cnp.NPY_FLOAT32, 2, False)
        cdef cnp.ndarray ax = _arr(x, "x", cnp.NPY_FLOAT32, 2, False)
        cdef cnp.ndarray asc = _arr(scores, "scores", cnp.NPY_FLOAT32, 2, True)
        cdef cnp.ndarray ai = _arr(ids, "ids", cnp.NPY_INT64, 2, True)
        cdef cnp.ndarray aw = _arr(weights, "weights", cnp.NPY_FLOAT32, 2, True)
        cdef Py_ssize_t E = cnp.PyArray_DIM(ar, 0), n = cnp.PyArray_DIM(ar, 1), T = cnp.PyArray_DIM(ax, 0)
        cdef Py_ssize_t k = _index(n_used, "n_used"), t
        cdef int nrm = 1 if norm else 0
        if not 1 <= k <= E:
            raise InvalidArgumentError(f"moe_route: {k} experts a token of {E}")
        _check_len(cnp.PyArray_DIM(ax, 1), n, "x", "columns of the router")
        if (cnp.PyArray_DIM(asc, 0) < T or cnp.PyArray_DIM(asc, 1) != E or cnp.PyArray_DIM(ai, 0) < T
                or cnp.PyArray_DIM(ai, 1) != k or cnp.PyArray_DIM(aw, 0) < T or cnp.PyArray_DIM(aw, 1) != k):
            raise InvalidArgumentError(f"moe_route: scores {scores.shape}, ids {ids.shape} and weights "
                                       f"{weights.shape} do not hold {T} rows of {E} experts, {k} chosen")
        for a, na in ((asc, "scores"), (ai, "ids"), (aw, "weights")):
            _no_overlap(a, ar, na, "router")
            _no_overlap(a, ax, na, "x")
        _no_overlap(asc, ai, "scores", "ids")
        _no_overlap(asc, aw, "scores", "weights")
        _no_overlap(ai, aw, "ids", "weights")
        cdef const float *pr = <const float *>cnp.PyArray_DATA(ar)
        cdef const float *px = <const float *>cnp.PyArray_DATA(ax)
        cdef float *ps = <float *>cnp.PyArray_DATA(asc)
        cdef int64_t *pi = <int64_t *>cnp.PyArray_DATA(ai)
        cdef float *pw = <float *>cnp.PyArray_DATA(aw)
        cdef int nt = self.nthreads if T > 1 and T * E * n >= MATVEC_PARALLEL_MIN else 1
        with nogil:
            if nt > 1:
                for t in prange(T, num_threads=nt, schedule="static"):
                    cyllm_moe_route(pr, px + t * n, E, n, k, nrm, ps + t * E, pi + t * k, pw + t * k)
            else:
                for t in range(T):
                    cyllm_moe_route(pr, px + t * n, E, n, k, nrm, ps + t * E, pi + t * k, pw + t * k)

    def moe_experts(self, out, x, experts, ids, weights, act, h, y):
        """out (n,) f32 += sum over j of weights[j] * down_j @ (act(gate_j @ x) * (up_j @ x)),
        added in order j = 0, 1, ... (program.c, cyllm_moe_experts_run): (gate_j, up_j, down_j)
        = experts[ids[j]], the k experts a token uses (ids (k,) int64), each role of one kind for all of them
        (float16, or QuantMatrix of one format: gate and up alike); h (k, f) and y (k, n) f32
        scratch. Returns False, having done nothing, where the experts' kinds or formats
        differ or there are more than CYLLM_MOE_MAX_K of them (the caller then runs them one
        by one)."""
        cdef cyllm_moe m
        memset(&m, 0, sizeof(cyllm_moe))
        cdef cnp.ndarray ai = _arr(ids, "ids", cnp.NPY_INT64, 1, False)
        cdef Py_ssize_t k = cnp.PyArray_DIM(ai, 0), j, n, f, act_n, e, n_exp = len(experts)
        cdef const int64_t *pid = <const int64_t *>cnp.PyArray_DATA(ai)
        if k > CYLLM_MOE_MAX_K:
            return False
        if k < 1:
            raise InvalidArgumentError("moe_experts: no experts chosen")
        cdef cnp.ndarray ao = _arr(out, "out", cnp.NPY_FLOAT32, 1, True)
        cdef cnp.ndarray ax = _arr(x, "x", cnp.NPY_FLOAT32, 1, False)
        cdef cnp.ndarray aw = _arr(weights, "weights", cnp.NPY_FLOAT32, 1, False)
        cdef cnp.ndarray ah = _arr(h, "h", cnp.NPY_FLOAT32, 2, True)
        cdef cnp.ndarray ay = _arr(y, "y", cnp.NPY_FLOAT32, 2, True)
        n = cnp.PyArray_DIM(ax, 0)
        _check_len(cnp.PyArray_DIM(ao, 0), n, "out", "x's length")
        _check_len(cnp.PyArray_DIM(aw, 0), k, "weights", "the experts chosen")
        _no_overlap(ao, ax, "out", "x")
        for j in range(k):
            if pid[j] < 0 or pid[j] >= n_exp:
                raise InvalidArgumentError(f"moe_experts: expert {pid[j]} is out of range [0, {n_exp})")
        first = experts[pid[0]]
        _check_trio(first)
        g0, d0 = (<tuple>first)[0], (<tuple>first)[2]
        # f from the first expert's gate; every expert's shapes are checked by _expert_ptrs
        # (a mismatch: False, and the op-by-op path names it)
        if type(g0) is QuantMatrix:
            f = g0.rows
        elif cnp.PyArray_Check(g0) and cnp.PyArray_NDIM(<cnp.ndarray>g0) == 2:
            f = cnp.PyArray_DIM(<cnp.ndarray>g0, 0)
        else:
            return False
        if cnp.PyArray_DIM(ah, 0) < k or cnp.PyArray_DIM(ah, 1) != f or cnp.PyArray_DIM(ay, 0) < k \
                or cnp.PyArray_DIM(ay, 1) != n:
            raise InvalidArgumentError(f"moe_experts: scratch h {tuple(h.shape)} and y {tuple(y.shape)} "
                                       f"cannot hold {k} experts of ({f}, {n})")
        _no_overlap(ah, ax, "h", "x")
        _no_overlap(ah, ao, "h", "out")
        _no_overlap(ay, ax, "y", "x")
        _no_overlap(ay, ao, "y", "out")
        _no_overlap(ah, ay, "h", "y")
        m.fmt_gu, m.fmt_down = _expert_fmt(g0), _expert_fmt(d0)
        qgu, qdn = m.fmt_gu >= 0, m.fmt_down >= 0
        for j in range(k):
            if not _expert_ptrs(experts[pid[j]], f, n, m.fmt_gu, m.fmt_down, ao, &m.gate[j], &m.up[j], &m.down[j]):
                return False
        m.k, m.n, m.f = k, n, f
        m.rb_gu = g0.row_bytes if qgu else 0
        m.rb_down = d0.row_bytes if qdn else 0
        m.act = _act(act)
        m.x = <const float *>cnp.PyArray_DATA(ax)
        m.out = <float *>cnp.PyArray_DATA(ao)
        m.wts = <const float *>cnp.PyArray_DATA(aw)
        m.h = <float *>cnp.PyArray_DATA(ah)
        m.y = <float *>cnp.PyArray_DATA(ay)
        cdef int64_t xbytes = cyllm_qact_bytes(cyllm_qformat(m.fmt_gu).act, n) if qgu else 0
        cdef int64_t hbytes = cyllm_qact_bytes(cyllm_qformat(m.fmt_down).act, f) if qdn else 0
        if xbytes < 0 or hbytes < 0:
            raise InvalidArgumentError("moe_experts: a row length is not a whole number of activation blocks")
        xbytes = (xbytes + 63) & ~63
        m.hq_stride = (hbytes + 63) & ~63
        cdef char *buf = self._moe_act_for(xbytes + k * m.hq_stride)
        m.xq = buf
        m.hq = buf + xbytes
        cdef int nt = self.nthreads
        if k * f * n * 3 < MATVEC_PARALLEL_MIN:
            nt = 1
        with nogil:
            cyllm_moe_experts_run(self.kt, <const void *>self.q.qk, &m, nt)
        return True

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
        _same_shape(au, ag, "w_up", "w_gate")
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
    def attention(self, out, q, k_cache, v_cache, pos, window=0, scale=None, softcap=0.0):
        """out, q (n_heads*head_dim,) f32; k_cache, v_cache (n_kv, max_ctx, head_dim) f16;
        causal over cache positions max(0, pos+1-window)..pos (window 0: from 0); query head h
        reads kv head h // (n_heads // n_kv); scores scaled by scale (None: 1/sqrt(head_dim)),
        then soft-capped to softcap * tanh(s / softcap) where softcap > 0."""
        cdef cnp.ndarray ao = _arr(out, "out", cnp.NPY_FLOAT32, 1, True)
        cdef cnp.ndarray aq = _arr(q, "q", cnp.NPY_FLOAT32, 1, False)
        cdef cnp.ndarray ak = _arr(k_cache, "k_cache", cnp.NPY_FLOAT16, 3, False)
        cdef cnp.ndarray av = _arr(v_cache, "v_cache", cnp.NPY_FLOAT16, 3, False)
        cdef Py_ssize_t n_kv = cnp.PyArray_DIM(ak, 0), max_ctx = cnp.PyArray_DIM(ak, 1)
        cdef Py_ssize_t hd = cnp.PyArray_DIM(ak, 2)
        _same_shape(av, ak, "v_cache", "k_cache")
        cdef Py_ssize_t qlen = cnp.PyArray_DIM(aq, 0)
        cdef Py_ssize_t n_heads = _cache_heads(ak, qlen, "q has length")
        _check_len(cnp.PyArray_DIM(ao, 0), qlen, "out", "the length of q")
        cdef Py_ssize_t p = _index(pos, "pos")
        _check_pos(p, max_ctx)
        cdef Py_ssize_t w = _window(window)
        cdef Py_ssize_t start = p + 1 - w if 0 < w < p + 1 else 0
        cdef float sc = _scale(scale, hd), cap = _softcap(softcap)
        _attention_overlaps(ao, aq, ak, av)

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
            cyllm_attention_run(kt, po, pq, pk, pv, n_heads, n_kv, hd, max_ctx, start, p, sc, cap,
                                scratch, nt)

    def cache_store(self, k_cache, v_cache, k, v, pos):
        """k_cache[:, pos, :] = k ; v_cache[:, pos, :] = v (f32 -> f16, round to nearest even)."""
        cdef cnp.ndarray ak = _arr(k_cache, "k_cache", cnp.NPY_FLOAT16, 3, True)
        cdef cnp.ndarray av = _arr(v_cache, "v_cache", cnp.NPY_FLOAT16, 3, True)
        cdef cnp.ndarray xk = _arr(k, "k", cnp.NPY_FLOAT32, 1, False)
        cdef cnp.ndarray xv = _arr(v, "v", cnp.NPY_FLOAT32, 1, False)
        cdef Py_ssize_t n_kv = cnp.PyArray_DIM(ak, 0), max_ctx = cnp.PyArray_DIM(ak, 1)
        cdef Py_ssize_t hd = cnp.PyArray_DIM(ak, 2)
        _same_shape(av, ak, "v_cache", "k_cache")
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
        cdef Py_ssize_t max_ctx = cnp.PyArray_DIM(ac, 0), half = _rope_tables(ac, as_)
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
        cdef float e = _eps(eps)
        cdef float *po = <float *>cnp.PyArray_DATA(ao)
        cdef const float *px = <const float *>cnp.PyArray_DATA(ax)
        cdef const float *pw = <const float *>cnp.PyArray_DATA(aw)
        with nogil:
            cyllm_rmsnorm(po, px, pw, n, e)

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
        cdef int nt, i
        if mode >= 2:
            # gate into out, up into scratch (T, f), then out = act(out) * up
            if tuple(w.shape) != tuple(wu.shape):
                raise InvalidArgumentError(
                    f"w_up has shape {tuple(wu.shape)}, expected {tuple(w.shape)} (the shape of w_gate)")
            f = w.shape[0]
            if cnp.PyArray_DIM(ao, 0) != T or cnp.PyArray_DIM(ao, 1) != f:
                raise InvalidArgumentError(f"out has shape {out.shape}, expected ({T}, {f}) (rows of x, rows of w_gate)")
            au = self._scratch_vec("up_batch", T * f).reshape(T, f)
            if self._fused_qgate_up(ao, au, w, wu, x, mode - 2):
                return 0
            self._gemm(out, w, None, x, 0)
            self._gemm(au, wu, None, x, 0)
            # element-wise, so any split gives the same bits; one thread did 18% of a
            # TinyLlama Q4_K_M prefill here
            nt = self.nthreads if T * f >= 65536 else 1
            with nogil:
                if nt == 1:
                    cyllm_qglu(<float *>cnp.PyArray_DATA(ao), <const float *>cnp.PyArray_DATA(ao),
                               <const float *>cnp.PyArray_DATA(au), 0, T * f, mode - 2)
                else:
                    for i in prange(nt, num_threads=nt, schedule="static", chunksize=1):
                        cyllm_qglu(<float *>cnp.PyArray_DATA(ao), <const float *>cnp.PyArray_DATA(ao),
                                   <const float *>cnp.PyArray_DATA(au), T * f * i // nt, T * f * (i + 1) // nt,
                                   mode - 2)
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

    cdef bint _fused_qgate_up(self, cnp.ndarray ao, cnp.ndarray au, object w, object wu, object x,
                              int glu) except -1:
        """gate_up_batch in one pass when gate and up are quantized alike and prefill by
        int8 GEMM (QuantKernels._qgate_up); False: the caller runs the two GEMMs and the GLU."""
        if type(w) is not QuantMatrix or type(wu) is not QuantMatrix:
            return False
        gd, gk = _qm(w, "w_gate")
        ud, uk = _qm(wu, "w_up")
        if gk != uk or w.row_bytes != wu.row_bytes or self.q.prefill_method[gk] != QPREFILL_INT8:
            return False
        cdef cnp.ndarray ax = _arr(x, "x", cnp.NPY_FLOAT32, 2, False)
        cdef Py_ssize_t T = cnp.PyArray_DIM(ax, 0)
        if cnp.PyArray_DIM(ax, 1) != w.cols:
            raise InvalidArgumentError(f"x has shape {x.shape}: expected {w.cols} columns (columns of w_gate)")
        _no_overlap(ao, ax, "out", "x")
        _no_overlap(ao, gd, "out", "w_gate")
        _no_overlap(ao, ud, "out", "w_up")
        self.q._qgate_up(<float *>cnp.PyArray_DATA(ao), <float *>cnp.PyArray_DATA(au),
                         <const uint8_t *>cnp.PyArray_DATA(<cnp.ndarray>gd),
                         <const uint8_t *>cnp.PyArray_DATA(<cnp.ndarray>ud), w.row_bytes, gk,
                         <const float *>cnp.PyArray_DATA(ax), T, w.cols, w.rows, glu)
        return True

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
            _same_shape(au, aw, "w_up", "w_gate")
            _no_overlap(ao, au, "out", "w_up")
        if cnp.PyArray_DIM(ax, 1) != n:
            raise InvalidArgumentError(f"x has shape {x.shape}: expected {n} columns (columns of {wname})")
        if cnp.PyArray_DIM(ao, 0) != T or cnp.PyArray_DIM(ao, 1) != d:
            raise InvalidArgumentError(f"out has shape {out.shape}, expected ({T}, {d}) (rows of x, rows of {wname})")
        _no_overlap(ao, ax, "out", "x")
        _no_overlap(ao, aw, "out", wname)
        if T == 0 or d == 0:
            return 0
        if n == 0:                  # empty sums: x @ W.T = 0, and act(0) * 0 = 0
            if mode != 1:
                ao.fill(0)
            return 0
        cdef const cyllm_kernels *kt = self.kt
        cdef float *po = <float *>cnp.PyArray_DATA(ao)
        cdef const uint16_t *pw = <const uint16_t *>cnp.PyArray_DATA(aw)
        cdef const uint16_t *pu = <const uint16_t *>cnp.PyArray_DATA(au) if mode >= 2 else NULL
        cdef const float *px = <const float *>cnp.PyArray_DATA(ax)
        if T <= gemm_few_tokens:
            self._few_tokens(po, pw, pu, px, T, d, n, mode)
            return 0
        cdef Py_ssize_t ldx = _gemm_ldx(T, n)
        cdef float *pad
        if ldx != n:
            pad = <float *>cnp.PyArray_DATA(self._scratch_vec("gemm_x", T * ldx))
            with nogil:
                _copy_rows(pad, ldx, px, T, n)
            px = pad
        # threads take runs of whole weight panels (gemm_nr rows; a row's bits do not depend
        # on the split) as they come free, ~GEMM_CHUNKS runs per thread: on a shared host a
        # thread that loses its core for a while no longer holds up the op's end (a call per
        # run costs nothing extra: every panel is packed and x re-read per panel anyway)
        cdef Py_ssize_t nr = kt.gemm_nr, panels = (d + kt.gemm_nr - 1) // kt.gemm_nr, t, r0, r1
        cdef Py_ssize_t per, runs
        cdef int nt = self.nthreads
        if nt > panels:
            nt = <int>panels
        if T * d * n * (2 if mode >= 2 else 1) < MATVEC_PARALLEL_MIN:
            nt = 1
        per = max(1, panels // (nt * GEMM_CHUNKS))
        runs = (panels + per - 1) // per
        with nogil:
            if nt == 1:
                kt.gemm_rows(po, pw, pu, px, ldx, T, n, d, 0, d, mode)
            else:
                for t in prange(runs, num_threads=nt, schedule="dynamic", chunksize=1):
                    r0 = t * per * nr
                    r1 = (t + 1) * per * nr
                    if r1 > d:
                        r1 = d
                    kt.gemm_rows(po, pw, pu, px, ldx, T, n, d, r0, r1, mode)
        return 0

    cdef void _few_tokens(self, float *po, const uint16_t *pw, const uint16_t *pu, const float *px,
                          Py_ssize_t T, Py_ssize_t d, Py_ssize_t n, int mode) noexcept:
        """The GEMM of a few tokens as their matvecs, run by run of rows: the first token
        streams a run from memory, the others find it in cache. The GEMM packs every weight
        panel to f32 for whatever T brings, which for 2 tokens cost 1.8x their matvecs. Each
        token gets the matvec's bits (the decode step's); mode as _gemm's (0, 1 add, 2 + act)."""
        cdef const cyllm_kernels *kt = self.kt
        cdef Py_ssize_t row_bytes = n * 2 * (2 if mode >= 2 else 1)
        cdef int nt = self.nthreads
        if d * n * T * (2 if mode >= 2 else 1) < MATVEC_PARALLEL_MIN:
            nt = 1
        # runs of whole 4-row groups, about gemm_few_run_bytes each (each token after the first
        # re-reads a run from L2), but at least 4 runs per thread so that threads finish together
        cdef Py_ssize_t per = min(gemm_few_run_bytes // row_bytes, d // (4 * nt)) // 4 * 4
        if per < 4:
            per = 4
        cdef Py_ssize_t runs = (d + per - 1) // per, i
        if nt > runs:
            nt = <int>runs
        with nogil:
            if nt == 1:
                for i in range(runs):
                    _few_tokens_run(kt, po, pw, pu, px, T, d, n, mode, i * per, min(d, i * per + per))
            else:
                for i in prange(runs, num_threads=nt, schedule="dynamic", chunksize=1):
                    _few_tokens_run(kt, po, pw, pu, px, T, d, n, mode, i * per, min(d, i * per + per))

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
        cdef cnp.ndarray atok = _tokens(tokens)
        cdef const int32_t *tok = <const int32_t *>cnp.PyArray_DATA(atok)
        cdef Py_ssize_t vocab = cnp.PyArray_DIM(at, 0), dim = cnp.PyArray_DIM(at, 1)
        cdef Py_ssize_t T = cnp.PyArray_DIM(atok, 0), t
        if cnp.PyArray_DIM(ao, 0) != T or cnp.PyArray_DIM(ao, 1) != dim:
            raise InvalidArgumentError(f"out has shape {out.shape}, expected ({T}, {dim}) (tokens, columns of the table)")
        _check_ids(tok, T, vocab)
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
        cdef cnp.ndarray atok = _tokens(tokens)
        cdef const int32_t *tok = <const int32_t *>cnp.PyArray_DATA(atok)
        cdef Py_ssize_t vocab = table.rows, dim = table.cols, t
        cdef Py_ssize_t T = cnp.PyArray_DIM(atok, 0)
        if cnp.PyArray_DIM(ao, 0) != T or cnp.PyArray_DIM(ao, 1) != dim:
            raise InvalidArgumentError(f"out has shape {(<object>ao).shape}, expected ({T}, {dim}) (tokens, columns of the table)")
        _check_ids(tok, T, vocab)
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
        _same_shape(ao, ax, "out", "x")
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
        _same_shape(ao, ax, "out", "x")
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
        cdef Py_ssize_t max_ctx = cnp.PyArray_DIM(ac, 0), half = _rope_tables(ac, as_)
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
        _same_shape(av, ak, "v_cache", "k_cache")
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

    def attention_batch(self, out, q, k_cache, v_cache, pos0, window=0, scale=None, softcap=0.0):
        """Causal attention of T queries: row t attends to cache positions
        max(0, pos0+t+1-window)..pos0+t (window 0: from 0); scores scaled by scale, then
        soft-capped where softcap > 0.
        out, q (T, n_heads*hd) f32. The avx512 variant computes blocks of rows as small
        GEMMs with an exact softmax; the others call the decode kernel row by row."""
        cdef cnp.ndarray ao = _arr(out, "out", cnp.NPY_FLOAT32, 2, True)
        cdef cnp.ndarray aq = _arr(q, "q", cnp.NPY_FLOAT32, 2, False)
        cdef cnp.ndarray ak = _arr(k_cache, "k_cache", cnp.NPY_FLOAT16, 3, False)
        cdef cnp.ndarray av = _arr(v_cache, "v_cache", cnp.NPY_FLOAT16, 3, False)
        cdef Py_ssize_t n_kv = cnp.PyArray_DIM(ak, 0), max_ctx = cnp.PyArray_DIM(ak, 1)
        cdef Py_ssize_t hd = cnp.PyArray_DIM(ak, 2), T = cnp.PyArray_DIM(aq, 0)
        _same_shape(av, ak, "v_cache", "k_cache")
        cdef Py_ssize_t qlen = cnp.PyArray_DIM(aq, 1)
        cdef Py_ssize_t n_heads = _cache_heads(ak, qlen, "q rows have length")
        _same_shape(ao, aq, "out", "q")
        cdef Py_ssize_t p0 = _index(pos0, "pos0")
        _check_span(p0, T, max_ctx)
        _attention_overlaps(ao, aq, ak, av)
        cdef const cyllm_kernels *kt = self.kt
        cdef float *po = <float *>cnp.PyArray_DATA(ao)
        cdef const float *pq = <const float *>cnp.PyArray_DATA(aq)
        cdef const uint16_t *pk = <const uint16_t *>cnp.PyArray_DATA(ak)
        cdef const uint16_t *pv = <const uint16_t *>cnp.PyArray_DATA(av)
        cdef Py_ssize_t group = n_heads // n_kv, items = T * n_kv, it, t, kvh, st
        cdef float sc = _scale(scale, hd), cap = _softcap(softcap)
        cdef Py_ssize_t w = _window(window)
        cdef int nt = self.nthreads
        if T * (p0 + T) * hd * n_heads < 65536:
            nt = 1
        cdef Py_ssize_t R = kt.attention_rows_max, blocks, per, h, t0
        cdef float *work
        cdef float *scr
        cdef int ntr
        if getattr(self, "batch_rows_exact", False):
            # every row exactly as attention() computes it at that position (the decode
            # step's split, whatever T): a model whose activations are rounded to int8
            # blocks must give a token the same bits whichever path computed its cache
            scr = self._scratch_for(cyllm_attention_scratch(n_heads, hd, p0 + T))
            with nogil:
                for t in range(T):
                    st = p0 + t + 1 - w if 0 < w < p0 + t + 1 else 0
                    ntr = self.nthreads if (p0 + t + 1 - st) * hd * n_heads >= 16384 else 1
                    cyllm_attention_run(kt, po + t * qlen, pq + t * qlen, pk, pv, n_heads, n_kv, hd, max_ctx,
                                        st, p0 + t, sc, cap, scr, ntr)
            return
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
                                      hd, sc, cap, min(R, T - t0), p0 + t0 + 1,
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
                                       p0 + t + 1 - st, hd, sc, cap, group, NULL)
            else:
                for it in prange(items, num_threads=nt, schedule="dynamic", chunksize=1):
                    t = items // n_kv - 1 - it // n_kv       # longest rows first
                    kvh = it % n_kv
                    st = p0 + t + 1 - w if 0 < w < p0 + t + 1 else 0
                    kt.attention_group(po + t * qlen + kvh * group * hd, pq + t * qlen + kvh * group * hd,
                                       pk + (kvh * max_ctx + st) * hd, pv + (kvh * max_ctx + st) * hd,
                                       p0 + t + 1 - st, hd, sc, cap, group, NULL)
