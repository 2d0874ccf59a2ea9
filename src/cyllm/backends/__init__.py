"""Backend registry: the backend is chosen once, at load time, by name."""

from __future__ import annotations

from ..errors import CUDA_INSTALL_HINT, BackendUnavailableError

BACKENDS = ("cpu", "cuda", "numpy")


def get_backend(name: str, threads: int | None = None):
    """Instantiate backend ``name`` ("cpu" | "cuda" | "numpy")."""
    if threads is not None:
        from ..threads import parse_threads
        threads = parse_threads(threads)       # bad values fail the same way on every backend
    if name == "numpy":
        from .numpy_ref import NumpyBackend
        return NumpyBackend(threads)
    if name == "cpu":
        try:
            from .cpu import CpuBackend
        except ImportError as e:
            raise BackendUnavailableError(
                f"the cpu backend's compiled kernels cannot be imported ({e}); "
                "build them with `pip install .` in the cyllm source tree") from None
        return CpuBackend(threads)
    if name == "cuda":
        try:
            from .cuda import CudaBackend
        except ImportError as e:
            raise BackendUnavailableError(
                f"the cuda backend is not available ({e}); {CUDA_INSTALL_HINT}") from None
        return CudaBackend(threads)
    raise BackendUnavailableError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
