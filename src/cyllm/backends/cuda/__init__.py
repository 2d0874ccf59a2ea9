"""The CUDA backend (CuPy over the kernels of cuda/*.cu), one module per concern:

- backend.py       CudaBackend: the op interface of backends/base.py; the one-token (decode) ops
- nvrtc.py         the F16 kernels' source string and its compile cache (one module per device)
- source.py        where the .cu files are, and how they are assembled into one source
- kernel_names.py  every F16 kernel launched, named whole (tests/test_cuda_kernel_table.py)
- shapes.py        launch-shape heuristics (matvec rows/warps/unroll, attention chunking, plans and kernel)
- norm_fold.py     rmsnorm held back and folded into the next matvec
- rope_fold.py     the q/k/v matvec held back; rope and the KV-cache store folded into it
- graphs.py        decode_step: one CUDA graph replay per token
- pdl.py           programmatic dependent launch through ctypes (cuLaunchKernelEx)
- prefill.py       the batched ops of prompt processing (T tokens at once)
- cublas.py        the prefill GEMM (cublasGemmEx: FP16 in, FP32 out)
- checks.py        argument checks shared by decode and prefill ops
- quant.py         quantized weights on the device (CudaQuantMatrix) and their kernels

Experiment switches (used only for measurements) live in bench/cuda_switches.py.
Importing this package never needs CuPy or a GPU.
"""

from .backend import CudaBackend

__all__ = ["CudaBackend"]
