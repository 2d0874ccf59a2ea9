"""CPU backend: the Cython/OpenMP kernels of cyllm._ext.kernels (cython_ext/).

The ops themselves (embed, rmsnorm, matvec, matvec_add, gate_up_silu, rope,
cache_store, attention, swiglu, add) are methods of the compiled base class
CpuKernels: each call validates its arrays in C (a wrong dtype, shape or index
raises InvalidArgumentError) and runs without the GIL, so a Python call costs
well under a microsecond of overhead. This class adds the memory side of the
Backend protocol and the thread/variant policy.

Kernel variant: "avx2" (AVX2 + FMA + F16C) when the CPU has it, else "generic"
(portable C). CYLLM_KERNELS=generic|avx2 or CpuBackend(variant=...) overrides;
the choice is made once per backend and shown by kernel_info().
"""

from __future__ import annotations

import numpy as np

from ..errors import BackendUnavailableError
from ..threads import resolve_threads

try:
    from .._ext import kernels as _k
except ImportError as e:          # not built (source checkout without `pip install .`)
    raise BackendUnavailableError(
        f"the cpu backend's compiled kernels are missing ({e}); build them with "
        "`pip install .` (or `pip install -e . --no-build-isolation`) in the cyllm source tree"
    ) from None


class CpuBackend(_k.CpuKernels):
    name = "cpu"
    fuse_qkv = False      # weights stay memory-mapped: no concatenated copy

    def __init__(self, threads=None, variant: str | None = None):
        """threads: None -> OMP_NUM_THREADS or physical cores (cyllm.threads);
        variant: None -> $CYLLM_KERNELS or the best this CPU runs; "generic" | "avx2"."""
        super().__init__(resolve_threads(threads), variant)

    # kernel_variant and threads are properties of CpuKernels

    def set_threads(self, n) -> None:
        self.threads = resolve_threads(n)

    def rope_store(self, q, k, v, cos, sin, k_cache, v_cache, pos) -> None:
        self.rope(q, k, cos, sin, pos)
        self.cache_store(k_cache, v_cache, k, v, pos)

    # -- memory ---------------------------------------------------------------
    def upload(self, a: np.ndarray) -> np.ndarray:
        """The array itself when already usable: no copy of mmapped f16 weights or f32
        vectors. Otherwise a C-contiguous, aligned, native-order copy; float64 becomes
        float32 and a 1-D float16 vector float32 (every vector op reads f32)."""
        a = np.asarray(a)
        if a.dtype == np.float64 or (a.dtype == np.float16 and a.ndim == 1):
            a = a.astype(np.float32)
        elif not a.dtype.isnative:
            a = a.astype(a.dtype.newbyteorder("="))
        if a.flags.c_contiguous and a.flags.aligned:
            return a
        return np.ascontiguousarray(a)

    def empty(self, shape, dtype=np.float32) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def to_host(self, a: np.ndarray) -> np.ndarray:
        return a

    def synchronize(self) -> None:
        pass

    def measure_read_bandwidth(self, threads: int | None = None, nbytes: int = 512 << 20,
                               reps: int = 5) -> float:
        """Memory read bandwidth in GB/s with this backend's variant (roofline for `cyllm bench`)."""
        return measure_read_bandwidth(self.threads if threads is None else threads,
                                      nbytes, reps, self.kernel_variant)

    def __repr__(self) -> str:
        return f"CpuBackend(threads={self.threads}, variant={self.kernel_variant!r})"


def measure_read_bandwidth(threads: int = 1, nbytes: int = 512 << 20, reps: int = 5,
                           variant: str | None = None) -> float:
    """Best-of-reps read bandwidth (GB/s, 1e9 B/s) of `threads` threads summing a
    buffer of `nbytes` (far larger than the last-level cache)."""
    return _k.read_bandwidth_gbs(threads, nbytes, reps, variant)


def kernel_info() -> dict:
    """What runs the CPU kernels here: variant, cpu_features, openmp, max_threads.

    variant is the default one ($CYLLM_KERNELS or the best available); when
    $CYLLM_KERNELS names something unusable it is None and `error` says why.
    """
    info = {
        "variant": _k.DEFAULT_VARIANT,
        "cpu_features": _k.cpu_features(),
        "openmp": _k.openmp_enabled(),
        "max_threads": _k.omp_max_threads(),
        "available_variants": _k.available_variants(),
        "avx2_compiled": _k.avx2_compiled(),
    }
    if _k._DEFAULT_ERROR is not None:
        info["error"] = str(_k._DEFAULT_ERROR)
    return info
