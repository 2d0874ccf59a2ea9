"""CPU backend: the Cython/OpenMP kernels of cyllm._ext.kernels (cython_ext/).

The ops themselves (every op of backends.base.OPS) are methods of the compiled
base class CpuKernels: each call validates its arrays in C (a wrong dtype, shape or index
raises InvalidArgumentError) and runs without the GIL. This class adds the memory
side of the Backend protocol, the thread/variant policy, and decode_step: the
captured single-token forward pass (one OpenMP region per token).

Kernel variant: "avx512" (the AVX2 kernels + AVX-512F prefill GEMM/attention) when
the CPU has it, else "avx2" (AVX2 + FMA + F16C), else "generic" (portable C).
CYLLM_KERNELS=generic|avx2|avx512 or CpuBackend(variant=...) overrides; the choice
is made once per backend and shown by kernel_info(). CYLLM_FUSED=0 turns the
captured decode step off (the model then calls the ops one by one). Each captured
step's setting follows measured step times (step_tuner.py): unless the thread count was
given, its team size adapts to what else runs on the cores, and its matvecs' software
prefetch is kept on or off, whichever this CPU runs faster (CYLLM_PREFETCH=on|off fixes it).
"""

from __future__ import annotations

import os
import time

import numpy as np

from ..errors import BackendUnavailableError, InvalidArgumentError
from ..memory import drop_array_file_pages
from ..quant.formats import R16_OF, R16_ROWS
from ..quant.matrix import QuantMatrix
from ..threads import resolve_threads, startable
from . import moe
from .base import DECODE_OPS, Backend, HostArrays
from .step_tuner import StepTuner

try:
    from .._ext import kernels as _k
except ImportError as e:          # not built (source checkout without `pip install .`)
    raise BackendUnavailableError(
        f"the cpu backend's compiled kernels are missing ({e}); build them with "
        "`pip install .` (or `pip install -e . --no-build-isolation`) in the cyllm source tree"
    ) from None


# The ops a captured decode step may contain (see CpuBackend.decode_step): the decode
# ops of the registry plus rmsnorm_batch, which per-head q/k norms issue on (heads, hd) views.
_STEP_OPS = DECODE_OPS + ("rmsnorm_batch",)


def _fused_default() -> bool:
    return os.environ.get("CYLLM_FUSED", "1").strip().lower() not in ("0", "false", "no", "off")


def _adaptive_default(threads) -> bool:
    env = os.environ.get("CYLLM_ADAPTIVE_THREADS", "").strip().lower()
    if env:
        if env not in ("0", "1", "false", "true", "no", "yes", "off", "on"):
            raise InvalidArgumentError(f"CYLLM_ADAPTIVE_THREADS must be 0 or 1, got {env[:20]!r}")
        return env in ("1", "true", "yes", "on")
    return threads is None and not os.environ.get("OMP_NUM_THREADS", "").strip()


def _prefetch_default() -> str:
    """CYLLM_PREFETCH: "auto" (default: measured per step), "on" or "off"."""
    env = os.environ.get("CYLLM_PREFETCH", "").strip().lower() or "auto"
    if env not in ("auto", "on", "off"):
        raise InvalidArgumentError(f"CYLLM_PREFETCH must be auto, on or off, got {env[:20]!r}")
    return env


class CpuBackend(HostArrays, _k.CpuKernels, Backend):
    name = "cpu"
    fuse_qkv = False      # weights stay memory-mapped: no concatenated copy
    # fused quantized tensors (phi3's qkv, gate_up) are cut on the host, where a row slice is
    # a view of the file, and each part uploaded: a part may be reordered in groups of 16
    # rows (an r16 layout), whose row views exist only at multiples of 16
    quant_row_views = False

    def __init__(self, threads=None, variant: str | None = None, fused: bool | None = None):
        """threads: None -> OMP_NUM_THREADS or physical cores (cyllm.threads);
        variant: None -> $CYLLM_KERNELS or the best this CPU runs; "generic" | "avx2" | "avx512";
        fused: None -> $CYLLM_FUSED (default on): decode steps run as one captured program."""
        super().__init__(startable(resolve_threads(threads)), variant)
        self.fused = _fused_default() if fused is None else bool(fused)
        # a count left to us (no flag, no OMP_NUM_THREADS) is an upper bound: each decode
        # step's team size follows measured step times (step_tuner.py); CYLLM_ADAPTIVE_THREADS=0|1
        # says no or yes whatever the count's origin. The software prefetch is measured
        # the same way unless CYLLM_PREFETCH fixes it.
        pf = _prefetch_default()
        self._tuner = StepTuner(self.threads, threads=_adaptive_default(threads),
                                prefetch=pf != "off", tune_prefetch=pf == "auto")
        self._step_owner = None       # the issue_ops the program was captured from
        self._step_program = None     # its _k.DecodeProgram, or None when it cannot be captured

    # -- captured decode step ----------------------------------------------------------
    def decode_step(self, issue_ops, token, pos) -> None:
        """Run ``issue_ops(token, pos)`` (a model's forward pass for one token).

        The first call records the ops it issues (running each one normally, which
        validates every argument), then compiles them into a C program
        (_k.DecodeProgram) that later calls run inside ONE OpenMP parallel region
        with only the token and position changed: no Python per op, one wake-up of
        the thread team per token, barriers only where an op needs another's
        output. The logits are bitwise those of the op-by-op path. A different
        ``issue_ops`` recaptures; the program keeps every array it uses alive, so
        the model must keep issuing ops on the same arrays (model.py does: all its
        buffers are allocated once). CYLLM_FUSED=0 (or fused=False) turns this off.
        """
        if not self.fused:
            issue_ops(token, pos)
            return
        if self.data_dependent_steps:
            self._run_op_by_op(issue_ops, token, pos)
            return
        if self._step_owner is not None and self._step_owner == issue_ops:
            if self._step_program is None:      # not capturable: op by op
                self._run_op_by_op(issue_ops, token, pos)
            else:
                setting = self._tuner.next()
                t0 = time.perf_counter()
                self._step_program.run(token, pos, min(setting[0], self.threads), setting[1])
                self._tuner.record(setting, time.perf_counter() - t0)
            return
        self._capture(issue_ops, token, pos)

    def _run_op_by_op(self, issue_ops, token, pos) -> None:
        """A step that is not a captured program, op by op, on the team size the step tuner
        picks from measured step times, as a program's would be. With another process on one
        of two cores, a mixture of experts' 2-thread steps ran at 47.3 tok/s, the tuner's at
        112.5 (four of Qwen3-30B-A3B's blocks, Q4_K_M; bench/results/contention_epyc.md). The
        bits do not depend on the team size (see step_tuner.py)."""
        setting = self._tuner.next()
        full = self.threads
        self.threads = min(setting[0], full)         # the kernels' team (CpuKernels.threads)
        t0 = time.perf_counter()
        try:
            issue_ops(token, pos)
        finally:
            self.threads = full
        self._tuner.record(setting, time.perf_counter() - t0)

    def _capture(self, issue_ops, token, pos) -> None:
        records = []
        shadow = self.__dict__
        cls = type(self)

        depth = [0]

        def recorder(name):
            op = getattr(cls, name)

            def record(*args):
                depth[0] += 1
                try:
                    op(self, *args)         # runs (and validates) the op as usual
                finally:
                    depth[0] -= 1
                if depth[0] == 0:           # only the model's calls, not an op's inner ones
                    records.append((name, args))
            return record

        for name in _STEP_OPS:
            shadow[name] = recorder(name)
        try:
            issue_ops(token, pos)
        finally:
            for name in _STEP_OPS:
                shadow.pop(name, None)
        try:
            program = _k.DecodeProgram(self, records, token, pos)
        except _k.NotCapturable:
            program = None
        self._step_owner, self._step_program = issue_ops, program

    def step_info(self) -> dict | None:
        """The captured program: ops and barriers per token (None before the first step)."""
        p = self._step_program
        return None if p is None else {"ops": p.n_ops, "barriers": p.n_barriers}

    # kernel_variant and threads are properties of CpuKernels

    def set_threads(self, n) -> None:
        self.threads = startable(resolve_threads(n))
        self._tuner.set_max(self.threads)

    @property
    def decode_team(self) -> int:
        """Threads the next decode step runs on (below `threads` when the tuner chose fewer)."""
        return min(self._tuner.size, self.threads)

    def rope_store(self, q, k, v, cos, sin, k_cache, v_cache, pos) -> None:
        self.rope(q, k, cos, sin, pos, k_cache.shape[2])
        self.cache_store(k_cache, v_cache, k, v, pos)

    # a mixture of experts: routed by moe_route (the choice a decode program makes in C), the
    # chosen experts in one call (moe_experts) where they are one kind a role
    def captures_moe(self, experts) -> bool:
        return True         # DecodeProgram compiles moe (or, for mixed experts, runs op by op)

    def moe(self, out, x, router, experts, n_used, norm, act, scratch) -> None:
        moe.moe(self, out, x, router, experts, n_used, norm, act, scratch)

    def moe_batch(self, out, x, router, experts, n_used, norm, act, scratch) -> None:
        moe.moe_batch(self, out, x, router, experts, n_used, norm, act, scratch)

    # -- memory ---------------------------------------------------------------
    def upload(self, a: np.ndarray) -> np.ndarray:
        """The array itself when already usable: no copy of mmapped f16 weights. Otherwise
        a C-contiguous, aligned, native-order copy; float64 becomes float32 and a 1-D float16
        vector float32 (every vector op reads f32). Vectors (norms, biases) are always
        copied: a few KB each, but read from the file's map, each one maps the whole large
        page-cache folio around it (2 MB on hosts whose filesystem keeps large folios), which
        for a model whose matrices were all reordered at load put ~75 MB of file pages back
        into the resident set (tests/test_memory_quant.py). A QuantMatrix keeps its blocks
        (usually in the file's memory map), reordered by _native_layout where an r16 layout
        applies."""
        if isinstance(a, QuantMatrix):
            return self._native_layout(a)
        a = np.asarray(a)
        if a.ndim == 1:         # always a copy (above)
            dt = np.float32 if a.dtype in (np.float64, np.float16) else a.dtype.newbyteorder("=")
            return np.array(a, dtype=dt)
        if a.dtype == np.float64:
            a = a.astype(np.float32)
        elif not a.dtype.isnative:
            a = a.astype(a.dtype.newbyteorder("="))
        if a.flags.c_contiguous and a.flags.aligned:
            return a
        return np.ascontiguousarray(a)

    def _native_layout(self, qm: QuantMatrix) -> QuantMatrix:
        """Quantized matrices with rows in groups of 16 become their r16 layouts where
        the AVX512-VNNI kernels run (on Zen 4 their kernels are up to 2x the row kernels' speed,
        decode and prefill: bench/results/cpu_quant_epyc_zen4.md); the same bytes, reordered once
        at load (a copy; the file's pages of the tensor are dropped after). CYLLM_REPACK=0 keeps
        the file's layout. Any other matrix is used as it is."""
        r16 = R16_OF.get(qm.fmt.name)
        if r16 is None or qm.rows % R16_ROWS or not repack_enabled(self.quant_variant):
            return qm
        out = np.empty_like(qm.data)
        # in slices of whole groups, each slice's file pages dropped once copied: the resident
        # set grows by one slice, not by the tensor (a 128k-vocab embedding is ~300 MB)
        step = max(R16_ROWS, (_REPACK_SLICE // qm.row_bytes) // R16_ROWS * R16_ROWS)
        for a in range(0, qm.rows, step):
            b = min(qm.rows, a + step)
            _k.repack_r16(out[a:b], qm.data[a:b], qm.fmt.name, self.threads)
            drop_array_file_pages(qm.data[a:b])
        return QuantMatrix(out, r16, qm.shape)

    thread_team = True

    @property
    def captures_decode(self) -> bool:
        return self.fused and not self.data_dependent_steps

    def measure_bandwidth(self, nbytes: int, threads: int | None = None) -> tuple[float | None, str]:
        return self.measure_read_bandwidth(threads, nbytes), "cyllm read kernel"

    def measure_read_bandwidth(self, threads: int | None = None, nbytes: int = 512 << 20,
                               reps: int = 5) -> float:
        """Memory read bandwidth in GB/s with this backend's variant (roofline for `cyllm bench`)."""
        return measure_read_bandwidth(self.threads if threads is None else startable(threads),
                                      nbytes, reps, self.kernel_variant)

    def __repr__(self) -> str:
        return f"CpuBackend(threads={self.threads}, variant={self.kernel_variant!r})"


# quantized tables whose kernels on the r16 layouts beat their row kernels, so the backend
# repacks every quantized format at load for them. Zen 4
# (bench/results/cpu_quant_epyc_zen4.md), avx512vnni, `cyllm bench` A/B: TinyLlama Q4_K_M prefill
# +78% and decode +22%, Q4_0 +51% and +15%, Q8_0 +93% and +20%; the default model (SmolLM2-135M
# Q4_1) +51% and +46%; Q6_K (q6_k) prefill +52%, decode +3% (2 threads) and +23% (1 thread);
# SmolLM2-135M Q4_K_M (mostly q5_0) +25% and +31%. The q4_k
# algorithm in 256-bit registers for the avx2 table gained 1.1-1.3x per kernel but nothing in
# the model's decode, so the other tables keep the file's layout (their r16 entries are the
# portable ones).
R16_VARIANTS = ("avx512vnni",)


_REPACK_SLICE = 16 << 20        # bytes of a tensor reordered between two drops of its file pages


def repack_enabled(quant_variant: str) -> bool:
    """Whether the CPU backend reorders quantized matrices into their r16 layouts at load:
    for the tables in R16_VARIANTS, unless CYLLM_REPACK=0."""
    env = os.environ.get("CYLLM_REPACK", "").strip()
    if env not in ("", "0", "1"):
        raise InvalidArgumentError(f"CYLLM_REPACK must be 0 or 1, got {env[:20]!r}")
    return env != "0" and quant_variant in R16_VARIANTS


def measure_read_bandwidth(threads: int = 1, nbytes: int = 512 << 20, reps: int = 5,
                           variant: str | None = None) -> float:
    """Best-of-reps read bandwidth (GB/s, 1e9 B/s) of `threads` threads summing a
    buffer of `nbytes` (far larger than the last-level cache)."""
    return _k.read_bandwidth_gbs(threads, nbytes, reps, variant)


def kernel_info() -> dict:
    """What runs the CPU kernels here: variant, cpu_features, openmp, max_threads.

    variant is the default one ($CYLLM_KERNELS or the best available); when
    $CYLLM_KERNELS names something unusable it is None and `error` says why.
    """
    info = {
        "variant": _k.DEFAULT_VARIANT,
        "cpu_features": _k.cpu_features(),
        "openmp": _k.openmp_enabled(),
        "max_threads": _k.omp_max_threads(),
        "available_variants": _k.available_variants(),
        "avx2_compiled": _k.avx2_compiled(),
    }
    if _k._DEFAULT_ERROR is not None:
        info["error"] = str(_k._DEFAULT_ERROR)
    else:
        try:
            q = _k.QuantKernels(1, None, _k.DEFAULT_VARIANT)
            info["quant_variant"] = q.quant_variant
            info["formats"] = weight_format_kernels(q)
        except Exception as e:          # noqa: BLE001 -- a bad $CYLLM_QKERNELS: say why
            info["quant_error"] = str(e)
    return info


def weight_format_kernels(q=None) -> dict:
    """{format: what computes it on this CPU}: the kernel table indexed by format."""
    from ..quant.formats import FORMATS
    if q is None:
        q = _k.QuantKernels(1, None, _k.DEFAULT_VARIANT)
    dot = {"generic": "portable C", "avx2": "AVX2 vpmaddubsw", "avxvnni": "AVX-VNNI vpdpbusd",
           "avx512vnni": "AVX512-VNNI vpdpbusd"}[q.quant_variant]
    out = {"f16": f"{_k.DEFAULT_VARIANT} f16 kernels (F16C + FMA)" if _k.DEFAULT_VARIANT != "generic"
           else "generic f16 kernels (portable C)"}
    for f in FORMATS.values():
        if not f.quantized:
            continue
        out[f.name] = (f"{q.quant_variant}: {dot} integer dot, x as {f.act} blocks; prefill "
                       + ("int8 GEMM" if q.prefill_method_of(f.name) == "int8" else "f16 panels + f16 GEMM"))
    if repack_enabled(q.quant_variant):
        for name, lay in R16_OF.items():
            out[name] += f"; rows in groups of 16 interleaved at load ({lay.name}), 16 rows per instruction"
    return out
