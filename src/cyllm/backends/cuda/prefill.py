"""The batched prefill ops of the CUDA backend (a mixin of CudaBackend).

Row t of every (T, n) array is prompt position pos0 + t. The GEMMs go
through cuBLAS (FP16 inputs, FP32 accumulation and output, tensor cores);
the rest are one launch each over all rows.
"""

from __future__ import annotations

import math

import numpy as np

from ...errors import InvalidArgumentError
from ..base import check_token
from . import quant as cuda_quant
from .checks import check_act as _check_act, check_softcap as _check_softcap, check_window as _check_window
from .cublas import gemm_ex
from .graphs import READ_STEP
from .kernel_names import ATTN_BATCH_KERNELS, GLU_KERNELS
from .quant import CudaQuantMatrix
from .shapes import blocks as _blocks

try:  # CuPy is optional: this module imports without it
    import cupy as cp
except Exception:  # noqa: BLE001 - reported by CudaBackend when it is constructed
    cp = None


class PrefillOps:
    """Needs from the backend: ``_k``, ``_flush``, ``device``, ``_scratch`` (name -> buffer),
    ``attention`` (the decode kernel, for heads too wide for the batched one), ``_step``, and
    ``_prefill_rec`` (None, or the record of a chunk run for capture: prefill_graph.py)."""

    def _pos0(self, pos0: int, t: int, limit: int):
        """Kernel argument for a chunk's first position (checked on the host: pos0 + t <= limit):
        the value itself, or -1 (read from the step buffer) while a chunk is recorded for
        capture, which notes the limit for the chunk's replays."""
        if pos0 < 0 or pos0 + t > limit:
            raise InvalidArgumentError(f"positions {pos0}..{pos0 + t - 1} are out of range [0, {limit})")
        rec = self._prefill_rec
        if rec is None:
            return np.int32(pos0)
        rec.limit = min(rec.limit, limit)
        return READ_STEP

    def _buf(self, name: str, n: int, dtype):
        """A device scratch buffer of at least n elements, kept and grown (prefill, and eager
        decode before a capture). A captured prefill chunk keeps the buffers it was recorded
        with (PrefillRecord.scratch), so growing one here leaves the prefill graphs valid (decode's
        only buffer, qmv_up, has one size a model: allocated before its first capture)."""
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
        rec = self._prefill_rec
        if rec is not None:
            # a recorded chunk: its ids are copied before each replay (prefill_graph.py)
            rec.vocab = min(rec.vocab, vocab)
            dev = rec.tokens[:t]
        else:
            dev = self._buf("tokens", max(t, self.prefill_chunk), cp.int32)[:t]     # one size: never grown
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
        """cublasGemmEx: f16 inputs (or f32: a router's), f32 output, f32 compute. False if
        unavailable here."""
        if getattr(self, "_gemm_broken", False):
            return False
        if x16.dtype != w.dtype or w.dtype not in (np.float16, np.float32):
            # a caller's mistake, not a binding that fails here: never mark cuBLAS broken for it
            self._flush()
            raise InvalidArgumentError(f"GEMM: w {w.dtype} and x {x16.dtype} (float16 or float32, alike)")
        stream = cp.cuda.get_current_stream().ptr
        rec = self._prefill_rec
        if rec is not None and rec.capturable:
            try:
                gemm_ex(self.device, stream, out, w, x16, t, d, n, ldc, beta, direct=True)
                return True
            except Exception:  # noqa: BLE001 - the library not callable here: the chunk runs uncaptured
                rec.capturable = False
                if cp.cuda.get_current_stream().is_capturing():
                    raise           # CuPy's binding refuses a capturing stream: the capture fails
        try:
            gemm_ex(self.device, stream, out, w, x16, t, d, n, ldc, beta)
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
        p0 = self._pos0(pos0, t, n_pos)
        nq, nk = q.shape[1] // hd, k.shape[1] // hd
        total = t * (nq + nk) * half
        self._k("rope_batch_f32")((_blocks(total, 256),), (256,),
                                  (q, k, cos, sin, p0, np.int32(n_pos), np.int32(t),
                                   np.int32(nq), np.int32(nk), np.int32(half),
                                   np.int32(self._rows(q, "rope_batch")), np.int32(self._rows(k, "rope_batch")),
                                   np.int32(hd), self._step))

    def cache_store_batch(self, k_cache, v_cache, k, v, pos0) -> None:
        self._flush()
        n_kv, max_ctx, hd = k_cache.shape
        t = k.shape[0]
        pos0 = int(pos0)
        if v.shape != k.shape or k.shape[1] != n_kv * hd or v_cache.shape != k_cache.shape:
            raise InvalidArgumentError(f"cache_store_batch: k {tuple(k.shape)} does not fit a cache of {n_kv} heads x {hd}")
        if t == 0:
            return
        p0 = self._pos0(pos0, t, max_ctx)
        total = t * n_kv * hd
        self._k("cache_store_batch_f16")((_blocks(total, 256),), (256,),
                                         (k_cache, v_cache, k, v, p0, np.int32(t), np.int32(max_ctx),
                                          np.int32(n_kv), np.int32(hd), np.int32(self._rows(k, "cache_store_batch")),
                                          np.int32(self._rows(v, "cache_store_batch")), self._step))

    def attention_batch(self, out, q, k_cache, v_cache, pos0, window=0, scale=None, softcap=0.0) -> None:
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
        p0 = self._pos0(pos0, t, max_ctx)
        nc = 1 if hd <= 32 else 2 if hd <= 64 else 4 if hd <= 128 else 8 if hd <= 256 else 0
        if nc == 0:     # very wide heads: the decode kernel, one query at a time
            if self._prefill_rec is not None:
                self._prefill_rec.capturable = False    # host positions: a graph would keep them
            for r in range(t):
                self.attention(out[r], q[r], k_cache, v_cache, pos0 + r, window, scale, softcap)
            return
        bq = bk = 16 if nc == 8 else 32
        vec = self.attn_batch_vec and hd % 4 == 0
        pad = 4 if vec else 1
        smem = 4 * ((bq + bk) * (hd + pad) + bq * (bk + pad))
        self._k(ATTN_BATCH_KERNELS[(nc, vec)])((n_heads, _blocks(t, bq)), (128,),
                                     (out, q, k_cache, v_cache, np.int32(t), p0, np.int32(max_ctx),
                                      np.int32(n_heads // n_kv), np.int32(hd),
                                      np.int32(self._rows(q, "attention_batch")),
                                      np.int32(self._rows(out, "attention_batch")),
                                      np.float32(1.0 / math.sqrt(hd) if scale is None else scale),
                                      np.int32(_check_window(window)), _check_softcap(softcap), self._step),
                                     shared_mem=smem)
