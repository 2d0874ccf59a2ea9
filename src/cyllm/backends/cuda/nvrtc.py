"""The F16 kernels' NVRTC build: cuda/*.cu as one source string, compiled once per device
(and set of extra defines) and shared by every CudaBackend of the process.

The quantized kernels (cuda/quant_matvec.cu) are built separately, one module per weight
format (quant.py)."""

from __future__ import annotations

from ...errors import BackendUnavailableError
from .source import assemble

# concatenation order of the kernel sources (common.cuh is inlined once, first)
KERNEL_FILES = ("common.cuh", "elementwise.cu", "matvec.cu", "attention.cu", "moe.cu")

# (device id, extra defines) -> (RawModule, built without the PTX load hints)
_MODULES: dict = {}


def kernel_source() -> str:
    """All the F16 backend's kernels as one source string (see source.assemble)."""
    return assemble(KERNEL_FILES)


def compile_module(defines: tuple[str, ...] = ()):
    """(RawModule, plain_loads): the kernels compiled now, by NVRTC through CuPy."""
    import cupy as cp
    src = kernel_source()
    errors = []
    # the PTX load hint (ld.global.nc.L1::no_allocate) is a nicety: fall back without it
    for opts in ((), ("-DCYLLM_PLAIN_LOADS",)):
        try:
            mod = cp.RawModule(code=src, options=opts + tuple(defines))
            mod.get_function("add_f32")      # forces the NVRTC compile now
            return mod, bool(opts)
        except Exception as e:  # noqa: BLE001 - CompileException, or a driver refusing the cubin
            errors.append(e)
    first = str(errors[0]).strip().splitlines()
    raise BackendUnavailableError(
        f"the cuda kernels failed to compile ({first[0] if first else type(errors[0]).__name__})")


def module_for(device_id: int, defines: tuple[str, ...] = ()):
    """(RawModule, plain_loads) of this device, compiled on first use."""
    key = (device_id, tuple(defines))
    cached = _MODULES.get(key)
    if cached is None:
        cached = _MODULES[key] = compile_module(defines)
    return cached
