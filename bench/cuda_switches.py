"""Experiment switches of the CUDA backend: environment variables that only measurements use.

The backend itself reads none of these (its user-facing off switches, CYLLM_CUDA_GRAPHS,
CYLLM_CUDA_FUSE_NORM and CYLLM_CUDA_PDL, stay in backends/cuda/backend.py). A benchmark
script calls ``apply(backend)`` right after constructing the backend, before the first
kernel is compiled:

- CYLLM_CUDA_MV_SHAPES=old      matvec launch shapes of the earlier rule (shapes.matvec_shape)
- CYLLM_CUDA_MV_WIDE_UNROLL=N   loads in flight for large square/wide matvecs (default 8)
- CYLLM_CUDA_DEFINES="-DX=1 ..." extra NVRTC options for the F16 kernels (e.g. -DMV_UNROLL=8)

    CYLLM_CUDA_MV_SHAPES=old PYTHONPATH=src python3 bench/bench_cuda.py --quick
"""

from __future__ import annotations

import os


def apply(backend, environ=os.environ) -> list[str]:
    """Set the switches found in ``environ`` on ``backend``; returns them as "NAME=value" lines."""
    used = []
    rule = environ.get("CYLLM_CUDA_MV_SHAPES")
    if rule:
        backend.matvec_shape_rule = rule
        used.append(f"CYLLM_CUDA_MV_SHAPES={rule}")
    wide = environ.get("CYLLM_CUDA_MV_WIDE_UNROLL")
    if wide:
        backend.matvec_unroll_wide = int(wide)
        used.append(f"CYLLM_CUDA_MV_WIDE_UNROLL={wide}")
    defines = environ.get("CYLLM_CUDA_DEFINES", "").split()
    if defines:
        backend.compile_defines = tuple(defines)
        used.append(f"CYLLM_CUDA_DEFINES={' '.join(defines)}")
    return used
