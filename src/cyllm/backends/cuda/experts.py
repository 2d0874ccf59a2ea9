"""A mixture of experts on the GPU (a mixin of CudaBackend).

Decode over quantized experts that upload_experts stacked (quant.CudaExperts) never leaves the
device: the router and the choice of experts (moe_route_f32, cuda/moe.cu), each role's chosen
experts in one launch that reads their ids on the device (qmv_experts_*, quant_matvec.cu),
and the weighted sum in rank order (moe_combine_f32). Such a step is captured in the decode
graph like any other.

Otherwise (float experts, experts of mixed formats, and prefill, whose rows are grouped by
expert on the host) the router's logits are computed on the device and read back, the host
picks the experts (backends/moe.py, as the host backends do), and each chosen expert runs
through this backend's own gate_up and matvec (decode) or gate_up_batch and matmul (prefill).
Reading the scores synchronises, so such a step is never captured
(Backend.data_dependent_steps, data_dependent_prefill).
"""

from __future__ import annotations

import numpy as np

from ...errors import InvalidArgumentError
from ..moe import MoeScratch, expert_groups, route_rows
from . import quant as cuda_quant
from .checks import check_act
from .shapes import blocks as _blocks

try:  # CuPy is optional: this module imports without it, like the others of the backend
    import cupy as cp
except Exception:  # noqa: BLE001 - reported by CudaBackend when it is constructed
    cp = None

ROUTE_THREADS = 256         # MOE_THREADS of cuda/moe.cu: 8 router rows a block
MAX_EXPERTS = 1024          # MOE_MAX_EXPERTS: the probabilities a block keeps in shared memory


class _DeviceScratch:
    """The device arrays of moe on the device, allocated at the first (eager) step."""

    __slots__ = ("logits", "ids", "weights", "counter", "h", "y")

    def __init__(self, n_experts: int, n_used: int, ffn: int, dim: int):
        self.logits = cp.empty(n_experts, dtype=cp.float32)
        self.ids = cp.zeros(n_used, dtype=cp.int32)
        self.weights = cp.zeros(n_used, dtype=cp.float32)
        self.counter = cp.zeros(1, dtype=cp.int32)      # moe_route_f32 puts it back to zero
        self.h = cp.empty((n_used, ffn), dtype=cp.float32)
        self.y = cp.empty((n_used, dim), dtype=cp.float32)


class ExpertOps:
    """Needs from the backend: ``_flush`` (launches held-back ops), ``_launch``, ``_k``,
    gate_up, matvec, add, gate_up_batch, matmul."""

    def upload_experts(self, trios):
        if cuda_quant.stackable_experts(trios):
            return cuda_quant.upload_experts(self, trios)
        return super().upload_experts(trios)

    def captures_moe(self, experts) -> bool:
        return self._routes_on_device(experts)

    def _routes_on_device(self, experts) -> bool:
        return (self.moe_on_device and isinstance(experts, cuda_quant.CudaExperts)
                and len(experts) <= MAX_EXPERTS)

    def _route(self, x, router, n_used: int, norm: bool, s: MoeScratch) -> None:
        T = x.shape[0]
        if s.logits is None:                            # once, at the first (eager) step
            s.logits = self.empty(s.scores.shape)
        self._flush()                                   # x may be a held-back op's output
        self._step_read_back = True                     # this step cannot be captured (graphs.py)
        cp.matmul(x, router.T, out=s.logits[:T])        # (T, E) f32
        s.logits[:T].get(out=s.scores[:T])              # synchronises
        route_rows(T, n_used, norm, s)

    def moe(self, out, x, router, experts, n_used, norm, act, scratch) -> None:
        if self._routes_on_device(experts):
            self._moe_on_device(out, x, router, experts, n_used, norm, act, scratch)
            return
        s = scratch
        self._route(x[None], router, n_used, norm, s)
        hb, y = s.hb[0], s.y[0]
        for j in range(n_used):
            gate, up, down = experts[s.ids[0, j]]
            self.gate_up(hb, gate, up, x, act)
            self.matvec(y, down, hb)
            self._flush()
            y *= float(s.weights[0, j])
            self.add(out, out, y)

    def _moe_on_device(self, out, x, router, experts, n_used, norm, act, s: MoeScratch) -> None:
        E, n = router.shape
        g, d = experts.gate, experts.down
        act = check_act(act)
        if not (0 < n_used <= E == len(experts) and x.shape == out.shape == (n,) == (g.cols,) == (d.rows,)
                and d.cols == g.rows
                and router.dtype == x.dtype == out.dtype == np.float32 and router.flags.c_contiguous
                and x.flags.c_contiguous and out.flags.c_contiguous):
            self._flush()
            raise InvalidArgumentError(f"moe: router {tuple(router.shape)}, x {tuple(x.shape)}, out "
                                       f"{tuple(out.shape)}, {len(experts)} experts of {g.rows} x {g.cols}, "
                                       f"{n_used} a token")
        if s.dev is None:                               # at the first (eager) step, never in a capture
            s.dev = _DeviceScratch(E, n_used, g.rows, n)
        v = s.dev
        if v.ids.shape[0] != n_used or v.h.shape[1] != g.rows or v.logits.shape[0] != E:
            self._flush()
            raise InvalidArgumentError("moe: the scratch was allocated for another layer shape")
        self._flush()                                   # x (the normed stream) may be held back
        self._launch("moe_route_f32", (_blocks(E, ROUTE_THREADS // 32),), (ROUTE_THREADS,),
                     (v.ids, v.weights, v.logits, v.counter, router, x, np.int32(E), np.int32(n),
                      np.int32(n_used), np.int32(1 if norm else 0)))
        cuda_quant.qmatvec_experts(self, v.h, g, experts.up, v.ids, x, 0, act)
        cuda_quant.qmatvec_experts(self, v.y, d, None, v.ids, v.h, g.rows)
        self._launch("moe_combine_f32", (_blocks(n, 256),), (256,), (out, v.y, v.weights, np.int32(n_used), np.int32(n)))

    def moe_batch(self, out, x, router, experts, n_used, norm, act, scratch) -> None:
        s, T = scratch, x.shape[0]
        self._route(x, router, n_used, norm, s)
        for e, rows, ranks in expert_groups(s.ids[:T]):
            n = rows.size
            gate, up, down = experts[e]
            xg, hb, y = s.xg[:n], s.hb[:n], s.y[:n]
            rows_d, ranks_d = cp.asarray(rows), cp.asarray(ranks)
            cp.take(x, rows_d, axis=0, out=xg)
            self.gate_up_batch(hb, gate, up, xg, act)
            self.matmul(y, down, hb)
            self._flush()
            y *= cp.asarray(s.weights[rows, ranks])[:, None]
            s.part[rows_d, ranks_d] = y
        for j in range(n_used):
            cp.add(out, s.part[:T, j], out=out)
