"""Decode through CUDA graphs (a mixin of CudaBackend).

Per-step values (token id, position) come from a two-int device buffer: ``decode_step``
writes that buffer, then replays a CUDA graph of the whole forward pass, so a token
costs one graph launch instead of hundreds of Python-side launches. One graph serves a
range of positions: attention's grid is sized for the whole cache (blocks past the position
leave at once), and the attention op names the positions where its kernel variant or grid
changes (_attn_bounds), so each range between them has a graph of its own, captured on
first use (_regime): up to four for the decode attention of a grouped-query model (three for
groups of 2), two for multi-head attention, when every layer has the same heads.
``CYLLM_CUDA_GRAPHS=0`` turns graphs off (eager ops, still reading the step buffer).
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

from ...errors import InvalidArgumentError
from ..base import check_token

try:  # CuPy is optional: this module imports without it
    import cupy as cp
except Exception:  # noqa: BLE001 - reported by CudaBackend when it is constructed
    cp = None


READ_STEP = np.int32(-1)      # a kernel's token or position argument: "read the step buffer" (step_value)


class GraphDecode:
    """Needs from the backend: ``_stream``, ``_step``/``_step_host`` (the step buffer and its
    host copy), ``_flush()`` and ``_drop_held()`` (ops held back to fold into the next one:
    launched, or forgotten), ``use_graphs``, and the ops reading the step buffer while
    ``_device_mode`` is set (recording ``_vocab``/``_max_pos`` for the checks here)."""

    def reset_graph(self) -> None:
        """Forget the captured graphs (call after reallocating any run-state buffer)."""
        self._reset_decode_graphs()

    def _reset_decode_graphs(self) -> None:
        self._graph = None              # the graph of the last step
        self._graph_key = None          # the issue_ops the graphs were captured from
        self._graphs = {}               # regime (_regime) -> graph
        self._attn_bounds = None        # set by the attention op: see _regime
        self._vocab = None
        self._max_pos = None

    def decode_step(self, issue_ops, token: int, pos: int) -> None:
        """Run ``issue_ops(token, pos)`` (one token's whole forward pass) for this token.

        The first call of a regime (_regime) runs it eagerly (compiling kernels,
        allocating scratch) and captures it as a CUDA graph; later calls only write
        {token, pos} to the device and replay that graph. Every op issued must take its
        per-step values from the step buffer, which the ops of this backend do
        while decode_step runs; ``issue_ops`` must not allocate or synchronise.
        """
        self._flush()                       # an op held back by eager calls goes before this step
        token = int(token)
        pos = int(pos)
        if self._vocab is not None:
            check_token(token, self._vocab)
        if self._max_pos is not None and not 0 <= pos < self._max_pos:
            raise InvalidArgumentError(f"position {pos} is out of range [0, {self._max_pos})")
        if pos < 0:
            raise InvalidArgumentError(f"position {pos} is out of range")
        self._step_host[0] = token
        self._step_host[1] = pos
        stream = self._stream
        with stream:
            self._upload_step()
            if self._graph_key != issue_ops:     # another model's forward pass: start over
                self._reset_decode_graphs()
                self._graph_key = issue_ops
            graph = self._graphs.get(self._regime(pos))
            if graph is not None:
                self._graph = graph
                graph.launch(stream=stream)
                return
            self._device_mode = True
            try:
                self._vocab = None
                self._max_pos = None
                self._step_read_back = False
                issue_ops(token, pos)           # eager: computes this token, compiles, allocates
                self._flush()
                # a step whose ops read a value back to the host (a mixture of experts routed
                # there) is run as issued each time, as data_dependent_steps says beforehand
                if self.use_graphs and not self.data_dependent_steps and not self._step_read_back:
                    self._capture(issue_ops, token, pos)
            finally:
                self._device_mode = False

    def _upload_step(self) -> None:
        """The step buffer's host copy {token, pos} to the device, on the backend's stream;
        pageable source: the call returns once the 8 bytes are staged, so reuse is safe."""
        cp.cuda.runtime.memcpyAsync(self._step.data.ptr, self._step_host.ctypes.data, 8,
                                    cp.cuda.runtime.memcpyHostToDevice, self._stream.ptr)

    def _capture(self, issue_ops, token: int, pos: int) -> None:
        stream = self._stream
        graph = None
        try:
            stream.begin_capture()
            try:
                issue_ops(token, pos)
                self._flush()                   # a held-back rmsnorm or matvec belongs to this graph
            finally:
                graph = stream.end_capture()
        except Exception as e:  # noqa: BLE001 - something in issue_ops cannot be captured
            import warnings
            warnings.warn(f"cyllm: CUDA graph capture failed ({e}); decoding without graphs", RuntimeWarning)
            self._drop_held()                   # ops of the aborted pass: never launched
            self.use_graphs = False
            self._reset_decode_graphs()
            return
        self._graph = self._graphs[self._regime(pos)] = graph

    def _regime(self, pos: int):
        """Which of the step's graphs serves position pos: the number of the attention op's
        bounds (_attn_bounds, CudaBackend._attn_plan) at or below it. Decode attention's
        variant and grid change with the cache's length (K/V rows loaded before pdl_wait
        while a short cache spreads over one wave; query heads a block), and a graph keeps
        the launches it was captured with, so each range of positions has a graph of its
        own, captured on first use (None: the first step, or no attention op that varies)."""
        return bisect_right(self._attn_bounds, pos) if self._attn_bounds else None

    def _note_attn_bounds(self, *bounds: int) -> None:
        """The attention op's positions where its launches change (0: none); each starts a
        graph regime. Called per layer while a step is recorded, so known ones change nothing."""
        known = self._attn_bounds or ()
        if any(b > 0 and b not in known for b in bounds):
            self._attn_bounds = tuple(sorted({*known, *(b for b in bounds if b > 0)}))
