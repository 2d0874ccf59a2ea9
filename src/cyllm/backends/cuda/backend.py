"""CUDA backend: the op interface of base.py on an NVIDIA GPU, through CuPy.

Kernels live in cuda/*.cu (shipped as the package ``cyllm._cuda``) and are
compiled once, at first use, by NVRTC through ``cupy.RawModule`` (nvrtc.py).
Weights are uploaded once as FP16, the KV cache is FP16, activations and
accumulation are FP32, exactly as in the CPU backend. Quantized weights stay in
their block format on the device (quant.py).

Per-step values (token id, position) can come from the host as kernel arguments
(eager ops) or from a two-int device buffer, which ``decode_step`` writes before
replaying a CUDA graph of the whole forward pass (graphs.py).

The other concerns have their own modules: kernel_names.py (every kernel launched,
named whole), shapes.py (launch-shape heuristics), norm_fold.py (rmsnorm folded into
the next matvec), pdl.py (programmatic dependent launch through ctypes), cublas.py
(the prefill GEMM).

Importing this module never fails for want of CuPy or a GPU; constructing
``CudaBackend`` raises ``BackendUnavailableError`` with one clear line.
"""

from __future__ import annotations

import math
import os

import numpy as np

from ...errors import CUDA_INSTALL_HINT, BackendUnavailableError, InvalidArgumentError, ModelLoadError
from ...quant.matrix import QuantMatrix
from ..base import ACTIVATIONS, Backend, check_token
from . import quant as cuda_quant
from .cublas import gemm_ex
from .graphs import GraphDecode
from .kernel_names import (ATTN_BATCH_KERNELS, ATTN_SPLIT_KERNELS, GATE_UP_OPS, GLU_KERNELS,
                           MATVEC_KERNELS, MATVEC_SCALAR_KERNELS)
from .norm_fold import NormFolding
from .nvrtc import module_for
from .pdl import PdlLauncher
from .quant import CudaQuantMatrix
from .shapes import ATT_THREADS, ATT_WARPS, MV_LARGE, SMEM_LIMIT, attn_chunk, attn_smem, matvec_shape
from .shapes import blocks as _blocks

try:  # CuPy is an optional extra; a broken CUDA install can raise more than ImportError
    import cupy as cp
    _CUPY_ERROR: Exception | None = None
except Exception as e:  # noqa: BLE001 - reported when the backend is constructed
    cp = None
    _CUPY_ERROR = e

_NEG1 = np.int32(-1)          # "read the step buffer" (see step_value in common.cuh)
_FIT_MARGIN = 512 << 20       # room left for scratch, cuBLAS workspace, the CUDA context


def _check_act(act) -> str:
    if act not in ACTIVATIONS:
        raise InvalidArgumentError(f"act must be one of {', '.join(ACTIVATIONS)}, got {act!r}")
    return act


def _check_window(window) -> int:
    w = int(window)
    if w < 0:
        raise InvalidArgumentError(f"window must be >= 0 (0: no window), got {w}")
    return min(w, 2**31 - 1)


class CudaBackend(NormFolding, GraphDecode, Backend):
    name = "cuda"
    fuse_qkv = True       # upload copies anyway: one (q+2kv, dim) matrix, one matvec
    kernel_variant = "cuda"

    def __init__(self, threads: int | None = None):
        self.threads = 1
        if cp is None:
            raise BackendUnavailableError(
                f"the cuda backend needs CuPy ({_CUPY_ERROR}); {CUDA_INSTALL_HINT}")
        try:
            n_dev = cp.cuda.runtime.getDeviceCount()
        except Exception as e:  # noqa: BLE001 - no driver, no device, driver too old...
            raise BackendUnavailableError(f"the cuda backend found no usable NVIDIA GPU ({e})") from None
        if n_dev < 1:
            raise BackendUnavailableError("the cuda backend found no NVIDIA GPU")
        self.device = cp.cuda.Device()
        props = cp.cuda.runtime.getDeviceProperties(self.device.id)
        name = props.get("name", b"GPU")
        self.device_name = name.decode() if isinstance(name, bytes) else str(name)
        self.sm_count = int(props.get("multiProcessorCount", 1))

        self._module = None
        self._kernels: dict = {}
        self.plain_loads = False        # True when the module was built without the PTX load hints
        # decode_step state: step = {token, pos} on the device, read by the graph's kernels
        self._step = cp.zeros(2, dtype=cp.int32)
        self._step_host = np.zeros(2, dtype=np.int32)
        self._stream = cp.cuda.Stream(non_blocking=False)   # blocking: ordered with the null stream
        self.use_graphs = os.environ.get("CYLLM_CUDA_GRAPHS", "1") != "0"
        self._graph = None
        self._graph_key = None
        self._device_mode = False       # ops read token/pos from self._step
        self._vocab: int | None = None
        self._max_pos: int | None = None
        self._pinned: dict = {}
        self._attn_scratch = None       # (key, o_part, m_part, l_part)
        self._cast_buf = None
        # matvec launch shape: rows per warp, warps per block, loads in flight per lane (4 or 8)
        # (None = heuristic); bench/bench_cuda.py tunes them
        self.matvec_rows: int | None = None
        self.matvec_warps: int | None = None
        self.matvec_unroll: int | None = None
        # rmsnorm folded into the next matvec that reads its output (see rmsnorm); CYLLM_CUDA_FUSE_NORM=0 turns it off
        self.fuse_norm = os.environ.get("CYLLM_CUDA_FUSE_NORM", "1") != "0"
        self._pending_norm = None       # (out, x, w, eps) of an rmsnorm not launched yet
        self._scratch: dict = {}        # name -> device buffer reused by the batched ops
        # decode attention: load V with K for short chunks (None = off: measured no faster on an H200,
        # and slower at long contexts, its registers cost resident blocks)
        self.attn_v_early: bool | None = None
        self.attn_batch_vec = True      # float4 variant of attention_batch where head_dim % 4 == 0
        # programmatic dependent launch of the decode kernels inside decode_step (sm_90+);
        # CYLLM_CUDA_PDL=0 turns it off
        self.use_pdl = (os.environ.get("CYLLM_CUDA_PDL", "1") != "0"
                        and int(props.get("major", 0)) >= 9)
        self._pdl = None
        # loads in flight per lane for large matrices no taller than wide (wo, down) where
        # matvec_unroll is unset: under PDL the first batch streams before the wait, so the
        # short matvecs that follow attention start with more bytes in flight
        self.matvec_unroll_wide = 8
        self.matvec_shape_rule = "large"    # or "old" (see shapes.matvec_shape)
        # extra NVRTC options, e.g. ("-DMV_UNROLL=8",): experiments only (bench/cuda_switches.py);
        # set before the first kernel is compiled
        self.compile_defines: tuple[str, ...] = ()

    # -- kernels ----------------------------------------------------------------
    def _k(self, name: str):
        k = self._kernels.get(name)
        if k is None:
            if self._module is None:
                self._module, self.plain_loads = module_for(self.device.id, self.compile_defines)
            k = self._kernels[name] = self._module.get_function(name)
        return k

    def _launch(self, name: str, grid, block, args, shared_mem: int = 0) -> None:
        """Launch a decode kernel whose dependent accesses follow pdl_wait.

        Under decode_step (and use_pdl) it goes out with programmatic dependent
        launch, so it overlaps the previous kernel's tail; otherwise as usual.
        """
        k = self._k(name) if isinstance(name, str) else name     # a name, or a kernel of cuda_quant
        if self._device_mode and self.use_pdl:
            try:
                if self._pdl is None:
                    self._pdl = PdlLauncher()
                func = getattr(k, "kernel", k)      # RawKernel -> its cupy.cuda.Function (CUfunction)
                rc = self._pdl.launch(func.ptr, grid, block, args, shared_mem,
                                      cp.cuda.get_current_stream().ptr)
            except Exception:  # noqa: BLE001 - no libcuda symbol, no .ptr: plain launches from now on
                rc = -1
            if rc == 0:
                return
            self.use_pdl = False
        k(grid, block, args, shared_mem=shared_mem)

    def warmup(self) -> None:
        """Compile the kernels now (otherwise the first op pays for NVRTC)."""
        self._k("add_f32")

    # -- memory -----------------------------------------------------------------
    def check_fits(self, nbytes: int) -> None:
        """Raise a clear ModelLoadError when ``nbytes`` more would not fit on the GPU."""
        free, total = cp.cuda.runtime.memGetInfo()
        pool = cp.get_default_memory_pool()
        free += pool.free_bytes()        # blocks CuPy holds but is not using
        if nbytes + _FIT_MARGIN > free:
            gib = 1 << 30
            raise ModelLoadError(
                f"the model needs {nbytes / gib:.2f} GiB of GPU memory but {self.device_name} has only "
                f"{free / gib:.2f} GiB free (of {total / gib:.2f} GiB); use a smaller model or --backend cpu")

    def upload(self, a: np.ndarray):
        if isinstance(a, QuantMatrix):      # typed weight: block bytes stay quantized on the GPU
            return cuda_quant.upload(self, a)
        a = np.asarray(a)
        if a.dtype == np.float64:
            a = a.astype(np.float32)
        self.check_fits(a.nbytes)
        try:
            return cp.asarray(np.ascontiguousarray(a))
        except cp.cuda.memory.OutOfMemoryError:
            raise ModelLoadError(
                f"out of GPU memory uploading a {a.nbytes / 2**20:.1f} MiB tensor to {self.device_name}") from None

    def empty(self, shape, dtype=np.float32):
        # zero-filled, not garbage: a cache row that is never written must not hold NaN
        try:
            return cp.zeros(shape, dtype=dtype)
        except cp.cuda.memory.OutOfMemoryError:
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            raise ModelLoadError(
                f"out of GPU memory allocating {nbytes / 2**20:.1f} MiB of run state on "
                f"{self.device_name}; try a shorter --context") from None

    def to_host(self, a) -> np.ndarray:
        """Device -> host through a page-locked buffer kept per array.

        The result is a view that stays valid until the next to_host of the
        same array (as with the numpy backend, where it is the array itself).
        """
        self._flush()
        if not a.flags.c_contiguous:
            return cp.ascontiguousarray(a).get()
        key = (a.data.ptr, a.shape, a.dtype.str)
        buf = self._pinned.get(key)
        if buf is None:
            if len(self._pinned) >= 32:
                self._pinned.clear()     # callers keep their views alive; only the cache is dropped
            import cupyx
            buf = self._pinned[key] = cupyx.empty_pinned(a.shape, a.dtype)
        a.get(out=buf)                   # on the current stream, blocking
        return buf

    def synchronize(self) -> None:
        self._flush()
        self.device.synchronize()

    # -- per-step values --------------------------------------------------------
    def _pos(self, pos, limit: int):
        """Kernel argument for the position: the host value, or -1 under decode_step."""
        if self._device_mode:
            self._max_pos = limit if self._max_pos is None else min(self._max_pos, limit)
            return _NEG1
        pos = int(pos)
        if not 0 <= pos < limit:
            raise InvalidArgumentError(f"position {pos} is out of range [0, {limit})")
        return np.int32(pos)

    # -- ops --------------------------------------------------------------------
    def embed(self, out, table, token, scale=1.0):
        self._flush()
        vocab, dim = table.shape
        check_token(int(token), vocab)
        if self._device_mode:
            self._vocab = vocab
            tok = _NEG1
        else:
            tok = np.int32(token)
        if isinstance(table, CudaQuantMatrix):
            cuda_quant.qembed(self, out, table, int(tok), scale)
            return
        self._k("embed_f16")((_blocks(dim, 256),), (256,),
                             (out, table, self._step, tok, np.int32(vocab), np.int32(dim),
                              np.float32(scale)))

    _MV_LARGE = MV_LARGE          # matrices from this size get the "large" launch shapes

    def _matvec_shape(self, d: int, n: int, rmax: int) -> tuple[int, int, int]:
        """(rows per warp, warps per block, loads in flight per lane) of a d x n matvec."""
        return matvec_shape(d, n, rmax, self.sm_count, self.matvec_rows, self.matvec_warps,
                            self.matvec_unroll, self.matvec_unroll_wide, self.matvec_shape_rule)

    def _mv(self, base: str, out, w0, w1, x, rmax: int):
        d, n = w0.shape
        if x.shape[0] != n or out.shape[0] != d:
            self._flush()
            raise InvalidArgumentError(f"{base}: shapes {tuple(w0.shape)} @ {tuple(x.shape)} -> {tuple(out.shape)}")
        norm = self._take_norm(out, x)
        if (n % 8 == 0 and w0.data.ptr % 16 == 0 and w1.data.ptr % 16 == 0 and x.data.ptr % 16 == 0
                and w0.flags.c_contiguous and w1.flags.c_contiguous):
            r, warps, u = self._matvec_shape(d, n, rmax)
            name = MATVEC_KERNELS[(base, r, u == 8, norm is not None)]
            # the wide variants keep a whole batch of loads in registers: never ask for a
            # block larger than the compiled kernel can launch
            warps = max(1, min(warps, getattr(self._k(name), "max_threads_per_block", 1024) // 32))
            grid, block = (_blocks(d, warps * r),), (32 * warps,)
            if norm is not None:
                xn, xin, nw, eps = norm
                self._launch(name, grid, block, (out, w0, w1, xin, np.int32(d), np.int32(n // 8),
                                                           nw, np.float32(eps), xn))
            else:
                self._launch(name, grid, block, (out, w0, w1, x, np.int32(d), np.int32(n // 8)))
        else:
            if norm is not None:
                self._rmsnorm_now(*norm)
            if not (w0.flags.c_contiguous and w1.flags.c_contiguous):
                raise InvalidArgumentError(f"{base}: the weight matrix must be C-contiguous")
            self._k(MATVEC_SCALAR_KERNELS[base])((_blocks(d, 8),), (256,),
                                      (out, w0, w1, x, np.int32(d), np.int32(n)))

    def matvec(self, out, w, x):
        if isinstance(w, CudaQuantMatrix):
            cuda_quant.qmatvec(self, out, w, x, "matvec")
            return
        self._mv("matvec", out, w, w, x, 4)

    def matvec_add(self, out, w, x):
        if isinstance(w, CudaQuantMatrix):
            cuda_quant.qmatvec(self, out, w, x, "add")
            return
        self._mv("matvec_add", out, w, w, x, 4)

    def gate_up(self, out, w_gate, w_up, x, act="silu"):
        if isinstance(w_gate, CudaQuantMatrix) or isinstance(w_up, CudaQuantMatrix):
            cuda_quant.qmatvec(self, out, (w_gate, w_up), x, "gate_up", _check_act(act))
            return
        if w_gate.shape != w_up.shape:
            self._flush()
            raise InvalidArgumentError(f"gate_up: gate {tuple(w_gate.shape)} and up {tuple(w_up.shape)} differ")
        self._mv(GATE_UP_OPS[_check_act(act)], out, w_gate, w_up, x, 2)

    def rope(self, q, k, cos, sin, pos, head_dim=None):
        self._flush()
        n_pos, half = cos.shape
        hd = 2 * half if head_dim is None else int(head_dim)
        if hd < 2 * half or q.shape[0] % hd or k.shape[0] % hd:
            raise InvalidArgumentError(f"rope: q {tuple(q.shape)}, k {tuple(k.shape)} with head_dim {hd}, "
                                       f"{2 * half} rotated")
        p = self._pos(pos, n_pos)
        nq = q.shape[0] // hd
        nk = k.shape[0] // hd
        self._k("rope_f32")((_blocks((nq + nk) * half, 256),), (256,),
                            (q, k, cos, sin, self._step, p, np.int32(n_pos),
                             np.int32(nq), np.int32(nk), np.int32(half), np.int32(hd)))

    def rope_store(self, q, k, v, cos, sin, k_cache, v_cache, pos):
        """*fused* rope(q, k, cos, sin, pos) then cache_store(k_cache, v_cache, k, v, pos).

        Optional op (only this backend has it): one launch instead of two.
        """
        self._flush()
        n_pos, half = cos.shape
        n_kv, max_ctx, hd = k_cache.shape
        if hd != 2 * half:        # partial rotary: the fused kernel stores rotated pairs only
            self.rope(q, k, cos, sin, pos, hd)
            self.cache_store(k_cache, v_cache, k, v, pos)
            return
        p = self._pos(pos, min(n_pos, max_ctx))
        if k.shape[0] != n_kv * hd or v.shape[0] != n_kv * hd:
            raise InvalidArgumentError(f"rope_store: k {tuple(k.shape)} does not fit a cache of {n_kv} heads x {hd}")
        nq = q.shape[0] // hd
        self._launch("rope_store_f32", (_blocks((nq + n_kv) * half, 256),), (256,),
                     (q, k, v, cos, sin, k_cache, v_cache, self._step, p, np.int32(n_pos),
                      np.int32(max_ctx), np.int32(nq), np.int32(n_kv), np.int32(half)))

    def cache_store(self, k_cache, v_cache, k, v, pos):
        self._flush()
        n_kv, max_ctx, hd = k_cache.shape
        p = self._pos(pos, max_ctx)
        self._k("cache_store_f16")((_blocks(n_kv * hd, 256),), (256,),
                                   (k_cache, v_cache, k, v, self._step, p,
                                    np.int32(max_ctx), np.int32(n_kv), np.int32(hd)))

    def _attn_chunk(self, n_kv: int, max_ctx: int) -> int:
        return attn_chunk(n_kv, max_ctx, self.sm_count)

    def _attn_buffers(self, n_heads: int, n_split: int, hd: int):
        key = (n_heads, n_split, hd)
        s = self._attn_scratch
        if s is None or s[0] != key:
            # allocated on the first (eager) call, never inside a graph capture; the
            # counters start at zero and the merging block puts them back to zero
            s = self._attn_scratch = (key,
                                      cp.zeros(n_heads, dtype=cp.int32),
                                      cp.empty(n_heads * n_split * hd, dtype=cp.float32),
                                      cp.empty(n_heads * n_split, dtype=cp.float32),
                                      cp.empty(n_heads * n_split, dtype=cp.float32))
        return s[1:]

    @staticmethod
    def _attn_smem(gt: int, hd: int, chunk: int, n_split: int) -> int:
        return attn_smem(gt, hd, chunk, n_split)

    def attention(self, out, q, k_cache, v_cache, pos, window=0, scale=None):
        self._flush()
        n_kv, max_ctx, hd = k_cache.shape
        n_heads = q.shape[0] // hd
        if n_heads * hd != q.shape[0] or n_heads % n_kv or out.shape[0] != q.shape[0]:
            raise InvalidArgumentError(
                f"attention: q {tuple(q.shape)} does not fit a cache of {n_kv} heads x {hd}")
        group = n_heads // n_kv
        p = self._pos(pos, max_ctx)
        chunk = self._attn_chunk(n_kv, max_ctx)
        n_split = _blocks(max_ctx, chunk)
        counters, o_part, m_part, l_part = self._attn_buffers(n_heads, n_split, hd)
        sc = np.float32(1.0 / math.sqrt(hd) if scale is None else scale)
        args_tail = (q, k_cache, v_cache, self._step, p, np.int32(max_ctx), np.int32(n_kv),
                     np.int32(group), np.int32(hd), np.int32(chunk), np.int32(n_split), sc,
                     np.int32(_check_window(window)))
        hd8 = hd // 8
        gt = 0
        if (hd % 8 == 0 and 0 < hd8 <= 32 and hd8 & (hd8 - 1) == 0
                and k_cache.data.ptr % 16 == 0 and v_cache.data.ptr % 16 == 0):
            gt = 1 if group == 1 else 2 if group == 2 else 4 if group <= 4 else 8
            while gt and self._attn_smem(gt, hd, chunk, n_split) > SMEM_LIMIT:
                gt //= 2
        if gt:
            ve = bool(self.attn_v_early)
            self._launch(ATTN_SPLIT_KERNELS[(gt, ve)], (n_kv, n_split), (ATT_THREADS,),
                         (out, counters, o_part, m_part, l_part) + args_tail,
                         shared_mem=self._attn_smem(gt, hd, chunk, n_split))
        else:
            smem = 4 * (hd + chunk + ATT_WARPS + ATT_WARPS * n_split)
            if smem > SMEM_LIMIT:
                raise InvalidArgumentError(f"attention: head_dim {hd} is too large for the cuda backend")
            self._k("attn_split_generic")((n_heads, n_split), (ATT_THREADS,),
                                          (out, counters, o_part, m_part, l_part) + args_tail, shared_mem=smem)

    def swiglu(self, out, gate, up):
        self._flush()
        n = out.shape[0]
        self._k("swiglu_f32")((_blocks(n, 256),), (256,), (out, gate, up, np.int32(n)))

    def add(self, out, x, y):
        self._flush()
        n = out.shape[0]
        self._k("add_f32")((_blocks(n, 256),), (256,), (out, x, y, np.int32(n)))

    # -- batched prefill ----------------------------------------------------------
    # Row t of every (T, n) array is prompt position pos0 + t. The GEMMs go
    # through cuBLAS (FP16 inputs, FP32 accumulation and output, tensor cores);
    # the rest are one launch each over all rows.
    def _buf(self, name: str, n: int, dtype):
        """A device scratch buffer of at least n elements, kept and grown (prefill only, never in a graph)."""
        b = self._scratch.get(name)
        if b is None or b.size < n:
            b = self._scratch[name] = cp.empty(max(n, 1), dtype=dtype)
        return b[:n]

    @staticmethod
    def _rows(a, what: str) -> int:
        """Row stride in elements of a 2-D array whose rows are contiguous."""
        if a.ndim != 2 or a.strides[1] != a.itemsize or a.strides[0] % a.itemsize:
            raise InvalidArgumentError(f"{what}: expected a 2-D array with contiguous rows, got shape "
                                       f"{tuple(a.shape)} strides {tuple(a.strides)}")
        return a.strides[0] // a.itemsize

    def embed_batch(self, out, table, tokens, scale=1.0):
        self._flush()
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        vocab, dim = table.shape
        t = int(tokens.shape[0])
        if out.shape != (t, dim):
            raise InvalidArgumentError(f"embed_batch: {t} tokens of width {dim} -> out {tuple(out.shape)}")
        if t == 0:
            return
        lo, hi = int(tokens.min()), int(tokens.max())
        check_token(lo, vocab)
        check_token(hi, vocab)
        dev = self._buf("tokens", t, cp.int32)
        # pageable source: memcpyAsync returns once the bytes are staged, so the caller may reuse tokens
        cp.cuda.runtime.memcpyAsync(dev.data.ptr, tokens.ctypes.data, tokens.nbytes,
                                    cp.cuda.runtime.memcpyHostToDevice,
                                    cp.cuda.get_current_stream().ptr)
        if isinstance(table, CudaQuantMatrix):
            cuda_quant.qembed_batch(self, out, table, dev, scale)
            return
        self._k("embed_batch_f16")((_blocks(dim, 256), t), (256,),
                                   (out, table, dev, np.int32(t), np.int32(vocab), np.int32(dim),
                                    np.int32(self._rows(out, "embed_batch")), np.float32(scale)))

    def rmsnorm_batch(self, out, x, w, eps):
        self._flush()
        t, n = x.shape
        if out.shape != x.shape or w.shape[0] != n:
            raise InvalidArgumentError(f"rmsnorm_batch: x {tuple(x.shape)}, w {tuple(w.shape)} -> out {tuple(out.shape)}")
        if t == 0:
            return
        self._k("rmsnorm_rows_f32")((t,), (512,), (out, x, w, np.int32(n), np.float32(eps),
                                                   np.int32(self._rows(out, "rmsnorm_batch")),
                                                   np.int32(self._rows(x, "rmsnorm_batch"))))

    def _cast16(self, x, name: str = "x16"):
        """x (T, n) f32 -> a contiguous (T, n) f16 scratch copy, the GEMM's B operand."""
        t, n = x.shape
        x16 = self._buf(name, t * n, cp.float16).reshape(t, n)
        total = t * n
        self._k("cast_rows_f32_f16")((_blocks(total, 256),), (256,),
                                     (x16, x, np.int64(total), np.int32(n), np.int32(self._rows(x, "matmul"))))
        return x16

    def _check_mm(self, what, out, w, x):
        t, n = x.shape
        d = w.shape[0]
        if w.ndim != 2 or w.shape[1] != n or out.shape != (t, d):
            raise InvalidArgumentError(f"{what}: {tuple(x.shape)} @ {tuple(w.shape)}^T -> {tuple(out.shape)}")
        if not w.flags.c_contiguous:
            raise InvalidArgumentError(f"{what}: the weight matrix must be C-contiguous")
        return t, d, n

    def matmul(self, out, w, x) -> None:
        """out (T, d) f32 = x (T, n) f32 @ w (d, n) f16 ^T, an FP16 GEMM with FP32 accumulation.

        x is rounded to FP16 (the GEMM's inputs); the products are summed in
        FP32 and written as FP32 by cuBLAS.
        """
        if isinstance(w, CudaQuantMatrix):
            cuda_quant.qmatmul(self, out, w, x, 0.0)
            return
        self._flush()
        t, d, n = self._check_mm("matmul", out, w, x)
        if t == 0:
            return
        self._gemm(out, w, self._cast16(x), 0.0)

    def matmul_add(self, out, w, x) -> None:
        """*fused* out (T, d) += x @ w^T: the GEMM's beta = 1 does the residual add."""
        if isinstance(w, CudaQuantMatrix):
            cuda_quant.qmatmul(self, out, w, x, 1.0)
            return
        self._flush()
        t, d, n = self._check_mm("matmul_add", out, w, x)
        if t == 0:
            return
        self._gemm(out, w, self._cast16(x), 1.0)

    def gate_up_batch(self, out, w_gate, w_up, x, act="silu") -> None:
        """*fused* out (T, f) = act(x @ w_gate^T) * (x @ w_up^T): x cast once, two GEMMs, one product pass."""
        if isinstance(w_gate, CudaQuantMatrix) or isinstance(w_up, CudaQuantMatrix):
            cuda_quant.qgate_up_batch(self, out, w_gate, w_up, x, _check_act(act))
            return
        self._flush()
        product = GLU_KERNELS[_check_act(act)]
        if w_gate.shape != w_up.shape:
            raise InvalidArgumentError(f"gate_up_batch: gate {tuple(w_gate.shape)} and up {tuple(w_up.shape)} differ")
        t, f, n = self._check_mm("gate_up_batch", out, w_gate, x)
        self._check_mm("gate_up_batch", out, w_up, x)
        if t == 0:
            return
        x16 = self._cast16(x)
        up = self._buf("up", t * f, cp.float32).reshape(t, f)
        self._gemm(out, w_gate, x16, 0.0)
        self._gemm(up, w_up, x16, 0.0)
        if self._rows(out, "gate_up_batch") == f:
            self._k(product)((_blocks(t * f, 256),), (256,), (out, out, up, np.int32(t * f)))
        else:
            for r in range(t):
                self._k(product)((_blocks(f, 256),), (256,), (out[r], out[r], up[r], np.int32(f)))

    def _gemm(self, out, w, x16, beta: float) -> None:
        """out (T, d) f32 = x16 (T, n) f16 @ w (d, n) f16 ^T + beta * out."""
        t, n = x16.shape
        d = w.shape[0]
        ldc = self._rows(out, "matmul")
        if not self._gemm_ex(out, w, x16, t, d, n, ldc, beta):
            prod = cp.matmul(x16.astype(cp.float32), w.T.astype(cp.float32))
            if beta:
                out += prod
            else:
                out[...] = prod

    def _gemm_ex(self, out, w, x16, t, d, n, ldc, beta) -> bool:
        """cublasGemmEx: f16 inputs, f32 output, f32 compute. False if unavailable here."""
        if getattr(self, "_gemm_broken", False):
            return False
        try:
            gemm_ex(self.device, cp.cuda.get_current_stream().ptr, out, w, x16, t, d, n, ldc, beta)
            return True
        except Exception:  # noqa: BLE001 - older/newer CuPy without this binding: use cupy.matmul
            self._gemm_broken = True
            return False

    def add_rows(self, out, x, b) -> None:
        self._flush()
        if out.shape != x.shape or x.ndim != 2 or b.shape != (x.shape[1],):
            raise InvalidArgumentError(f"add_rows: x {tuple(x.shape)} + b {tuple(b.shape)} -> out {tuple(out.shape)}")
        t, n = x.shape
        if out.flags.c_contiguous and x.flags.c_contiguous and b.flags.c_contiguous:
            if t:
                self._k("add_rows_f32")((_blocks(t * n, 256),), (256,), (out, x, b, np.int64(t * n), np.int32(n)))
        else:
            cp.add(x, b, out=out)

    def rope_batch(self, q, k, cos, sin, pos0, head_dim=None) -> None:
        self._flush()
        n_pos, half = cos.shape
        t = q.shape[0]
        pos0 = int(pos0)
        hd = 2 * half if head_dim is None else int(head_dim)
        if k.shape[0] != t or hd < 2 * half or q.shape[1] % hd or k.shape[1] % hd:
            raise InvalidArgumentError(f"rope_batch: q {tuple(q.shape)}, k {tuple(k.shape)} with head_dim {hd}")
        if t == 0:
            return
        if pos0 < 0 or pos0 + t > n_pos:
            raise InvalidArgumentError(f"positions {pos0}..{pos0 + t - 1} are out of range [0, {n_pos})")
        nq, nk = q.shape[1] // hd, k.shape[1] // hd
        total = t * (nq + nk) * half
        self._k("rope_batch_f32")((_blocks(total, 256),), (256,),
                                  (q, k, cos, sin, np.int32(pos0), np.int32(n_pos), np.int32(t),
                                   np.int32(nq), np.int32(nk), np.int32(half),
                                   np.int32(self._rows(q, "rope_batch")), np.int32(self._rows(k, "rope_batch")),
                                   np.int32(hd)))

    def cache_store_batch(self, k_cache, v_cache, k, v, pos0) -> None:
        self._flush()
        n_kv, max_ctx, hd = k_cache.shape
        t = k.shape[0]
        pos0 = int(pos0)
        if v.shape != k.shape or k.shape[1] != n_kv * hd or v_cache.shape != k_cache.shape:
            raise InvalidArgumentError(f"cache_store_batch: k {tuple(k.shape)} does not fit a cache of {n_kv} heads x {hd}")
        if t == 0:
            return
        if pos0 < 0 or pos0 + t > max_ctx:
            raise InvalidArgumentError(f"positions {pos0}..{pos0 + t - 1} are out of range [0, {max_ctx})")
        total = t * n_kv * hd
        self._k("cache_store_batch_f16")((_blocks(total, 256),), (256,),
                                         (k_cache, v_cache, k, v, np.int32(pos0), np.int32(t), np.int32(max_ctx),
                                          np.int32(n_kv), np.int32(hd), np.int32(self._rows(k, "cache_store_batch")),
                                          np.int32(self._rows(v, "cache_store_batch"))))

    def attention_batch(self, out, q, k_cache, v_cache, pos0, window=0, scale=None) -> None:
        """Causal attention of T queries (row t at position pos0 + t), flash-attention tiles."""
        self._flush()
        n_kv, max_ctx, hd = k_cache.shape
        t = q.shape[0]
        pos0 = int(pos0)
        n_heads = q.shape[1] // hd if q.ndim == 2 else 0
        if (q.ndim != 2 or n_heads * hd != q.shape[1] or n_heads % n_kv or out.shape != q.shape
                or not k_cache.flags.c_contiguous or not v_cache.flags.c_contiguous):
            raise InvalidArgumentError(f"attention_batch: q {tuple(q.shape)} does not fit a cache of {n_kv} heads x {hd}")
        if t == 0:
            return
        if pos0 < 0 or pos0 + t > max_ctx:
            raise InvalidArgumentError(f"positions {pos0}..{pos0 + t - 1} are out of range [0, {max_ctx})")
        nc = 1 if hd <= 32 else 2 if hd <= 64 else 4 if hd <= 128 else 8 if hd <= 256 else 0
        if nc == 0:     # very wide heads: the decode kernel, one query at a time
            for r in range(t):
                self.attention(out[r], q[r], k_cache, v_cache, pos0 + r, window, scale)
            return
        bq = bk = 16 if nc == 8 else 32
        vec = self.attn_batch_vec and hd % 4 == 0
        pad = 4 if vec else 1
        smem = 4 * ((bq + bk) * (hd + pad) + bq * (bk + pad))
        self._k(ATTN_BATCH_KERNELS[(nc, vec)])((n_heads, _blocks(t, bq)), (128,),
                                     (out, q, k_cache, v_cache, np.int32(t), np.int32(pos0), np.int32(max_ctx),
                                      np.int32(n_heads // n_kv), np.int32(hd),
                                      np.int32(self._rows(q, "attention_batch")),
                                      np.int32(self._rows(out, "attention_batch")),
                                      np.float32(1.0 / math.sqrt(hd) if scale is None else scale),
                                      np.int32(_check_window(window))), shared_mem=smem)

    # -- measurement ------------------------------------------------------------------
    @property
    def captures_decode(self) -> bool:
        return self.use_graphs

    def measure_bandwidth(self, nbytes: int, threads: int | None = None) -> tuple[float | None, str]:
        return self.measure_copy_bandwidth(), "device copy"

    def measure_copy_bandwidth(self, nbytes: int = 1 << 30, iters: int = 20) -> float:
        """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
        free, _ = cp.cuda.runtime.memGetInfo()
        nbytes = int(min(nbytes, max(free // 4, 1 << 20)))
        src = cp.empty(nbytes, dtype=cp.uint8)
        dst = cp.empty(nbytes, dtype=cp.uint8)
        src.fill(1)
        stream = self._stream
        kind = cp.cuda.runtime.memcpyDeviceToDevice
        with stream:
            for _ in range(3):
                cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, kind, stream.ptr)
            times = []
            for _ in range(iters):
                start = stream.record()
                cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, kind, stream.ptr)
                end = stream.record()
                end.synchronize()
                times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
        del src, dst
        t = float(np.median(times))
        return 2 * nbytes / t / 1e9
