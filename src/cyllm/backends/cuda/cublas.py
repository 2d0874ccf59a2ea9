"""cuBLAS GemmEx: the prefill GEMMs (FP16 inputs, FP32 accumulation and output, tensor
cores). cupy.matmul cannot take FP16 inputs with an FP32 output, which is what keeps the
prefill's accuracy equal to the CPU backend's. Through CuPy's low-level binding, or, for a
prefill chunk recorded for a CUDA graph (prefill_graph.py), through the library itself:
cuBLAS can be captured, but CuPy's binding refuses any call while a stream captures."""

from __future__ import annotations

import ctypes

import numpy as np

# alpha and the two betas, host scalars (CUBLAS_POINTER_MODE_HOST): made once, not per GEMM
_ONE = np.ones(1, dtype=np.float32)
_BETA = {0.0: np.zeros(1, dtype=np.float32), 1.0: np.ones(1, dtype=np.float32)}


_IN_TYPES = {"float16": 2, "float32": 0}    # input dtype -> CUDA_R_16F, CUDA_R_32F


def gemm_ex(device, stream_ptr: int, out, w, x16, t: int, d: int, n: int, ldc: int, beta: float,
            direct: bool = False) -> None:
    """out (T, d) f32 (row stride ldc) = x16 (T, n) f16 @ w (d, n) f16 ^T + beta * out; or, with
    float32 w and x (a mixture of experts' router), the same in FP32 (COMPUTE_32F: no TF32
    unless the handle's math mode asks for it, as CuPy's does under CUPY_TF32=1).
    ``direct``: through the library (capturable), not CuPy's binding.

    Raises whatever the binding raises where it is missing or differs (older/newer CuPy)."""
    kind = _IN_TYPES[str(w.dtype)]
    if str(x16.dtype) != str(w.dtype):
        raise ValueError(f"gemm_ex: w is {w.dtype}, x {x16.dtype}")
    handle = device.cublas_handle
    api = _Direct(_library(handle)) if direct else _binding()
    b = _BETA.get(beta)
    if b is None:
        b = np.full(1, beta, dtype=np.float32)
    # the handle may still be bound to another stream: queue the GEMM after our kernels
    api.setStream(handle, stream_ptr)
    mode = api.getPointerMode(handle)
    api.setPointerMode(handle, 0)               # CUBLAS_POINTER_MODE_HOST
    try:
        # column-major view: out^T (d, T) = w^T' (d, n) . x16^T (n, T)
        api.gemmEx(handle, 1, 0, d, t, n,           # OP_T, OP_N, m, n, k
                   _ONE.ctypes.data, w.data.ptr, kind, n,      # A = w, CUDA_R_16F or _32F, lda
                   x16.data.ptr, kind, n,                     # B = x16, the same type, ldb
                   b.ctypes.data, out.data.ptr, 0, ldc,       # C = out, CUDA_R_32F, ldc
                   68, -1)                                    # CUBLAS_COMPUTE_32F, GEMM_DEFAULT
    finally:
        api.setPointerMode(handle, mode)


def _binding():
    from cupy_backends.cuda.libs import cublas
    return cublas


class _Direct:
    """The four calls of gemm_ex, as CuPy's binding names them, through the library itself."""

    def __init__(self, lib):
        self.lib = lib

    @staticmethod
    def _ok(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")

    def setStream(self, handle, stream_ptr):
        self._ok(self.lib.cublasSetStream_v2(handle, stream_ptr), "cublasSetStream")

    def getPointerMode(self, handle) -> int:
        mode = ctypes.c_int()
        self._ok(self.lib.cublasGetPointerMode_v2(handle, ctypes.byref(mode)), "cublasGetPointerMode")
        return mode.value

    def setPointerMode(self, handle, mode):
        self._ok(self.lib.cublasSetPointerMode_v2(handle, mode), "cublasSetPointerMode")

    def gemmEx(self, *args):
        self._ok(self.lib.cublasGemmEx(*args), "cublasGemmEx")


_LIB = None            # the library once found; False: not callable here (asked once)


def _library(handle: int):
    """libcublas as the process loaded it, with the functions this module calls typed: the
    copy whose version is the one CuPy's binding reports for ``handle`` (two CUDA majors may
    be loaded, by CuPy and by another package)."""
    global _LIB
    if _LIB is None:
        _LIB = False
        from cupy_backends.cuda.libs import cublas
        want = cublas.getVersion(handle)
        vp, i = ctypes.c_void_p, ctypes.c_int
        with open("/proc/self/maps") as f:
            paths = dict.fromkeys(line.rsplit(None, 1)[-1] for line in f if "/libcublas.so" in line)
        for path in paths:                 # "/libcublas.so" is not libcublasLt
            lib = ctypes.CDLL(path)
            version = i()
            lib.cublasGetVersion_v2.argtypes = [vp, ctypes.POINTER(i)]
            if lib.cublasGetVersion_v2(handle, ctypes.byref(version)) != 0 or version.value != want:
                continue
            lib.cublasSetStream_v2.argtypes = [vp, vp]
            lib.cublasGetPointerMode_v2.argtypes = [vp, ctypes.POINTER(i)]
            lib.cublasSetPointerMode_v2.argtypes = [vp, i]
            lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
            for fn in (lib.cublasSetStream_v2, lib.cublasGetPointerMode_v2, lib.cublasSetPointerMode_v2,
                       lib.cublasGemmEx, lib.cublasGetVersion_v2):
                fn.restype = i
            _LIB = lib
            break
    if _LIB is False:
        raise OSError("CuPy's libcublas is not callable through ctypes here")
    return _LIB
