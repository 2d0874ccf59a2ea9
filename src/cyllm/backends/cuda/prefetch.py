"""The next matvec's weights fetched into L2 ahead of it (a mixin of CudaBackend).

A decode token on quantized weights is a chain of matvecs, each at the DRAM's pace only in
its middle: at every kernel boundary the DRAM idles while the last blocks drain and the
next kernel's blocks are placed and wait for their first loads, and attention at short
depth reads next to nothing. So a quantized matvec launched under ``decode_step`` may carry
a plan of the next one's weights (the head of every warp's slice: pf_next in
cuda/quant_matvec.cu), which its blocks hand to the L2 as they start.

Which matvec comes next is learnt, not declared: the quantized launches of a step are
recorded in order, and at the end of the step each one's plan is built from its
successor's (the last one's from the first: the next token's). A step's first eager pass
launches without plans; its graph, captured after it, has them.

Off by default: it no longer pays. Measured on an H100 (bench/results/cuda_quant_model_h100.md),
Llama-2-7B decode with half of each warp's slice fetched: Q4_K -1 to -4%, Q8_0 -0.4 to +1.1%
at depth 0 and -1.5 to -5% at 4096, and Q4_0 +3.3 to +3.8% -- but only while ptxas moved
the q4_0 matvecs' own pre-wait weight loads below their pdl_wait (common.cuh,
pdl_wait_after_loads), so that the L2 fetch stood in for loads that came late. With those
loads issued before the wait, Q4_0 with the fetch is 1.2% slower at depth 0 and 2.3% at 4096.
``qmv_prefetch`` (CYLLM_CUDA_PREFETCH) is the fraction of each warp's slice fetched, 0 = off;
only q4_0 successors get a plan (``PREFETCH_FORMATS``); a plan's bytes stay under a quarter
of the L2 where one item per slice fits in that.
"""

from __future__ import annotations

import os

import numpy as np

from ...errors import InvalidArgumentError
from .quant import TILE, plane_spans

try:  # CuPy is optional: this module imports without it
    import cupy as cp
except Exception:  # noqa: BLE001 - reported by CudaBackend when it is constructed
    cp = None

_NULL = np.int64(0)                 # no plan
PREFETCH_FORMATS = ("q4_0",)        # the one format whose successors once measured faster
DEFAULT_FRACTION = 0.0              # off: now measured slower (above)


def default_fraction() -> float:
    """CYLLM_CUDA_PREFETCH (a fraction in [0, 1]; 0 = off), else DEFAULT_FRACTION."""
    v = os.environ.get("CYLLM_CUDA_PREFETCH", "").strip()
    if not v:
        return DEFAULT_FRACTION
    try:
        f = float(v)
    except ValueError:
        f = -1.0
    if not 0.0 <= f <= 1.0:
        raise InvalidArgumentError(f"CYLLM_CUDA_PREFETCH must be a fraction in [0, 1] (0: off), got {v[:20]!r}")
    return f


def plan_values(mats, warps: int, fraction: float, budget: int) -> list[int] | None:
    """The int64 plan of pf_next for a kernel reading ``mats`` (CudaQuantMatrix of one width
    and format) with ``warps`` warps per row tile: {entries, S, nbi, h} then {base address,
    bytes per item of a full tile, full tiles} per plane of each matrix. h: items fetched at
    the head of each warp's slice, ``fraction`` of the slice length nbi/S (at most the
    shortest slice, at least 1), lowered while the plan's bytes exceed ``budget`` but not
    below 1. None: nothing to fetch."""
    if fraction <= 0 or not mats:
        return None
    nbi = mats[0].nbi
    slice_items = max(1, nbi // warps)
    h = max(1, min(slice_items, round(fraction * nbi / warps)))
    entries = []
    for m in mats:
        tiles = m.rows // TILE
        if tiles == 0:
            continue
        base = int(m.data.data.ptr)
        for off, item_bytes in plane_spans(m):
            if (base + off) % 16 == 0:          # cp.async.bulk.prefetch wants 16-byte aligned ranges
                entries.append((base + off, item_bytes, tiles))
    if not entries:
        return None
    per_item = sum(ib * t * warps for _, ib, t in entries)      # bytes for h = 1
    h = min(h, max(1, budget // per_item))
    out = [len(entries), warps, nbi, h]
    for e in entries:
        out.extend(e)
    return out


class WeightPrefetch:
    """Needs from the backend: ``_device_mode``, ``l2_bytes``, ``qmv_prefetch`` and
    ``qmv_prefetch_formats`` (PREFETCH_FORMATS, or another tuple for experiments)."""

    def _pf_reset(self) -> None:
        self._pf_plans: list = []       # per launch of the step: (its key, its plan or _NULL, the successor's matrices)
        self._pf_key = None             # what the plans were built from
        self._pf_rec: list = []         # this pass's launches: (key, mats, warps)
        self._pf_old: list = []         # plans replaced while a captured graph may still point at them
        self._pf_recording = False

    def _pf_begin(self) -> None:
        self._pf_rec = []
        self._pf_recording = True       # only decode_step's passes are recorded (not a bench's own timing loops)

    def _pf_stop(self) -> None:
        """A pass ended without _pf_end (it raised): record nothing until the next _pf_begin."""
        self._pf_recording = False

    def _pf_arg(self, mats: tuple, warps: int):
        """The plan argument of a quantized decode launch reading ``mats`` with ``warps`` warps
        per tile: the next launch's weights, as learnt from the last pass (_NULL: none)."""
        if not (self._device_mode and self._pf_recording):
            return _NULL
        i = len(self._pf_rec)
        key = (tuple(id(m) for m in mats), warps)
        self._pf_rec.append((key, mats, warps))
        if i < len(self._pf_plans) and self._pf_plans[i][0] == key:
            return self._pf_plans[i][1]
        return _NULL

    def _pf_end(self) -> None:
        """After a pass: build each launch's plan from its successor's, unless already built
        for this sequence. Runs outside capture only after an eager pass; a capture pass
        finds its plans built (the same launches, in the same order)."""
        self._pf_recording = False
        rec = self._pf_rec
        fraction = float(self.qmv_prefetch or 0.0)
        formats = tuple(self.qmv_prefetch_formats)
        key = (tuple(r[0] for r in rec), fraction, formats)
        if key == self._pf_key:
            return
        plans = []
        budget = self.l2_bytes // 4
        for i, (k, _, _) in enumerate(rec):
            _, mats, warps = rec[(i + 1) % len(rec)]
            v = plan_values(mats, warps, fraction, budget) if mats[0].fmt.name in formats else None
            # the successor's matrices stay referenced with the plan holding their addresses
            plans.append((k, _NULL if v is None else cp.asarray(np.array(v, dtype=np.int64)), mats))
        self._pf_old.append(self._pf_plans)
        self._pf_plans = plans
        self._pf_key = key
