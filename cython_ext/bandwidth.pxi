# The memory read-bandwidth probe: the roofline `cyllm bench` reports next to decode
# speed (bench/probe_vs_matvec.py compares it with the matvec). Included by kernels.pyx.

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
