"""How each decode step runs, chosen step by step from measured step times: how many
threads it runs on, and whether its matvecs prefetch their weights in software.

Why threads: a decode step splits every matvec's rows among its threads and waits at
~10 barriers per layer. When another process keeps one of the cores busy, the thread
that shares that core runs only part of the time and every barrier waits for it: on a
2-core laptop, 2-thread decode then runs 2-5x slower than 1 thread (llama.cpp
collapses the same way). Which count is best depends on what else runs, and that
changes while a model generates, so no count fixed in advance is right.

Why prefetch: whether a software prefetch a few KiB ahead of the weight stream helps
depends on the CPU's own prefetchers. On Zen 5 it raised the F16 matvec from 24-31 to
40-60 GB/s; on Zen 4 the same prefetch costs F16 decode 10-25% (TinyLlama shape,
2 threads) while it still gains the quantized kernels 10-15%. No default is right on
every CPU and file, so it is measured here too.

Neither choice changes a bit of the logits: the rows a thread computes do not depend
on the team size (each row, head and block is computed the same way whoever computes
it), and a prefetch only moves data earlier. So the setting may change between any
two steps.

The policy: run at the current setting and keep its recent step times; now and then run
a few steps with one neighbouring setting (a probe: one thread fewer, prefetch toggled,
one thread more, in turn) and move there when it is faster by a margin. A probe alternates
with the current setting step by step and is judged against those interleaved steps, not
against steps run before it: on a shared host the memory bandwidth moves between levels
within seconds (35 and 52-62 GB/s on the 2-core Zen 4 VM), so steps a second apart can
differ by more than the settings do, while neighbouring steps share the conditions
(bench/results/cpu_quant_epyc_zen4.md). A round of probes
that all lose quadruples the wait before the next one (up to MAX_INTERVAL steps), so on a quiet
machine probing costs well under 1% of the steps; a step time that jumps well above what
the current setting had been giving probes at once, so a busy process that starts
mid-generation is answered within a few steps.
"""

from __future__ import annotations

import statistics
from collections import deque

FIRST = 4              # steps before the first probe, and between the probes of one round
                       # (a one-shot generation learns early)
INTERVAL = 16          # steps between probes after a change
MAX_INTERVAL = 512     # ... growing to this while the current setting keeps winning
PROBE_STEPS = 3        # steps per probe at least (their median is compared) ...
PROBE_SECONDS = 0.05   # ... and at least this long: a small model's 5 ms steps are at the
                       # mercy of other processes' time slices, 3 of them decide nothing
MAX_PROBE_STEPS = 16
WINDOW = 3             # latest steps of the current setting watched for a jump (or half
                       # a probe's steps when steps are short)
MARGIN = 0.03          # a probe must be this much faster than the interleaved current steps
JUMP = 1.5             # current median over its best median since the last change: probe now

# the neighbours a probe tries, in turn (fewer threads first: a core busy from the start
# gives no jump in step time to react to, and it is the costliest thing to miss)
_MOVES = ("fewer", "prefetch", "more")


class StepTuner:
    """Picks the setting (threads, prefetch) of each decode step: ``setting = next()``,
    run the step with it, ``record(setting, seconds)``.

    max_threads: the most threads a step may use. threads: False keeps the count at
    max_threads (given by the user). prefetch: the starting choice; tune_prefetch: False
    keeps it."""

    def __init__(self, max_threads: int, threads: bool = True, prefetch: bool = True,
                 tune_prefetch: bool = True):
        self.max_threads = max(1, int(max_threads))
        self._threads_wanted = bool(threads)
        self._tune_threads = self._threads_wanted and self.max_threads > 1
        self._tune_prefetch = bool(tune_prefetch)
        self._start_prefetch = bool(prefetch)
        self._reset()

    def _reset(self) -> None:
        self.size = self.max_threads
        self.prefetch = self._start_prefetch
        self._times: dict[tuple[int, bool], deque] = {}
        self._interval = INTERVAL
        self._countdown = FIRST
        self._probe: tuple[int, bool] | None = None      # the setting being probed
        self._probe_left = 0      # probe steps still to run
        self._probe_turn = True   # whether the next step of the probe runs the probe setting
        self._paired: deque = deque(maxlen=MAX_PROBE_STEPS)   # the current setting's steps interleaved with the probe's
        self._turn = 0            # which neighbour the next probe tries (round robin)
        self._losses = 0          # probes lost since the last move or wait increase
        self._unchecked = 0       # steps since the last jump test

    @property
    def setting(self) -> tuple[int, bool]:
        return self.size, self.prefetch

    @property
    def adapts_threads(self) -> bool:
        """Whether the team size may change (given more than one thread)."""
        return self._threads_wanted

    @property
    def adapts(self) -> bool:
        return self._tune_threads or self._tune_prefetch

    def _neighbours(self) -> list[tuple[int, bool]]:
        """The settings a probe may try now, in the order of _MOVES."""
        out = []
        for move in _MOVES:
            if move == "prefetch" and self._tune_prefetch:
                out.append((self.size, not self.prefetch))
            elif move == "fewer" and self._tune_threads and self.size > 1:
                out.append((self.size - 1, self.prefetch))
            elif move == "more" and self._tune_threads and self.size < self.max_threads:
                out.append((self.size + 1, self.prefetch))
        return out

    def _probe_steps(self) -> int:
        """Steps of the next probe: PROBE_STEPS, more when steps are short."""
        recent = self._times.get(self.setting)
        if not recent:
            return PROBE_STEPS
        step = statistics.median(recent)
        want = int(PROBE_SECONDS / step) + 1 if step > 0 else MAX_PROBE_STEPS
        return max(PROBE_STEPS, min(MAX_PROBE_STEPS, want))

    def next(self) -> tuple[int, bool]:
        if not self.adapts:
            return self.setting
        if self._probe is not None:
            turn = self._probe_turn
            self._probe_turn = not turn
            return self._probe if turn else self.setting
        self._countdown -= 1
        if self._countdown > 0:
            return self.setting
        options = self._neighbours()
        if not options:
            self._countdown = MAX_INTERVAL
            return self.setting
        probe = options[self._turn % len(options)]
        self._turn += 1
        self._probe, self._probe_left = probe, self._probe_steps()
        self._times.pop(probe, None)          # a probe is judged on its own steps only
        self._paired.clear()
        self._probe_turn = False              # this step runs it, the next the current setting
        return probe

    def record(self, setting: tuple[int, bool], seconds: float) -> None:
        if not self.adapts:
            return
        times = self._times.get(setting)
        if times is None:
            times = self._times[setting] = deque(maxlen=MAX_PROBE_STEPS)
        times.append(seconds)
        if self._probe is None:
            # the jump test, every WINDOW steps (it sorts: not on every token): the latest
            # steps against the longer span, so a busy process that starts shows within a
            # few steps and one slow step among noisy ones does not
            self._unchecked += 1
            if (self._unchecked >= WINDOW and len(times) == MAX_PROBE_STEPS
                    and setting[0] == self.size and setting[1] == self.prefetch):
                self._unchecked = 0
                latest = list(times)[-max(WINDOW, self._probe_steps() // 2):]
                if statistics.median(latest) > JUMP * statistics.median(times):
                    self._countdown = 0      # slower than it was: look around now
            return
        if setting == self.setting:
            self._paired.append(seconds)
        elif setting == self._probe:
            self._probe_left -= 1
        else:
            return
        if self._probe_left > 0 or len(self._paired) < len(self._times[self._probe]):
            return
        # the probe's steps against the current setting's steps interleaved with them
        probe = statistics.median(self._times[self._probe])
        if probe < (1.0 - MARGIN) * statistics.median(self._paired):
            self.size, self.prefetch = self._probe
            self._interval = INTERVAL
            self._losses = self._turn = 0
        else:
            self._losses += 1
            if self._losses >= len(self._neighbours()):    # every neighbour lost: wait longer
                self._interval = min(4 * self._interval, MAX_INTERVAL)
                self._losses = 0
            else:                            # the round goes on: the next neighbour soon
                self._countdown = FIRST
                self._probe = None
                return
        self._countdown = self._interval
        self._probe = None

    def set_max(self, max_threads: int) -> None:
        """A new upper bound (set_threads): start again from it."""
        self.max_threads = max(1, int(max_threads))
        self._tune_threads = self._threads_wanted and self.max_threads > 1
        self._reset()
