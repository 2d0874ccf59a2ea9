"""Consecutive quantized decode matvecs as one persistent kernel (a mixin of CudaBackend).

Between two attention ops a decode layer runs only matvecs -- wo (+ residual), the MLP's
gate+up and down (+ residual), the next layer's q/k/v -- each a kernel that pays 1.5-4 us
beyond the time of its bytes on an H100 (bench/results/cuda_quant_model_h100.md). Inside
``decode_step`` such matvecs are held back here as a list; when any other op comes (or
to_host/synchronize), the list goes out as one ``qchain`` launch (cuda/quant_chain.cu): one
block per SM, a producer warp streaming the weights of every op of the list into a ring of
shared memory without waiting for the ops' results, consumer warps computing the ops in
order with a grid-wide barrier only where an op reads what an earlier one of the list
wrote. A list of one, a format or shape the kernel does not take, or ``chain_matvecs``
off (CYLLM_CUDA_CHAIN=0): each op goes out as its own kernel, as before.

The op table is device memory written in the step's eager pass and found again (by its
bytes) when the graph is captured, so the graph reads a table that never changes.
"""

from __future__ import annotations

import numpy as np

from .quant import LAYOUTS, TILE, ChainItem, _allow_smem
from .source import assemble

try:  # CuPy is optional: this module imports without it
    import cupy as cp
except Exception:  # noqa: BLE001 - reported by CudaBackend when it is constructed
    cp = None

MAX_SLOTS = 16            # ring slots at most (CH_MAX_SLOTS)
FMT_INDEX = {name: i for i, name in enumerate(LAYOUTS)}     # ch_geom's switch in quant_chain.cu

# one ChainOp of quant_chain.cu
OP_DTYPE = np.dtype([("w", "<u8", (3,)), ("out", "<u8"), ("x", "<u8"), ("nw", "<u8"), ("xn", "<u8"),
                     ("rows", "<i4", (3,)), ("nparts", "<i4"), ("nbi", "<i4"), ("fmt", "<i4"),
                     ("mode", "<i4"), ("sync", "<i4"), ("tiles", "<i4"), ("rot", "<i4"), ("ipc", "<i4"),
                     ("eps", "<f4"), ("pad", "<i4", (2,))])
assert OP_DTYPE.itemsize == 112

_MODULES: dict = {}       # (device id, formats, defines) -> the qchain kernel
_TABLES_MAX = 4096        # op tables kept per backend (a few per model)


def _span(a) -> tuple[int, int]:
    return (int(a.data.ptr), int(a.data.ptr) + int(a.nbytes))


def _hits(spans, others) -> bool:
    return any(a0 < b1 and b0 < a1 for a0, a1 in spans for b0, b1 in others)


def _item_bytes(fmt: str) -> int:
    units, _, pa, pb, _ = LAYOUTS[fmt]
    return 16 * units + sum(r[1] - r[0] for r in (pa, pb) if r is not None)


class MatvecChaining:
    """Needs from the backend: ``_device_mode``, ``use_pdl``, ``sm_count``, ``device``,
    ``compile_defines``, ``_stream``, ``_launch`` and ``_flush``/``_drop_held`` of the
    folding mixins after it in the MRO."""

    def _chain_init(self, enabled: bool) -> None:
        self.chain_matvecs = enabled
        self.chain_warps = 8            # consumer warps per block (CH_WARPS, compiled in)
        self.chain_slots = 8            # ring slots per block
        self.chain_inflight = 2         # chunks on their way at once per block
        self._chain_items: list[ChainItem] = []
        self._chain_tables: dict = {}       # op table bytes -> (device table, device counters)
        self._chain_smem_max = None

    # -- holding back --------------------------------------------------------------
    def _chain_take(self, item: ChainItem) -> bool:
        """Hold ``item`` for the next chain launch (True), or not (False: launch it now)."""
        if not (self.chain_matvecs and self._device_mode and self.use_pdl):
            return False
        for p in item.parts:
            if p.rows % TILE or p.fmt.name not in FMT_INDEX:
                return False
        self._chain_items.append(item)
        return True

    def _flush(self) -> None:
        self._launch_chain()
        super()._flush()

    def _drop_held(self) -> None:
        self._chain_items = []
        super()._drop_held()

    def _flush_before_norm(self) -> None:
        # a norm held back behind the chain keeps the order (it goes out after the chain, or
        # folded into a later op of it); a norm or q/k/v already held must go out first
        if self._pending_norm is not None or self._pending_qkv is not None:
            self._flush()

    # -- launching -----------------------------------------------------------------
    def _launch_chain(self) -> None:
        items, self._chain_items = self._chain_items, []
        if not items:
            return
        if len(items) == 1:
            items[0].launch()
            return
        ops, max_n, slot_bytes = self._chain_program(items)
        if ops is None:                     # a row too long for the ring: one kernel each
            for it in items:
                it.launch()
            return
        table, bar = self._chain_table(ops)
        fmts = tuple(sorted({it.parts[0].fmt.name for it in items}))
        k = self._chain_kernel(fmts)
        slots = self._chain_nslots()
        smem = 16 * MAX_SLOTS + slots * slot_bytes + _staging_bytes(max_n, self.chain_warps)
        _allow_smem(k, smem)
        inflight = max(1, min(int(self.chain_inflight), slots))
        self._launch(k, (self.sm_count,), ((self.chain_warps + 1) * 32,),
                     (table, np.int32(len(items)), bar, np.int32(slot_bytes), np.int32(slots),
                      np.int32(inflight), np.int32(max_n)), shared_mem=smem)

    def _chain_nslots(self) -> int:
        return max(2, min(int(self.chain_slots), MAX_SLOTS))

    def _chain_program(self, items):
        """The op table of a chain: (ops, longest row, slot bytes), or (None, 0, 0)."""
        max_n = max(it.parts[0].cols for it in items)
        room = self._smem_optin() - 16 * MAX_SLOTS - _staging_bytes(max_n, self.chain_warps)
        slot_bytes = room // self._chain_nslots() // 128 * 128
        ops = np.zeros(len(items), OP_DTYPE)
        written: list = []          # spans written / read since the last barrier
        read: list = []
        folded: list = []           # (xn span, norm) of this group's folded norms
        rot = 0
        for i, it in enumerate(items):
            norm, x = it.norm, it.x
            if norm is None:
                # x is the output of a norm folded into an op of this group: fold it here
                # too, so this op does not wait for that op's blocks to write it
                for span, nm in folded:
                    if span == _span(x):
                        norm = (None, nm[1], nm[2], nm[3])
                        break
            reads = [_span(norm[1]), _span(norm[2])] if norm is not None else [_span(x)]
            if it.mode == 1:
                reads.append(_span(it.out))
            writes = [_span(it.out)] + ([_span(norm[0])] if norm is not None and norm[0] is not None else [])
            sync = i > 0 and (_hits(reads, written) or _hits(writes, written + read))
            if sync:
                written, read, folded = [], [], []
            written += writes
            read += reads
            if it.norm is not None and it.norm[0] is not None:
                folded.append((_span(it.norm[0]), it.norm))
            o = ops[i]
            w0 = it.parts[0]
            fmt = w0.fmt.name
            per_item = TILE * _item_bytes(fmt)
            ipc_max = slot_bytes // per_item
            if ipc_max < 1:
                return None, 0, 0
            nch = -(-w0.nbi // ipc_max)
            o["ipc"] = -(-w0.nbi // nch)
            glu = it.mode >= 2
            parts = it.parts
            for j, p in enumerate(parts):
                o["w"][j] = p.data.data.ptr
                o["rows"][j] = p.rows
            o["nparts"] = 1 if glu else len(parts)
            o["tiles"] = parts[0].rows // TILE if glu else sum(p.rows // TILE for p in parts)
            o["out"] = it.out.data.ptr
            if norm is not None:
                o["x"] = norm[1].data.ptr
                o["nw"] = norm[2].data.ptr
                o["xn"] = 0 if norm[0] is None else norm[0].data.ptr
                o["eps"] = norm[3]
            else:
                o["x"] = x.data.ptr
            o["nbi"] = w0.nbi
            o["fmt"] = FMT_INDEX[fmt]
            o["mode"] = it.mode
            o["sync"] = int(sync)
            o["rot"] = rot
            rot = (rot + int(o["tiles"])) % self.sm_count
        return ops, max_n, slot_bytes

    def _chain_table(self, ops: np.ndarray):
        """The device copy of an op table (uploaded in the eager pass; found by its bytes when
        the same ops are captured) and its two barrier counters."""
        key = ops.tobytes()
        hit = self._chain_tables.get(key)
        if hit is None:
            if self._stream.is_capturing():
                raise RuntimeError("a matvec chain appeared only while capturing the decode graph")
            if len(self._chain_tables) >= _TABLES_MAX:
                self._chain_tables.clear()
            table = cp.asarray(np.frombuffer(key, dtype=np.uint8))
            bar = cp.zeros(2, dtype=cp.uint32)
            hit = self._chain_tables[key] = (table, bar)
        return hit

    def _chain_kernel(self, fmts: tuple):
        defines = tuple(self.compile_defines) + (f"-DCH_WARPS={int(self.chain_warps)}",
                                                 f"-DCH_DEBUG={int(getattr(self, 'chain_debug', 0))}")
        key = (self.device.id, fmts, defines)
        k = _MODULES.get(key)
        if k is None:
            # kept alive here: _allow_smem remembers kernels by id()
            src = assemble(("common.cuh", "quant_matvec.cu", "quant_chain.cu"))
            mod = cp.RawModule(code=src, options=tuple(f"-DQMV_{f}" for f in fmts) + defines)
            k = _MODULES[key] = mod.get_function("qchain")
        return k

    def _smem_optin(self) -> int:
        if self._chain_smem_max is None:
            # cudaDevAttrMaxSharedMemoryPerBlockOptin
            self._chain_smem_max = int(cp.cuda.runtime.deviceGetAttribute(97, self.device.id))
        return self._chain_smem_max


def _staging_bytes(n: int, warps: int) -> int:
    # x's int8 codes, one 16-byte entry per 32 elements, partial sums of two matrices, sums of x^2
    return n + 16 * (n // 32) + 4 * (2 * warps * TILE + warps)
