"""KV caches of recent conversations, kept in host memory between requests.

The model has one KV cache: with two users chatting in turns, each request
would overwrite the other's conversation and the next turn would prefill it
all again. A PromptCache keeps copies of the displaced conversations
(least recently used first out, bounded in bytes) and, when a request
begins like one of them, copies it back before the request's prefill, which
then runs only the tokens after the common prefix.

Installed as ``model.prompt_cache``; generate.Session.feed calls
``before_feed(ids, save)`` with the model lock held, before it compares ``ids``
with what the cache holds, so the copy back is invisible to everything else:
the restored tokens are owned by a fresh Session, and reuse follows the usual
ownership rule.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ...generate import Session

MIN_TOKENS = 32     # shorter conversations are cheaper to prefill again than to keep
MIN_GAIN = 16       # restore only when it saves at least this many prompt tokens


@dataclass
class Snapshot:
    tokens: tuple[int, ...]
    k: list            # per layer (n_kv, n, head_dim) f16, host
    v: list
    nbytes: int


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PromptCache:
    def __init__(self, model, capacity_bytes: int):
        self.model = model
        self.capacity = int(capacity_bytes)
        self._entries: OrderedDict[tuple[int, ...], Snapshot] = OrderedDict()
        self.nbytes = 0
        self.saved = 0          # counters, for tests and the bench
        self.restored = 0

    def __len__(self) -> int:
        return len(self._entries)

    def before_feed(self, ids: list[int], save: bool = True) -> None:
        """Called with model.lock held, before a session makes the cache hold ``ids``;
        ``save``: keep a copy of the conversation it displaces (if long enough)."""
        live_common = self.displace(ids, save)
        best, best_common = None, 0
        for snap in self._entries.values():
            c = common_prefix(ids, snap.tokens)
            if c > best_common:
                best, best_common = snap, c
        if best is not None and best_common >= live_common + MIN_GAIN:
            self._restore(best, min(best_common, len(ids) - 1))

    def displace(self, ids: list[int], save: bool = True) -> int:
        """Called with model.lock held, before the cache is made to hold ``ids`` (a session's
        prompt, or echo's scoring passes, which rewrite it from position 0): with ``save``,
        keep a copy of the conversation this displaces (if long enough). Returns the tokens
        the live conversation shares with ``ids``."""
        owner = self.model.kv_owner
        live = owner.tokens if owner is not None else []
        live_common = common_prefix(ids, live)
        if save and len(live) >= MIN_TOKENS and len(live) - live_common >= MIN_TOKENS:
            self._save(live)
        return live_common

    # -- copies -----------------------------------------------------------------
    def _save(self, tokens: list[int]) -> None:
        key = tuple(tokens)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        for other in [k for k in self._entries if key[:len(k)] == k]:
            self._drop(other)           # a shorter version of the same conversation
        n = len(key)
        per_token = sum(2 * L.k_cache.shape[0] * L.k_cache.shape[2] * L.k_cache.dtype.itemsize
                        for L in self.model.layers)
        if n * per_token > self.capacity:
            return
        while self._entries and self.nbytes + n * per_token > self.capacity:
            self._drop(next(iter(self._entries)))
        self.model.backend.synchronize()
        k = [_to_host(L.k_cache, n) for L in self.model.layers]
        v = [_to_host(L.v_cache, n) for L in self.model.layers]
        snap = Snapshot(key, k, v, n * per_token)
        self._entries[key] = snap
        self.nbytes += snap.nbytes
        self.saved += 1

    def _drop(self, key) -> None:
        self.nbytes -= self._entries.pop(key).nbytes

    def _restore(self, snap: Snapshot, n: int) -> None:
        model = self.model
        model.backend.synchronize()
        for L, k, v in zip(model.layers, snap.k, snap.v):
            _write(L.k_cache, k, n)
            _write(L.v_cache, v, n)
        _device_sync(L.k_cache)
        holder = Session(model)
        holder.tokens = list(snap.tokens[:n])
        model.kv_owner = holder
        self._entries.move_to_end(snap.tokens)
        self.restored += 1


def _to_host(cache, n: int) -> np.ndarray:
    """Positions 0..n-1 of a (n_kv, context, head_dim) cache as a new host array."""
    part = cache[:, :n, :]
    if isinstance(part, np.ndarray):
        return part.copy()
    return part.get()               # cupy


def _write(cache, saved: np.ndarray, n: int) -> None:
    if isinstance(cache, np.ndarray):
        cache[:, :n, :] = saved[:, :n, :]
    else:
        import cupy
        cache[:, :n, :] = cupy.asarray(saved[:, :n, :])


def _device_sync(cache) -> None:
    if not isinstance(cache, np.ndarray):
        import cupy
        cupy.cuda.Device().synchronize()     # the backend's stream must see the copies
