# DecodeProgram: one token's recorded ops compiled to the C op array that
# cyllm_program_run (csrc/program.c) executes in one OpenMP parallel region.
# Tests: tests/test_cpu_fused.py (program vs op by op, bitwise). Included by kernels.pyx.

class NotCapturable(Exception):
    """The recorded ops cannot be compiled into a DecodeProgram (the caller runs them op by op)."""


# ops that run on thread 0 alone inside the program (all others split over the team);
# a QUANTIZE op is either (its mode)
cdef inline bint _serial_op(const cyllm_op *o) noexcept:
    if o.kind == CYLLM_OP_QUANTIZE:
        return o.mode == 1
    return (o.kind != CYLLM_OP_MATVEC and o.kind != CYLLM_OP_GATE_UP and o.kind != CYLLM_OP_ATTENTION
            and o.kind != CYLLM_OP_QMATVEC and o.kind != CYLLM_OP_QGATE_UP and o.kind != CYLLM_OP_GLU
            and o.kind != CYLLM_OP_MOE)


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
    cdef dict moe_acts           # bytes -> (buffer, aligned address): the moe ops' activation blocks (shared)
    cdef float *scratch          # attention partials for the longest context of any op
    cdef cyllm_claim *claims     # n_slots x claim_threads row-claim counters (program.c)
    cdef int n_slots             # matvec-like ops (each has a slot of claims)
    cdef int claim_threads       # teams up to this size have their claims allocated
    cdef bint running            # a run is under way (it releases the GIL)
    cdef readonly Py_ssize_t max_pos      # run(pos) needs pos < max_pos
    cdef readonly Py_ssize_t vocab        # run(token) needs token < vocab
    cdef readonly int n_barriers

    def __cinit__(self):
        self.ops = NULL
        self.n_ops = 0
        self.scratch = NULL
        self.claims = NULL
        self.n_slots = 0
        self.claim_threads = 0
        self.running = False

    def __dealloc__(self):
        free(self.ops)
        free(self.scratch)
        free(self.claims)

    def __init__(self, CpuKernels backend, list records, token, pos):
        self.kt = backend.kt
        self.qk = backend.q.qk
        self.refs = []
        self.qx = {}
        self.moe_acts = {}
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
        for i in range(self.n_ops):                 # row claims: one slot per weight op
            self.ops[i].slot = self.n_slots if _weight_op(self.ops[i].kind) else -1
            if _weight_op(self.ops[i].kind):
                self.n_slots += 1
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

    cdef int _compile_moe(self, tuple args, list meta) except -1:
        """A mixture of experts' MLP, (out, x, router, experts, n_used, norm, act, scratch) as
        CpuBackend.moe takes it: the router's product, the choice and the chosen experts in the
        program (program.c, moe_layer_step), with arrays of its own. NotCapturable where the
        experts are not one kind a role (quantized of one format, gate and up alike, or
        float16) or more than CYLLM_MOE_MAX_K a token: the op runs them then."""
        cdef cnp.ndarray ao = _arr(args[0], "out", cnp.NPY_FLOAT32, 1, True)
        cdef cnp.ndarray ax = _arr(args[1], "x", cnp.NPY_FLOAT32, 1, False)
        cdef cnp.ndarray ar = _arr(args[2], "router", cnp.NPY_FLOAT32, 2, False)
        experts = args[3]
        cdef Py_ssize_t E = cnp.PyArray_DIM(ar, 0), n = cnp.PyArray_DIM(ar, 1)
        cdef Py_ssize_t k = _index(args[4], "n_used"), f, e
        _check_len(cnp.PyArray_DIM(ax, 0), n, "x", "columns of the router")
        _check_len(cnp.PyArray_DIM(ao, 0), n, "out", "columns of the router")
        _check_len(len(experts), E, "experts", "rows of the router")
        if not 1 <= k <= E:
            raise InvalidArgumentError(f"moe: {k} experts a token of {E}")
        if k > CYLLM_MOE_MAX_K:
            raise NotCapturable(f"more than {CYLLM_MOE_MAX_K} experts a token")
        _no_overlap(ao, ax, "out", "x")
        _no_overlap(ao, ar, "out", "router")
        g0, u0, d0 = experts[0]
        f = g0.shape[0]
        cdef int fmt_gu = _expert_fmt(g0), fmt_dn = _expert_fmt(d0)
        qgu, qdn = fmt_gu >= 0, fmt_dn >= 0
        tables = np.zeros((3, E), np.uintp)        # every expert's gate, up, down
        cdef size_t *pt = <size_t *>cnp.PyArray_DATA(<cnp.ndarray>tables)
        for e in range(E):
            if not _expert_ptrs(experts[e], f, n, fmt_gu, fmt_dn, ao, <const void **>(pt + e),
                                <const void **>(pt + E + e), <const void **>(pt + 2 * E + e)):
                raise NotCapturable("experts of more than one kind, format or shape a role")
        cdef int64_t xbytes = cyllm_qact_bytes(cyllm_qformat(fmt_gu).act, n) if qgu else 0
        cdef int64_t hbytes = cyllm_qact_bytes(cyllm_qformat(fmt_dn).act, f) if qdn else 0
        if xbytes < 0 or hbytes < 0:
            raise InvalidArgumentError("moe: a row length is not a whole number of activation blocks")
        xbytes = (xbytes + 63) & ~63
        hbytes = (hbytes + 63) & ~63
        # the op's own work arrays (backends/moe.py MoeScratch, one token: the layers share them,
        # as the op does), so a step leaves its choice in scratch.ids as the op would
        s = args[7]
        if getattr(s, "h_all", None) is None:
            raise NotCapturable("moe without the one-call scratch arrays")
        scores = _arr(s.scores, "scores", cnp.NPY_FLOAT32, 2, True)[0]
        ids = _arr(s.ids, "ids", cnp.NPY_INT64, 2, True)[0]
        wts = _arr(s.weights, "weights", cnp.NPY_FLOAT32, 2, True)[0]
        h = _arr(s.h_all, "h", cnp.NPY_FLOAT32, 2, True)
        y = _arr(s.y_all, "y", cnp.NPY_FLOAT32, 2, True)
        if (scores.shape[0] != E or ids.shape[0] != k or wts.shape[0] != k or cnp.PyArray_DIM(h, 0) != k
                or cnp.PyArray_DIM(h, 1) != f or cnp.PyArray_DIM(y, 0) != k or cnp.PyArray_DIM(y, 1) != n):
            raise InvalidArgumentError(f"moe: the scratch arrays do not fit {E} experts of ({f}, {n}), {k} a token")
        work = ((scores, "scores"), (ids, "ids"), (wts, "weights"), (h, "h"), (y, "y"))
        for i, (a, name) in enumerate(work):
            _no_overlap(a, ax, name, "x")
            _no_overlap(a, ao, name, "out")
            _no_overlap(a, ar, name, "router")
            for b, other in work[i + 1:]:
                _no_overlap(a, b, name, other)
        # activation blocks of x and of the k h's: one buffer for every moe op of the program
        cdef Py_ssize_t nacts = xbytes + k * hbytes
        if nacts not in self.moe_acts:
            buf = np.zeros(nacts + 64, np.uint8)
            self.moe_acts[nacts] = (buf, (<size_t>cnp.PyArray_DATA(<cnp.ndarray>buf) + 63) & ~(<size_t>63))
        acts_buf, acts_at = self.moe_acts[nacts]
        cdef size_t acts = acts_at
        raw = np.zeros(sizeof(cyllm_moe_layer) + 64, np.uint8)     # the layer's record
        # the arrays the record points into, not the scratch object (its attributes may be rebound)
        self.refs.append((experts, tables, scores, ids, wts, h, y, raw, acts_buf))
        cdef size_t base = (<size_t>cnp.PyArray_DATA(<cnp.ndarray>raw) + 63) & ~(<size_t>63)
        cdef cyllm_moe_layer *L = <cyllm_moe_layer *>base
        L.E = E
        L.k = k
        L.norm = 1 if args[5] else 0
        L.router = <const float *>cnp.PyArray_DATA(ar)
        L.gate = <const void *const *>pt
        L.up = <const void *const *>(pt + E)
        L.down = <const void *const *>(pt + 2 * E)
        L.scores = <float *>cnp.PyArray_DATA(<cnp.ndarray>scores)
        L.ids = <int64_t *>cnp.PyArray_DATA(<cnp.ndarray>ids)
        L.wts = <float *>cnp.PyArray_DATA(<cnp.ndarray>wts)
        L.m.k = k
        L.m.n = n
        L.m.f = f
        L.m.fmt_gu = fmt_gu
        L.m.fmt_down = fmt_dn
        L.m.rb_gu = g0.row_bytes if qgu else 0
        L.m.rb_down = d0.row_bytes if qdn else 0
        L.m.act = _act(args[6])
        L.m.x = <const float *>cnp.PyArray_DATA(ax)
        L.m.out = <float *>cnp.PyArray_DATA(ao)
        L.m.wts = L.wts
        L.m.h = <float *>cnp.PyArray_DATA(<cnp.ndarray>h)
        L.m.y = <float *>cnp.PyArray_DATA(<cnp.ndarray>y)
        L.m.xq = <void *>acts
        L.m.hq = <void *>(acts + xbytes)
        L.m.hq_stride = hbytes
        cdef cyllm_op o
        memset(&o, 0, sizeof(cyllm_op))
        o.kind = CYLLM_OP_MOE
        o.moe = <void *>L
        # the experts' weights are left out of the spans: no op writes weights
        writes = [_span(ao), _span(scores), _span(ids), _span(wts), _span(h), _span(y), _span(acts_buf)]
        self._push(&o, meta, [_span(ax), _span(ar), _span(ao)], writes)
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
            o.softcap = _softcap(args[7] if len(args) > 7 else 0.0)
            o.out = <float *>cnp.PyArray_DATA(a0)
            o.a = cnp.PyArray_DATA(a1)
            self._push(&o, ops, [_span(a1), _span(a2), _span(a3)], [_span(a0)])
        elif name == "moe":
            self._compile_moe(args, ops)
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

    def run(self, token, pos, threads, prefetch=None):
        """One decode step: token and pos checked, then every op in one parallel region.
        prefetch: True / False turns the matvecs' software prefetch on (the distances of
        _set_prefetch / _set_qprefetch) or off for this and later steps (no bit of any
        result depends on it; backends/step_tuner.py picks it); None leaves it as it is."""
        global cyllm_pf_bytes, cyllm_qpf_bytes
        if prefetch is not None:
            cyllm_pf_bytes = _pf_on_bytes if prefetch else 0
            cyllm_qpf_bytes = _qpf_on_bytes if prefetch else 0
        cdef Py_ssize_t tok = _index(token, "token"), p = _index(pos, "pos")
        cdef Py_ssize_t nt = _index(threads, "threads")
        if tok < 0 or tok >= self.vocab:
            raise InvalidArgumentError(f"token id {tok} is out of range [0, {self.vocab})")
        if p < 0 or p >= self.max_pos:
            raise InvalidArgumentError(f"position {p} is out of range [0, {self.max_pos})")
        if nt < 1 or nt > 4096:
            raise InvalidArgumentError(f"threads must be in [1, 4096], got {nt}")
        # the claims, the attention scratch and the step's buffers serve one run at a time
        # (the model's lock serializes its steps); a second thread here would share them, and
        # its realloc below would free the claims under the first
        if self.running:
            raise RuntimeError("this decode program is already running in another thread")
        cdef void *grown
        if nt > 1 and nt > self.claim_threads and self.n_slots > 0:    # once per larger team
            grown = realloc(self.claims, <size_t>self.n_slots * <size_t>nt * sizeof(cyllm_claim))
            if grown == NULL:
                raise MemoryError()
            self.claims = <cyllm_claim *>grown
            self.claim_threads = nt
        self.running = True
        try:
            with nogil:
                cyllm_program_run(self.kt, <const void *>self.qk, self.ops, self.n_ops, <int>nt, tok, p,
                                  self.scratch, self.claims, self.n_slots)
        finally:
            self.running = False
