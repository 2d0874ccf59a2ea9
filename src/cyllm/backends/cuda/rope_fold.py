"""rope and the KV-cache store folded into the q/k/v matvec (a mixin of CudaBackend).

A decode layer runs matvec(qkv, Wqkv, xb) then rope_store(q, k, v, ...) on the views of
qkv. rope_store reads a few KB and writes one cache row, yet as a kernel of its own it
costs a launch boundary and a chain of dependent memory round trips after its wait (1.8
us per layer of a Llama-2-7B Q4_0 token on an H100, bench/trace_cuda_decode.py). So the
matvec of a stacked quantized q/k/v is held back, and when the next op is the rope_store
of its own output, one kernel (``qmv_qkv_rope_<fmt>``, or ``qmv_qkv_rope_pair`` where v has
its own format) does both: each block computes the
two row tiles holding the halves of 32 rope pairs, rotates them in its tail and writes the
cache row. Where that does not pay (quant.rope_fold_pays has the measured rule), shapes
the fused kernel does not cover (partial rotary, head_dim not a multiple of 64), and when
any other op comes next (or to_host/synchronize), the held-back matvec goes out first as
it was, so the order of effects is the one the caller wrote.
"""

from __future__ import annotations

import numpy as np

from . import quant as cuda_quant
from .quant import TILE, CudaQuantStack


class RopeFolding:
    """Needs from the backend: ``fold_rope`` (bool), ``_pending_qkv`` (None, or the
    (out, w, x, norm, qx) of a q/k/v matvec held back), ``_take_norm``/``_flush`` of
    NormFolding (next in the MRO), ``_device_mode``, ``_pos``, ``_step``, ``sm_count`` and
    ``_launch``; ``_take_input`` of PrequantFolding (before it in the MRO)."""

    def _flush(self) -> None:
        self._launch_held_qkv()
        super()._flush()

    def _drop_held(self) -> None:
        self._pending_qkv = None
        super()._drop_held()

    def _take_norm(self, out, x):
        self._launch_held_qkv()         # the held matvec comes before whatever asks
        return super()._take_norm(out, x)

    def _launch_held_qkv(self) -> None:
        p = self._pending_qkv
        if p is not None:
            self._pending_qkv = None
            out, w, x, norm, qx = p
            cuda_quant.qmatvec_qkv(self, out, w, x, norm=norm, qx=qx)

    def _hold_qkv(self, out, w: CudaQuantStack, x) -> bool:
        """Hold back out = [Wq | Wk | Wv] x for a rope_store that may follow (True), or not."""
        if not (self.fold_rope and all(p.rows % (2 * TILE) == 0 for p in w.parts)
                and cuda_quant.qkv_args_ok(out, w, x) and cuda_quant.rope_fold_pays(self, w)):
            return False
        norm, qx = self._take_input(out, x)
        self._pending_qkv = (out, w, x, norm, qx)
        return True

    def _fold_rope_store(self, q, k, v, cos, sin, k_cache, v_cache, pos) -> bool:
        """rope_store on the held-back matvec's output as one fused launch (True), or not."""
        p = self._pending_qkv
        if p is None:
            return False
        out, w, x, norm, qx = p
        wq, wk, wv = w.parts
        n_pos, half = cos.shape
        n_kv, max_ctx, hd = k_cache.shape
        base, f32 = out.data.ptr, 4
        limit = min(n_pos, max_ctx)
        if not self._device_mode and not 0 <= int(pos) < limit:
            return False        # rope_store's own path launches the matvec, then reports the position
        if not (hd == 2 * half and hd % (2 * TILE) == 0 and wq.rows % hd == 0 and wk.rows == n_kv * hd
                and v_cache.shape == k_cache.shape and k_cache.dtype == v_cache.dtype == np.float16
                and cos.dtype == sin.dtype == np.float32 and sin.shape == cos.shape
                and cos.flags.c_contiguous and sin.flags.c_contiguous
                and k_cache.flags.c_contiguous and v_cache.flags.c_contiguous
                and q.data.ptr == base and q.size == wq.rows
                and k.data.ptr == base + f32 * wq.rows and k.size == wk.rows
                and v.data.ptr == base + f32 * (wq.rows + wk.rows) and v.size == wv.rows):
            return False
        self._pending_qkv = None
        try:
            cuda_quant.qmatvec_qkv_rope(self, out, w, x, norm, cos, sin, k_cache, v_cache,
                                        self._pos(pos, limit), qx)
        except Exception:  # noqa: BLE001 - e.g. the two tiles' shared memory refused: not launched
            self._pending_qkv = p           # the two ops as they were (rope_store's path)
            return False
        return True
