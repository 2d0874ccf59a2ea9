# Threading policy of the CPU ops: below these sizes an op stays on the calling thread;
# above them rows / heads / weight panels are split over `threads` OpenMP threads in a
# fixed order (results do not depend on the thread count). The decode program's
# barrier spin and software-prefetch knobs (benchmarks only). Included by kernels.pyx.

cdef extern from "thread_probe.h":
    int cyllm_probe_threads(int n) nogil


def _probe_threads(int n):
    """Of n threads (the caller counted), how many the system let run at once: n when it
    allowed them all (csrc/thread_probe.c says why the CPU backend asks before OpenMP does)."""
    cdef int got
    with nogil:
        got = cyllm_probe_threads(n)
    return got


# Below these sizes an op runs on the calling thread: the parallel-region wake-up
# would cost more than the work (f16 matvec: 64K weights = 128 KiB, ~4 us).
cdef enum:
    MATVEC_PARALLEL_MIN = 65536      # weights read (d * n, both matrices for gate_up)
    VECTOR_PARALLEL_MIN = 65536      # elements of add / swiglu
    ROWS_PER_THREAD_MIN = 8
    GEMM_CHUNKS = 8                  # F16 prefill GEMM: runs of panels handed out per thread


def _set_spin(int polls):
    """Polls a decode-program thread spins at a barrier before it sleeps (benchmarks only)."""
    global cyllm_spin
    cyllm_spin = polls


# the F16 matvecs' prefetch distance when prefetch is on (DecodeProgram.run's switch)
_pf_on_bytes = cyllm_pf_bytes


cyllm_pf_init()


def _set_wide_prefetch(int64_t x_bytes, int64_t nbytes):
    """The F16 matvec's wide-row prefetch (benchmarks only): from x of `x_bytes` bytes the
    weights go to L2 `nbytes` ahead (0 = never). Returns the previous (x_bytes, nbytes)."""
    global cyllm_pf_wide_x, cyllm_pf_wide_bytes
    if x_bytes < 0 or nbytes < 0:
        raise ValueError(f"wide-row prefetch sizes must be >= 0, got {x_bytes}, {nbytes}")
    old = (cyllm_pf_wide_x, cyllm_pf_wide_bytes)
    cyllm_pf_wide_x = x_bytes if nbytes > 0 else (1 << 62)
    cyllm_pf_wide_bytes = nbytes
    return old


def _set_steal(int mode):
    """Whether a decode step's idle threads take the others' matvec rows (program.c; benchmarks
    and tests): 1 on (the default), 0 off, 2 every thread starts with the next thread's rows.
    Returns the previous mode."""
    global cyllm_steal
    if mode not in (0, 1, 2):
        raise ValueError(f"steal mode must be 0, 1 or 2, got {mode}")
    old = cyllm_steal
    cyllm_steal = mode
    return old


def _set_prefetch(int64_t nbytes, int across_ops=1):
    """Tuning knobs of the F16 decode matvec's software prefetch (benchmarks only): bytes
    ahead in the weight stream (0 = off), and whether the decode program prefetches
    across ops."""
    global cyllm_pf_bytes, cyllm_pf_next, _pf_on_bytes
    cyllm_pf_bytes = _pf_on_bytes = nbytes
    cyllm_pf_next = across_ops
