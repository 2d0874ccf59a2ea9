"""L2 prefetch of the next quantized matvec's weights inside a captured decode step.

A quantized matvec of a 7B layer reads 9-50 MB: 3-17 us at copy speed, while its start
(waiting for the previous kernel, staging x) and its end (the cross-warp sums) leave DRAM
idle for 1-2 us each. The weights of the next matvec depend on nothing, so each quantized
matvec kernel is given the byte ranges of the next one and its blocks issue bulk L2
prefetches for them behind their own loads (cuda/common.cuh, l2_prefetch_share): DRAM keeps
streaming through the gaps and attention, and the next kernel finds its first bytes in L2.

The order of the matvecs is learned, not declared: decode_step runs the step eagerly once
before capturing it, and the same ops come in the same order, so the eager pass records
each launch's weight ranges and the capture gives launch i the ranges of launch i + 1 (the
last one gets the first's: the next token's first layer). A launch whose own ranges differ
from the recording (a different op sequence) gets none. A prefetch is only a hint: it
changes no result, only when bytes arrive.

``CYLLM_CUDA_L2_PREFETCH``: MiB prefetched per launch at most (0 turns it off).
"""

from __future__ import annotations

import os

import numpy as np

from ...errors import InvalidArgumentError

RANGES = 4                # QPF_RANGES of cuda/common.cuh: {address, bytes} pairs per launch
DEFAULT_MIB = 16          # bench/results/cuda_quant_model_h100.md has the sweep
_NULL = np.int64(0)


def cap_from_env() -> int:
    """Bytes per launch from CYLLM_CUDA_L2_PREFETCH (MiB), DEFAULT_MIB when unset."""
    raw = os.environ.get("CYLLM_CUDA_L2_PREFETCH", "").strip()
    if not raw:
        return DEFAULT_MIB << 20
    try:
        mib = float(raw)
    except ValueError:
        mib = -1.0
    if not (0.0 <= mib <= 1 << 20):
        raise InvalidArgumentError(
            f"CYLLM_CUDA_L2_PREFETCH must be a number of MiB >= 0 (0: off), got {raw!r}")
    return int(mib * (1 << 20))


def ranges_of(arrays) -> tuple:
    """((address, bytes), ...) of device arrays (CuPy), bytes rounded down to 16."""
    return tuple((int(a.data.ptr), int(a.nbytes) // 16 * 16) for a in arrays)


def capped(ranges: tuple, cap: int) -> tuple:
    """The leading ``cap`` bytes of the concatenated ranges, at most RANGES of them, each a
    multiple of 16 long and starting at its array's start (16-byte aligned)."""
    out = []
    left = cap // 16 * 16
    for addr, n in ranges[:RANGES]:
        take = min(n, left)
        if take <= 0:
            break
        out.append((addr, take))
        left -= take
    return tuple(out)


class WeightPrefetch:
    """The record -> capture protocol of one decode step's prefetch table.

    ``record()`` before the eager pass, ``capture()`` before the captured one, ``stop()``
    after; in between every quantized matvec calls ``arg(ranges)`` for its pointer argument.
    ``upload`` turns the (launches, 2 * RANGES) int64 table into a device array (the backend
    passes CuPy's; tests pass numpy's), kept alive here for as long as the graph uses it.
    """

    def __init__(self, cap: int, upload=None):
        self.cap = int(cap)
        self._upload = upload
        self._mode = None           # None, "record" or "capture"
        self._seq: list = []        # each launch's own ranges, in order (record)
        self._i = 0                 # launches seen in this capture
        self.table = None           # host table of the capture (launch i -> the next one's ranges)
        self._dev = None            # its device copy
        self._base = 0              # device address of row 0

    @property
    def enabled(self) -> bool:
        return self.cap > 0

    def record(self) -> None:
        self._mode = "record" if self.enabled else None
        self._seq = []

    def capture(self) -> None:
        """Build the table from the recording and upload it (before stream capture begins:
        the upload is a copy on the stream)."""
        self._mode = None
        self._i = 0
        n = len(self._seq)
        if not self.enabled or n == 0:
            return
        table = np.zeros((n, 2 * RANGES), dtype=np.int64)
        for i in range(n):
            nxt = capped(self._seq[(i + 1) % n], self.cap)
            for r, (addr, nbytes) in enumerate(nxt):
                table[i, 2 * r] = addr
                table[i, 2 * r + 1] = nbytes
        self.table = table
        if self._upload is not None:
            self._dev = self._upload(table)
            self._base = int(self._dev.data.ptr)
        else:
            self._dev = table
            self._base = int(table.ctypes.data)
        self._mode = "capture"

    def stop(self) -> None:
        self._mode = None

    def arg(self, arrays) -> np.int64:
        """The kernel's pointer argument for a launch reading the device ``arrays`` (its
        weights; 0: no prefetch)."""
        if self._mode is None:
            return _NULL
        ranges = ranges_of(arrays)
        if self._mode == "record":
            self._seq.append(ranges)
            return _NULL
        i = self._i
        self._i += 1
        if i < len(self._seq) and self._seq[i] == ranges:
            return np.int64(self._base + i * 2 * RANGES * 8)
        return _NULL


__all__ = ["DEFAULT_MIB", "RANGES", "WeightPrefetch", "cap_from_env", "capped", "ranges_of"]
