"""A mixture of experts on the GPU (a mixin of CudaBackend), eagerly: the router's logits are
computed on the device and read back, the host picks the experts (backends/moe.py, as the
host backends do), and each chosen expert runs through this backend's own gate_up and matvec
(decode) or gate_up_batch and matmul (prefill, the rows grouped by expert), quantized kernels
included. Reading the scores synchronises, so a step with experts is never captured as a
graph (Backend.data_dependent_steps): a correct path, not yet a fast one.
"""

from __future__ import annotations

from ..moe import MoeScratch, expert_groups, route_rows

try:  # CuPy is optional: this module imports without it, like the others of the backend
    import cupy as cp
except Exception:  # noqa: BLE001 - reported by CudaBackend when it is constructed
    cp = None


class ExpertOps:
    """Needs from the backend: ``_flush`` (launches held-back ops), gate_up, matvec, add,
    gate_up_batch, matmul."""

    def _route(self, x, router, n_used: int, norm: bool, s: MoeScratch) -> None:
        T = x.shape[0]
        if s.logits is None:                            # once, at the first (eager) step
            s.logits = self.empty(s.scores.shape)
        self._flush()                                   # x may be a held-back op's output
        cp.matmul(x, router.T, out=s.logits[:T])        # (T, E) f32
        s.logits[:T].get(out=s.scores[:T])              # synchronises
        route_rows(T, n_used, norm, s)

    def moe(self, out, x, router, experts, n_used, norm, act, scratch) -> None:
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
