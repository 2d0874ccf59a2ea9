# How the F16 GEMMs read x: rows spread over L1's sets, and a few tokens as matvecs.
# Included by kernels.pyx.
#
# The GEMM micro-kernels broadcast one column of 12 (avx512) or 6 (avx2) tokens of x at a
# time. When a row of x is a multiple of 4 KiB (n = 1024, 2048, 3072, 4096, ... floats),
# those tokens' lines all fall in one set of the L1 data cache, more of them than it has
# ways, and they evict each other on every column: 64-68 against 98 GFLOP/s at n = 2048 on
# Zen 4 (1 thread, avx512; bench/bench_gemm.py). Such x is copied once per GEMM into rows
# one cache line longer, which spreads the tokens over 12 sets. The copy changes no bits:
# every output is the same FMA chain over the same values.

cdef int gemm_pad_mode = 1           # 0 never, 1 when a row is a multiple of 4 KiB, 2 always


def _set_gemm_pad(int mode):
    """When the F16 GEMMs copy x into longer rows (benchmarks and tests): 0 never, 1 when its
    row is a multiple of 4 KiB (the default), 2 always. Returns the previous mode."""
    global gemm_pad_mode
    if mode not in (0, 1, 2):
        raise ValueError(f"gemm pad mode must be 0, 1 or 2, got {mode}")
    old = gemm_pad_mode
    gemm_pad_mode = mode
    return old


cdef inline Py_ssize_t _gemm_ldx(Py_ssize_t T, Py_ssize_t n) noexcept nogil:
    """Floats between the rows of x as the GEMM should read it: n, or n + 16 (one line more)."""
    if T < 2 or gemm_pad_mode == 0 or (gemm_pad_mode == 1 and (n * 4) % 4096 != 0):
        return n
    return n + 16


def _gemm_row_stride(Py_ssize_t T, Py_ssize_t n):
    """The row stride (floats) the F16 GEMMs read x of T rows of n floats with (tests)."""
    return _gemm_ldx(T, n)


cdef inline void _copy_rows(float *dst, Py_ssize_t ldd, const float *src, Py_ssize_t T,
                            Py_ssize_t n) noexcept nogil:
    """dst rows ldd floats apart <- src (T, n) contiguous."""
    cdef Py_ssize_t t
    for t in range(T):
        memcpy(dst + t * ldd, src + t * n, n * sizeof(float))


# At most this many tokens run the F16 GEMM as their matvecs (CpuKernels._few_tokens, two tokens
# a pass), in runs of rows of about gemm_few_run_bytes of weights. Zen 4, 2048x2048 from DRAM,
# ms, GEMM / matvecs at 1 thread | 2 threads: 2 tokens 1.11 / 0.63 | 0.67 / 0.41, 4 tokens
# 1.20 / 0.90 | 0.73 / 0.55, 6 tokens 1.32 / 1.16 | 0.70 / 0.73, 8 even
# (bench/results/cpu_quant_epyc_zen4.md)
cdef Py_ssize_t gemm_few_tokens = 4
cdef Py_ssize_t gemm_few_run_bytes = 262144


def _set_gemm_few(Py_ssize_t tokens, Py_ssize_t run_bytes):
    """Up to how many tokens the F16 GEMMs run as matvecs, and the rows' run in bytes
    (benchmarks and tests). Returns the previous (tokens, run_bytes)."""
    global gemm_few_tokens, gemm_few_run_bytes
    if tokens < 0 or run_bytes < 1:
        raise ValueError(f"few-token GEMM settings must be >= 0 and >= 1, got {tokens}, {run_bytes}")
    old = (gemm_few_tokens, gemm_few_run_bytes)
    gemm_few_tokens = tokens
    gemm_few_run_bytes = run_bytes
    return old
