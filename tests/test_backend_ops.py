"""Every op of the backend contract on every backend, against the NumPy reference.

One table of op cases (CASES), in the pattern of llama.cpp's tests/test-backend-ops.cpp:
each case names an op of backends.base.OPS and its shapes/parameters; the same case
runs on numpy_ref and on every backend this machine has, and the outputs are compared
with the op's tolerance (OUTPUTS). Backends ("runners"):

- cpu-<variant>-t<threads>: CpuBackend, every available kernel variant at 1 and 2 threads;
- cpu-step-<variant>: the decode ops run through CpuBackend.decode_step, i.e. the captured
  C program (csrc/program.c), whose kernels are not the op-by-op ones;
- cuda and cuda-graph (marked ``cuda``, skipped without cupy and a GPU): CudaBackend op
  by op, and the decode ops replayed from a captured CUDA graph (device-side token/pos).

Inputs are seeded from the case id (reproducible), outputs are poisoned with NaN before
the call (an unwritten element fails), and cache rows past the last attended position
hold NaN (a kernel that reads them fails). Exact ops (embed, cache_store, add) are
compared bit for bit, with float16 edge values (ties, subnormals, overflow, inf, NaN).

Backend-specific properties the table cannot express (bitwise identity across thread
counts, variant forcing, unaligned inputs, argument errors, CUDA launch shapes, ...)
stay in test_ops.py and test_cuda_ops.py.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import zlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

from conftest import require_cuda
from cyllm.backends.base import OP_NAMES, OPS
from cyllm.backends.moe import MoeScratch
from cyllm.backends.numpy_ref import NumpyBackend
from cyllm.errors import BackendUnavailableError
from cyllm.quant import FORMATS, QUANTIZED, QuantMatrix
from cyllm.quant.convert import quantize_rows_f32

try:
    from cyllm._ext import kernels as _k
    from cyllm.backends import cpu as _cpu
    CPU_VARIANTS = list(_k.available_variants())
    STEP_OPS = _cpu._STEP_OPS          # what a captured CPU decode step may contain
except (ImportError, BackendUnavailableError):        # extension not built: cpu rows absent
    _cpu = None
    CPU_VARIANTS = []
    STEP_OPS = ()

DECODE_OPS = tuple(o.name for o in OPS if not o.batched)


# -- the registry's signatures: argument names in order, and their declared defaults ----

def _parse_signature(sig: str) -> tuple[list[str], dict]:
    names, defaults = [], {}
    for part in sig.split(","):
        name, _, default = part.partition("=")
        names.append(name.strip())
        if default:
            defaults[name.strip()] = ast.literal_eval(default.strip())
    return names, defaults


SIGNATURES = {o.name: _parse_signature(o.signature) for o in OPS}


# -- argument markers -----------------------------------------------------------------

@dataclass(frozen=True)
class Host:
    """An argument that stays a host numpy array on every backend (embed_batch's tokens)."""
    value: np.ndarray


@dataclass(frozen=True)
class Alias:
    """This argument is the very array passed as argument ``name`` (out aliasing x)."""
    name: str


@dataclass(frozen=True)
class Experts:
    """moe's experts: E (w_gate, w_up, w_down) weights, each put on the backend as a weight."""
    mats: tuple


@dataclass(frozen=True)
class Scratch:
    """moe's work arrays (backends.moe.MoeScratch), allocated by the backend under test."""
    rows: int
    dim: int
    ffn: int
    n_experts: int
    n_used: int
    batch: bool


# -- tolerances ------------------------------------------------------------------------

@dataclass(frozen=True)
class Tol:
    """|got - want| <= rel * scale + atol, elementwise; rel == atol == 0: bit for bit.

    scale(inputs, want) is the error scale of each element (None: |want|); for sums of
    products it is the sum of |products|, which bounds float32 rounding whatever the order.
    cuda_rel replaces rel on the cuda backend where its arithmetic differs in kind
    (the GEMMs round x to float16: 2^-11 of each product).
    """
    rel: float = 0.0
    atol: float = 0.0
    scale: Callable | None = None
    cuda_rel: float | None = None

    @property
    def exact(self) -> bool:
        return self.rel == 0.0 and self.atol == 0.0


def _abs64(a):
    return np.abs(np.asarray(a, dtype=np.float64))


def dot_scale(inp, want):
    """matvec/matmul: sum_j |w_ij x_j|."""
    return _abs64(inp["x"]) @ _abs64(inp["w"]).T            # (d,) or (T, d)


def dot_add_scale(inp, want):
    """matvec_add/matmul_add: the products and the value out held before the call."""
    return dot_scale(inp, want) + _abs64(inp["out"])


def glu_scale(inp, want):
    """act(g) * u: errors of g and u scaled by |act'| <= 1.13 and |act(g)| <= |g|."""
    wg, wu, x = (np.asarray(inp[k], dtype=np.float64) for k in ("w_gate", "w_up", "x"))
    g, u = x @ wg.T, x @ wu.T
    bg, bu = np.abs(x) @ np.abs(wg).T, np.abs(x) @ np.abs(wu).T
    return 1.2 * bg * np.abs(u) + bu * np.abs(g) + np.abs(g * u)


def act_err(x, w_cols, act):
    """Per element of x (..., n): the bound amax(block)/254 on |x - q*d| when x is rounded to
    int8 blocks of format act (q = rint(x * 127/amax), d = amax/127)."""
    block = 32 if act == "q8_0" else 256
    xb = np.abs(np.asarray(x, np.float64)).reshape(*np.shape(x)[:-1], -1, block)
    return np.repeat(xb.max(axis=-1) / 254.0, block, axis=-1).reshape(np.shape(x))


def _w64(w):
    return np.abs(w.dequantize().astype(np.float64)) if isinstance(w, QuantMatrix) else _abs64(w)


def qdot_scale(inp, want):
    """Quantized weights: the native kernels round x to int8 blocks (error <= amax/254 per
    element), so the bound is sum_j |w_ij| err_j plus float32 rounding of the products."""
    w = inp["w"]
    return act_err(inp["x"], w.cols, w.fmt.act) @ _w64(w).T + 1e-5 * (_abs64(inp["x"]) @ _w64(w).T)


def qdot_add_scale(inp, want):
    return qdot_scale(inp, want) + 1e-5 * _abs64(inp["out"])


def qglu_scale(inp, want):
    """act(g) * u with g, u each off by its qdot bound (as glu_scale)."""
    x = np.asarray(inp["x"], np.float64)
    wg, wu = inp["w_gate"], inp["w_up"]
    dg, du = (np.asarray(m.dequantize() if isinstance(m, QuantMatrix) else m, np.float64) for m in (wg, wu))
    g, u = x @ dg.T, x @ du.T

    def bound(m, d):
        e = 1e-5 * (np.abs(x) @ np.abs(d).T)
        return e + (act_err(x, m.cols, m.fmt.act) @ np.abs(d).T if isinstance(m, QuantMatrix) else 0.0)
    bg, bu = bound(wg, dg), bound(wu, du)
    return 1.2 * bg * (np.abs(u) + bu) + bu * np.abs(g) + 1e-5 * np.abs(g * u)


def _route64(router, x, k, norm):
    """The experts of each row of x (T, n) and their weights, as the moe ops choose them (float64)."""
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64).T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, -1, kind="stable")[:, :k]
    w = np.take_along_axis(p, ids, -1)
    return ids, (w / w.sum(-1, keepdims=True) if norm else w)


def moe_scale(inp, want):
    """out plus, per chosen expert, its weight times sum_j |down_ij h_j| with h = |act(g) u|:
    the scale of the float32 sums (f16 weights), and of the int8 rounding of x and h (blocks)."""
    x = np.atleast_2d(np.asarray(inp["x"], np.float64))
    ids, w = _route64(inp["router"], x, inp["n_used"], inp["norm"])
    mats = [[np.asarray(m.dequantize() if isinstance(m, QuantMatrix) else m, np.float64) for m in trio]
            for trio in inp["experts"].mats]
    scale = _abs64(inp["out"]).reshape(x.shape[0], -1).copy()
    for t in range(x.shape[0]):
        for e, wt in zip(ids[t], w[t]):
            g, u, d = mats[e]
            h = np.abs(x[t] @ g.T) * np.abs(x[t] @ u.T) + (np.abs(x[t]) @ np.abs(g).T) * (np.abs(x[t]) @ np.abs(u).T)
            scale[t] += wt * (np.abs(d) @ h)
    return scale.reshape(np.shape(inp["out"]))


EXACT = Tol()
DOT = Tol(1e-5, scale=dot_scale)
GEMM = Tol(2e-5, scale=dot_scale, cuda_rel=1e-3)
DOT_ADD = Tol(1e-5, scale=dot_add_scale)
GEMM_ADD = Tol(2e-5, scale=dot_add_scale, cuda_rel=1e-3)
ROPE = Tol(1e-6, 2e-6)
F16_FLIP = Tol(1e-3, 1e-7)          # a float16 store of a value that may differ in its last f32 bit
ATTENTION = Tol(2e-4, 2e-5)

# op -> {written argument: tolerance}
OUTPUTS: dict[str, dict[str, Tol]] = {
    "embed": {"out": EXACT},
    "rmsnorm": {"out": Tol(2e-6, 1e-7, cuda_rel=1e-5)},
    "matvec": {"out": DOT},
    "matvec_add": {"out": DOT_ADD},
    "gate_up": {"out": Tol(1e-5, scale=glu_scale)},
    "rope": {"q": ROPE, "k": ROPE},
    "cache_store": {"k_cache": EXACT, "v_cache": EXACT},
    "rope_store": {"q": ROPE, "k": ROPE, "k_cache": F16_FLIP, "v_cache": EXACT},
    "attention": {"out": ATTENTION},
    "swiglu": {"out": Tol(1e-5, 1e-7)},
    "add": {"out": EXACT},
    "embed_batch": {"out": EXACT},
    "rmsnorm_batch": {"out": Tol(2e-6, 1e-6, cuda_rel=1e-5)},
    "matmul": {"out": GEMM},
    "matmul_add": {"out": GEMM_ADD},
    "gate_up_batch": {"out": Tol(2e-5, scale=glu_scale, cuda_rel=1e-3)},
    "add_rows": {"out": EXACT},
    "rope_batch": {"q": ROPE, "k": ROPE},
    "cache_store_batch": {"k_cache": EXACT, "v_cache": EXACT},
    "attention_batch": {"out": ATTENTION},
    "moe": {"out": Tol(1e-5, scale=moe_scale)},
    "moe_batch": {"out": Tol(1e-5, scale=moe_scale, cuda_rel=1e-3)},       # cuda: GEMMs of f16 x
}


# quantized weights (cases with a `fmt` parameter): x rounded to int8 blocks bounds the error
Q_DOT = Tol(1.0, scale=qdot_scale)
Q_OUTPUTS: dict[str, dict[str, Tol]] = {
    "embed": {"out": Tol(1e-30, cuda_rel=2.0**-11)},       # exact (cuda: f16 dequantized rows)
    "embed_batch": {"out": Tol(1e-30, cuda_rel=2.0**-11)},
    "matvec": {"out": Q_DOT},
    "matvec_add": {"out": Tol(1.0, scale=qdot_add_scale)},
    "gate_up": {"out": Tol(1.0, scale=qglu_scale)},
    "matmul": {"out": Q_DOT},
    "matmul_add": {"out": Tol(1.0, scale=qdot_add_scale)},
    "gate_up_batch": {"out": Tol(1.0, scale=qglu_scale)},
    # x and each expert's h rounded to int8 blocks: a few 1/254 of moe_scale's sums
    "moe": {"out": Tol(2e-2, scale=moe_scale)},
    "moe_batch": {"out": Tol(2e-2, scale=moe_scale)},
}


def tolerances(op, params):
    return Q_OUTPUTS[op] if "fmt" in params else OUTPUTS[op]


# -- input builders: (rng, **case params) -> {argument name: value} ----------------------

def qweights(rng, d, n, fmt):
    """A (d, n) weight matrix: float16, or a QuantMatrix of random rows (row scales varied
    over 4 decades, a zero row and a zero block) quantized by cyllm's quantizer."""
    if fmt in (None, "f16"):
        return f16(rng, d, n)
    x = rng.standard_normal((d, n)).astype(np.float32) * (10.0 ** rng.uniform(-2, 2, (d, 1))).astype(np.float32)
    x[d // 2] = 0.0
    x[0, :FORMATS[fmt].block] = 0.0
    return QuantMatrix(quantize_rows_f32(x, fmt), fmt, (d, n))

def f16(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float16)


def f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def nan32(*shape):
    return np.full(shape, np.nan, np.float32)


def special_f32(rng, n):
    """n float32 values: float16 rounding edge cases (ties, subnormals, overflow, signed
    zero, inf, NaN) first, then random values over 14 decades."""
    edge = np.array([0.0, -0.0, 1.0, -1.0, 65504.0, 65519.0, 65520.0, -65520.0, 1e6, -1e6,
                     6.1035156e-05, 6.0e-05, 5.96e-08, 2.98e-08, 2.99e-08, 1e-9, -3e-6,
                     1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 2049.0, 2051.0, np.inf, -np.inf, np.nan],
                    dtype=np.float32)
    rand = (rng.standard_normal(n) * 10.0 ** rng.uniform(-9, 5, n)).astype(np.float32)
    return np.concatenate([edge, rand])[:n]


def special_f16(rng, n):
    """n float16 values: signed zero, the largest, inf, NaN, subnormals, then random."""
    edge = np.array([0.0, -0.0, 65504.0, -65504.0, np.inf, -np.inf, np.nan, 2.0**-24, -(2.0**-24),
                     6.0975552e-05, 6.1035156e-05, 1e-7, 0.33325195, 2049.0], dtype=np.float16)
    return np.concatenate([edge, f16(rng, n)])[:n]


def rope_tables(max_ctx, rot, theta=10000.0):
    """cos, sin (max_ctx, rot/2) f32 of the usual inverse-frequency rotary embedding."""
    half = rot // 2
    inv = 1.0 / theta ** (np.arange(half, dtype=np.float64) * 2 / rot)
    ang = np.outer(np.arange(max_ctx), inv)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def kv_cache(rng, n_kv, max_ctx, hd, last=None):
    """k, v caches (n_kv, max_ctx, hd) f16; rows past ``last`` hold NaN (must not be read)."""
    k, v = f16(rng, n_kv, max_ctx, hd, scale=1.5), f16(rng, n_kv, max_ctx, hd)
    if last is not None:
        k[:, last + 1:] = np.nan
        v[:, last + 1:] = np.nan
    return k, v


def _optional(args, **kw):
    """Pass the op's optional parameters only where the case sets them (else: defaults)."""
    args.update({k: v for k, v in kw.items() if v is not None})
    return args


def b_embed(rng, vocab, dim, token, scale=None, specials=False, int64=False, fmt=None):
    if fmt is not None:
        table = qweights(rng, vocab, dim, fmt)
    else:
        table = (special_f16(rng, vocab * dim) if specials else f16(rng, vocab * dim)).reshape(vocab, dim)
    return _optional(dict(out=nan32(dim), table=table, token=np.int64(token) if int64 else token),
                     scale=scale)


def b_embed_batch(rng, vocab, dim, T, scale=None, specials=False, fmt=None):
    if fmt is not None:
        table = qweights(rng, vocab, dim, fmt)
    else:
        table = (special_f16(rng, vocab * dim) if specials else f16(rng, vocab * dim)).reshape(vocab, dim)
    tokens = rng.integers(0, vocab, T).astype(np.int32)
    tokens[0], tokens[-1] = vocab - 1, 0          # both ends of the table
    return _optional(dict(out=nan32(T, dim), table=table, tokens=Host(tokens)), scale=scale)


def b_rmsnorm(rng, n, eps=1e-5, T=None, alias=False):
    shape = (n,) if T is None else (T, n)
    x = f32(rng, *shape, scale=3.0)
    return dict(out=Alias("x") if alias else nan32(*shape), x=x, w=f32(rng, n), eps=eps)


def b_matvec(rng, d, n, add=False, fmt=None):
    x = f32(rng, n)
    if fmt is not None:
        x[:32] = 0.0                                 # an all-zero activation block (amax 0)
        x[40] *= 30.0                                # an outlier that sets its block's scale
    return dict(out=f32(rng, d) if add else nan32(d), w=qweights(rng, d, n, fmt), x=x)


def b_matmul(rng, T, d, n, add=False, fmt=None):
    return dict(out=f32(rng, T, d) if add else nan32(T, d), w=qweights(rng, d, n, fmt), x=f32(rng, T, n))


def b_gate_up(rng, f, n, T=None, act=None, fmt=None, fmt_up=None):
    x = f32(rng, n) if T is None else f32(rng, T, n)
    out = nan32(f) if T is None else nan32(T, f)
    w_gate = qweights(rng, f, n, fmt)
    w_up = qweights(rng, f, n, fmt_up or fmt)
    return _optional(dict(out=out, w_gate=w_gate, w_up=w_up, x=x), act=act)


def b_rope(rng, n_heads, n_kv, hd, pos, rot=None, max_ctx=None, pass_hd=False):
    """rot < hd: partial rotary (head_dim passed); pass_hd: head_dim given although rot == hd."""
    rot = hd if rot is None else rot
    cos, sin = rope_tables(max_ctx or pos + 1, rot)
    return _optional(dict(q=f32(rng, n_heads * hd), k=f32(rng, n_kv * hd), cos=cos, sin=sin, pos=pos),
                     head_dim=hd if (rot != hd or pass_hd) else None)


def b_rope_batch(rng, n_heads, n_kv, hd, T, pos0, rot=None, max_ctx=None):
    rot = hd if rot is None else rot
    cos, sin = rope_tables(max_ctx or pos0 + T, rot)
    return _optional(dict(q=f32(rng, T, n_heads * hd), k=f32(rng, T, n_kv * hd), cos=cos, sin=sin,
                          pos0=pos0), head_dim=hd if rot != hd else None)


def b_rope_store(rng, n_heads, n_kv, hd, pos, max_ctx, rot=None):
    rot = hd if rot is None else rot
    cos, sin = rope_tables(max_ctx, rot)
    kc, vc = kv_cache(rng, n_kv, max_ctx, hd)
    return dict(q=f32(rng, n_heads * hd), k=f32(rng, n_kv * hd), v=f32(rng, n_kv * hd), cos=cos, sin=sin,
                k_cache=kc, v_cache=vc, pos=pos)


def b_cache_store(rng, n_kv, max_ctx, hd, pos, specials=False):
    kc, vc = kv_cache(rng, n_kv, max_ctx, hd)
    if specials:
        vals = special_f32(rng, n_kv * hd)
        k, v = vals, vals[::-1].copy()
    else:
        k, v = f32(rng, n_kv * hd), f32(rng, n_kv * hd)
    return dict(k_cache=kc, v_cache=vc, k=k, v=v, pos=pos)


def b_cache_store_batch(rng, n_kv, max_ctx, hd, T, pos0, specials=False):
    kc, vc = kv_cache(rng, n_kv, max_ctx, hd)
    if specials:
        vals = special_f32(rng, T * n_kv * hd).reshape(T, n_kv * hd)
        k, v = vals, vals[::-1, ::-1].copy()
    else:
        k, v = f32(rng, T, n_kv * hd), f32(rng, T, n_kv * hd)
    return dict(k_cache=kc, v_cache=vc, k=k, v=v, pos0=pos0)


def b_attention(rng, n_heads, n_kv, hd, pos, max_ctx=None, window=None, scale=None, softcap=None):
    kc, vc = kv_cache(rng, n_kv, max_ctx or pos + 1, hd, last=pos)
    # q of scale 2: peaky scores exercise the softmax's running-max rescaling
    args = dict(out=nan32(n_heads * hd), q=f32(rng, n_heads * hd, scale=2.0), k_cache=kc, v_cache=vc,
                pos=pos)
    return _optional(args, window=window, scale=scale, softcap=softcap)


def b_attention_batch(rng, n_heads, n_kv, hd, T, pos0, max_ctx=None, window=None, scale=None, softcap=None):
    last = pos0 + T - 1
    kc, vc = kv_cache(rng, n_kv, max_ctx or last + 1, hd, last=last)
    args = dict(out=nan32(T, n_heads * hd), q=f32(rng, T, n_heads * hd, scale=2.0), k_cache=kc,
                v_cache=vc, pos0=pos0)
    return _optional(args, window=window, scale=scale, softcap=softcap)


def b_moe(rng, E, k, f, n, T=None, norm=True, act="silu", fmt=None, fmt_down=None):
    """E experts of size f over rows of n, k a token; the router's scores spread enough (and
    random) that no two are within float32 rounding of each other."""
    rows = () if T is None else (T,)
    experts = Experts(tuple((qweights(rng, f, n, fmt), qweights(rng, f, n, fmt),
                             qweights(rng, n, f, fmt_down or fmt)) for _ in range(E)))
    return dict(out=f32(rng, *rows, n), x=f32(rng, *rows, n), router=f32(rng, E, n, scale=n ** -0.5),
                experts=experts, n_used=k, norm=norm, act=act,
                scratch=Scratch(T or 1, n, f, E, k, batch=T is not None))


def b_swiglu(rng, n):
    return dict(out=nan32(n), gate=f32(rng, n, scale=3.0), up=f32(rng, n))


def b_add(rng, n, alias=False):
    return dict(out=Alias("x") if alias else nan32(n), x=f32(rng, n), y=f32(rng, n))


def b_add_rows(rng, T, n, alias=False):
    return dict(out=Alias("x") if alias else nan32(T, n), x=f32(rng, T, n), b=f32(rng, n))


BUILDERS: dict[str, Callable] = {
    "embed": b_embed,
    "rmsnorm": b_rmsnorm,
    "matvec": b_matvec,
    "matvec_add": lambda rng, **p: b_matvec(rng, add=True, **p),
    "gate_up": b_gate_up,
    "rope": b_rope,
    "cache_store": b_cache_store,
    "rope_store": b_rope_store,
    "attention": b_attention,
    "swiglu": b_swiglu,
    "add": b_add,
    "embed_batch": b_embed_batch,
    "rmsnorm_batch": b_rmsnorm,
    "matmul": b_matmul,
    "matmul_add": lambda rng, **p: b_matmul(rng, add=True, **p),
    "gate_up_batch": b_gate_up,
    "add_rows": b_add_rows,
    "rope_batch": b_rope_batch,
    "cache_store_batch": b_cache_store_batch,
    "attention_batch": b_attention_batch,
    "moe": b_moe,
    "moe_batch": b_moe,
}


# -- the table --------------------------------------------------------------------------
# Sizes break shortcuts: lengths that are not multiples of 4/8/16/32 (kernel tails), odd
# head dims, MHA/GQA/MQA, positions 0, 1, the last and past the 256-position attention
# block, large enough to take the threaded paths (>= 65536 weights or elements).

def case(op, **params):
    return (op, params)


CASES = [
    # embed: exact, float16 edge values, token at both ends, numpy ints, embedding scale (Gemma)
    case("embed", vocab=7, dim=37, token=0, specials=True),
    case("embed", vocab=7, dim=37, token=6, specials=True, int64=True),
    case("embed", vocab=50, dim=1000, token=3, scale=33.941125),
    case("embed", vocab=9, dim=40, token=8, scale=0.5, specials=True),
    case("rmsnorm", n=1),
    case("rmsnorm", n=17, eps=1e-6),
    case("rmsnorm", n=576, alias=True),
    case("rmsnorm", n=100_003),
    case("matvec", d=1, n=1),
    case("matvec", d=3, n=7),
    case("matvec", d=17, n=33),
    case("matvec", d=64, n=1000),
    case("matvec", d=129, n=257),
    case("matvec", d=200, n=576),
    case("matvec", d=1031, n=257),
    case("matvec", d=2600, n=1000),            # tall (cuda: 4 rows per warp)
    case("matvec", d=33, n=11008),             # wide
    case("matvec_add", d=3, n=7),
    case("matvec_add", d=129, n=257),
    case("matvec_add", d=600, n=576),
    case("gate_up", f=1, n=1),
    case("gate_up", f=17, n=33, act="gelu_tanh"),
    case("gate_up", f=64, n=1000, act="silu"),
    case("gate_up", f=129, n=257),
    case("gate_up", f=129, n=257, act="gelu_tanh"),
    case("gate_up", f=600, n=576, act="gelu_tanh"),
    case("gate_up", f=130, n=4104),
    case("rope", n_heads=9, n_kv=3, hd=64, pos=0),
    case("rope", n_heads=4, n_kv=1, hd=80, pos=31, max_ctx=32, pass_hd=True),
    case("rope", n_heads=2, n_kv=2, hd=6, pos=1),
    case("rope", n_heads=8, n_kv=2, hd=128, rot=96, pos=17),      # partial rotary (Phi-4-mini: 0.75)
    case("rope", n_heads=4, n_kv=2, hd=10, rot=4, pos=5),
    case("rope", n_heads=3, n_kv=1, hd=6, rot=2, pos=0),
    case("cache_store", n_kv=3, max_ctx=5, hd=446, pos=0, specials=True),
    case("cache_store", n_kv=3, max_ctx=5, hd=446, pos=4, specials=True),
    case("cache_store", n_kv=1, max_ctx=9, hd=6, pos=8),
    case("cache_store", n_kv=8, max_ctx=33, hd=128, pos=16),
    case("rope_store", n_heads=4, n_kv=2, hd=16, pos=0, max_ctx=8),
    case("rope_store", n_heads=9, n_kv=3, hd=64, pos=30, max_ctx=31),
    case("rope_store", n_heads=4, n_kv=2, hd=24, rot=8, pos=3, max_ctx=10),
    case("rope_store", n_heads=6, n_kv=2, hd=96, rot=64, pos=12, max_ctx=20),
    case("attention", n_heads=1, n_kv=1, hd=64, pos=0),
    case("attention", n_heads=4, n_kv=1, hd=64, pos=7),                        # MQA
    case("attention", n_heads=9, n_kv=3, hd=64, pos=46),                       # GQA of 3
    case("attention", n_heads=8, n_kv=2, hd=48, pos=66, max_ctx=67),
    case("attention", n_heads=3, n_kv=1, hd=6, pos=9, max_ctx=40),
    case("attention", n_heads=9, n_kv=3, hd=64, pos=255),                      # one whole 256 block
    case("attention", n_heads=9, n_kv=3, hd=64, pos=256),                      # one position past it
    case("attention", n_heads=4, n_kv=4, hd=80, pos=300),
    case("attention", n_heads=2, n_kv=1, hd=128, pos=1023),
    case("attention", n_heads=9, n_kv=3, hd=64, pos=46, window=8),             # window < pos
    case("attention", n_heads=4, n_kv=1, hd=64, pos=5, window=16),             # window > pos
    case("attention", n_heads=2, n_kv=1, hd=40, pos=15, window=16),            # window == pos + 1
    case("attention", n_heads=6, n_kv=2, hd=32, pos=20, window=1),             # itself only
    case("attention", n_heads=4, n_kv=2, hd=64, pos=700, window=300),          # blocks + window
    case("attention", n_heads=8, n_kv=4, hd=32, pos=30, scale=0.0625),
    case("attention", n_heads=4, n_kv=2, hd=16, pos=12, scale=1.0),            # unscaled: peaky
    case("attention", n_heads=4, n_kv=1, hd=256, pos=40, window=16, scale=0.0625),   # Gemma 3 local
    # soft-capped scores (Gemma 2): caps that bind on these peaky scores; the GQA tile, a head
    # dim off the vector width, the scalar tail positions and the merged 256-position blocks
    case("attention", n_heads=8, n_kv=4, hd=64, pos=46, softcap=1.5),
    case("attention", n_heads=2, n_kv=1, hd=40, pos=15, softcap=2.0),
    case("attention", n_heads=3, n_kv=3, hd=48, pos=5, softcap=0.75),
    case("attention", n_heads=4, n_kv=2, hd=256, pos=300, window=280, scale=1.0, softcap=50.0),
    case("swiglu", n=1),
    case("swiglu", n=17),
    case("swiglu", n=576),
    case("swiglu", n=100_003),
    case("add", n=1),
    case("add", n=576),
    case("add", n=100_003),
    case("add", n=577, alias=True),
    case("embed_batch", vocab=50, dim=36, T=1),
    case("embed_batch", vocab=7, dim=37, T=5, specials=True),
    case("embed_batch", vocab=60, dim=100, T=17, scale=3.0),
    case("rmsnorm_batch", T=1, n=7),
    case("rmsnorm_batch", T=5, n=576, eps=1e-6),
    case("rmsnorm_batch", T=17, n=4096),
    case("rmsnorm_batch", T=3, n=48, alias=True),
    case("matmul", T=1, d=33, n=17),
    case("matmul", T=2, d=1, n=7),
    case("matmul", T=5, d=100, n=257),
    case("matmul", T=17, d=577, n=300),
    case("matmul", T=64, d=33, n=256),
    case("matmul", T=300, d=64, n=300),
    case("matmul_add", T=1, d=33, n=17),
    case("matmul_add", T=13, d=100, n=257),
    case("matmul_add", T=64, d=577, n=300),
    case("gate_up_batch", T=1, f=33, n=17),
    case("gate_up_batch", T=5, f=100, n=257, act="gelu_tanh"),
    case("gate_up_batch", T=17, f=577, n=300, act="silu"),
    case("gate_up_batch", T=64, f=129, n=600, act="gelu_tanh"),
    case("add_rows", T=1, n=7),
    case("add_rows", T=13, n=99),
    case("add_rows", T=5, n=576, alias=True),
    case("rope_batch", n_heads=4, n_kv=2, hd=16, T=1, pos0=0),
    case("rope_batch", n_heads=9, n_kv=3, hd=64, T=17, pos0=40, max_ctx=60),
    case("rope_batch", n_heads=4, n_kv=2, hd=24, rot=8, T=5, pos0=3),          # partial rotary
    case("rope_batch", n_heads=8, n_kv=2, hd=128, rot=96, T=12, pos0=0),
    case("cache_store_batch", n_kv=2, max_ctx=4, hd=8, T=1, pos0=0),
    case("cache_store_batch", n_kv=3, max_ctx=8, hd=64, T=5, pos0=3),          # ends at the last row
    case("cache_store_batch", n_kv=2, max_ctx=130, hd=150, T=17, pos0=100, specials=True),
    case("attention_batch", n_heads=4, n_kv=2, hd=16, T=1, pos0=0),
    case("attention_batch", n_heads=3, n_kv=1, hd=24, T=5, pos0=0),
    case("attention_batch", n_heads=6, n_kv=6, hd=10, T=13, pos0=1),
    case("attention_batch", n_heads=4, n_kv=2, hd=16, T=17, pos0=3, max_ctx=25),
    case("attention_batch", n_heads=9, n_kv=3, hd=64, T=64, pos0=200),
    case("attention_batch", n_heads=3, n_kv=1, hd=24, T=300, pos0=0),
    case("attention_batch", n_heads=2, n_kv=2, hd=16, T=1, pos0=10, window=4),
    case("attention_batch", n_heads=4, n_kv=2, hd=16, T=20, pos0=0, window=8),     # window < T
    case("attention_batch", n_heads=4, n_kv=1, hd=32, T=10, pos0=50, window=16),   # window < pos0
    case("attention_batch", n_heads=2, n_kv=1, hd=32, T=12, pos0=5, window=100),   # window > all
    case("attention_batch", n_heads=3, n_kv=1, hd=24, T=9, pos0=4, scale=0.5),
    case("attention_batch", n_heads=4, n_kv=1, hd=256, T=17, pos0=30, window=20, scale=0.0625),
    case("attention_batch", n_heads=4, n_kv=2, hd=64, T=17, pos0=3, softcap=1.5),
    case("attention_batch", n_heads=2, n_kv=1, hd=40, T=300, pos0=0, softcap=2.0),
    case("attention_batch", n_heads=8, n_kv=4, hd=256, T=20, pos0=10, window=8, scale=1.0, softcap=50.0),
    case("attention_batch", n_heads=3, n_kv=1, hd=24, T=1, pos0=9, softcap=0.5),
    # mixtures of experts: one expert of one, all of several, a few of many (rows that choose
    # overlapping sets), weights renormalized or not, both activations
    case("moe", E=1, k=1, f=7, n=17),
    case("moe", E=4, k=4, f=33, n=40, act="gelu_tanh"),
    case("moe", E=8, k=2, f=64, n=96),
    case("moe", E=16, k=3, f=40, n=100, norm=False),
    case("moe", E=5, k=3, f=48, n=64, act="gelu_tanh"),
    case("moe_batch", E=1, k=1, f=7, n=17, T=1),
    case("moe_batch", E=8, k=2, f=64, n=96, T=13),
    case("moe_batch", E=16, k=3, f=40, n=100, T=40, norm=False, act="gelu_tanh"),
    case("moe_batch", E=5, k=5, f=24, n=36, T=6),
]

# quantized weights (QuantMatrix): every format, rows not a multiple of the 4-row groups,
# one or several blocks per row, the threaded sizes; gate/up of two formats (mixed) and
# a float16 gate with a quantized up
_K = ("q4_k", "q5_k", "q6_k")
for _f in QUANTIZED:
    _n = 256 * 3 if _f in _K else 32 * 5
    CASES += [
        case("matvec", d=131, n=_n, fmt=_f),
        case("matvec", d=517, n=1024, fmt=_f),
        case("matvec_add", d=203, n=_n, fmt=_f),
        case("gate_up", f=131, n=_n, act="silu" if _f < "q5" else "gelu_tanh", fmt=_f),
        case("embed", vocab=50, dim=_n, token=49, scale=2.5, fmt=_f),
        case("matmul", T=5, d=131, n=_n, fmt=_f),
    ]
CASES += [
    case("gate_up", f=600, n=512, fmt="q4_k", fmt_up="q6_k"),
    case("gate_up", f=129, n=256, act="gelu_tanh", fmt="f16", fmt_up="q8_0"),
    case("embed", vocab=7, dim=64, token=0, fmt="q4_1"),
    case("embed_batch", vocab=60, dim=512, T=17, scale=3.0, fmt="q8_0"),
    case("embed_batch", vocab=9, dim=256, T=5, fmt="q4_k"),
    case("matmul", T=33, d=257, n=1024, fmt="q4_0"),
    case("matmul", T=64, d=96, n=512, fmt="q6_k"),
    case("matmul", T=17, d=300, n=768, fmt="q4_k"),
    case("matmul", T=9, d=70, n=2048, fmt="q8_0"),
    case("matmul_add", T=7, d=131, n=512, fmt="q4_k"),
    case("matmul_add", T=13, d=100, n=256, fmt="q5_0"),
    case("gate_up_batch", T=9, f=131, n=512, fmt="q4_k"),
    case("gate_up_batch", T=5, f=77, n=96, act="gelu_tanh", fmt="q4_0"),
    case("gate_up_batch", T=12, f=129, n=256, fmt="q4_k", fmt_up="q6_k"),
    case("gate_up_batch", T=3, f=40, n=512, fmt="f16", fmt_up="q5_k"),
    case("moe", E=6, k=2, f=256, n=256, fmt="q4_k", fmt_down="q6_k"),
    case("moe", E=8, k=3, f=64, n=96, fmt="q8_0"),
    case("moe", E=32, k=8, f=96, n=160, fmt="q5_0", fmt_down="q4_1"),
    case("moe", E=4, k=1, f=256, n=256, fmt="q5_k", fmt_down="q4_0", act="gelu_tanh"),
    case("moe_batch", E=6, k=2, f=256, n=512, T=20, fmt="q4_k", fmt_down="q6_k"),
    case("moe_batch", E=8, k=3, f=64, n=96, T=9, fmt="q4_0", fmt_down="q8_0"),
    # cuda groups a chunk's rows by expert on the device: more rows an expert than a group's
    # 32 columns (several groups of one expert), groups of 16, experts no row chooses, more
    # experts than the routing block's threads, and the K-quants' superblocks under gelu
    case("moe_batch", E=4, k=2, f=64, n=96, T=70, fmt="q8_0", fmt_down="q4_0"),
    case("moe_batch", E=32, k=8, f=96, n=160, T=40, fmt="q5_0", fmt_down="q4_1"),
    case("moe_batch", E=16, k=1, f=64, n=64, T=3, norm=False, fmt="q5_1"),
    case("moe_batch", E=300, k=4, f=32, n=64, T=11, fmt="q8_0"),
    case("moe_batch", E=4, k=1, f=256, n=256, T=33, fmt="q5_k", fmt_down="q4_0", act="gelu_tanh"),
]


def case_id(op, params):
    return op + "-" + "-".join(f"{k}{v}" for k, v in params.items())


# -- runners: how a case's arrays reach a backend and come back ---------------------------

class HostRunner:
    """A backend op by op (cpu, cuda; the reference below)."""

    def __init__(self, backend):
        self.be = backend

    def put(self, a):
        return self.be.upload(a)

    def put_weight(self, w):
        """A QuantMatrix: the backend's upload (cpu keeps the blocks, numpy and cuda dequantize)."""
        return self.be.upload(w)

    def get(self, a):
        return np.array(self.be.to_host(a), copy=True)

    def call(self, op, args, step):
        getattr(self.be, op)(*args)


class RefRunner(HostRunner):
    def __init__(self):
        super().__init__(NumpyBackend())

    def put(self, a):
        return a            # as given: the reference keeps float16 caches float16

    def call(self, op, args, step):
        with np.errstate(over="ignore", invalid="ignore"):   # float16 overflow of the edge values
            super().call(op, args, step)


class StepRunner(HostRunner):
    """A decode op as a one-op decode step: the first decode_step captures it (running the
    op itself), then every input is put back and the second runs the captured program."""

    def __init__(self, backend):
        super().__init__(backend)
        self.restore = []

    def put(self, a):
        dev = self.be.upload(a)
        self.restore.append((dev, a.copy()))
        return dev

    def _reset(self):
        for dev, a in self.restore:
            dev[...] = a

    def call(self, op, args, step):
        def issue(token, pos):
            getattr(self.be, op)(*args)
        self.be.decode_step(issue, *step)
        self._reset()
        self.be.decode_step(issue, *step)
        self.check_replayed()

    def check_replayed(self):
        assert self.be.step_info() is not None, "the op was not captured into a decode program"


class CudaGraphRunner(StepRunner):
    """The same on cuda: the first decode_step runs the op eagerly in device mode (token and
    pos read from the step buffer) and captures it; the second replays the CUDA graph."""

    def __init__(self, backend, cp):
        super().__init__(backend)
        self.cp = cp

    def _reset(self):
        for dev, a in self.restore:
            self.cp.copyto(dev, self.cp.asarray(a))

    def check_replayed(self):
        # (a failed capture warns and turns graphs off: that fails here too)
        if os.environ.get("CYLLM_CUDA_GRAPHS", "1") != "0":    # =0: device-mode eager ops only
            assert self.be._graph is not None, "the op was not captured into a CUDA graph"


def make_runner(kind):
    if kind.startswith("cuda"):
        cp = require_cuda()
        from cyllm.backends.cuda import CudaBackend
        be = CudaBackend()
        be.widen_kib_per_sm = 0     # each case's format on its own kernels (widening keeps values)
        return CudaGraphRunner(be, cp) if kind == "cuda-graph" else HostRunner(be)
    parts = kind.split("-")             # cpu-<variant>-t<threads> | cpu-step-<variant>
    if parts[1] == "step":
        return StepRunner(_cpu.CpuBackend(2, variant=parts[2], fused=True))
    return HostRunner(_cpu.CpuBackend(int(parts[2][1:]), variant=parts[1]))


def step_values(op, named):
    """(token, pos) of the decode step that issues this op: what the captured program varies."""
    if op == "embed":
        return int(named["token"]), 0
    return 0, int(named.get("pos", 0))


def run(runner, op, named):
    """Call ``op`` on the runner's backend with private copies of the case's inputs;
    return {written argument name: its host value afterwards}."""
    names, defaults = SIGNATURES[op]
    last = max(names.index(n) for n in named)
    arrays = {}
    for name in names[:last + 1]:
        v = named.get(name, defaults.get(name))
        if name not in named and name not in defaults:
            raise AssertionError(f"case for {op} lacks the required argument {name!r}")
        if isinstance(v, QuantMatrix):
            arrays[name] = runner.put_weight(v)
        elif isinstance(v, np.ndarray):
            arrays[name] = runner.put(v.copy())
        elif isinstance(v, Host):
            arrays[name] = v.value.copy()
        elif isinstance(v, Experts):
            # as the model puts them: cuda stacks quantized experts (one array a role)
            arrays[name] = runner.be.upload_experts([[m if isinstance(m, QuantMatrix) else m.copy() for m in trio]
                                                     for trio in v.mats])
        elif isinstance(v, Scratch):
            arrays[name] = MoeScratch.allocate(runner.be, v.rows, v.dim, v.ffn, v.n_experts, v.n_used, v.batch)
        elif not isinstance(v, Alias):
            arrays[name] = v
    for name in names[:last + 1]:
        if isinstance(named.get(name), Alias):
            arrays[name] = arrays[named[name].name]
    runner.call(op, [arrays[n] for n in names[:last + 1]], step_values(op, named))
    if op == "moe_batch" and runner.be.name == "cuda":
        # experts that stack quantized (on int8 tensor cores) are routed and grouped on the
        # device, the rest on the host: the result above is that path's
        on_device = arrays["scratch"].dev is not None
        scratch = arrays["scratch"]
        assert on_device == runner.be.captures_moe_batch(arrays["experts"], *scratch.ids.shape), on_device
    return {name: runner.get(arrays[name]) for name in OUTPUTS[op]}  # (same names in Q_OUTPUTS)


def check(op, name, tol, got, want, scale, on_cuda):
    """got against want within tol; scale: the error scale of each element (None if exact)."""
    where = f"{op}: {name}"
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{where}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}"
    if tol.exact:
        bits = np.uint16 if got.dtype == np.float16 else np.uint32
        same = (got.view(bits) == want.view(bits)) | (np.isnan(got) & np.isnan(want))
        bad = np.flatnonzero(~same)
        assert bad.size == 0, (f"{where}: {bad.size} elements differ, first at flat index {bad[0]}: "
                               f"got {got.ravel()[bad[0]]!r}, want {want.ravel()[bad[0]]!r}")
        return
    g, w = got.astype(np.float64), want.astype(np.float64)
    assert np.all(np.isfinite(g) == np.isfinite(w)), f"{where}: non-finite values differ (unwritten output?)"
    rel = tol.cuda_rel if (on_cuda and tol.cuda_rel is not None) else tol.rel
    fin = np.isfinite(w)
    err = np.abs(g - w)[fin]
    bound = (rel * scale + tol.atol)[fin]
    worst = np.argmax(err - bound) if err.size else 0
    assert np.all(err <= bound), (f"{where}: error {err[worst]:.3g} over the bound {bound[worst]:.3g} "
                                  f"(max err/scale {np.max(err / (scale[fin] + 1e-300)):.3g}, rel {rel:g})")


# -- the parametrization: every case on every runner that has its op -----------------------

# without cupy the cuda rows skip at once (require_cuda, per test, skips where cupy finds no GPU)
_CUDA = (pytest.mark.cuda,
         pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="cupy is not installed"))


def _captured(kind, op, params) -> bool:
    """Whether a recording runner (cpu-step, cuda-graph) records this case. A mixture of experts
    is recorded on cpu (its decode program routes in C) and on cuda where its experts stack
    (routed on the device): quantized, or float16 rows of whole 16-byte loads. Other float
    experts are routed by the host between ops, and such a step runs as issued
    (Backend.captures_moe)."""
    if kind != "cuda-graph" or op != "moe" or params.get("fmt") is not None:
        return True
    return params["f"] % 8 == 0 and params["n"] % 8 == 0


def runner_kinds():
    kinds = []
    for v in CPU_VARIANTS:
        kinds += [(f"cpu-{v}-t1", OP_NAMES, ()), (f"cpu-{v}-t2", OP_NAMES, ())]
    for v in CPU_VARIANTS:
        kinds.append((f"cpu-step-{v}", STEP_OPS, ()))
    kinds.append(("cuda", OP_NAMES, _CUDA))
    kinds.append(("cuda-graph", DECODE_OPS, _CUDA))
    return kinds


def _params():
    out = []
    for kind, ops, marks in runner_kinds():
        for op, params in CASES:
            recorded = kind.startswith("cpu-step") or kind == "cuda-graph"
            if op in ops and (not recorded or _captured(kind, op, params)):
                out.append(pytest.param(kind, op, params, marks=marks, id=f"{kind}:{case_id(op, params)}"))
    return out


_REF = RefRunner()
_EXPECTED: dict = {}


def expected(op, params):
    """The case's inputs, the reference's outputs and their error scales, computed once
    per case (every runner compares against the same)."""
    key = case_id(op, params)
    if key not in _EXPECTED:
        named = BUILDERS[op](np.random.default_rng(zlib.crc32(key.encode())), **params)
        want = run(_REF, op, named)
        inputs = {k: (v.value if isinstance(v, Host) else v) for k, v in named.items()}
        inputs.setdefault("norm", True)
        scales = {name: (np.abs(want[name].astype(np.float64)) if tol.scale is None
                         else tol.scale(inputs, want[name]))
                  for name, tol in tolerances(op, params).items() if not tol.exact}
        _EXPECTED[key] = (named, want, scales)
    return _EXPECTED[key]


@pytest.fixture(autouse=True, scope="module")
def _serial_blas():
    """The reference's matmuls on one BLAS thread: on a small machine whose cores are busy
    (the kernels under test use them too) a threaded BLAS runs 100x slower."""
    from threadpoolctl import threadpool_limits
    with threadpool_limits(limits=1, user_api="blas"):
        yield


@pytest.mark.parametrize("kind,op,params", _params())
def test_op(kind, op, params):
    runner = make_runner(kind)
    named, want, scales = expected(op, params)
    got = run(runner, op, named)
    for name, tol in tolerances(op, params).items():
        check(op, name, tol, got[name], want[name], scales.get(name), kind.startswith("cuda"))


# -- the table itself -----------------------------------------------------------------------

def test_every_op_has_a_case():
    """A new op in the registry fails here until it has a builder, tolerances and cases."""
    covered = {op for op, _ in CASES}
    assert set(OP_NAMES) - covered == set(), "ops without a case"
    assert covered <= set(OP_NAMES), "cases of ops that are not in the registry"
    assert set(BUILDERS) == set(OP_NAMES) and set(OUTPUTS) == set(OP_NAMES)
    for op in OP_NAMES:
        assert set(OUTPUTS[op]) <= set(SIGNATURES[op][0]), f"{op}: an output that is not an argument"


def test_case_ids_are_unique():
    ids = [case_id(op, p) for op, p in CASES]
    assert len(ids) == len(set(ids))


@pytest.mark.skipif(not CPU_VARIANTS, reason="cpu kernels not built")
@pytest.mark.parametrize("variant", CPU_VARIANTS)
def test_cpu_backend_has_every_op(variant):
    assert _cpu.CpuBackend(1, variant=variant).missing_ops() == []
    assert set(STEP_OPS) >= set(DECODE_OPS)


@pytest.mark.cuda
def test_cuda_backend_has_every_op():
    require_cuda()
    from cyllm.backends.cuda import CudaBackend
    assert CudaBackend().missing_ops() == []
