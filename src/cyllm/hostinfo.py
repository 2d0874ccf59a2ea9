"""What CPU this is, in the words results and saved tuning are keyed by."""

from __future__ import annotations

import platform


def _cpuinfo_fields(*keys: str) -> dict[str, str]:
    """The first value of each of `keys` in /proc/cpuinfo (empty where there is none)."""
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, sep, value = line.partition(":")
                key = key.strip()
                if sep and key in keys and key not in found:
                    found[key] = value.strip()
    except OSError:
        pass
    return found


def cpu_model_name() -> str:
    """The CPU model string (/proc/cpuinfo 'model name'; platform info elsewhere)."""
    name = _cpuinfo_fields("model name", "Model name")
    if name:
        return next(iter(name.values()))
    return platform.processor() or platform.machine() or "unknown"


def cpu_description() -> str:
    """The model name with its family and model numbers: hosts sold under one name (a
    VM's "AMD EPYC") are different CPUs, and benchmark tables are kept per CPU."""
    ids = _cpuinfo_fields("cpu family", "model")
    fam = f" (family {ids['cpu family']} model {ids['model']})" if len(ids) == 2 else ""
    return cpu_model_name() + fam
