"""Prefill chunks through CUDA graphs (a mixin of CudaBackend).

A chunk of a prompt is about fifteen launches a layer. Issued from Python they cost a small
model more than its GPU work: SmolLM2-135M Q4_K_M on an H100 spent ~26 ms of host time on a
512-token prefill against 12 ms of GPU work (bench/results/cuda_quant_model_h100.md). So
``prefill_step`` records a chunk's ops once and replays them. The chunk's token ids and its
first position come from device buffers (the ids copied, the position written to the step
buffer's second slot, before each replay), so one graph serves every chunk of its length at
any position. A graph is kept per (model pass, chunk length, all logits or none), at most
MAX_PREFILL_GRAPHS of them (the least recently replayed goes first).

Chunk lengths are few: ``prefill_rows`` pads a short chunk (a chat's next turn, a long
prompt's remainder) to a power of two from MIN_PADDED_ROWS to PADDED_STEP rows, and past that
to a multiple of PADDED_STEP, its extra rows repeating the last id. Those lengths are captured
the first time they run; any other length (one the end of the context cut short) the second
time it comes. Padding costs GPU work on rows nobody reads (at most PADDED_STEP - 1 of them
past PADDED_STEP rows, where a large model's GEMMs start to count); an eager chunk costs the
host its ~330 launches whatever its rows.
``CYLLM_CUDA_PREFILL_GRAPHS=0`` (or ``CYLLM_CUDA_GRAPHS=0``) runs every chunk eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import InvalidArgumentError

try:  # CuPy is optional: this module imports without it
    import cupy as cp
except Exception:  # noqa: BLE001 - reported by CudaBackend when it is constructed
    cp = None

MAX_PREFILL_GRAPHS = 12          # the padded lengths of a 512-token chunk are 10
MIN_PADDED_ROWS = 16
PADDED_STEP = 64


def padded_length(t: int) -> bool:
    """Whether prefill_rows pads to t rows (t > 0)."""
    if t <= PADDED_STEP:
        return t >= MIN_PADDED_ROWS and t & (t - 1) == 0
    return t % PADDED_STEP == 0


@dataclass
class PrefillRecord:
    """What the ops of a chunk note while it is recorded (PrefillOps reads ``_prefill_rec``)."""
    tokens: object                  # device int32 (T,): the ids the recorded embed reads
    limit: int = 1 << 62            # a chunk must end at or before every op's position limit
    vocab: int = 1 << 62            # and hold ids below every embedding table's rows
    capturable: bool = True         # False: an op kept host positions (heads over 256 wide)
    scratch: tuple = ()             # the scratch buffers the graph reads and writes: kept alive
                                    # with it when a later chunk grows their names (PrefillOps._buf)


class GraphPrefill:
    """Needs from the backend: ``_stream``, ``_step_host`` and ``_upload_step()`` (GraphDecode),
    ``_flush()``, ``_drop_held()``, ``use_graphs``, ``prefill_graphs``, and PrefillOps' batched
    ops (which read ``_prefill_rec``) and scratch buffers (``_scratch``)."""

    def reset_graph(self) -> None:
        super().reset_graph()
        self._prefill_graphs = {}       # (issue_ops, T, all_logits) -> (state, graph, record), oldest use first
        self._prefill_once = set()      # keys run once without a graph
        self._prefill_never = set()     # keys whose chunk cannot be captured: run eagerly

    def prefill_rows(self, t: int, most: int) -> int:
        """t rows padded to a length that gets a graph (see the module's docstring), at most
        ``most`` (the model's chunk, or the positions left in its cache); t where no graph
        would replay it (graphs off, chunks that depend on their values, or chunks that cannot be
        captured: heads over 256 wide)."""
        if not (self.use_graphs and self.prefill_graphs) or self.data_dependent_prefill or self._prefill_never or t <= 0:
            return t
        if t <= PADDED_STEP:
            rows = max(MIN_PADDED_ROWS, 1 << (t - 1).bit_length())
        else:
            rows = -(-t // PADDED_STEP) * PADDED_STEP
        return max(t, min(most, rows))

    def run_ops(self, issue_ops, *args) -> None:
        with self._stream:              # after the chunks, on their stream
            issue_ops(*args)
            self._flush()

    def prefill_step(self, issue_ops, state, tokens, pos0: int, all_logits: bool) -> None:
        """Run ``issue_ops(T, pos0, all_logits)``, one chunk of a prompt whose ids are
        ``tokens`` (T host ints, the ones the ops' embed reads from ``state``), through its
        graph when it has one (see the module's docstring)."""
        self._flush()                   # an op held back by eager calls goes before the chunk
        t, pos0 = len(tokens), int(pos0)
        if not (self.use_graphs and self.prefill_graphs) or self.data_dependent_prefill or t == 0:
            with self._stream:          # the stream the graphs run on: cuBLAS picks its kernels per stream
                issue_ops(t, pos0, all_logits)
            return
        key = (issue_ops, t, bool(all_logits))
        entry = self._prefill_graphs.get(key)
        if entry is not None and entry[0] is state:
            _, graph, rec = entry
            self._prefill_graphs[key] = self._prefill_graphs.pop(key)     # the most recent use
            ids = np.ascontiguousarray(tokens, dtype=np.int32)
            if pos0 < 0 or pos0 + t > rec.limit:
                raise InvalidArgumentError(f"positions {pos0}..{pos0 + t - 1} are out of range [0, {rec.limit})")
            if int(ids.min()) < 0 or int(ids.max()) >= rec.vocab:
                issue_ops(t, pos0, all_logits)          # the eager ops say which id is wrong
                return
            with self._stream:
                self._chunk_inputs(rec.tokens, ids, pos0)
                graph.launch(stream=self._stream)
            return
        first_time = t == state.tokens.shape[0] or padded_length(t)
        if key in self._prefill_never or (not first_time and key not in self._prefill_once):
            self._prefill_once.add(key)                 # a length seen once may not come back
            with self._stream:
                issue_ops(t, pos0, all_logits)
            return
        self._record_chunk(key, issue_ops, state, tokens, pos0, all_logits)

    def _chunk_inputs(self, dev_ids, ids: np.ndarray, pos0: int) -> None:
        """The chunk's ids and first position to the device, on the graphs' stream; pageable
        sources: each call returns once its bytes are staged."""
        cp.cuda.runtime.memcpyAsync(dev_ids.data.ptr, ids.ctypes.data, ids.nbytes,
                                    cp.cuda.runtime.memcpyHostToDevice, self._stream.ptr)
        self._step_host[1] = pos0
        self._upload_step()             # graphs.py

    def _record_chunk(self, key, issue_ops, state, tokens, pos0: int, all_logits: bool) -> None:
        """Run the chunk eagerly with its ops reading the device buffers (compiling kernels,
        allocating scratch), then capture the same ops as a graph."""
        t = key[1]
        ids = np.ascontiguousarray(tokens, dtype=np.int32)
        rec = PrefillRecord(tokens=cp.empty(t, dtype=cp.int32))
        stream = self._stream
        with stream:
            self._chunk_inputs(rec.tokens, ids, pos0)
            self._prefill_rec = rec
            try:
                issue_ops(t, pos0, all_logits)          # eager: this chunk's results
                self._flush()
                if not rec.capturable:
                    self._prefill_never.add(key)
                    return
                graph = None
                try:
                    stream.begin_capture()
                    try:
                        issue_ops(t, pos0, all_logits)
                        self._flush()
                    finally:
                        graph = stream.end_capture()
                except Exception as e:  # noqa: BLE001 - something in issue_ops cannot be captured
                    import warnings
                    warnings.warn(f"cyllm: CUDA graph capture of a prefill chunk failed ({e}); "
                                  "prefilling without graphs", RuntimeWarning)
                    self._drop_held()
                    self.prefill_graphs = False
                    return
            finally:
                self._prefill_rec = None
        rec.scratch = tuple(self._scratch.values())
        self._prefill_graphs.pop(key, None)             # one of an older batch state
        if len(self._prefill_graphs) >= MAX_PREFILL_GRAPHS:
            self._prefill_graphs.pop(next(iter(self._prefill_graphs)))     # the least recently used
        self._prefill_graphs[key] = (state, graph, rec)
