"""The thread counts `cyllm tune` saved: where they live, how they are read and written.

The best thread count depends on the machine and on the model size, and differs
between prefill and decode. The tool (`cyllm tune`, tools/tuning.py) measures
them; this module keeps them in ``<config dir>/tuning.json`` keyed by the CPU model
name, so the file can be shared (a roaming home directory) without one machine's
numbers steering another's. ``tuned_threads(weight_bytes)`` reads them back; it is
cheap and never raises, because model loading calls it.

Config dir: $CYLLM_CONFIG_DIR, else $XDG_CONFIG_HOME/cyllm, else ~/.config/cyllm.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from .errors import InvalidArgumentError
from .hostinfo import cpu_model_name

FILE_NAME = "tuning.json"
FORMAT_VERSION = 1
# A thread count within this fraction of the fastest counts as just as good; the
# smallest such count wins (fewer threads: less noise from, and for, other work).
TOLERANCE = 0.03
# model size classes by weight bytes (upper bounds), smallest first
SIZE_CLASSES = [("<500MB", 500_000_000), ("500MB-2GB", 2_000_000_000),
                ("2GB-8GB", 8_000_000_000), (">=8GB", None)]


def config_dir() -> Path:
    env = os.environ.get("CYLLM_CONFIG_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CONFIG_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".config"
    return base / "cyllm"


def tuning_path() -> Path:
    return config_dir() / FILE_NAME


def size_class(weight_bytes: int) -> str:
    for name, bound in SIZE_CLASSES:
        if bound is None or weight_bytes < bound:
            return name
    return SIZE_CLASSES[-1][0]


MAX_FILE_BYTES = 1 << 20          # a tuning file is a few KB
_warned_damaged = False


def _load_file() -> tuple[dict, str | None]:
    """(the saved data or {}, why the file is unusable or None). Never raises."""
    path = tuning_path()
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return {}, None
    except OSError as e:
        return {}, f"cannot read it: {e.strerror or e}"
    if len(raw) > MAX_FILE_BYTES:
        return {}, f"larger than {MAX_FILE_BYTES >> 20} MiB"
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return {}, "not valid JSON"
    if not isinstance(data, dict) or not isinstance(data.get("machines"), dict):
        return {}, "not a cyllm tuning file"
    if data.get("version") != FORMAT_VERSION:
        return {}, f"format version {str(data.get('version'))[:20]!r}, expected {FORMAT_VERSION}"
    return data, None


def _read_file() -> dict:
    return _load_file()[0]


def damaged_reason() -> str | None:
    """Why the tuning file cannot be used (None when it is fine or absent)."""
    return _load_file()[1]


def _warn_damaged_once(reason: str) -> None:
    global _warned_damaged
    if not _warned_damaged:
        _warned_damaged = True
        from .oneline import one_line
        print(one_line(f"cyllm: warning: ignoring the tuning file {tuning_path()} ({reason}); "
                       "`cyllm tune` writes a new one"), file=sys.stderr)


def _entries_for_this_cpu() -> dict:
    """{size class: entry} saved for this CPU model ({} when none or unreadable)."""
    data, reason = _load_file()
    if reason is not None:
        _warn_damaged_once(reason)
    entries = data.get("machines", {}).get(cpu_model_name(), {})
    return entries if isinstance(entries, dict) else {}


def _valid_count(v) -> int | None:
    from .threads import logical_cpus
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        return None
    # a count tuned on a larger allocation of the same CPU model would oversubscribe here
    return v if v <= logical_cpus() else None


def tuned_threads(weight_bytes: int) -> tuple[int | None, int | None]:
    """(decode threads, prefill threads) saved for this CPU and this model size; None where unknown."""
    try:
        entry = _entries_for_this_cpu().get(size_class(int(weight_bytes)))
        if not isinstance(entry, dict):
            return None, None
        return _valid_count(entry.get("decode_threads")), _valid_count(entry.get("prefill_threads"))
    except Exception:   # noqa: BLE001 -- a damaged tuning file must never stop a model from loading
        return None, None


def describe_saved_tuning() -> list[str]:
    """Lines for `cyllm info`."""
    path = tuning_path()
    reason = damaged_reason()
    if reason is not None:
        return [f"tuning: the file {path} is unusable ({reason}); `cyllm tune` writes a new one"]
    entries = _entries_for_this_cpu()
    if not entries:
        if path.exists():
            return [f"tuning: none saved for this CPU in {path} (run `cyllm tune`)"]
        return ["tuning: none saved (run `cyllm tune -m MODEL` to measure the best thread counts)"]
    lines = [f"tuning ({path}):"]
    for name, _ in SIZE_CLASSES:
        e = entries.get(name)
        if not isinstance(e, dict):
            continue
        lines.append(f"  models {name}: decode {_n_threads(e.get('decode_threads'))}, "
                     f"prefill {_n_threads(e.get('prefill_threads'))} "
                     f"(measured on {e.get('model', '?')}, {e.get('date', '?')})")
    return lines


def _n_threads(n) -> str:
    return f"{n} thread" + ("" if n == 1 else "s")


def save_tuning(weight_bytes: int, decode_threads: int, prefill_threads: int, info: dict | None = None) -> Path:
    """Record the best counts for this CPU and model size class; returns the file written."""
    path = tuning_path()
    data = _read_file() or {"version": FORMAT_VERSION, "machines": {}}   # a damaged file is replaced
    machine = data["machines"].setdefault(cpu_model_name(), {})
    if not isinstance(machine, dict):
        machine = data["machines"][cpu_model_name()] = {}
    entry = {"decode_threads": int(decode_threads), "prefill_threads": int(prefill_threads),
             "weight_bytes": int(weight_bytes), "date": time.strftime("%Y-%m-%d %H:%M")}
    entry.update(info or {})
    machine[size_class(weight_bytes)] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)          # atomic: a concurrent reader sees old or new, never half
    except OSError as e:
        raise InvalidArgumentError(f"cannot write the tuning file {path}: {e}") from None
    return path
