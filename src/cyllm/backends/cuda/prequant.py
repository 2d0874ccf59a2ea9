"""A quantized matvec's output handed to the next one already quantized (a mixin of CudaBackend).

A decode matvec on quantized weights stages its activation x as int8 codes with a scale per
32 elements before its dots (cuda/quant_matvec.cu, qstage): every block reads all of x (and
the folded norm's weight) from the L2 and quantizes it. On Llama-2-7B's decode that took
1.4-4.4 us after each kernel's wait (H100, bench/trace_cuda_decode.py stage marks), time in
which the DRAM streams nothing. So under decode_step a quantized matvec (the producer) is
held back until the next op shows what reads its output. Where that is a quantized matvec
reading it directly or through a held-back rmsnorm, the producer's blocks also write their
32-row tiles of the output as those codes (of output * the norm's weight), the 32-blocks'
scales and sums, and the sums of squares the folded norm needs (qx_produce); the consumer,
a ``..._qx`` kernel, copies its slice (qstage_qx). Any other op launches the producer as it
was, first, so the order of effects is the one the caller wrote. Decode attention (its fast
path, head_dim a multiple of 32) is a producer too, for wo; it has no norm weight to apply.

The codes are those a matvec staging x itself makes (int8 blocks of 32, one scale each, for
every format), so a step rounds alike whichever way each matvec got its x. Llama-2-7B decode
on an H100 (bench/sweep_cuda_decode.py --vary prequant=1,0, matvecs only): Q4_K_M 502 -> 568
tok/s (67.7% -> 76.6% of the roofline), Q4_0 540 -> 575, Q8_0 336 -> 372; at depth 4096
+5-7%. Attention's hand-over to wo and k/v reusing q's codes added Q4_K_M 545 -> 569, Q4_0
560 -> 570, SmolLM2-135M Q8_0 1702 -> 1832 (bench/results/cuda_quant_model_h100.md).
"""

from __future__ import annotations

from .quant import NULL_ARG as _NULL, TILE

try:  # CuPy is optional: this module imports without it, like the others of the backend
    import cupy as cp
except Exception:  # noqa: BLE001 - reported by CudaBackend when it is constructed
    cp = None


class _Held:
    """A launch not issued yet: kernel, launch shape, its arguments but the last (a quantized
    matvec's qxo and qnw; attention's qxo alone: ``scales`` False, it cannot apply a norm's
    weight), and the output vector it writes."""

    __slots__ = ("k", "grid", "block", "args", "smem", "out", "scales")

    def __init__(self, k, grid, block, args, smem, out, scales=True):
        self.k, self.grid, self.block, self.args, self.smem, self.out = k, grid, block, args, smem, out
        self.scales = scales


def _same(a, b) -> bool:
    return a.data.ptr == b.data.ptr and a.size == b.size


def _overlaps(a, b) -> bool:
    return a.data.ptr < b.data.ptr + b.nbytes and b.data.ptr < a.data.ptr + a.nbytes


def qx_bytes(n: int) -> int:
    """Bytes of a prequantized n-vector: n codes, n/32 entries of 16 bytes, n/32 sums of squares."""
    return n + n // 2 + n // 8


class PrequantFolding:
    """Needs from the backend: ``prequant`` (bool), ``_held_mv`` (None or a _Held),
    ``_qx_bufs`` (two device byte buffers or None) and ``_qx_flip``, ``_qx_norm`` (None or
    the codes a norm-folding matvec read, see _take_input), ``_device_mode``,
    ``_launch``, RopeFolding's ``_pending_qkv`` and NormFolding's ``_pending_norm``,
    ``_norm_foldable`` and ``rmsnorm`` (after it in the MRO)."""

    def _flush(self) -> None:
        self._launch_producer(None, None)
        self._qx_norm = None
        super()._flush()

    def _drop_held(self) -> None:
        self._held_mv = None
        self._qx_norm = None
        super()._drop_held()

    def _take_input(self, out, x, quantized: bool = True):
        """(norm, qx) for a matvec into ``out`` reading ``x``: the held-back rmsnorm whose
        output is x (NormFolding), or None; and, for a quantized matvec, x prequantized by the
        held-back producer (of the norm's input where a norm is folded), or None: staged from
        floats. The held-back producer, if any, goes out before the caller's launch.

        A matvec that folded a norm in and read the codes of its input (q after the down
        projection) leaves them for the matvecs that read the norm's output after it (k and
        v, where v's format keeps q, k and v apart): they fold the same norm from the same
        codes (its sums of squares included) instead of staging the normed vector, and do
        not write it again (xn None). Until any other op, a production into the buffers, or
        a matvec writing that output."""
        norm = self._take_norm(out, x)
        if self._qx_norm is not None and _overlaps(out, self._qx_norm[0]):
            self._qx_norm = None            # this matvec writes the vector those codes stand for
        if not quantized:
            self._launch_producer(None, None)
            return norm, None
        if norm is not None:
            qx = self._take_producer(norm[1], norm[2])
            if qx is not None:
                self._qx_norm = (norm[0], qx, norm[2], norm[3])
            return norm, qx
        qx = self._take_producer(x, None)
        r = self._qx_norm                   # None again if that producer wrote into the buffers
        if qx is None and r is not None and _same(r[0], x):
            # only with its codes: a kernel given them never reads x (the normed vector, here
            # its input slot) unless xn is set; one staging x would apply the norm twice
            return (None, x, r[2], r[3]), r[1]
        return None, qx

    def rmsnorm(self, out, x, w, eps):
        p = self._held_mv
        if (p is not None and self._pending_norm is None and self._pending_qkv is None
                and _same(p.out, x) and out.shape == x.shape and w.shape[0] == x.shape[0]
                and self._norm_foldable(out, x, w)):
            # the norm will be held too (nothing else is, so its own flush launches nothing
            # before the producer), and the matvec that folds it in may take the producer's
            # output quantized
            self._held_mv = None
            super().rmsnorm(out, x, w, eps)
            self._held_mv = p
            return
        super().rmsnorm(out, x, w, eps)

    def _hold_producer(self, k, grid, block, args, smem, out, scales=True) -> bool:
        """Hold back a launch (a quantized matvec, or attention with ``scales`` False) whose
        output the next op may take quantized (True), or not: outside decode_step, or an
        output that ends in a partial 32-block."""
        if not (self.prequant and self._device_mode and out.size % TILE == 0):
            return False
        self._held_mv = _Held(k, grid, block, args, smem, out, scales)
        return True

    def _take_producer(self, x, nw):
        """The held-back producer goes out now; the device buffer it writes x's codes to
        (x * nw where the consumer folds an rmsnorm of weight nw), or None when it does not
        write x or no buffer can be had (then it goes out as it was)."""
        p = self._held_mv
        if p is None:
            return None
        qx = self._qx_buffer(x.size) if _same(p.out, x) and (nw is None or p.scales) else None
        self._launch_producer(qx, nw)
        return qx

    def _launch_producer(self, qx, nw) -> None:
        p = self._held_mv
        if p is None:
            return
        self._held_mv = None
        if qx is not None:
            self._qx_norm = None        # the codes it leaves may be in the buffer written now
        extra = (qx if qx is not None else _NULL,)
        if p.scales:
            extra += (nw if qx is not None and nw is not None else _NULL,)
        self._launch(p.k, p.grid, p.block, p.args + extra, shared_mem=p.smem)

    def _qx_buffer(self, n: int):
        """One of two device buffers, in turn, of at least qx_bytes(n): a kernel that reads
        one while writing the next must never write the one it reads, and the kernel after
        it starts writing only once this one has finished (pdl_wait)."""
        need = qx_bytes(n)
        bufs = self._qx_bufs
        if bufs is None or bufs[0].size < need:
            stream = cp.cuda.get_current_stream()
            if getattr(stream, "is_capturing", lambda: False)():
                return None         # not inside a graph: the eager pass before it allocates
            bufs = self._qx_bufs = (cp.empty(need, dtype=cp.uint8), cp.empty(need, dtype=cp.uint8))
        self._qx_flip ^= 1
        return bufs[self._qx_flip]
