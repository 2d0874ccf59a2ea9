# Argument checks shared by every op of kernels.pyx and quant.pxi: each op validates its
# arrays here (dtype, rank, contiguity, writability, lengths, overlap) and its scalars
# (positions, eps, scale, window, act) before it releases the GIL. Messages name the
# argument and what it was checked against. Included by kernels.pyx.

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


cdef inline float _softcap(object cap) except? -1:
    """An attention score soft cap: 0 (none) or a finite number > 0."""
    cdef double c
    try:
        c = float(cap)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"softcap must be a number, got {cap!r}") from None
    if not (c == 0 or (c > 0 and c < 1e30)):
        raise InvalidArgumentError(f"softcap must be 0 (none) or a finite number > 0, got {cap!r}")
    return <float>c


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


cdef inline cnp.ndarray _arr(object a, str name, int typenum, int ndim, bint writable):
    """a as an ndarray of the given dtype and rank, C-contiguous, aligned, native order."""
    if not cnp.PyArray_Check(a):
        raise InvalidArgumentError(f"{name} must be a numpy array, got {type(a).__name__}")
    cdef cnp.ndarray arr = <cnp.ndarray>a
    if cnp.PyArray_TYPE(arr) != typenum or not cnp.PyArray_ISNOTSWAPPED(arr):
        want = {cnp.NPY_FLOAT32: "float32", cnp.NPY_FLOAT16: "float16", cnp.NPY_INT64: "int64",
                cnp.NPY_INT32: "int32"}.get(typenum, "numeric")
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


cdef inline tuple _qm(object w, str name):
    """(block data (rows, row_bytes) uint8, kernel id) of a QuantMatrix weight."""
    if type(w) is not QuantMatrix:
        raise InvalidArgumentError(
            f"{name} must be a float16 numpy array or a cyllm.quant.QuantMatrix, got {type(w).__name__}")
    return (<object>w).data, (<object>w).fmt.kernel_id


# -- checks several ops share (each replaces a preamble repeated in cpu_ops.pxi) -----

cdef inline int _same_shape(cnp.ndarray b, cnp.ndarray a, str nb, str na) except -1:
    """b must have the shape of a (both already checked to the same rank by _arr)."""
    cdef int i
    for i in range(cnp.PyArray_NDIM(a)):
        if cnp.PyArray_DIM(b, i) != cnp.PyArray_DIM(a, i):
            raise InvalidArgumentError(
                f"{nb} has shape {(<object>b).shape}, expected {(<object>a).shape} (the shape of {na})")
    return 0


cdef inline Py_ssize_t _rope_tables(cnp.ndarray ac, cnp.ndarray as_) except -1:
    """Half the rotated dims of the cos/sin tables (max_ctx, half): both alike, half > 0."""
    _same_shape(as_, ac, "sin", "cos")
    if cnp.PyArray_DIM(ac, 1) < 1:
        raise InvalidArgumentError(f"cos has shape {(<object>ac).shape}: head_dim/2 must be positive")
    return cnp.PyArray_DIM(ac, 1)


cdef inline Py_ssize_t _cache_heads(cnp.ndarray ak, Py_ssize_t qlen, str qwhat) except -1:
    """Query heads of a q of length qlen on the kv cache ak (n_kv, max_ctx, head_dim):
    a positive multiple of head_dim, and of the kv heads. qwhat: "q has length" or
    "q rows have length" (the message's start)."""
    cdef Py_ssize_t n_kv = cnp.PyArray_DIM(ak, 0), hd = cnp.PyArray_DIM(ak, 2)
    if n_kv < 1 or hd < 1:
        raise InvalidArgumentError(f"k_cache has an empty dimension: shape {(<object>ak).shape}")
    if qlen == 0 or qlen % hd:
        raise InvalidArgumentError(f"{qwhat} {qlen}, not a positive multiple of head_dim {hd}")
    cdef Py_ssize_t n_heads = qlen // hd
    if n_heads % n_kv:
        raise InvalidArgumentError(
            f"q holds {n_heads} heads, not a multiple of the cache's {n_kv} kv heads")
    return n_heads


cdef inline int _attention_overlaps(cnp.ndarray ao, cnp.ndarray aq, cnp.ndarray ak,
                                    cnp.ndarray av) except -1:
    _no_overlap(ao, aq, "out", "q")
    _no_overlap(ao, ak, "out", "k_cache")
    _no_overlap(ao, av, "out", "v_cache")
    return 0


cdef inline cnp.ndarray _tokens(object tokens):
    """tokens as a contiguous 1-D native int32 array (ids are checked by the op)."""
    if (not cnp.PyArray_Check(tokens) or cnp.PyArray_TYPE(<cnp.ndarray>tokens) != cnp.NPY_INT32
            or not cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>tokens)
            or cnp.PyArray_NDIM(<cnp.ndarray>tokens) != 1
            or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>tokens)
            or not cnp.PyArray_ISALIGNED(<cnp.ndarray>tokens)):
        raise InvalidArgumentError("tokens must be a contiguous 1-D native int32 numpy array")
    return <cnp.ndarray>tokens


cdef inline int _check_ids(const int32_t *tok, Py_ssize_t T, Py_ssize_t vocab) except -1:
    cdef Py_ssize_t t
    for t in range(T):
        if tok[t] < 0 or tok[t] >= vocab:
            raise InvalidArgumentError(f"token id {tok[t]} is out of range [0, {vocab})")
    return 0
