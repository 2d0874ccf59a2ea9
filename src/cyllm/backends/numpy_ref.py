"""Plain NumPy float32 reference backend: the ground truth the tests compare against.

Written for clarity, not speed: each op is the textbook formula. Weights are
widened to float32 at upload (quantized ones dequantized by cyllm.quant.reference)
so the arithmetic here is float32 throughout,
while the KV cache stays float16 exactly as in the fast backends.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgumentError
from ..quant.matrix import QuantMatrix
from ..quant.reference import quantize_act
from . import moe
from .base import ACTIVATIONS, Backend, HostArrays, check_token, window_start


def silu(x: np.ndarray) -> np.ndarray:
    # exp(-x) overflows to inf for x < -88, and x / inf = -0 is the right limit
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU with the tanh approximation (Gemma's gelu_pytorch_tanh)."""
    x = x.astype(np.float32, copy=False)
    return (0.5 * x * (1.0 + np.tanh(np.float32(np.sqrt(2.0 / np.pi)) * (x + np.float32(0.044715) * x ** 3)))
            ).astype(np.float32)


def activation(name: str):
    if name not in ACTIVATIONS:
        raise InvalidArgumentError(f"act must be one of {', '.join(ACTIVATIONS)}, got {name!r}")
    return silu if name == "silu" else gelu_tanh


class _ActQuant(np.ndarray):
    """A dequantized weight matrix whose products first round x the way the native
    kernels do (``act``: the activation format of its block format)."""
    act: str | None = None

    def __array_finalize__(self, obj):
        self.act = getattr(obj, "act", None)


def _fake_quant(x: np.ndarray, act: str | None) -> np.ndarray:
    """x (..., n) -> float64 with every row rounded to int8 blocks of format act (x = q * d)."""
    if act is None:
        return x
    x2 = np.asarray(x, np.float32).reshape(-1, x.shape[-1])
    out = np.empty(x2.shape, np.float64)
    for r in range(x2.shape[0]):
        a = quantize_act(x2[r], act)
        block = a["q"].size // a["d"].size
        out[r] = (a["q"].astype(np.float64).reshape(-1, block) * a["d"].astype(np.float64)[:, None]).reshape(-1)
    return out.reshape(x.shape)


def _mm(w, x):
    """w @ x for x (n,) or x @ w.T for x (T, n): float32, or float64 on fake-quantized x."""
    act = getattr(w, "act", None)
    if act is None:
        return w.astype(np.float32, copy=False) @ x if x.ndim == 1 else x @ w.astype(np.float32, copy=False).T
    xq = _fake_quant(x, act)
    w64 = np.asarray(w, np.float64)
    return (w64 @ xq if x.ndim == 1 else xq @ w64.T).astype(np.float32)


class NumpyBackend(HostArrays, Backend):
    name = "numpy"
    kernel_variant = "numpy"
    fuse_qkv = False

    def __init__(self, threads: int | None = None, quantized_activations: bool = False):
        """quantized_activations: products with a quantized weight matrix see x rounded to
        int8 blocks as the native CPU kernels round it (the reference of their math on a
        whole model); off (default): plain float32 math on the dequantized weights."""
        self.threads = 1
        self.quantized_activations = quantized_activations

    # -- memory ---------------------------------------------------------------
    def upload(self, a: np.ndarray) -> np.ndarray:
        # float16 weights are widened once so every matvec is float32 math; a quantized
        # matrix is dequantized (the reference stays plain: float32 weights)
        if isinstance(a, QuantMatrix):
            w = a.dequantize()
            if self.quantized_activations:
                w = w.view(_ActQuant)
                w.act = a.fmt.act
            return w
        if a.dtype == np.float16:
            return a.astype(np.float32)
        return np.array(a, copy=True)

    # -- ops ------------------------------------------------------------------
    def embed(self, out, table, token, scale=1.0):
        check_token(token, table.shape[0])
        out[:] = table[token].astype(np.float32) * np.float32(scale)

    def rmsnorm(self, out, x, w, eps):
        ms = np.mean(x.astype(np.float32) ** 2, dtype=np.float32)
        out[:] = x * np.float32(1.0 / np.sqrt(ms + np.float32(eps))) * w

    def matvec(self, out, w, x):
        out[:] = _mm(w, x)

    def matvec_add(self, out, w, x):
        out += _mm(w, x)

    def gate_up(self, out, w_gate, w_up, x, act="silu"):
        out[:] = activation(act)(_mm(w_gate, x)) * _mm(w_up, x)

    def rope(self, q, k, cos, sin, pos, head_dim=None):
        c, s = cos[pos], sin[pos]                         # (half,)
        half = c.shape[0]
        hd = 2 * half if head_dim is None else head_dim
        for vec in (q, k):
            h = vec.reshape(-1, hd)                       # (heads, head_dim) view
            x1 = h[:, :half].copy()
            x2 = h[:, half:2 * half].copy()
            h[:, :half] = x1 * c - x2 * s
            h[:, half:2 * half] = x2 * c + x1 * s

    def rope_store(self, q, k, v, cos, sin, k_cache, v_cache, pos):
        self.rope(q, k, cos, sin, pos, k_cache.shape[2])
        self.cache_store(k_cache, v_cache, k, v, pos)

    def cache_store(self, k_cache, v_cache, k, v, pos):
        n_kv, _, hd = k_cache.shape
        k_cache[:, pos, :] = k.reshape(n_kv, hd)
        v_cache[:, pos, :] = v.reshape(n_kv, hd)

    def attention(self, out, q, k_cache, v_cache, pos, window=0, scale=None, softcap=0.0):
        n_kv, _, hd = k_cache.shape
        n_heads = q.shape[0] // hd
        group = n_heads // n_kv
        start = window_start(pos, window)
        sc = np.float32(1.0 / np.sqrt(hd) if scale is None else scale)
        qh = q.reshape(n_heads, hd)
        oh = out.reshape(n_heads, hd)
        for h in range(n_heads):
            kv = h // group
            keys = k_cache[kv, start: pos + 1].astype(np.float32)    # (t, hd)
            vals = v_cache[kv, start: pos + 1].astype(np.float32)    # (t, hd)
            scores = keys @ qh[h] * sc                                # (t,)
            if softcap:
                scores = softcap * np.tanh(scores / softcap)
            scores = np.exp(scores - scores.max())
            oh[h] = (scores / scores.sum()) @ vals

    def moe(self, out, x, router, experts, n_used, norm, act, scratch):
        moe.moe(self, out, x, router, experts, n_used, norm, act, scratch)

    def moe_batch(self, out, x, router, experts, n_used, norm, act, scratch):
        moe.moe_batch(self, out, x, router, experts, n_used, norm, act, scratch)

    def swiglu(self, out, gate, up):
        out[:] = silu(gate) * up

    def add(self, out, x, y):
        np.add(x, y, out=out)

    # -- batched ops: the single-row op applied row by row, by definition ------
    def embed_batch(self, out, table, tokens, scale=1.0):
        for t, token in enumerate(tokens):
            self.embed(out[t], table, int(token), scale)

    def rmsnorm_batch(self, out, x, w, eps):
        for t in range(x.shape[0]):
            self.rmsnorm(out[t], x[t], w, eps)

    def matmul(self, out, w, x):
        out[:] = _mm(w, x)

    def matmul_add(self, out, w, x):
        out += _mm(w, x)

    def gate_up_batch(self, out, w_gate, w_up, x, act="silu"):
        out[:] = activation(act)(_mm(w_gate, x)) * _mm(w_up, x)

    def add_rows(self, out, x, b):
        np.add(x, b, out=out)

    def rope_batch(self, q, k, cos, sin, pos0, head_dim=None):
        for t in range(q.shape[0]):
            self.rope(q[t], k[t], cos, sin, pos0 + t, head_dim)

    def cache_store_batch(self, k_cache, v_cache, k, v, pos0):
        for t in range(k.shape[0]):
            self.cache_store(k_cache, v_cache, k[t], v[t], pos0 + t)

    def attention_batch(self, out, q, k_cache, v_cache, pos0, window=0, scale=None, softcap=0.0):
        for t in range(q.shape[0]):
            self.attention(out[t], q[t], k_cache, v_cache, pos0 + t, window, scale, softcap)
