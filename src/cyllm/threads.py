"""Thread-count policy: explicit flag > OMP_NUM_THREADS > saved tuning > physical cores.

Memory-bound kernels gain nothing from SMT siblings, so the default is the
number of physical cores, not logical CPUs.
"""

from __future__ import annotations

import os

from .errors import InvalidArgumentError

# far above any machine's core count (OpenMP would start that many threads), far below
# what overflows a C int: `-t 10**18` is an error, not an OverflowError
MAX_THREADS = 1024


def logical_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def physical_cores() -> int:
    """Physical cores available to this process (Linux sysfs; logical count elsewhere)."""
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
        try:
            with open(base + "core_id") as f:
                core = f.read().strip()
            with open(base + "physical_package_id") as f:
                pkg = f.read().strip()
        except OSError:
            return len(cpus)
        cores.add((pkg, core))
    return max(1, len(cores))


def parse_threads(value, what: str = "threads") -> int:
    """A positive thread count from an int or a string; InvalidArgumentError otherwise."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{what} must be a positive integer, got {value!r}")
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise InvalidArgumentError(f"{what} must be a positive integer, got {value[:40]!r}") from None
    if not isinstance(value, int):
        try:
            import numbers
            if isinstance(value, numbers.Integral):
                value = int(value)
            else:
                raise TypeError
        except TypeError:
            raise InvalidArgumentError(f"{what} must be a positive integer, got {value!r}") from None
    if value <= 0:
        raise InvalidArgumentError(f"{what} must be a positive integer, got {value}")
    if value > MAX_THREADS:
        raise InvalidArgumentError(f"{what} must be at most {MAX_THREADS}, got {str(value)[:30]}")
    return value


def resolve_threads(threads=None, tuned: int | None = None) -> int:
    """The thread count to use: flag, then OMP_NUM_THREADS, then tuning, then physical cores."""
    if threads is not None:
        return parse_threads(threads)
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env:
        # OMP_NUM_THREADS may be a list ("4,2") for nested regions: the first level counts.
        return parse_threads(env.split(",")[0], "OMP_NUM_THREADS")
    if tuned is not None:
        return parse_threads(tuned, "tuned threads")
    return physical_cores()


_STARTABLE = [1]      # the largest team this process has seen the system allow


def startable(n: int) -> int:
    """n, once the system has let n threads and some to spare run at once; one clear error
    if it refuses.

    OpenMP would otherwise find out in the first parallel region, where libgomp prints
    "Thread creation failed" and ends the process (a pids limit, ulimit -u, or an
    address-space limit the thread stacks exhaust). The spare eighth (and four) leaves room
    for what starts threads or maps memory after the probe: the model's file, a tokenizer's
    pool; with none, a team at the exact limit of an address-space cap still failed once
    the model was loaded. A count that passed is remembered."""
    if n > _STARTABLE[0]:
        try:
            from ._ext import kernels
        except ImportError:         # no compiled kernels: nothing in this process starts a team
            return n
        want = n + n // 8 + 4
        got = kernels._probe_threads(want)
        if got < want:
            fits = max(1, (got - 4) * 8 // 9)
            raise InvalidArgumentError(
                f"cannot run {n} threads here: the system let only {got} start; ask for at most "
                f"{fits} (this machine has {logical_cpus()} logical CPUs)")
        _STARTABLE[0] = n
    return n
