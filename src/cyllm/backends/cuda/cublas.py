"""cuBLAS GemmEx through CuPy's low-level binding: the prefill GEMMs (FP16 inputs, FP32
accumulation and output, tensor cores). cupy.matmul cannot take FP16 inputs with an FP32
output, which is what keeps the prefill's accuracy equal to the CPU backend's."""

from __future__ import annotations

import numpy as np

# alpha and the two betas, host scalars (CUBLAS_POINTER_MODE_HOST): made once, not per GEMM
_ONE = np.ones(1, dtype=np.float32)
_BETA = {0.0: np.zeros(1, dtype=np.float32), 1.0: np.ones(1, dtype=np.float32)}


def gemm_ex(device, stream_ptr: int, out, w, x16, t: int, d: int, n: int, ldc: int, beta: float) -> None:
    """out (T, d) f32 (row stride ldc) = x16 (T, n) f16 @ w (d, n) f16 ^T + beta * out.

    Raises whatever the binding raises where it is missing or differs (older/newer CuPy)."""
    from cupy_backends.cuda.libs import cublas
    handle = device.cublas_handle
    b = _BETA.get(beta)
    if b is None:
        b = np.full(1, beta, dtype=np.float32)
    # the handle may still be bound to another stream: queue the GEMM after our kernels
    cublas.setStream(handle, stream_ptr)
    mode = cublas.getPointerMode(handle)
    cublas.setPointerMode(handle, 0)            # CUBLAS_POINTER_MODE_HOST
    try:
        # column-major view: out^T (d, T) = w^T' (d, n) . x16^T (n, T)
        cublas.gemmEx(handle, 1, 0, d, t, n,        # OP_T, OP_N, m, n, k
                      _ONE.ctypes.data, w.data.ptr, 2, n,      # A = w, CUDA_R_16F, lda
                      x16.data.ptr, 2, n,                     # B = x16, CUDA_R_16F, ldb
                      b.ctypes.data, out.data.ptr, 0, ldc,    # C = out, CUDA_R_32F, ldc
                      68, -1)                                 # CUBLAS_COMPUTE_32F, GEMM_DEFAULT
    finally:
        cublas.setPointerMode(handle, mode)
