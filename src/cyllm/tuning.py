"""`cyllm tune` and the saved thread counts it produces.

The best thread count depends on the machine (core kinds, memory channels,
SMT) and on the model size (a small model's decode is dominated by per-op
synchronisation, a large one's by bandwidth), and differs between prefill and
decode. `cyllm tune` measures both, and saves the best per model size class in
``<config dir>/tuning.json`` keyed by the CPU model name, so the file can be
shared (a roaming home directory) without one machine's numbers steering
another's. ``tuned_threads(weight_bytes)`` reads it back; it is cheap and never
raises, because model loading calls it.

Config dir: $CYLLM_CONFIG_DIR, else $XDG_CONFIG_HOME/cyllm, else ~/.config/cyllm.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from .errors import InvalidArgumentError

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


def cpu_model_name() -> str:
    """The CPU model string (/proc/cpuinfo 'model name'; platform info elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") or line.startswith("Model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine() or "unknown"


def size_class(weight_bytes: int) -> str:
    for name, bound in SIZE_CLASSES:
        if bound is None or weight_bytes < bound:
            return name
    return SIZE_CLASSES[-1][0]


def _read_file() -> dict:
    try:
        with open(tuning_path(), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
        return {}
    if not isinstance(data.get("machines"), dict):
        return {}
    return data


def _entries_for_this_cpu() -> dict:
    """{size class: entry} saved for this CPU model ({} when none or unreadable)."""
    machines = _read_file().get("machines", {})
    entries = machines.get(cpu_model_name(), {})
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
    data = _read_file() or {"version": FORMAT_VERSION, "machines": {}}
    machine = data["machines"].setdefault(cpu_model_name(), {})
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


# -- the sweep ---------------------------------------------------------------------------
def best_threads(rates: dict[int, float]) -> int:
    """The smallest thread count within TOLERANCE of the fastest."""
    top = max(rates.values())
    return min(t for t, r in rates.items() if r >= (1.0 - TOLERANCE) * top)


def text_chart(title: str, rates: dict[int, float], best: int, width: int = 40) -> str:
    top = max(rates.values()) or 1.0
    lines = [title]
    for t in sorted(rates):
        bar = "#" * max(1, round(width * rates[t] / top))
        mark = "  <- best" if t == best else ""
        lines.append(f"  {t:3d} thread{'s' if t != 1 else ' '} | {bar:<{width}} {rates[t]:9.2f}{mark}")
    return "\n".join(lines)


def save_plot(path: Path, pp_rates, tg_rates, best_pp, best_tg, title: str) -> bool:
    """PNG of tokens/s vs threads (matplotlib, optional); False when it is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, rates, best, name in ((axes[0], pp_rates, best_pp, "prefill"),
                                  (axes[1], tg_rates, best_tg, "decode")):
        ts = sorted(rates)
        ax.plot(ts, [rates[t] for t in ts], marker="o")
        ax.axvline(best, color="tab:green", linestyle="--", label=f"best: {best}")
        ax.set_xlabel("threads")
        ax.set_ylabel("tokens/s")
        ax.set_title(name)
        ax.set_xticks(ts)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def add_tune_args(p) -> None:
    p.add_argument("--pp", default="64", help="prompt tokens per prefill run (default 64)")
    p.add_argument("--tg", default="32", help="tokens per decode run (default 32)")
    p.add_argument("--plot", metavar="PNG", help="where to write the chart (default: next to tuning.json)")
    p.add_argument("--no-save", action="store_true", help="measure and show, but do not save")


def cmd_tune(a) -> int:
    from .bench import (BenchConfig, Test, check_thread_counts, format_markdown, load_source,
                        parse_common, parse_int_list, run_bench)
    from .threads import logical_cpus

    backends, reps, seed = parse_common(a)
    if backends != ["cpu"]:
        raise InvalidArgumentError("tune measures the cpu backend's thread counts; use --backend cpu")
    if a.threads is None:
        threads = list(range(1, logical_cpus() + 1))
    else:
        threads = parse_int_list(a.threads, "--threads", minimum=1)
    pp = parse_int_list(a.pp, "--pp", minimum=1)[0]
    tg = parse_int_list(a.tg, "--tg", minimum=1)[0]
    check_thread_counts(threads)
    tests = [Test("pp", pp), Test("tg", tg)]
    src = load_source(a.model, a.synthetic, seed, backends, max(pp, tg), getattr(a, "quantize", None))
    cfg = BenchConfig(backends=backends, threads=threads, tests=tests, repetitions=reps,
                      seed=seed, context=a.context or max(pp, tg), overhead=False,
                      progress=not a.no_progress)
    results = run_bench(src, cfg)
    pp_rates = {r["threads"]: r["tokens_per_s"] for r in results if r["test"].startswith("pp")}
    tg_rates = {r["threads"]: r["tokens_per_s"] for r in results if r["test"].startswith("tg")}
    best_pp, best_tg = best_threads(pp_rates), best_threads(tg_rates)
    wbytes = src.weight_bytes
    cls = size_class(wbytes)

    print(format_markdown(results))
    print()
    print(text_chart(f"prefill (pp{pp}) tokens/s", pp_rates, best_pp))
    print(text_chart(f"decode (tg{tg}) tokens/s", tg_rates, best_tg))
    print()
    print(f"best: decode {_n_threads(best_tg)}, prefill {_n_threads(best_pp)} "
          f"(model size class {cls}, CPU {cpu_model_name()})")
    plot = Path(a.plot) if a.plot else config_dir() / f"tune-{cls}.png"
    if a.plot or not a.no_save:
        try:
            if save_plot(plot, pp_rates, tg_rates, best_pp, best_tg, f"{src.label} on {cpu_model_name()}"):
                print(f"chart: {plot}")
            elif a.plot:
                print("cyllm: notice: matplotlib is not installed; no PNG written "
                      "(pip install matplotlib)", file=sys.stderr)
        except OSError as e:
            print(f"cyllm: warning: cannot write the chart {plot}: {e}", file=sys.stderr)
    if not a.no_save:
        info = {"model": src.label, "logical_cpus": logical_cpus(), "threads_tried": threads,
                "prefill_tokens_per_s": {str(k): v for k, v in pp_rates.items()},
                "decode_tokens_per_s": {str(k): v for k, v in tg_rates.items()}}
        path = save_tuning(wbytes, best_tg, best_pp, info)
        print(f"saved to {path}: later runs use these counts for models {cls} "
              "(-t/--threads and OMP_NUM_THREADS still win)")
    return 0
