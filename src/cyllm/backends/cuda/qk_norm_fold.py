"""Per-head q/k norms folded into rope_store (a mixin of CudaBackend).

A decode layer of Qwen3, Gemma 3 or EXAONE 4 runs rmsnorm_batch(q_heads), rmsnorm_batch
(k_heads), then rope_store(q, k, v, ...). As kernels of their own the two norms are plain
launches of a few hundred nanoseconds of work each, and the boundaries around them cost
most: on a Qwen3-8B-shape Q4_0 token on an H200 the three took ~7.4 us a layer, 11% of the
token (bench/trace_cuda_decode.py, bench/results/cuda_quant_model_h100.md). So an in-place
norm of whole heads is held back, and when the next op is the rope_store of those same q
and k, one kernel (``qknorm_rope_store_<head_dim>``, cuda/elementwise.cu) does all three,
to the bit as the three would (at every position the host lets through: an out-of-range one
is refused before any launch). Any other op, a matvec taking its input (_take_norm), and
to_host/synchronize launch the held norms first as they were, so the order of effects is
the one the caller wrote.
"""

from __future__ import annotations

import numpy as np

from .kernel_names import QKNORM_ROPE_STORE_KERNELS
from .shapes import blocks as _blocks

QKN_WARPS = 2                   # QKN_WARPS of cuda/elementwise.cu: heads a block


class QkNormFolding:
    """Needs from the backend: ``fold_qk_norm`` (bool), ``_held_heads`` (the (x, w, eps) of
    the norms held back, at most two), ``rmsnorm_batch`` of PrefillOps (later in the MRO),
    ``_flush``/``_drop_held`` of the other folds, ``_pos``, ``_step``, ``_launch``,
    ``_same_carveout``."""

    def _flush(self) -> None:
        self._launch_held_heads()
        super()._flush()

    def _drop_held(self) -> None:
        self._held_heads = []
        super()._drop_held()

    def _take_norm(self, out, x):
        # a matvec asking for its input's norm (none held: it launches nothing else first)
        # comes after the held head norms, which may have written its input
        self._launch_held_heads()
        return super()._take_norm(out, x)

    def _launch_held_heads(self) -> None:
        held, self._held_heads = self._held_heads, []
        for x, w, eps in held:
            super().rmsnorm_batch(x, x, w, eps)

    def rmsnorm_batch(self, out, x, w, eps):
        if self._hold_heads(out, x, w, eps):
            return
        self._flush()
        super().rmsnorm_batch(out, x, w, eps)

    def _hold_heads(self, out, x, w, eps) -> bool:
        """Hold back an in-place norm of whole heads (q's, then k's) for a rope_store (True)."""
        if not (self.fold_qk_norm and len(self._held_heads) < 2 and x.ndim == 2 and x.shape[1] in QKNORM_ROPE_STORE_KERNELS
                and out.data.ptr == x.data.ptr and out.shape == x.shape and x.dtype == np.float32
                and x.flags.c_contiguous and w.dtype == np.float32 and w.shape == (x.shape[1],)
                and w.flags.c_contiguous):
            return False
        if not self._held_heads:
            super()._flush()            # what was held before goes first (the q/k/v matvec)
        self._held_heads.append((x, w, float(eps)))
        return True

    def _fold_qk_rope_store(self, q, k, v, cos, sin, k_cache, v_cache, pos) -> bool:
        """rope_store after the held norms of exactly q's and k's heads as one launch (True)."""
        held = self._held_heads
        if len(held) != 2:
            return False
        (qh, qw, eps), (kh, kw, keps) = held
        n_pos, half = cos.shape
        n_kv, max_ctx, hd = k_cache.shape
        if not (eps == keps and hd == 2 * half == qh.shape[1] == kh.shape[1]
                and qh.data.ptr == q.data.ptr and qh.size == q.size
                and kh.data.ptr == k.data.ptr and kh.size == k.size == n_kv * hd and v.size == k.size
                and q.flags.c_contiguous and k.flags.c_contiguous and v.flags.c_contiguous
                and v_cache.shape == k_cache.shape and k_cache.dtype == v_cache.dtype == np.float16
                and k_cache.flags.c_contiguous and v_cache.flags.c_contiguous
                and cos.dtype == sin.dtype == np.float32 and sin.shape == cos.shape
                and cos.flags.c_contiguous and sin.flags.c_contiguous):
            return False
        limit = min(n_pos, max_ctx)
        p = self._pos(pos, limit)       # a bad position: one clear error, the norms still held
        self._held_heads = []
        nq = qh.shape[0]
        self._launch(self._same_carveout(QKNORM_ROPE_STORE_KERNELS[hd]), (_blocks(nq + n_kv, QKN_WARPS),),
                     (32 * QKN_WARPS,),
                     (q, k, v, qw, kw, np.float32(eps), cos, sin, k_cache, v_cache, self._step, p,
                      np.int32(n_pos), np.int32(max_ctx), np.int32(nq), np.int32(n_kv)))
        return True
