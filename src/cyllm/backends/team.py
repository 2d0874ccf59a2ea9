"""How many threads a decode step runs on, chosen step by step from measured step times.

Why: a decode step splits every matvec's rows among its threads and waits at ~10
barriers per layer. When another process keeps one of the cores busy, the thread that
shares that core runs only part of the time and every barrier waits for it: on a 2-core
laptop, 2-thread decode then runs 2-5x slower than 1 thread (llama.cpp collapses the
same way). Which count is best depends on what else runs, and that changes while a
model generates, so no count fixed in advance is right. The rows a thread computes do
not depend on the team size (each row, head and block is computed the same way
whoever computes it), so the size may change between any two steps without changing
a single bit of the logits.

The policy: run at the current size and keep its recent step times; now and then run a
few steps one thread fewer or one more (a probe) and move there when it is faster by a
margin. A probe that loses quadruples the wait before the next one (up to MAX_INTERVAL
steps), so on a quiet machine probing costs well under 1% of the steps; a step time
that jumps well above what the current size had been giving probes at once, so a busy
process that starts mid-generation is answered within a few steps.
"""

from __future__ import annotations

import statistics
from collections import deque

FIRST = 4              # steps before the first probe (a one-shot generation learns early)
INTERVAL = 16          # steps between probes after a change
MAX_INTERVAL = 512     # ... growing to this while the current size keeps winning
PROBE_STEPS = 3        # steps per probe (their median is compared)
WINDOW = 3             # recent steps kept per size
MARGIN = 0.05          # a probe must be this much faster to win
JUMP = 1.5             # current median over its best median since the last change: probe now


class TeamSizer:
    """Picks the team size of each decode step: ``size = next_size()``, run the step,
    ``record(size, seconds)``."""

    def __init__(self, max_threads: int):
        self.max_threads = max(1, int(max_threads))
        self.size = self.max_threads
        self._times: dict[int, deque] = {}
        self._interval = INTERVAL
        self._countdown = FIRST
        self._probe: int | None = None       # the size being probed
        self._probe_left = 0
        self._downward = True                # which neighbour the next probe tries first
        self._best: float | None = None      # the current size's best median since the last change

    def next_size(self) -> int:
        if self.max_threads == 1:
            return 1
        if self._probe is not None:
            return self._probe
        self._countdown -= 1
        if self._countdown > 0:
            return self.size
        candidates = [s for s in (self.size - 1, self.size + 1) if 1 <= s <= self.max_threads]
        if len(candidates) == 2 and not self._downward:
            candidates.reverse()
        self._downward = not self._downward
        self._probe, self._probe_left = candidates[0], PROBE_STEPS
        self._times.pop(self._probe, None)   # a probe is judged on its own steps only
        return self._probe

    def record(self, size: int, seconds: float) -> None:
        if self.max_threads == 1:
            return
        self._times.setdefault(size, deque(maxlen=WINDOW)).append(seconds)
        if self._probe is None:
            if size == self.size and len(self._times[size]) == WINDOW:
                med = statistics.median(self._times[size])
                if self._best is None or med < self._best:
                    self._best = med
                elif med > JUMP * self._best:
                    self._countdown = 0      # slower than it was: look around now
            return
        if size != self._probe:
            return
        self._probe_left -= 1
        if self._probe_left > 0:
            return
        probe = statistics.median(self._times[size])
        current = self._times.get(self.size)
        if not current or probe < (1.0 - MARGIN) * statistics.median(current):
            self.size = self._probe
            self._interval = INTERVAL
        else:
            self._interval = min(4 * self._interval, MAX_INTERVAL)
        self._countdown = self._interval
        self._probe = None
        self._best = None                    # the baseline of the jump test starts again

    def set_max(self, max_threads: int) -> None:
        """A new upper bound (set_threads): start again from it."""
        self.__init__(max_threads)
