"""A mixture of experts on the GPU (a mixin of CudaBackend).

A layer's experts are uploaded into one array a role (CudaExperts: each expert's matrix back
to back, in the quantized layout of quant.py or as FP16 rows) where every expert of a role is
of one format and shape, gate and up alike. Decode over such experts never leaves the device:
the router and the choice of experts (moe_route_f32, cuda/moe.cu), each role's chosen experts
in one launch that reads their ids on the device (qmv_experts_* in quant_matvec.cu,
*_experts_f16 in matvec.cu), and the weighted sum in rank order (moe_combine_f32). Such a step
is captured in the decode graph like any other.

Prefill over quantized stacks (on int8 tensor cores, sm_80+) stays on the device too: the
router's GEMM, each row's choice (moe_route_rows), the chunk's choices grouped by expert
(moe_group: sorted positions and a work list of at most C columns of one expert each), the
gate and up of every group in one launch (qmma<C>_experts_<fmt>, each group's expert's tiles
read once for its columns), the GLU product, down the same way, and each row's outputs
added in rank order (moe_combine_rows). Nothing is read back, so such a chunk is captured
in a prefill graph like any other.

Otherwise (experts of mixed formats, FP16 experts, FP16 rows that the vector kernels cannot
take) the router's logits are computed on the device and read back, the host picks the
experts (backends/moe.py, as the host backends do), and each chosen expert runs through this
backend's own gate_up and matvec (decode) or gate_up_batch and matmul (prefill). Reading the
scores synchronises, so such a step is never captured (Backend.data_dependent_steps,
data_dependent_prefill).
"""

from __future__ import annotations

import numpy as np

from ...errors import InvalidArgumentError, ModelLoadError
from ...quant.matrix import QuantMatrix
from ..moe import MoeScratch, expert_groups, route_rows
from . import quant as cuda_quant
from .checks import check_act
from .kernel_names import EXPERTS_F16_KERNELS, GLU_KERNELS, MOE_KERNELS
from .quant import NULL_ARG as _NULL, QMMA_COLUMNS
from .shapes import blocks as _blocks

try:  # CuPy is optional: this module imports without it, like the others of the backend
    import cupy as cp
except Exception:  # noqa: BLE001 - reported by CudaBackend when it is constructed
    cp = None

ROUTE_THREADS = 256         # MOE_THREADS of cuda/moe.cu: 8 router rows a block
GROUP_THREADS = 1024        # MOE_GROUP_THREADS: moe_group's one block
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


class _BatchScratch:
    """The device arrays of moe_batch on the device for chunks of up to ``rows`` tokens."""

    __slots__ = ("ids", "weights", "slots", "pos", "work", "n_work", "h", "u", "qx", "qh")

    def __init__(self, rows: int, n_experts: int, n_used: int, ffn: int, dim: int):
        e = rows * n_used                               # entries: (token, rank) pairs
        self.ids = cp.zeros(e, dtype=cp.int32)          # (T, k): each token's experts, best first
        self.weights = cp.zeros(e, dtype=cp.float32)    # (T, k): their weights
        self.slots = cp.zeros(e, dtype=cp.int32)        # entry at each sorted position
        self.pos = cp.zeros(e, dtype=cp.int32)          # sorted position of each entry
        self.work = cp.zeros((max_groups(e, n_experts, min(QMMA_COLUMNS)), 4), dtype=cp.int32)
        self.n_work = cp.zeros(1, dtype=cp.int32)
        self.h = cp.empty((e, ffn), dtype=cp.float32)   # by sorted position: gate, then the GLU
        self.u = cp.empty((e, ffn), dtype=cp.float32)   # up (down's outputs: MoeScratch.part)
        self.qx = cp.empty(rows * (dim + dim // 2), dtype=cp.uint8)     # x's rows in int8 blocks
        self.qh = cp.empty(e * (ffn + ffn // 2), dtype=cp.uint8)        # h's rows in int8 blocks


def _group_smem(entries: int, n_experts: int) -> int:
    """Shared bytes of moe_group: the entries' experts, then each expert's count, start, group."""
    return 4 * (entries + 3 * n_experts)


def max_groups(entries: int, n_experts: int, columns: int) -> int:
    """The most groups moe_group can make of ``entries`` choices, at most ``columns`` of one
    expert each: sum over experts of ceil(count / columns) <= entries / columns + the experts chosen."""
    return -(-entries // columns) + min(n_experts, entries)


def group_columns(tokens: int, n_used: int, n_experts: int) -> int:
    """Columns a group of moe_batch's experts' kernels: 16 where an expert gets at most ~16 of
    the chunk's rows on average, else 32 (fewer, fuller blocks)."""
    return QMMA_COLUMNS[0] if tokens * n_used <= QMMA_COLUMNS[0] * n_experts else QMMA_COLUMNS[-1]


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


def stack_kinds(roles) -> list | None:
    """The kind of each role's stack (gate, up, down: _role_kind), or None where the experts
    keep one upload each: a role that does not stack, or a gate and up that differ in kind,
    format or shape (one launch runs both, with one kernel and one stride)."""
    kinds = [_role_kind(m) for m in roles]
    gate, up = roles[0][0], roles[1][0]
    if (None in kinds or kinds[0] != kinds[1] or gate.shape != up.shape
            or getattr(gate, "fmt", None) is not getattr(up, "fmt", None)):
        return None
    return kinds


class ExpertOps:
    """Needs from the backend: ``_flush`` (launches held-back ops), ``_pending_norm`` of
    NormFolding, ``_launch``, ``_k``,
    ``_gemm_ex``, ``_rows``, ``_prefill_rec``, ``smem_per_block``, ``moe_on_device``, gate_up,
    matvec, add, gate_up_batch, matmul."""

    def upload_experts(self, trios):
        trios = [tuple(t) for t in trios]
        roles = [[t[r] for t in trios] for r in range(3)] if trios and all(len(t) == 3 for t in trios) else None
        kinds = stack_kinds(roles) if roles else None
        if kinds is None:
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
        if self._prefill_rec is not None:               # nor this prefill chunk (prefill_graph.py)
            self._prefill_rec.capturable = False
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
                and router.data.ptr % 16 == 0 and x.flags.c_contiguous and out.flags.c_contiguous
                and x.data.ptr % 16 == 0):
            self._flush()
            raise InvalidArgumentError(f"moe: router {tuple(router.shape)}, x {tuple(x.shape)}, out "
                                       f"{tuple(out.shape)}, {len(experts)} experts of {g.rows} x {g.cols}, "
                                       f"{n_used} a token (float32, contiguous, router and x 16-byte aligned)")
        if s.dev is None:                               # at the first (eager) step, never in a capture
            s.dev = _DeviceScratch(E, n_used, g.rows, n)
        v = s.dev
        if v.ids.shape[0] != n_used or v.h.shape[1] != g.rows or v.logits.shape[0] != E:
            self._flush()
            raise InvalidArgumentError("moe: the scratch was allocated for another layer shape")
        # the layer's pre-norm, held back (norm_fold.py), goes into the router's kernel: it
        # reads the stream, and its block 0 writes x for the experts
        route = self._k(MOE_KERNELS["route"])
        cuda_quant.allow_smem(route, 4 * n)             # x staged in shared memory, n floats (may refuse)
        xin, nw, eps = self._take_moe_norm(x)           # after any refusal: a held norm is never lost
        self._launch(route, (_blocks(E, ROUTE_THREADS // 32),), (ROUTE_THREADS,),
                     (v.ids, v.weights, v.logits, v.counter, router, xin, x, nw, np.float32(eps), np.int32(E),
                      np.int32(n), np.int32(n_used), np.int32(1 if norm else 0)), shared_mem=4 * n)
        self._experts_matvec(v.h, g, experts.up, v.ids, x, 0, act)
        self._experts_matvec(v.y, d, None, v.ids, v.h, g.rows)
        self._launch(MOE_KERNELS["combine"], (_blocks(n, 256),), (256,),
                     (out, v.y, v.weights, np.int32(n_used), np.int32(n)))

    def _take_moe_norm(self, x):
        """(input, norm weight, eps) for moe_route_f32: the held-back rmsnorm whose output is x
        (the stream, its weight and eps), or (x, NULL, 0) with every held op launched. The
        stream is what moe adds to, but only moe_combine_f32, the layer's last kernel, writes
        it, so the norm is taken whatever ``out`` is (NormFolding._take_norm would refuse)."""
        p = self._pending_norm          # held only where its output does not overlap its input
        if p is not None and p[0].data.ptr == x.data.ptr and p[0].shape == x.shape:
            self._pending_norm = None
            self._flush()                               # what was held before the norm (prequant.py)
            return p[1], p[2], p[3]
        self._flush()
        return x, _NULL, 0.0

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

    def captures_moe_batch(self, experts, tokens: int, n_used: int) -> bool:
        """Whether moe_batch routes and groups these experts on the device for chunks of up to
        ``tokens`` rows: quantized stacks (both roles) on int8 tensor cores, and the chunk's
        choices within one block's shared memory (moe_group); then such a chunk is captured."""
        return (self.captures_moe(experts) and isinstance(experts.gate, cuda_quant.ExpertStack)
                and isinstance(experts.down, cuda_quant.ExpertStack) and cuda_quant.qmma_available(self)
                and _group_smem(tokens * n_used, len(experts)) <= getattr(self, "smem_per_block", 48 * 1024))

    def moe_batch(self, out, x, router, experts, n_used, norm, act, scratch) -> None:
        if self.captures_moe_batch(experts, scratch.ids.shape[0], n_used):
            self._moe_batch_on_device(out, x, router, experts, n_used, norm, act, scratch)
            return
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

    def _moe_batch_on_device(self, out, x, router, experts, n_used, norm, act, s: MoeScratch) -> None:
        """moe_batch over quantized stacks, nine launches and no read-back (the module's docstring)."""
        self._flush()
        g, u, d = experts.gate, experts.up, experts.down
        f, n = g.rows, g.cols
        T = x.shape[0] if x.ndim == 2 else -1
        E = len(experts)
        act = check_act(act)
        rows = s.scores.shape[0]
        # part (rows, k, dim) holds down's outputs by sorted position: (rows * k, dim)
        if not (0 < n_used <= E and 0 <= T <= rows and x.shape == out.shape == (T, n) == (T, d.rows)
                and d.cols == f and router.shape == (E, n) and router.dtype == x.dtype == out.dtype == np.float32
                and router.flags.c_contiguous and self._rows(x, "moe_batch") == n
                and s.part is not None and s.part.shape == (rows, n_used, n) and s.part.flags.c_contiguous):
            raise InvalidArgumentError(f"moe_batch: router {tuple(router.shape)}, x {tuple(x.shape)}, out "
                                       f"{tuple(out.shape)}, {len(experts)} experts of {f} x {g.cols}, "
                                       f"{n_used} a token, scratch of {rows} rows")
        ldo = self._rows(out, "moe_batch")              # one clear error for rows that are not whole
        if T == 0:
            return
        if s.logits is None:                            # at the first (eager) chunk, never in a capture
            s.logits = self.empty(s.scores.shape)
        if s.dev is None:
            s.dev = _BatchScratch(rows, E, n_used, f, n)
        v = s.dev
        if v.ids.shape[0] != rows * n_used or v.h.shape[1] != f or v.qx.shape[0] != rows * (n + n // 2):
            raise InvalidArgumentError("moe_batch: the scratch was allocated for another layer shape")
        entries = T * n_used
        logits = s.logits[:T]
        if not self._gemm_ex(logits, router, x, T, E, n, E, 0.0):        # the router in FP32
            cp.matmul(x, router.T, out=logits)
        self._k(MOE_KERNELS["route_rows"])((T,), (ROUTE_THREADS,),
                                           (v.ids, v.weights, logits, np.int32(E), np.int32(n_used),
                                            np.int32(1 if norm else 0)))
        c = group_columns(T, n_used, E)
        group = self._k(MOE_KERNELS["group"])
        smem = _group_smem(entries, E)
        cuda_quant.allow_smem(group, smem)
        group((1,), (GROUP_THREADS,), (v.slots, v.pos, v.work, v.n_work, v.ids, np.int32(entries), np.int32(E),
                                       np.int32(c)), shared_mem=smem)
        groups = max_groups(entries, E, c)
        qx, qh = v.qx[:T * (n + n // 2)], v.qh[:entries * (f + f // 2)]
        cuda_quant.quantize_rows(self, qx, x, g.fmt.name)
        h, hu, y = v.h[:entries], v.u[:entries], s.part.reshape(rows * n_used, n)[:entries]
        cuda_quant.qmatmul_experts(self, (h, hu), (g, u), v.work, v.n_work, groups, v.slots, n_used, qx, c)
        self._k(GLU_KERNELS[act])((_blocks(entries * f, 256),), (256,), (h, h, hu, np.int32(entries * f)))
        cuda_quant.quantize_rows(self, qh, h, d.fmt.name)
        cuda_quant.qmatmul_experts(self, (y,), (d,), v.work, v.n_work, groups, None, n_used, qh, c)
        self._k(MOE_KERNELS["combine_rows"])((_blocks(n, 256), T), (256,),
                                             (out, np.int32(ldo), y, v.weights, v.pos,
                                              np.int32(n_used), np.int32(n)))
