"""A mixture-of-experts MLP: the router's choice of experts and the chosen experts' products,
written once over a backend's own ops (numpy_ref and cpu here; cpu chooses through its C
routing, the one its decode program makes, and a recorded cpu step runs the whole MLP in C;
cuda decodes on the device where its experts are stacked, and otherwise reads the router's
scores back and shares the routing and the grouping here, backends/cuda/experts.py).

The routing is the one transformers and llama.cpp share for Mixtral, Qwen3-MoE and OLMoE:
p = softmax(router @ x); the n_used experts of the highest p, best first; their weights
are those p, divided by their sum where the model renormalizes. The MLP's output is the sum,
in rank order, of each chosen expert's down(act(gate x) * up x) times its weight.

Prefill groups a chunk's rows by expert, so that each expert's matrices are read once a chunk
instead of once a row, and still adds each row's expert outputs in rank order, after the same
products as decode's: with quantized weights (whose batched ops give each row the bits of
the single-row op, Backend.batch_rows_exact) a prompt's rows get the bits decode would give on
the host backends. (cuda's prefill multiplies on int8 tensor cores, its decode with dp4a dots:
the same rounding of x, sums in another order.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class MoeScratch:
    """Work arrays of the moe ops for up to ``rows`` tokens (model.py allocates them once)."""
    scores: np.ndarray    # (rows, E) f32, host: router logits, then probabilities
    ids: np.ndarray       # (rows, k) int64: the chosen experts, best first
    weights: np.ndarray   # (rows, k) f32: their weights
    hb: Any               # (rows, f) f32: act(gate x) * (up x) of one expert
    y: Any                # (rows, dim) f32: one expert's output
    xg: Any               # (rows, dim) f32: the rows routed to one expert (prefill)
    part: Any             # (rows, k, dim) f32: each row's weighted expert outputs, by rank (prefill)
    h_all: Any = None     # (k, f) f32: each chosen expert's act(gate x) * (up x) (decode, moe_experts)
    y_all: Any = None     # (k, dim) f32: each chosen expert's output (decode, moe_experts)
    logits: Any = None    # (rows, E) f32 device array: the router's logits (cuda, allocated there)
    dev: Any = None       # a backend's own arrays for routing on the device (cuda, allocated there)

    @classmethod
    def allocate(cls, backend, rows: int, dim: int, ffn: int, n_experts: int, n_used: int,
                 batch: bool) -> "MoeScratch":
        """For ``rows`` tokens of moe_batch (batch) or one of moe, on ``backend``'s arrays (the
        decode arrays of moe_experts only where the backend has that op: cpu)."""
        one_call = not batch and hasattr(backend, "moe_experts")
        return cls(scores=np.zeros((rows, n_experts), np.float32), ids=np.zeros((rows, n_used), np.int64),
                   weights=np.zeros((rows, n_used), np.float32), hb=backend.empty((rows, ffn)),
                   y=backend.empty((rows, dim)), xg=backend.empty((rows, dim)) if batch else None,
                   part=backend.empty((rows, n_used, dim)) if batch else None,
                   h_all=backend.empty((n_used, ffn)) if one_call else None,
                   y_all=backend.empty((n_used, dim)) if one_call else None)


def route(scores: np.ndarray, n_used: int, norm: bool, ids: np.ndarray, weights: np.ndarray) -> None:
    """scores (E,) f32, the router's logits (overwritten with probabilities) -> ids[:n_used], the
    experts of the highest probabilities, best first (of equals, the lower id), and weights[:n_used],
    their probabilities (divided by their sum with ``norm``)."""
    np.subtract(scores, scores.max(), out=scores)
    np.exp(scores, out=scores)
    np.divide(scores, scores.sum(), out=scores)
    for j in range(n_used):
        e = int(scores.argmax())
        ids[j] = e
        weights[j] = scores[e]
        scores[e] = -1.0                  # below every probability: not chosen again
    if norm:
        np.divide(weights, weights.sum(), out=weights)


def route_rows(T: int, n_used: int, norm: bool, s: MoeScratch) -> None:
    """route() each of the first T rows of s.scores (router logits) into s.ids and s.weights."""
    for t in range(T):
        route(s.scores[t], n_used, norm, s.ids[t], s.weights[t])


def _route_rows(b, x, router, n_used, norm, s: MoeScratch) -> None:
    """The choice of the rows of x (T, n) into s.ids and s.weights: the backend's own
    ``moe_route`` where it has one (cpu: the C routing its decode program makes), else here
    row by row, each through the product decode makes: the same bits, so the same experts."""
    own = getattr(b, "moe_route", None)
    if own is not None:
        own(router, x, n_used, norm, s.scores, s.ids, s.weights)
        return
    for t in range(x.shape[0]):
        np.dot(router, x[t], out=s.scores[t])
    route_rows(x.shape[0], n_used, norm, s)


def expert_groups(ids: np.ndarray):
    """ids (T, k), the experts of each row by rank -> (expert, rows (n,), ranks (n,)) for each
    expert some row chose, in expert order, its rows in row order."""
    k = ids.shape[1]
    flat = ids.reshape(-1)                              # expert of row t, rank j at t*k + j
    order = np.argsort(flat, kind="stable")
    for group in np.split(order, np.flatnonzero(np.diff(flat[order])) + 1):
        rows, ranks = np.divmod(group, k)
        yield int(flat[group[0]]), rows, ranks


def moe(b, out, x, router, experts, n_used: int, norm: bool, act: str, s: MoeScratch) -> None:
    """out (dim,) += the experts' MLP of x (dim,) (the module docstring); b: the backend whose
    gate_up and matvec run the products, or, where it has one, whose ``moe_experts`` runs the
    chosen experts in one call (cpu)."""
    _route_rows(b, x[None], router, n_used, norm, s)
    run_all = getattr(b, "moe_experts", None)
    if run_all is not None and s.h_all is not None and run_all(out, x, experts, s.ids[0], s.weights[0], act,
                                                               s.h_all, s.y_all):
        return
    hb, y = s.hb[0], s.y[0]
    for j in range(n_used):
        gate, up, down = experts[s.ids[0, j]]
        b.gate_up(hb, gate, up, x, act)
        b.matvec(y, down, hb)
        np.multiply(y, s.weights[0, j], out=y)
        np.add(out, y, out=out)


def moe_batch(b, out, x, router, experts, n_used: int, norm: bool, act: str, s: MoeScratch) -> None:
    """out (T, dim) += the experts' MLP of every row of x (T, dim): rows grouped by expert."""
    T = x.shape[0]
    _route_rows(b, x, router, n_used, norm, s)
    for e, rows, ranks in expert_groups(s.ids[:T]):
        n = rows.size
        gate, up, down = experts[e]
        xg, hb, y = s.xg[:n], s.hb[:n], s.y[:n]
        np.take(x, rows, axis=0, out=xg)
        b.gate_up_batch(hb, gate, up, xg, act)
        b.matmul(y, down, hb)
        np.multiply(y, s.weights[rows, ranks][:, None], out=y)
        s.part[rows, ranks] = y
    for j in range(n_used):
        np.add(out, s.part[:T, j], out=out)
