"""The op interface every backend implements, with the same names and argument order.

Conventions (shared by numpy_ref, cpu and cuda):
- Every op writes into a preallocated ``out`` given first, and allocates nothing.
- Activations are float32 vectors; weight matrices are float16, row-major
  (d_out, d_in); norm weights and biases are float32; the KV cache is float16.
- One layer's KV cache is a pair of arrays (n_kv_heads, max_ctx, head_dim) f16:
  each head's keys are contiguous in time, which is what attention reads.
- Rotary embeddings use the Hugging Face "rotate half" layout: within a head,
  element i pairs with element i + head_dim/2.
- Ops marked *fused* exist because a benchmark showed they pay; each has a
  plain definition in numpy_ref.py, so tests compare every backend against it.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

Array = Any   # np.ndarray on the host backends, cupy.ndarray on cuda


class Backend(Protocol):
    name: str              # "numpy" | "cpu" | "cuda"
    kernel_variant: str    # what runs the kernels: "numpy", "avx2", "generic", "cuda"
    threads: int           # worker threads used by the kernels (1 for numpy/cuda)
    fuse_qkv: bool         # True: the model uploads q/k/v as one (q+2kv, dim) matrix (one matvec
                           # instead of three); backends that map weights without copying say False

    # -- memory ---------------------------------------------------------------
    def upload(self, a: np.ndarray) -> Array:
        """Host array -> backend array (weights, once). May return a view (no copy)."""

    def empty(self, shape: tuple[int, ...], dtype=np.float32) -> Array:
        """A new uninitialised backend array (run state, once)."""

    def to_host(self, a: Array) -> np.ndarray:
        """Backend array -> host numpy array (a view where the backend allows)."""

    def synchronize(self) -> None:
        """Wait until every queued op has finished."""

    # -- ops ------------------------------------------------------------------
    def embed(self, out: Array, table: Array, token: int) -> None:
        """out (dim,) f32 = table[token] ; table (vocab, dim) f16."""

    def rmsnorm(self, out: Array, x: Array, w: Array, eps: float) -> None:
        """out (dim,) f32 = x / sqrt(mean(x^2) + eps) * w ; x (dim,) f32, w (dim,) f32."""

    def matvec(self, out: Array, w: Array, x: Array) -> None:
        """out (d,) f32 = w @ x ; w (d, n) f16, x (n,) f32."""

    def matvec_add(self, out: Array, w: Array, x: Array) -> None:
        """*fused* out (d,) f32 += w @ x ; the residual add folded into the matvec."""

    def gate_up_silu(self, out: Array, w_gate: Array, w_up: Array, x: Array) -> None:
        """*fused* out (f,) f32 = silu(w_gate @ x) * (w_up @ x) ; w_gate, w_up (f, n) f16."""

    def rope(self, q: Array, k: Array, cos: Array, sin: Array, pos: int) -> None:
        """In place on q (n_heads*head_dim,) and k (n_kv_heads*head_dim,) f32.

        cos, sin (max_ctx, head_dim/2) f32 tables; row ``pos`` is used.
        """

    def cache_store(self, k_cache: Array, v_cache: Array, k: Array, v: Array, pos: int) -> None:
        """k_cache[:, pos, :] = k ; v_cache[:, pos, :] = v (f32 -> f16).

        k_cache, v_cache (n_kv_heads, max_ctx, head_dim) f16 ; k, v (n_kv_heads*head_dim,) f32.
        """

    def rope_store(self, q: Array, k: Array, v: Array, cos: Array, sin: Array,
                   k_cache: Array, v_cache: Array, pos: int) -> None:
        """*fused* rope(q, k, cos, sin, pos) then cache_store(k_cache, v_cache, k, v, pos)."""

    def attention(self, out: Array, q: Array, k_cache: Array, v_cache: Array, pos: int) -> None:
        """Causal attention of one query over cache positions 0..pos inclusive.

        out, q (n_heads*head_dim,) f32 ; k_cache, v_cache (n_kv_heads, max_ctx, head_dim) f16.
        Query head h reads KV head h // (n_heads // n_kv_heads); scale 1/sqrt(head_dim).
        """

    def swiglu(self, out: Array, gate: Array, up: Array) -> None:
        """out (f,) f32 = silu(gate) * up."""

    def add(self, out: Array, x: Array, y: Array) -> None:
        """out = x + y, all (n,) f32 (out may alias x)."""

    # -- batched ops (prefill: T tokens at once, each row one position) --------
    def embed_batch(self, out: Array, table: Array, tokens: np.ndarray) -> None:
        """out (T, dim) f32 = table[tokens] ; tokens (T,) int32 on the host."""

    def rmsnorm_batch(self, out: Array, x: Array, w: Array, eps: float) -> None:
        """rmsnorm of every row: out, x (T, dim) f32 ; w (dim,) f32."""

    def matmul(self, out: Array, w: Array, x: Array) -> None:
        """out (T, d) f32 = x @ w.T ; w (d, n) f16, x (T, n) f32."""

    def matmul_add(self, out: Array, w: Array, x: Array) -> None:
        """*fused* out (T, d) f32 += x @ w.T."""

    def gate_up_silu_batch(self, out: Array, w_gate: Array, w_up: Array, x: Array) -> None:
        """*fused* out (T, f) f32 = silu(x @ w_gate.T) * (x @ w_up.T) ; x (T, n) f32."""

    def add_rows(self, out: Array, x: Array, b: Array) -> None:
        """out (T, n) = x (T, n) + b (n,) broadcast over rows (out may alias x)."""

    def rope_batch(self, q: Array, k: Array, cos: Array, sin: Array, pos0: int) -> None:
        """rope on every row in place: q (T, n_heads*head_dim), k (T, n_kv*head_dim); row t is position pos0+t."""

    def cache_store_batch(self, k_cache: Array, v_cache: Array, k: Array, v: Array, pos0: int) -> None:
        """k_cache[:, pos0+t, :] = k[t] (same for v) ; k, v (T, n_kv*head_dim) f32."""

    def attention_batch(self, out: Array, q: Array, k_cache: Array, v_cache: Array, pos0: int) -> None:
        """Causal attention for T queries: row t attends to cache positions 0..pos0+t inclusive.

        out, q (T, n_heads*head_dim) f32 ; the cache must already hold positions up to pos0+T-1.
        """


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
