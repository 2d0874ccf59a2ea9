"""The op interface every backend implements, with the same names and argument order.

OPS below is the one registry of ops: every list of op names in cyllm (the
model's batched ops, the CPU decode capture, the benchmark's null backend, the
op test table) derives from it.

Conventions (shared by numpy_ref, cpu and cuda):
- Every op writes into a preallocated ``out`` given first, and allocates nothing.
- Activations are float32 vectors; weight matrices are float16, row-major
  (d_out, d_in); norm weights and biases are float32; the KV cache is float16.
- One layer's KV cache is a pair of arrays (n_kv_heads, max_ctx, head_dim) f16:
  each head's keys are contiguous in time, which is what attention reads.
- Rotary embeddings use the Hugging Face "rotate half" layout: within a head,
  element i pairs with element i + rot/2 for the first rot dims (rot = 2 *
  cos.shape[1]; partial rotary leaves the rest of the head as it is).
- Attention with ``window`` w > 0 sees the last w positions (itself included);
  ``scale`` None means 1/sqrt(head_dim); ``softcap`` c > 0 turns each scaled score s into
  c * tanh(s / c) before the softmax (Gemma 2), 0 leaves it.
- Ops marked *fused* exist because a benchmark showed they pay; each has a
  plain definition in numpy_ref.py, so tests compare every backend against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

Array = Any   # np.ndarray on the host backends, cupy.ndarray on cuda

ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class Op:
    name: str
    signature: str     # arguments after self, as every backend spells them
    doc: str
    batched: bool = False   # a prefill op over T rows


OPS: tuple[Op, ...] = (
    Op("embed", "out, table, token, scale=1.0", "out (dim,) f32 = table[token] * scale ; table (vocab, dim) f16"),
    Op("rmsnorm", "out, x, w, eps", "out (dim,) = x / sqrt(mean(x^2) + eps) * w ; out may alias x"),
    Op("matvec", "out, w, x", "out (d,) f32 = w @ x ; w (d, n) f16, x (n,) f32"),
    Op("matvec_add", "out, w, x", "*fused* out (d,) += w @ x"),
    Op("gate_up", "out, w_gate, w_up, x, act='silu'",
       "*fused* out (f,) = act(w_gate @ x) * (w_up @ x) ; act 'silu' | 'gelu_tanh'"),
    Op("rope", "q, k, cos, sin, pos, head_dim=None",
       "in place on q (n_heads*hd,), k (n_kv*hd,) ; cos, sin (max_ctx, rot/2), row pos ; hd None = rot"),
    Op("cache_store", "k_cache, v_cache, k, v, pos", "k_cache[:, pos] = k ; v_cache[:, pos] = v (f32 -> f16)"),
    Op("rope_store", "q, k, v, cos, sin, k_cache, v_cache, pos",
       "*fused* rope(q, k, cos, sin, pos, head_dim of the cache) then cache_store"),
    Op("attention", "out, q, k_cache, v_cache, pos, window=0, scale=None, softcap=0.0",
       "causal attention of one query over cache positions max(0, pos+1-window)..pos ; "
       "query head h reads kv head h // (n_heads // n_kv)"),
    Op("moe", "out, x, router, experts, n_used, norm, act, scratch",
       "*fused* out (dim,) += sum over the n_used experts e of the highest p = softmax(router @ x), "
       "best first, of w_e * (w_down_e @ (act(w_gate_e @ x) * (w_up_e @ x))) ; w = those p, divided by "
       "their sum with norm ; router (E, dim) f32 ; experts: E (w_gate, w_up, w_down) ; scratch: "
       "backends.moe.MoeScratch"),
    Op("swiglu", "out, gate, up", "out (f,) = silu(gate) * up"),
    Op("add", "out, x, y", "out = x + y, all (n,) f32 (out may alias x)"),
    Op("embed_batch", "out, table, tokens, scale=1.0", "out (T, dim) = table[tokens] * scale ; tokens (T,) int32 host",
       batched=True),
    Op("rmsnorm_batch", "out, x, w, eps", "rmsnorm of every row: out, x (T, n) ; w (n,)", batched=True),
    Op("matmul", "out, w, x", "out (T, d) = x @ w.T ; w (d, n) f16, x (T, n) f32", batched=True),
    Op("matmul_add", "out, w, x", "*fused* out (T, d) += x @ w.T", batched=True),
    Op("gate_up_batch", "out, w_gate, w_up, x, act='silu'", "*fused* out (T, f) = act(x @ w_gate.T) * (x @ w_up.T)",
       batched=True),
    Op("moe_batch", "out, x, router, experts, n_used, norm, act, scratch",
       "*fused* moe of every row: out, x (T, dim)", batched=True),
    Op("add_rows", "out, x, b", "out (T, n) = x (T, n) + b (n,) on every row (out may alias x)", batched=True),
    Op("rope_batch", "q, k, cos, sin, pos0, head_dim=None", "rope of every row; row t is position pos0 + t",
       batched=True),
    Op("cache_store_batch", "k_cache, v_cache, k, v, pos0", "k_cache[:, pos0 + t] = k[t] (same for v)",
       batched=True),
    Op("attention_batch", "out, q, k_cache, v_cache, pos0, window=0, scale=None, softcap=0.0",
       "causal attention of T queries: row t is attention(..., pos0 + t, window, scale, softcap)",
       batched=True),
)
OP_NAMES = tuple(o.name for o in OPS)
DECODE_OPS = tuple(o.name for o in OPS if not o.batched)
BATCH_OPS = tuple(o.name for o in OPS if o.batched)


class Backend:
    """What every backend is beyond its ops: memory, capabilities with their defaults.

    The ops themselves (OPS) are methods of each backend class; they are not
    declared here so that a compiled base class (the CPU kernels) provides them.
    """

    name: str = "?"
    kernel_variant: str = "?"
    threads: int = 1
    # True: the model uploads q/k/v as one (q+2kv, dim) matrix (one matvec instead of
    # three); backends that map weights without copying say False
    fuse_qkv: bool = False
    # True: each batched op gives every row the bits its single-row op gives at that
    # position. The model asks for it when weights are quantized: their kernels round the
    # activations to int8 blocks, where a last-bit difference between the prefill and
    # decode paths can flip a rounding and change the text a seed gives (host backends)
    batch_rows_exact: bool = False
    # True: a row slice of an uploaded quantized matrix is a view the ops accept (fused
    # q/k/v and gate/up tensors are cut after upload); False: the model cuts them on the host
    quant_row_views: bool = True
    # True: a decode step's ops depend on values the host computes between them (a mixture of
    # experts whose experts the host picks by the router's scores), so a backend that records a
    # step and replays it (cpu's decode program, cuda's graphs) runs such steps as issued. The
    # model sets it where captures_moe is False for a layer's experts.
    data_dependent_steps: bool = False
    # the same of prefill chunks (cuda's prefill graphs): moe_batch groups a chunk's rows by
    # expert on the host. The model sets it where captures_moe_batch is False for a layer's experts.
    data_dependent_prefill: bool = False
    # prompt tokens per batched prefill pass: the weights are read once per pass, the
    # activations of the pass must stay in cache (CPU) -- a GPU wants far larger passes,
    # where each op's launch and each weight read is shared by more tokens
    prefill_chunk: int = 256

    def stack_rows(self, mats: tuple) -> Array | None:
        """Uploaded matrices of one width -> one matrix of their rows stacked that ``matvec``
        takes (out = the parts' products side by side), holding no copy of their bytes; None
        where this backend has no such stack for them (the model then runs one matvec each).
        The cuda backend stacks a layer's quantized q, k, v of one format (and, where the
        three fit one wave of blocks, a v of another format): one launch."""
        return None

    def upload(self, a: np.ndarray) -> Array:
        """Host array -> backend array (weights, once). May return a view (no copy)."""
        raise NotImplementedError

    def upload_experts(self, trios) -> Sequence:
        """A layer's experts, one (w_gate, w_up, w_down) trio of host weights an expert -> what
        the moe ops take: indexed by expert id, each item the expert's trio on the backend.
        Here each weight uploaded on its own; the cuda backend puts a role's quantized experts
        in one array, so that one launch runs the chosen ones by their ids on the device."""
        return tuple(tuple(self.upload(w) for w in trio) for trio in trios)

    def captures_moe(self, experts) -> bool:
        """Whether a decode step with ``moe`` over these experts (upload_experts') can be
        recorded and replayed: the experts are chosen inside the step (cpu's decode program,
        cuda's device routing), not by the host between its ops."""
        return False

    def captures_moe_batch(self, experts, tokens: int, n_used: int) -> bool:
        """The same of a prefill chunk of up to ``tokens`` rows with ``moe_batch`` over these
        experts (``n_used`` a row): its rows are routed and grouped by expert inside the chunk
        (cuda, quantized stacks), not by the host."""
        return False

    def empty(self, shape, dtype=np.float32) -> Array:
        """A new zeroed backend array (run state, once)."""
        raise NotImplementedError

    def to_host(self, a: Array) -> np.ndarray:
        raise NotImplementedError

    def synchronize(self) -> None:
        pass

    def decode_step(self, issue_ops, token: int, pos: int) -> None:
        """Run one token's ops; backends that capture the step (cpu, cuda) override this."""
        issue_ops(token, pos)

    def prefill_step(self, issue_ops, state, tokens, pos0: int, all_logits: bool) -> None:
        """Run one prompt chunk's ops, ``issue_ops(len(tokens), pos0, all_logits)``, whose
        embed reads ``tokens`` from ``state``; the cuda backend replays captured chunks."""
        issue_ops(len(tokens), pos0, all_logits)

    def prefill_rows(self, t: int, most: int) -> int:
        """The rows to run a prompt chunk of t tokens at (t <= rows <= most); a backend that
        replays captured chunks pads a short one to a length it keeps a graph for (the extra
        rows write cache positions past the chunk: see Model.prefill)."""
        return t

    def run_ops(self, issue_ops, *args) -> None:
        """Run ops outside a step (a prompt's last logits), ordered after the steps before."""
        issue_ops(*args)

    def set_threads(self, n) -> None:
        """Kernel threads; backends without a thread pool keep 1."""

    # capabilities the tools ask about (bench, tune); every backend answers, none is probed
    thread_team = False        # True: kernels run on a team of `threads` (the count can be swept)

    @property
    def captures_decode(self) -> bool:
        """True when decode_step replays a recorded step (Python issues no ops per token)."""
        return False

    def measure_bandwidth(self, nbytes: int, threads: int | None = None) -> tuple[float | None, str]:
        """(GB/s, what was measured): the memory bandwidth the roofline of `cyllm bench` uses;
        (None, "unavailable") where the backend has no probe."""
        return None, "unavailable"

    def supports_batch(self) -> bool:
        """True when every batched op exists (prefill runs T tokens per pass)."""
        return all(callable(getattr(self, op, None)) for op in BATCH_OPS)

    def missing_ops(self) -> list[str]:
        return [op for op in OP_NAMES if not callable(getattr(self, op, None))]


class HostArrays:
    """Memory ops of the backends whose arrays are plain host numpy arrays."""

    def empty(self, shape, dtype=np.float32) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)   # calloc'd: pages cost nothing until touched

    def to_host(self, a: np.ndarray) -> np.ndarray:
        return a

    def synchronize(self) -> None:
        pass


def check_token(token: int, vocab: int) -> None:
    """Shared guard: kernels index tables with this, so it must be in range."""
    if not 0 <= token < vocab:
        from ..errors import InvalidArgumentError
        raise InvalidArgumentError(f"token id {token} is out of range [0, {vocab})")


def window_start(pos: int, window: int) -> int:
    """First cache position attended by the query at ``pos`` under a sliding window."""
    return pos + 1 - window if 0 < window < pos + 1 else 0
