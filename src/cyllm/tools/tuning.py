"""`cyllm tune`: measure the best thread counts and save them (saved_tuning.py keeps them).

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

import sys
from pathlib import Path

from ..errors import InvalidArgumentError
from ..hostinfo import cpu_model_name
from ..saved_tuning import TOLERANCE, _n_threads, config_dir, save_tuning, size_class


# -- the sweep ---------------------------------------------------------------------------
# Repetitions whose spread ((max - min) / median) exceeds this are too noisy to save:
# the choice between thread counts a few percent apart would be chance.
NOISE_LIMIT = 0.10


def noisiest_row(results: list[dict]) -> tuple[float, dict] | None:
    """(spread, row) of the row whose repetitions disagree most; None with one repetition."""
    worst = None
    for r in results:
        med = r.get("tokens_per_s") or 0.0
        if r.get("repetitions", 1) < 2 or med <= 0:
            continue
        spread = (r["tokens_per_s_max"] - r["tokens_per_s_min"]) / med
        if worst is None or spread > worst[0]:
            worst = (spread, r)
    return worst


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


def add_tune_parser(sub, add_model_args) -> None:
    from .bench import add_common_bench_args
    t = sub.add_parser("tune", help="find and save the best thread counts for prefill and decode",
                       description="Sweep thread counts (1 to the logical CPUs) for prefill and decode, "
                       "show the table and a chart, and save the best per model size class.")
    add_common_bench_args(t, add_model_args)
    add_tune_args(t)
    t.set_defaults(func=cmd_tune)


def add_tune_args(p) -> None:
    p.add_argument("--pp", default="64", help="prompt tokens per prefill run (default 64)")
    p.add_argument("--tg", default="32", help="tokens per decode run (default 32)")
    p.add_argument("--plot", metavar="PNG", help="where to write the chart (default: next to tuning.json)")
    p.add_argument("--no-save", action="store_true", help="measure and show, but do not save")
    p.add_argument("--save-anyway", action="store_true",
                   help=f"save even when repetitions disagree by more than {NOISE_LIMIT * 100:.0f}%%")


def cmd_tune(a) -> int:
    from .bench import (BenchConfig, Test, check_thread_counts, format_markdown, load_source,
                        parse_common, parse_int_list, run_bench)
    from ..threads import logical_cpus

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
    from ..hub import model_path          # a Hugging Face name works here too
    src = load_source(model_path(a.model), a.synthetic, seed, backends, max(pp, tg), getattr(a, "quantize", None))
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
    noisy = noisiest_row(results)
    save = not a.no_save
    if noisy is not None and noisy[0] > NOISE_LIMIT:
        spread, r = noisy
        warn = (f"cyllm: warning: repetitions disagree by up to {spread:.0%} ({r['threads']} thread"
                f"{'s' if r['threads'] != 1 else ''}, {r['test']}): the machine is busy or the runs are short")
        if save and not a.save_anyway:
            warn += "; not saved (close other programs, use more -r or larger --pp/--tg, or --save-anyway)"
            save = False
        print(warn, file=sys.stderr)
    if save:
        info = {"model": src.label, "logical_cpus": logical_cpus(), "threads_tried": threads,
                "prefill_tokens_per_s": {str(k): v for k, v in pp_rates.items()},
                "decode_tokens_per_s": {str(k): v for k, v in tg_rates.items()}}
        path = save_tuning(wbytes, best_tg, best_pp, info)
        print(f"saved to {path}: later runs use these counts for models {cls} "
              "(-t/--threads and OMP_NUM_THREADS still win)")
    return 0
