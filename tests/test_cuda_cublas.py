"""gemm_ex's calls without a GPU: CuPy's binding and the library itself (the path a prefill
chunk recorded for a CUDA graph takes) get the same sequence, and a failing status stops it.

The arguments are the cuBLAS C API's; on a GPU, tests/test_cuda_model.py compares replayed
prefill chunks (the direct path) with eager ones (the binding) bit for bit."""

import types

import pytest

from cyllm.backends.cuda import cublas as C


class Recorder:
    """Stands for both APIs: CuPy's binding (values) and the library (statuses, out-params)."""

    def __init__(self, fail=None):
        self.calls, self.fail = [], fail

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name.replace("cublas", "").replace("_v2", ""), args))
            if name.startswith("cublas"):           # the library: a status; the mode through a pointer
                return 7 if self.fail == name else 0
            return 0 if name == "getPointerMode" else None
        return call


def _arrays(dtype="float16"):
    """out (float32), w and x16 (FP16, or float32: the router's GEMM)."""
    ptr = iter(range(0x1000, 0x10000, 0x100))
    return [types.SimpleNamespace(data=types.SimpleNamespace(ptr=next(ptr)), dtype=t)
            for t in ("float32", dtype, dtype)]


def _names(calls):
    return [n for n, _ in calls]


@pytest.mark.parametrize("dtype,cuda_type", [("float16", 2), ("float32", 0)])     # CUDA_R_16F, _32F
@pytest.mark.parametrize("direct", [False, True])
def test_gemm_ex_sequence(monkeypatch, direct, dtype, cuda_type):
    api = Recorder()
    if direct:
        monkeypatch.setattr(C, "_library", lambda handle: api)
        monkeypatch.setattr(C.ctypes, "byref", lambda x: x)
    else:
        monkeypatch.setattr(C, "_binding", lambda: api)
    out, w, x16 = _arrays(dtype)
    C.gemm_ex(types.SimpleNamespace(cublas_handle=42), 99, out, w, x16, 5, 7, 9, 11, 1.0, direct=direct)
    assert _names(api.calls) == ["SetStream", "GetPointerMode", "SetPointerMode", "GemmEx", "SetPointerMode"] \
        if direct else ["setStream", "getPointerMode", "setPointerMode", "gemmEx", "setPointerMode"]
    gemm = api.calls[3][1]
    assert gemm[:6] == (42, 1, 0, 7, 5, 9)                  # handle, OP_T, OP_N, m = d, n = T, k = n
    assert gemm[7:10] == (w.data.ptr, cuda_type, 9) and gemm[10:13] == (x16.data.ptr, cuda_type, 9)
    assert gemm[14:] == (out.data.ptr, 0, 11, 68, -1)
    assert C.ctypes.c_float.from_address(gemm[13]).value == 1.0     # beta, a host scalar
    assert api.calls[2][1][1] == 0                          # host pointer mode for the scalars


def test_direct_gemm_stops_on_a_failed_status_and_restores_the_mode(monkeypatch):
    api = Recorder(fail="cublasGemmEx")
    monkeypatch.setattr(C, "_library", lambda handle: api)
    monkeypatch.setattr(C.ctypes, "byref", lambda x: x)
    out, w, x16 = _arrays()
    with pytest.raises(RuntimeError, match="cublasGemmEx failed with cuBLAS status 7"):
        C.gemm_ex(types.SimpleNamespace(cublas_handle=1), 0, out, w, x16, 1, 1, 1, 1, 0.0, direct=True)
    assert _names(api.calls)[-1] == "SetPointerMode"


def test_gemm_ex_refuses_operands_of_two_types(monkeypatch):
    """w and x are read with one CUDA type: an FP32 w beside an FP16 x is refused before any call."""
    api = Recorder()
    monkeypatch.setattr(C, "_binding", lambda: api)
    out, w, x16 = _arrays("float32")
    x16.dtype = "float16"
    with pytest.raises(ValueError, match="w is float32, x float16"):
        C.gemm_ex(types.SimpleNamespace(cublas_handle=1), 0, out, w, x16, 1, 1, 1, 1, 0.0)
    assert api.calls == []
