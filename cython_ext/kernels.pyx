# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, embedsignature=True
"""CPU kernels of cyllm: argument checks + OpenMP loops around the C kernel tables.

Layout of the work: every op validates its arrays here (dtype, dims, contiguity,
writability, ranges) with the NumPy C API -- a few hundred ns, cheap next to a
Python method call -- then releases the GIL and calls the C kernels of the chosen
variant (csrc/kernels_generic.c, csrc/kernels_avx2.c, and csrc/kernels_avx512.c for the
avx512 variant's prefill GEMM and attention) through function pointers.
Big ops (matvec family, attention, the batched prefill GEMMs) split their
rows/heads over `threads` OpenMP threads; small vector ops run serially because
waking the team (~1-14 us) costs more than the op. Every row/head is computed by
one thread in a fixed order (long-context decode attention merges fixed cache
blocks in order), so results are bitwise identical for any thread count.
DecodeProgram (end of file) runs a whole captured decode step in one region.
"""

import os
import time

import numpy as np
cimport numpy as cnp
from cython.parallel cimport prange, threadid
from libc.stdint cimport uint16_t, int32_t, int64_t
from libc.stdlib cimport malloc, realloc, free
from libc.string cimport memcpy, memset
from libc.math cimport sqrt, expf

from cyllm.errors import BackendUnavailableError, InvalidArgumentError
from cyllm.quant.matrix import QuantMatrix

cnp.import_array()


# one file per concern, in dependency order (Cython inlines them into this module)
include "c_api.pxi"        # declarations of csrc/kernels.h and csrc/omp_shim.h
include "args.pxi"         # argument checks shared by every op
include "threading.pxi"    # when an op runs serially, when it splits over the team
include "variants.pxi"     # generic / avx2 / avx512: detection and choice
include "gemm_x.pxi"       # how the F16 GEMMs read x (padded rows, a few tokens as matvecs)
# the quantized-weight kernels (QuantKernels): CpuKernels hands QuantMatrix weights to them
include "quant.pxi"
include "cpu_ops.pxi"      # CpuKernels: the ops
include "bandwidth.pxi"    # the memory read-bandwidth probe
include "program.pxi"      # DecodeProgram: a captured decode step in one parallel region
