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
the next matvec), rope_fold.py (rope and the cache store folded into the q/k/v matvec),
qk_norm_fold.py (per-head q/k norms folded into rope_store),
pdl.py (programmatic dependent launch through ctypes), cublas.py (the prefill GEMM),
prefill.py (the batched ops of prompt processing), checks.py.

Importing this module never fails for want of CuPy or a GPU; constructing
``CudaBackend`` raises ``BackendUnavailableError`` with one clear line.
"""

from __future__ import annotations

import math
import os

import numpy as np

from ...errors import CUDA_INSTALL_HINT, BackendUnavailableError, InvalidArgumentError, ModelLoadError
from ...quant.matrix import QuantMatrix
from ..base import Backend, check_token
from . import quant as cuda_quant
from .checks import check_act as _check_act, check_softcap as _check_softcap, check_window as _check_window
from .experts import ExpertOps
from .graphs import READ_STEP, GraphDecode
from .kernel_names import GATE_UP_OPS, MATVEC_KERNELS, MATVEC_SCALAR_KERNELS
from .norm_fold import NormFolding
from .nvrtc import module_for
from .pdl import PdlLauncher
from .prefill import PrefillOps
from .prefill_graph import GraphPrefill
from .prequant import PrequantFolding
from .qk_norm_fold import QkNormFolding
from .rope_fold import RopeFolding
from .quant import NULL_ARG as _NULL, CudaQuantMatrix, CudaQuantStack
from .shapes import (ATT_THREADS, ATT_WARPS, MV_LARGE, SMEM_LIMIT, attn_bounds, attn_chunk, attn_heads_per_block,
                     attn_kernel, attn_smem, matvec_shape)
from .shapes import blocks as _blocks

try:  # CuPy is an optional extra; a broken CUDA install can raise more than ImportError
    import cupy as cp
    _CUPY_ERROR: Exception | None = None
except Exception as e:  # noqa: BLE001 - reported when the backend is constructed
    cp = None
    _CUPY_ERROR = e

_FIT_MARGIN = 512 << 20       # room left for scratch, cuBLAS workspace, the CUDA context
WIDEN_KIB_PER_SM = 24         # widen.py: measured in bench/results/cuda_quant_model_h100.md


class CudaBackend(QkNormFolding, PrequantFolding, RopeFolding, NormFolding, GraphPrefill, GraphDecode, PrefillOps, ExpertOps,
                  Backend):
    name = "cuda"
    fuse_qkv = True       # upload copies anyway: one (q+2kv, dim) matrix, one matvec
    quant_row_views = False   # CudaQuantMatrix (tiled planes) has no row views: fused tensors are cut on the host
    kernel_variant = "cuda"
    prefill_chunk = 512   # measured: bench/profile_cuda_prefill.py

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
        self.compute_capability = (int(props.get("major", 0)), int(props.get("minor", 0)))
        # the unified L1/shared array's shared part at most, and what the driver keeps of it per
        # block (cuda_quant sizes some launches' carveouts from these)
        self.smem_per_sm = int(props.get("sharedMemPerMultiprocessor", 0) or 0)
        self.smem_reserved_per_block = int(props.get("reservedSharedMemPerBlock", 1024) or 0)
        # shared memory one block may opt in to (99 KiB on consumer Ampere and Ada GPUs)
        self.smem_per_block = int(props.get("sharedMemPerBlockOptin", 0) or 0) or 48 * 1024

        self._module = None
        self._kernels: dict = {}
        self._matvec_carveout = None    # the K-quant matvec's carveout for attention (_same_carveout)
        self.match_carveout = True      # False: the driver's for them, as before (measurements)
        self.plain_loads = False        # True when the module was built without the PTX load hints
        # decode_step state: step = {token, pos} on the device, read by the graph's kernels
        self._step = cp.zeros(2, dtype=cp.int32)
        self._step_host = np.zeros(2, dtype=np.int32)
        self._stream = cp.cuda.Stream(non_blocking=False)   # blocking: ordered with the null stream
        self.use_graphs = os.environ.get("CYLLM_CUDA_GRAPHS", "1") != "0"
        self.prefill_graphs = os.environ.get("CYLLM_CUDA_PREFILL_GRAPHS", "1") != "0"   # prefill_graph.py
        self._prefill_rec = None        # the record of a prefill chunk being captured
        self.reset_graph()
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
        # warps a block of the quantized matvecs and short-prefill products (None: quant.py's
        # rule by rows, format and in-flight bytes); bench/bench_cuda_quant.py sweeps it
        self.qmv_warps: int | None = None
        # rmsnorm folded into the next matvec that reads its output (see rmsnorm); CYLLM_CUDA_FUSE_NORM=0 turns it off
        self.fuse_norm = os.environ.get("CYLLM_CUDA_FUSE_NORM", "1") != "0"
        self._pending_norm = None       # (out, x, w, eps) of an rmsnorm not launched yet
        # rope_store folded into the stacked quantized q/k/v matvec (rope_fold.py);
        # CYLLM_CUDA_FOLD_ROPE=0 keeps two launches
        self.fold_rope = os.environ.get("CYLLM_CUDA_FOLD_ROPE", "1") != "0"
        self._pending_qkv = None        # (out, w, x, norm, qx) of a q/k/v matvec not launched yet
        # per-head q/k norms folded into rope_store (qk_norm_fold.py); CYLLM_CUDA_FOLD_QK_NORM=0
        # keeps three launches
        self.fold_qk_norm = os.environ.get("CYLLM_CUDA_FOLD_QK_NORM", "1") != "0"
        self._held_heads: list = []     # (x, w, eps) of the head norms not launched yet
        # a quantized matvec's output handed to the next one quantized (prequant.py);
        # CYLLM_CUDA_PREQUANT=0 has every matvec quantize its input itself
        self.prequant = os.environ.get("CYLLM_CUDA_PREQUANT", "1") != "0"
        self._held_mv = None            # a quantized decode matvec not launched yet (prequant._Held)
        # small q5_0 matrices uploaded as q8_0 of the same values (widen.py); the cap is
        # KiB of a matrix's widened bytes a multiprocessor; CYLLM_CUDA_WIDEN=0 keeps every format
        self.widen_kib_per_sm = WIDEN_KIB_PER_SM if os.environ.get("CYLLM_CUDA_WIDEN", "1") != "0" else 0
        self._qx_bufs = None            # the two buffers prequantized vectors go through
        self._qx_flip = 0
        self._qx_norm = None            # (normed vector, its codes' buffer, norm weight, eps), prequant.py
        self._scratch: dict = {}        # name -> device buffer reused by the batched ops
        # prefill chunks of at most this many rows multiply quantized weights a few columns at
        # a time (quant.qmatmul_few), longer ones on dequantized FP16 tiles through cuBLAS, whose
        # dequantizing costs a 7B ~14 ms whatever the rows. A chat's turns on an H200, Llama-2-7B
        # shape, graphs, median ms by padded rows, tiles -> few columns: Q4_0 16 rows 22.5 ->
        # 10.8, 32 23.7 -> 14.1, 64 20.2 -> 19.2, 128 22.2 -> 34.7; Q4_K_M 16 23.1 -> 10.0, 32
        # 24.0 -> 14.7, 64 20.7 -> 19.9, 128 23.0 -> 36.7 (bench/results/cuda_quant_model_h100.md,
        # thirty-second session). 0: always the tiles (measurements). Keep it a length that
        # prefill_rows pads to (16, 32, 64, a multiple of 64), or a chunk could take one path
        # eagerly and the other padded for its graph
        self.qmm_few_max = 64
        # those chunks on int8 tensor cores (qmma, sm_80+) rather than dp4a dots (qmm). H100, the
        # same turns, median ms, qmm -> qmma: Q4_0 16 rows 10.37 -> 9.52, 32 13.86 -> 12.72, 64
        # 19.19 -> 16.10; Q4_K_M 10.53 -> 9.29, 14.78 -> 12.64, 20.30 -> 16.05; at 128 rows qmma
        # 26.4-26.9 against the tiles' 23.9-24.8, so the bound stays 64 (thirty-third session).
        # False: qmm (measurements)
        self.qmm_mma = True
        self.qmma_warps: int | None = None      # their warps a block (None: quant.QMMA_WARPS)
        # decode attention: the first K/V rows loaded before pdl_wait, and query heads a
        # block (None = by position, see _attn_plan; a value forces it; captured graphs keep
        # their choice until reset_graph)
        self.attn_v_early: bool | None = None
        self.attn_heads_per_block: int | None = None
        # the staged (long-cache) attention sums a batch's scores across a row's lanes by one
        # butterfly; False: a fold a score, as before (measurements; captured graphs keep the
        # choice until reset_graph)
        self.attn_butterfly = True
        # the staged (long-cache) attention loads its first K rows before pdl_wait and its first
        # V rows before the softmax, so neither phase of a block opens with a round trip (the
        # _ek kernels, 4 rows in flight a lane where the staged kernels of one and two heads
        # have 8). H100, `-n 64`, off -> on:
        # Llama-2-7B Q4_0 depth 2048 444.3 -> 464.7 tok/s, 4096 398.8 -> 411.3, Q4_K_M 4096
        # 383.1 -> 393.8; Mistral-7B Q4_0 4096 457.9 -> 454.9, 8192 408.5 -> 413.3; Llama-3.2-1B
        # Q4_0 2048 1600.1 -> 1590.9, 8192 1364.1 -> 1408.2 (bench/results/cuda_quant_model_h100.md,
        # thirty-first session). False: the staged kernels as before (captured graphs keep the
        # choice until reset_graph)
        self.attn_staged_early = True
        self.attn_batch_vec = True      # float4 variant of attention_batch where head_dim % 4 == 0
        # a mixture of experts' decode routed on the device where its experts are stacked
        # (experts.py); False: the host routing, as before (measurements; read at each step)
        self.moe_on_device = True
        self._step_read_back = False    # set by an op of the step being recorded that synchronised
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

    def _same_carveout(self, name: str):
        """The kernel ``name`` with the shared-memory carveout of the quantized matvec launched
        last where cuda_quant asks for that (``_matvec_carveout``: the K-quants' largest), else
        the driver's. In decode that matvec is the layer's q/k/v, so a model of one q/k/v
        format keeps one value through a captured step. Llama-2-7B Q4_K_M decode on an H100,
        attention and rope_store at the driver's choice against the q4_k/q6_k matvecs' largest
        carveout: 340.2 and 341.5 tok/s at depth 4096 in two runs, 508.1 at depth 0; matched,
        353.9, 353.2 and 514.9 (bench/results/cuda_quant_model_h100.md, eighteenth session).
        Why is not known: kernels of one carveout overlapping better under PDL is a guess. q8_0
        first seemed to contradict it (its decode at depth lost as much with attention at its
        matvecs' then largest carveout); since every q8_0 kernel takes the driver's choice, its
        decode is 5-6% faster on an H200 (quant._CARVEOUT_MAX), which fits the guess."""
        k = self._k(name)
        want = self._matvec_carveout if self.match_carveout else None
        cuda_quant.set_carveout(k, -1 if want is None else want)
        return k

    def _launch(self, name, grid, block, args, shared_mem: int = 0) -> None:
        """Launch a decode kernel (``name``: its name, or the kernel) whose dependent accesses
        follow pdl_wait.

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
            return READ_STEP
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
            tok = READ_STEP
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
        self._matvec_carveout = None    # FP16 weights: attention keeps the driver's carveout
        d, n = w0.shape
        if x.shape[0] != n or out.shape[0] != d:
            self._flush()
            raise InvalidArgumentError(f"{base}: shapes {tuple(w0.shape)} @ {tuple(x.shape)} -> {tuple(out.shape)}")
        norm, _ = self._take_input(out, x, quantized=False)
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

    def stack_rows(self, mats):
        """Quantized q, k, v as one decode launch (see Backend.stack_rows and quant.stack_rows)."""
        return cuda_quant.stack_rows(mats, self.sm_count)

    def matvec(self, out, w, x):
        if isinstance(w, CudaQuantMatrix):
            cuda_quant.qmatvec(self, out, w, x, "matvec", hold=True)
            return
        if isinstance(w, CudaQuantStack):
            if not self._hold_qkv(out, w, x):
                cuda_quant.qmatvec_qkv(self, out, w, x)
            return
        self._mv("matvec", out, w, w, x, 4)

    def matvec_add(self, out, w, x):
        if isinstance(w, CudaQuantMatrix):
            cuda_quant.qmatvec(self, out, w, x, "add", hold=True)
            return
        self._mv("matvec_add", out, w, w, x, 4)

    def gate_up(self, out, w_gate, w_up, x, act="silu"):
        if isinstance(w_gate, CudaQuantMatrix) or isinstance(w_up, CudaQuantMatrix):
            cuda_quant.qmatvec(self, out, (w_gate, w_up), x, "gate_up", _check_act(act), hold=True)
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

        An op of the registry (base.OPS) every backend has; here one launch instead of two,
        or none when it folds into the q/k/v matvec held back just before (rope_fold.py).
        """
        if self._fold_qk_rope_store(q, k, v, cos, sin, k_cache, v_cache, pos):
            return
        if self._fold_rope_store(q, k, v, cos, sin, k_cache, v_cache, pos):
            return
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
        self._launch(self._same_carveout("rope_store_f32"), (_blocks((nq + n_kv) * half, 256),), (256,),
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

    def _attn_plan(self, pos: int, n_kv: int, group: int, chunk: int) -> tuple[bool, int]:
        """(early, hpb) of decode attention at pos: whether it runs the variant that loads its
        first K/V rows before pdl_wait, and how many query heads of a group a block takes.

        Early rows while the blocks holding positions 0..pos fit in one wave of the SMs
        (pos < short; with two heads a block up to ceil(group / 2) times as many blocks, which
        the timings below cover). Past that their registers (124 against 64 for tiles of one
        head, 123 against 80 for two and four; 128 against 64 when this was measured) halve
        the resident blocks of a long cache. Llama-2-7B on an H100 (32 KV heads, chunks of
        256): up to position 1023; tg128 Q4_K_M +3.8%, Q8_0 +2.0%; at depth 4096 Q8_0 -1.2% had
        it stayed on, Q4_0 level with 122 registers.

        Heads a block (shapes.attn_bounds): a GQA group's whole tile would leave a short
        cache's few rows on n_kv blocks (Mistral-7B at depth 64: 8 blocks, 9.9 us a layer
        against Llama-2-7B's 5.8). Below one chunk each query head gets a block of its own (the
        sibling blocks read the same rows, from L2); up to 1.5 x ``short`` two heads a block,
        which halves those reads where the cache has grown; past it the whole group, the rows
        read once. Against whole groups (H100 and H200, Q4_0 unless said;
        bench/results/cuda_quant_model_h100.md): Mistral-7B H100 depth 0 532.8 -> 581.0 (one a
        block), H200 depth 3000 427.4 -> 528.5 (two; one 508.9); TinyLlama-1.1B (groups of 8)
        H200 depth 1800 1210.9 -> 1398.2 (two; one 1104.3); SmolLM2-135M Q4_K_M H200 depth 2048
        1343.0 -> 1582.7 (two). Past ``short`` (4096 for both below), H200, twenty-sixth
        session: Mistral-7B depth 4096 510.3 -> 536.3, 5120 491.0 -> 528.7; Llama-3.2-1B 4096
        1620.7 -> 1779.3, 5120 1583.8 -> 1729.4; at 6144 (1.5 x) +7% and +2%, at 7168 (1.75 x)
        -3% and -8%, so the bound is the last depth where both shapes won clearly.
        The bound between one and two is not tuned per shape: Mistral-7B at depth 1024 (H200)
        ran 609.5 with one a block and 545.4 with two (whole groups, H100: 397.5 against 510.0).

        In a captured step (``_device_mode``) the bounds go to _attn_bounds, which picks the
        step's graph (graphs._regime), so a graph's launches hold for its positions."""
        near, short, far = attn_bounds(n_kv, group, chunk, self.sm_count)
        if self._device_mode:
            self._note_attn_bounds(near, short, far)
        early = pos < short if self.attn_v_early is None else bool(self.attn_v_early)
        if self.attn_heads_per_block is not None:
            return early, max(1, min(int(self.attn_heads_per_block), group))
        return early, attn_heads_per_block(pos, near, short, far, group)

    @staticmethod
    def _attn_smem(gt: int, hd: int, chunk: int, n_split: int) -> int:
        return attn_smem(gt, hd, chunk, n_split)

    def attention(self, out, q, k_cache, v_cache, pos, window=0, scale=None, softcap=0.0):
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
        head = (q, k_cache, v_cache, self._step, p, np.int32(max_ctx), np.int32(n_kv), np.int32(group))
        tail = (np.int32(hd), np.int32(chunk), np.int32(n_split), sc, np.int32(_check_window(window)),
                _check_softcap(softcap))
        hd8 = hd // 8
        gt = 0
        if (hd % 8 == 0 and 0 < hd8 <= 32 and hd8 & (hd8 - 1) == 0
                and k_cache.data.ptr % 16 == 0 and v_cache.data.ptr % 16 == 0
                and self._attn_smem(1, hd, chunk, n_split) <= SMEM_LIMIT):
            ve, hpb = self._attn_plan(int(pos), n_kv, group, chunk)
            gt = 1 if hpb == 1 else 2 if hpb == 2 else 4 if hpb <= 4 else 8
            while gt and self._attn_smem(gt, hd, chunk, n_split) > SMEM_LIMIT:
                gt //= 2
        if gt:
            name = attn_kernel(gt, ve, self.attn_butterfly, self.attn_staged_early, hd,
                               k_cache.data.ptr, v_cache.data.ptr)
            k = self._same_carveout(name)
            args = (out, counters, o_part, m_part, l_part) + head + (np.int32(hpb),) + tail
            grid, smem = (n_kv * -(-group // hpb), n_split), self._attn_smem(gt, hd, chunk, n_split)
            # a quantized wo may take the output prequantized (prequant.py): whole 32-blocks a head
            if hd % 32 == 0 and self._hold_producer(k, grid, (ATT_THREADS,), args, smem, out, scales=False):
                return
            self._launch(k, grid, (ATT_THREADS,), args + (_NULL,), shared_mem=smem)
        else:
            smem = 4 * (hd + chunk + ATT_WARPS + ATT_WARPS * n_split)
            if smem > SMEM_LIMIT:
                raise InvalidArgumentError(f"attention: head_dim {hd} is too large for the cuda backend")
            self._same_carveout("attn_split_generic")((n_heads, n_split), (ATT_THREADS,),
                                          (out, counters, o_part, m_part, l_part) + head + tail, shared_mem=smem)

    def swiglu(self, out, gate, up):
        self._flush()
        n = out.shape[0]
        self._k("swiglu_f32")((_blocks(n, 256),), (256,), (out, gate, up, np.int32(n)))

    def add(self, out, x, y):
        self._flush()
        n = out.shape[0]
        self._k("add_f32")((_blocks(n, 256),), (256,), (out, x, y, np.int32(n)))

    # -- measurement ------------------------------------------------------------------
    @property
    def captures_decode(self) -> bool:
        return self.use_graphs and not self.data_dependent_steps

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
        # back to the driver, not kept in CuPy's pool: 2 GiB held for the rest of a bench run
        # showed up as the engine's GPU memory (bench/results/cuda_quant_model_h100.md)
        cp.get_default_memory_pool().free_all_blocks()
        t = float(np.median(times))
        return 2 * nbytes / t / 1e9
