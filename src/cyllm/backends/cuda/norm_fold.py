"""rmsnorm folded into the matvec that consumes it (a mixin of CudaBackend).

rmsnorm(xb, x, w) followed by matvec(out, W, xb) is the pattern of every sub-block.
Instead of a one-block kernel (a few microseconds of latency and a launch) the norm is
held back and the matvec computes it on the fly: each warp already walks all of x, so
it also sums x^2 and scales by w; block 0 writes xb too, so the op's output still
exists. Any other op, and to_host/synchronize, launches a held-back norm first
(``_flush``), so the order of effects is the one the caller wrote.
"""

from __future__ import annotations

import numpy as np

from ...errors import InvalidArgumentError


class NormFolding:
    """Needs from the backend: ``_k(name)`` (a compiled kernel), ``fuse_norm`` (bool) and
    ``_pending_norm`` (None, or the (out, x, w, eps) of the norm held back)."""

    def _flush(self) -> None:
        p = self._pending_norm
        if p is not None:
            self._pending_norm = None
            self._rmsnorm_now(*p)

    def _drop_held(self) -> None:
        """Forget a held-back norm without launching it (its pass was abandoned)."""
        self._pending_norm = None

    def _rmsnorm_now(self, out, x, w, eps):
        n = x.shape[0]
        self._k("rmsnorm_f32")((1,), (512,), (out, x, w, np.int32(n), np.float32(eps)))

    @staticmethod
    def _overlap(a, b) -> bool:
        a0, b0 = a.data.ptr, b.data.ptr
        return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes

    def rmsnorm(self, out, x, w, eps):
        self._flush()
        n = x.shape[0]
        if out.shape != x.shape or w.shape[0] != n:
            raise InvalidArgumentError(f"rmsnorm: x {tuple(x.shape)}, w {tuple(w.shape)} -> out {tuple(out.shape)}")
        if self._norm_foldable(out, x, w):
            self._pending_norm = (out, x, w, float(eps))
            return
        self._rmsnorm_now(out, x, w, eps)

    def _norm_foldable(self, out, x, w) -> bool:
        """Whether rmsnorm(out, x, w) (shapes checked) is held back for the next matvec."""
        n = x.shape[0]
        return bool(self.fuse_norm and n % 8 == 0 and x.data.ptr % 16 == 0 and w.data.ptr % 16 == 0
                    and x.flags.c_contiguous and out.flags.c_contiguous and w.flags.c_contiguous
                    and not self._overlap(out, x))

    def _take_norm(self, out, x):
        """The held-back rmsnorm whose output is ``x``, if the matvec into ``out`` can fold it in."""
        p = self._pending_norm
        if p is None:
            return None
        if (p[0].data.ptr == x.data.ptr and p[0].shape == x.shape
                and not self._overlap(out, p[1]) and not self._overlap(out, p[0])):
            self._pending_norm = None
            return p
        self._flush()
        return None
