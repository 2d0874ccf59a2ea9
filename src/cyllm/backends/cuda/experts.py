"""A mixture of experts on the GPU (a mixin of CudaBackend).

A layer's experts are uploaded into one array a role (CudaExperts: each expert's matrix back
to back, in the quantized layout of quant.py or as FP16 rows) where every expert of a role is
of one format and shape, gate and up alike. Decode over such experts never leaves the device:
the router and the choice of experts (moe_route_f32, cuda/moe.cu), each role's chosen experts
in one launch that reads their ids on the device (qmv_experts_* in quant_matvec.cu,
*_experts_f16 in matvec.cu), and the weighted sum in rank order (moe_combine_f32). Such a step
is captured in the decode graph like any other.

Otherwise (experts of mixed formats, FP16 rows that the vector kernels cannot take, and
prefill, whose rows are grouped by expert on the host) the router's logits are computed on
the device and read back, the host picks the experts (backends/moe.py, as the host backends
do), and each chosen expert runs through this backend's own gate_up and matvec (decode) or
gate_up_batch and matmul (prefill). Reading the scores synchronises, so such a step is never
captured (Backend.data_dependent_steps, data_dependent_prefill).
"""

from __future__ import annotations

import numpy as np

from ...errors import InvalidArgumentError, ModelLoadError
from ...quant.matrix import QuantMatrix
from ..moe import MoeScratch, expert_groups, route_rows
from . import quant as cuda_quant
from .checks import check_act
from .kernel_names import EXPERTS_F16_KERNELS, MOE_KERNELS
from .shapes import blocks as _blocks

try:  # CuPy is optional: this module imports without it, like the others of the backend
    import cupy as cp
except Exception:  # noqa: BLE001 - reported by CudaBackend when it is constructed
    cp = None

ROUTE_THREADS = 256         # MOE_THREADS of cuda/moe.cu: 8 router rows a block
MAX_EXPERTS = 1024          # MOE_MAX_EXPERTS: the probabilities a block keeps in shared memory
F16_WARPS = 8               # warps (= rows) a block of the *_experts_f16 kernels


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


class F16ExpertStack:
    """One role of a layer's experts in FP16: (count, rows, cols) on the device, expert e's
    matrix ``data[e]``; cols a multiple of 8 (the vector kernels' 16-byte loads)."""

    __slots__ = ("data", "rows", "cols", "count")

    def __init__(self, data):
        self.data = data
        self.count, self.rows, self.cols = (int(v) for v in data.shape)

    @property
    def stride(self) -> int:
        """An expert's matrix in 16-byte units."""
        return self.rows * self.cols // 8

    def matrix(self, e: int):
        return self.data[e]


class CudaExperts:
    """A layer's experts uploaded as one stack a role (quant.ExpertStack or F16ExpertStack).
    Indexed like the host backends' tuple of (gate, up, down) trios: experts[e] is expert e's
    trio (views of the stacks)."""

    __slots__ = ("gate", "up", "down")

    def __init__(self, gate, up, down):
        self.gate, self.up, self.down = gate, up, down

    def __len__(self) -> int:
        return self.gate.count

    def __getitem__(self, e):
        e = int(e)
        if not 0 <= e < self.gate.count:
            raise IndexError(f"expert {e} of {self.gate.count}")
        return (self.gate.matrix(e), self.up.matrix(e), self.down.matrix(e))

    def __iter__(self):
        return (self[e] for e in range(len(self)))


def _role_kind(mats) -> str | None:
    """"quant" (QuantMatrix of one format and shape that the kernels have), "f16" (float16
    matrices of one shape, rows of whole 16-byte loads), or None: not one stack."""
    first = mats[0]
    if isinstance(first, QuantMatrix):
        same = all(isinstance(m, QuantMatrix) and m.fmt is first.fmt and m.shape == first.shape for m in mats)
        return "quant" if same and first.fmt.name in cuda_quant.LAYOUTS else None
    if isinstance(first, np.ndarray) and first.dtype == np.float16 and first.ndim == 2 and first.shape[1] % 8 == 0:
        same = all(isinstance(m, np.ndarray) and m.dtype == np.float16 and m.shape == first.shape for m in mats)
        return "f16" if same else None
    return None


class ExpertOps:
    """Needs from the backend: ``_flush`` (launches held-back ops), ``_launch``, ``_k``,
    gate_up, matvec, add, gate_up_batch, matmul."""

    def upload_experts(self, trios):
        trios = [tuple(t) for t in trios]
        roles = [[t[r] for t in trios] for r in range(3)] if trios and all(len(t) == 3 for t in trios) else None
        kinds = [_role_kind(m) for m in roles] if roles else [None]
        if None in kinds or kinds[0] != kinds[1] or roles[0][0].shape != roles[1][0].shape:
            return super().upload_experts(trios)
        return CudaExperts(*(cuda_quant.upload_expert_stack(self, m) if k == "quant" else self._f16_stack(m)
                             for m, k in zip(roles, kinds)))

    def _f16_stack(self, mats) -> F16ExpertStack:
        rows, cols = mats[0].shape
        self.check_fits(len(mats) * rows * cols * 2)
        try:
            data = cp.empty((len(mats), rows, cols), dtype=cp.float16)
            for e, m in enumerate(mats):
                data[e].set(np.ascontiguousarray(m))
        except cp.cuda.memory.OutOfMemoryError:
            raise ModelLoadError(f"out of GPU memory uploading {len(mats)} experts of {rows} x {cols} "
                                 f"to {self.device_name}") from None
        return F16ExpertStack(data)

    def captures_moe(self, experts) -> bool:
        """Whether moe routes these experts on the device (stacked, at most MAX_EXPERTS, and
        moe_on_device): then a step with them is captured."""
        return self.moe_on_device and isinstance(experts, CudaExperts) and len(experts) <= MAX_EXPERTS

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
        if self.captures_moe(experts):
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
                and x.flags.c_contiguous and out.flags.c_contiguous and x.data.ptr % 16 == 0):
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
        self._launch(MOE_KERNELS["route"], (_blocks(E, ROUTE_THREADS // 32),), (ROUTE_THREADS,),
                     (v.ids, v.weights, v.logits, v.counter, router, x, np.int32(E), np.int32(n),
                      np.int32(n_used), np.int32(1 if norm else 0)))
        self._experts_matvec(v.h, g, experts.up, v.ids, x, 0, act)
        self._experts_matvec(v.y, d, None, v.ids, v.h, g.rows)
        self._launch(MOE_KERNELS["combine"], (_blocks(n, 256),), (256,),
                     (out, v.y, v.weights, np.int32(n_used), np.int32(n)))

    def _experts_matvec(self, out, w0, w1, ids, x, ldx: int, act: str | None = None) -> None:
        """out[j] = W0[ids[j]] x[j] (w1 None) or act(W0[ids[j]] x[j]) * (W1[ids[j]] x[j]) for each
        rank j, one launch; x row j at x + j * ldx floats (0: one vector for every expert)."""
        if isinstance(w0, cuda_quant.ExpertStack):
            cuda_quant.qmatvec_experts(self, out, w0, w1, ids, x, ldx, act)
            return
        k, d = ids.shape[0], w0.rows
        self._launch(EXPERTS_F16_KERNELS[act], (_blocks(d, F16_WARPS), k), (32 * F16_WARPS,),
                     (out, w0.data, (w0 if w1 is None else w1).data, np.int64(w0.stride), ids,
                      np.int32(w0.count), x, np.int32(ldx), np.int32(d), np.int32(w0.cols // 8)))

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
