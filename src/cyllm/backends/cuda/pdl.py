"""Programmatic dependent launch (PDL) from Python: cuLaunchKernelEx through ctypes.

Used by CudaBackend._launch for the decode kernels inside decode_step (sm_90+).
"""

from __future__ import annotations

import numpy as np


class PdlLauncher:
    """Launches a kernel with programmatic dependent launch (cuLaunchKernelEx, through ctypes).

    CuPy's RawKernel cannot set launch attributes, so the driver entry point is
    called directly with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION:
    the kernel may begin while the previous kernel on the stream still runs, and
    its own ``griddepcontrol.wait`` (pdl_wait in common.cuh) orders it after that
    kernel's completion. Works inside stream capture: the graph keeps the edge.
    """

    _ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6      # CUlaunchAttributeID

    def __init__(self):
        import ctypes
        self.ct = ctypes
        lib = ctypes.CDLL("libcuda.so.1")
        self.fn = lib.cuLaunchKernelEx
        self.fn.restype = ctypes.c_int

        class Attr(ctypes.Structure):          # CUlaunchAttribute: id, pad to 8, 64-byte value union
            _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]

        class Config(ctypes.Structure):        # CUlaunchConfig
            _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                        ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                        ("attrs", ctypes.POINTER(Attr)), ("n_attrs", ctypes.c_uint)]

        self.attr = Attr()
        self.attr.id = self._ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
        self.attr.value[0] = 1
        self.Config = Config

    def _arg(self, a):
        ct = self.ct
        if isinstance(a, np.int32):
            return ct.c_int32(int(a))
        if isinstance(a, np.float32):
            return ct.c_float(float(a))
        if isinstance(a, np.int64):
            return ct.c_int64(int(a))
        return ct.c_void_p(int(a.data.ptr))     # a CuPy array

    def launch(self, func_ptr: int, grid, block, args, smem: int, stream_ptr: int) -> int:
        ct = self.ct
        cfg = self.Config()
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        cfg.grid[:] = g
        cfg.block[:] = b
        cfg.smem = smem
        cfg.stream = stream_ptr
        cfg.attrs = ct.pointer(self.attr)
        cfg.n_attrs = 1
        vals = [self._arg(a) for a in args]
        params = (ct.c_void_p * len(vals))(*[ct.addressof(v) for v in vals])
        return self.fn(ct.byref(cfg), ct.c_void_p(func_ptr), params, None)
