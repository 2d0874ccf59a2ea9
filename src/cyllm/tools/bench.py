"""`cyllm bench`: llama-bench-style throughput tables, with a memory roofline.

Tests (llama-bench naming):
  pp<N>      prompt processing: prefill N random token ids from an empty cache
  tg<N>      text generation: N single-token forward passes (random ids; the
             cost is the forward, sampling is left out as llama-bench does)
  tg<N>@d<D> the same with D positions already in the KV cache

Each test runs once untimed (warm-up: page faults, waking the thread team),
then ``-r`` times; the table shows the median tokens/s and the sample stdev.

Single-batch decode is memory-bound, so every tg row also reports the bytes a
token reads (weights actually touched + the KV cache positions attended), the
achieved GB/s, and that as a percentage of the read bandwidth measured in the
same run at the same thread count (the roofline).
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

from ..errors import BackendUnavailableError, CyllmError, InvalidArgumentError
from ..backends.base import OP_NAMES, Backend, HostArrays

OUTPUT_FORMATS = ("md", "json", "jsonl", "csv")
# warm-up runs are shortened: their job is to fault pages in and wake threads
WARMUP_TG = 8


# -- argument parsing ----------------------------------------------------------
MAX_LIST_VALUES = 1024      # more sizes or thread counts than any sweep needs


def parse_int_list(text, what: str, minimum: int = 0) -> list[int]:
    """"1,2,4" / "1-4" / 512 -> [ints], each >= minimum; InvalidArgumentError otherwise.

    At most MAX_LIST_VALUES values: a range is checked before it is expanded, so
    "0-1000000000000000000" is an error, not an endless loop or a MemoryError.
    """
    if isinstance(text, (list, tuple)):
        items = [str(t) for t in text]
    elif isinstance(text, (int, np.integer)) and not isinstance(text, bool):
        items = [str(int(text))]
    elif isinstance(text, str):
        if text.count(",") >= MAX_LIST_VALUES:
            raise InvalidArgumentError(f"{what}: more than {MAX_LIST_VALUES} values")
        items = [t.strip() for t in text.split(",")]
    else:
        raise InvalidArgumentError(f"{what}: expected a comma-separated list of numbers, got {text!r}")
    out: dict[int, None] = {}                      # ordered, O(1) duplicate check
    for item in items:
        m = re.fullmatch(r"(\d+)-(\d+)", item)          # a range "1-4"
        try:
            if m:
                a, b = int(m.group(1)), int(m.group(2))
                if b < a:
                    raise ValueError
            else:
                a = b = int(item)
        except ValueError:
            shown = item if len(item) <= 40 else item[:40] + "..."
            raise InvalidArgumentError(
                f"{what}: {shown!r} is not a whole number (expected a list like 1,2,4)") from None
        if b - a + 1 > MAX_LIST_VALUES:
            raise InvalidArgumentError(
                f"{what}: the range {a}-{b} has {b - a + 1} values; at most {MAX_LIST_VALUES}")
        vals = range(a, b + 1)
        for v in vals:
            if v < minimum:
                raise InvalidArgumentError(f"{what}: expected numbers >= {minimum}, got {v}")
            out[v] = None
        if len(out) > MAX_LIST_VALUES:
            raise InvalidArgumentError(f"{what}: more than {MAX_LIST_VALUES} values")
    if not out:
        raise InvalidArgumentError(f"{what}: the list is empty")
    return list(out)


def parse_backends(text) -> list[str]:
    from ..backends import BACKENDS
    names = [t.strip().lower() for t in str(text).split(",") if t.strip()]
    if not names:
        raise InvalidArgumentError("--backend: the list is empty")
    for n in names:
        if n not in BACKENDS:
            raise InvalidArgumentError(f"unknown backend {n!r} (choose from {', '.join(BACKENDS)})")
    return list(dict.fromkeys(names))


def parse_output_format(text) -> str:
    fmt = str(text).strip().lower()
    if fmt == "markdown":
        fmt = "md"
    if fmt not in OUTPUT_FORMATS:
        raise InvalidArgumentError(f"unknown output format {text!r} (choose from {', '.join(OUTPUT_FORMATS)})")
    return fmt


def warn(msg: str) -> None:
    print(f"cyllm: warning: {msg}", file=sys.stderr)


def check_thread_counts(threads: list[int]) -> None:
    """Warn (stderr) about counts above the logical CPUs: they still run, oversubscribed."""
    from ..threads import logical_cpus
    n = logical_cpus()
    over = [t for t in threads if t > n]
    if over:
        warn(f"{', '.join(map(str, over))} thread(s) exceed the {n} logical CPUs available; "
             "those runs oversubscribe the cores and are usually slower")


# -- the model under test --------------------------------------------------------
@dataclass
class ModelSource:
    """Weights held once and bound to each backend in turn."""
    label: str                      # what the table shows
    config: object                  # ModelConfig
    weights: dict
    tokenizer: object = None
    path: str | None = None
    preset: str | None = None
    weight_format: str = "F16"      # as stored in the file: Q4_K_M, Q8_0, BF16... (llama-bench's "model")
    file_bytes: int | None = None   # size on disk (llama-bench's "size")

    @property
    def weight_bytes(self) -> int:
        return sum(int(a.nbytes) for a in self.weights.values())

    @property
    def model_type(self) -> str:
        """llama-bench's model column: family, size, weight format (``llama 135M Q4_1``)."""
        return f"{self.config.arch} {_size_label(int(self.config.n_params))} {self.weight_format}"


def _size_label(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.1f}".rstrip("0").rstrip(".") + "B"
    return f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def weight_format_of(path) -> tuple[str, int]:
    """(weight format, bytes on disk) of a GGUF file or Hugging Face directory, from headers."""
    from collections import Counter
    from pathlib import Path
    p = Path(path)
    if p.is_file():
        from ..loading.gguf import read_gguf
        from .modelinfo import gguf_file_type_name
        gf = read_gguf(p)
        name = gguf_file_type_name(gf.metadata.get("general.file_type"))
        if name is None:        # no file type recorded: the most common matrix type
            kinds = Counter(t.type_name for t in gf.tensors.values() if len(t.dims) == 2)
            name = kinds.most_common(1)[0][0] if kinds else "?"
        return name, p.stat().st_size
    files = sorted(p.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    try:
        from ..loading.safetensors import open_checkpoint
        kinds = Counter(f.dtype_of(t) for f, t in open_checkpoint(p).values())
        return (kinds.most_common(1)[0][0] if kinds else "?"), size
    except CyllmError:
        return "?", size


def load_source(model=None, synthetic=None, seed: int = 0, backends=("cpu",), context: int = 0,
                quantize: str | None = None) -> ModelSource:
    """Weights from a path (HF dir / GGUF), a synthetic preset, or the default model;
    quantize: as cyllm.load's (float matrices quantized in memory)."""
    if quantize is not None:
        from ..quant.convert import check_quantize_type
        quantize = check_quantize_type(quantize)
        src = load_source(model, synthetic, seed, backends, context)
        from ..quant.convert import quantize_weights
        from ..quant.convert import QUANTIZE_AT_LOAD
        quantize_weights(src.config, src.weights, quantize)
        src.label += f" --quantize {quantize}"
        # what is held now: the recipe's name and the quantized bytes (the file's are not read)
        src.weight_format = QUANTIZE_AT_LOAD[quantize].upper()
        src.file_bytes = src.weight_bytes
        return src
    if model and synthetic:
        raise InvalidArgumentError("pass either -m/--model or --synthetic, not both")
    if synthetic:
        from .synthetic import build_synthetic, preset_config
        cfg = preset_config(synthetic)
        # the numpy backend keeps a float32 copy of every matrix (3x the f16 bytes)
        factor = 3.0 if "numpy" in backends else 1.0
        kv = cfg.kv_bytes_per_token() * max(context, 1) * len(backends)
        from .synthetic import check_fits, weight_bytes
        check_fits(int(weight_bytes(cfg) * factor) + kv, f"synthetic preset {synthetic!r}")
        cfg, weights = build_synthetic(synthetic, seed=seed, check_memory=False)
        src = ModelSource(label=f"{cfg.name.split(':', 1)[1]} (synthetic)", config=cfg,
                          weights=weights, preset=synthetic)
        src.file_bytes = src.weight_bytes            # nothing on disk: the float16 weights held
        return src
    from ..loading import load_path
    if model is None:
        try:
            from ..default_model import default_model_path
        except ImportError:
            raise InvalidArgumentError("no model given: pass -m PATH or --synthetic PRESET") from None
        model = default_model_path()
    config, weights, tok = load_path(model)
    label = os.path.basename(os.path.normpath(os.fspath(model)))
    fmt, size = weight_format_of(model)
    return ModelSource(label=label, config=config, weights=weights, tokenizer=tok, path=os.fspath(model),
                       weight_format=fmt, file_bytes=size)


def make_backend(name: str, threads: int):
    from ..backends import get_backend
    try:
        return get_backend(name, threads)
    except ImportError as e:            # the compiled extension is missing
        raise BackendUnavailableError(f"the {name} backend is not available ({e})") from None


def bind_model(src: ModelSource, backend, context: int):
    from ..model import Model
    return Model.from_weights(src.config, src.weights, src.tokenizer, backend=backend, context=context)


def set_threads(model, n: int) -> int:
    """Switch the kernel thread count in place; returns the count now in effect."""
    model.set_threads(n, n)         # both phases use n
    return int(model.backend.threads)


def varies_threads(backend) -> bool:
    """Only backends with a thread team (cpu) are swept over -t."""
    return backend.thread_team


# -- bandwidth (the roofline) ----------------------------------------------------
_BW_CACHE: dict[tuple, tuple[float | None, str]] = {}


def _as_gbps(v) -> float | None:
    if v is None:
        return None
    v = float(v)
    if not np.isfinite(v) or v <= 0:
        return None
    return v / 1e9 if v > 1e5 else v       # accept bytes/s or GB/s


# The probe reads a buffer as large as the weights a token reads, capped here: a model
# larger than the last-level cache is compared with DRAM bandwidth, one that fits in
# it with cache bandwidth (against a DRAM-sized probe a small model showed 110%).
PROBE_MAX_BYTES = 512 << 20
PROBE_MIN_BYTES = 1 << 20


def probe_bytes(working_set: int) -> int:
    return int(min(max(working_set, PROBE_MIN_BYTES), PROBE_MAX_BYTES))


def _numpy_read_probe(nbytes: int = 256 << 20) -> float:
    """GB/s of a 1-thread numpy sum over nbytes (fallback when the extension has no probe)."""
    buf = np.ones(max(nbytes // 4, 1), dtype=np.float32)          # (nbytes/4,)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.nbytes / best / 1e9


def read_bandwidth(backend, threads: int, nbytes: int = PROBE_MAX_BYTES) -> tuple[float | None, str]:
    """(GB/s, source) of reading ``nbytes`` of memory with the backend's kernels and ``threads``."""
    kind = backend.name
    nbytes = probe_bytes(nbytes)
    key = (kind, threads if kind == "cpu" else 1, nbytes)
    if key in _BW_CACHE:
        return _BW_CACHE[key]
    gbps, source = backend.measure_bandwidth(nbytes, threads)
    result: tuple[float | None, str] = (_as_gbps(gbps), source)
    if gbps is None and kind != "cuda":
        result = (_numpy_read_probe(nbytes), "numpy sum, 1 thread")
    _BW_CACHE[key] = result
    return result


# -- bytes per token ---------------------------------------------------------------
def weight_bytes_read_per_token(model) -> int:
    """Bytes of weights one forward pass reads, from the arrays the backend holds.

    Every layer matrix and norm is read once, of a mixture of experts the share of its experts
    a token uses (their average: n_experts_used of n_experts); of the embedding table only one
    row is read, unless it doubles as the output matrix (tied), then all of it.
    """
    def nb(a):
        return int(getattr(a, "nbytes", 0)) if a is not None else 0

    c = model.config
    total = nb(model.final_norm) + nb(model.output)
    if model.output is not model.embedding:
        total += nb(model.embedding) // max(c.vocab_size, 1)
    for L in model.layers:
        for a in (L.attn_norm, L.wq, L.wk, L.wv, L.bq, L.bk, L.bv, L.wo, L.ffn_norm,
                  L.w_gate, L.w_up, L.w_down, L.q_norm, L.k_norm, L.post_attn_norm, L.post_ffn_norm, L.router):
            total += nb(a)
        if L.experts:
            total += round(sum(nb(m) for trio in L.experts for m in trio) * c.n_experts_used / c.n_experts)
    return total


def kv_bytes_read(model, depth: int, n_gen: int) -> float:
    """Average KV-cache bytes a tg token reads: K and V of every position attended.

    The token at position p attends p + 1 positions; over positions depth..depth+n-1
    that averages depth + (n + 1) / 2.
    """
    c = model.config
    itemsize = int(getattr(getattr(model.layers[0].k_cache, "dtype", None), "itemsize", 2) or 2)
    avg_pos = depth + (n_gen + 1) / 2
    return 2 * c.n_layers * c.n_kv_heads * c.head_dim * itemsize * avg_pos


# -- op-issue overhead (what the Python model costs outside the kernels) -------------
class _NullBackend(HostArrays, Backend):
    """Every op a no-op: timing a forward pass on it measures model.py's own overhead."""
    name = "null"
    kernel_variant = "none"

    def upload(self, a):
        return a


def _noop(self, *args, **kwargs):
    pass


# every op of the registry, so the model takes the same code paths as on a real backend
for _op in OP_NAMES:
    setattr(_NullBackend, _op, _noop)


def issue_overhead_s(src: ModelSource, n: int = 20) -> float | None:
    """Seconds per token spent issuing ops in Python (no kernel work), best of n."""
    try:
        from ..model import Model
        m = Model.from_weights(src.config, src.weights, None, backend=_NullBackend(), context=2)
        best = float("inf")
        for _ in range(n):
            t0 = time.perf_counter()
            m.forward(1 % src.config.vocab_size, 0)
            best = min(best, time.perf_counter() - t0)
        return best
    except Exception:   # noqa: BLE001 -- an optional statistic must never break a benchmark
        return None


# -- running the tests ----------------------------------------------------------------
@dataclass
class Test:
    kind: str          # "pp" | "tg"
    n: int
    depth: int = 0

    @property
    def name(self) -> str:
        return f"{self.kind}{self.n}" + (f"@d{self.depth}" if self.depth else "")


def plan_tests(pp: list[int], tg: list[int], depths: list[int]) -> list[Test]:
    tests = [Test("pp", n) for n in pp if n > 0]
    tests += [Test("tg", n, d) for d in depths for n in tg if n > 0]
    if not tests:
        raise InvalidArgumentError("nothing to run: every -p and -n size is 0")
    return tests


def needed_context(tests: list[Test]) -> int:
    need = 1
    for t in tests:
        need = max(need, t.n + t.depth)
    return need


def fill_cache_to_depth(model, depth: int, seed: int) -> None:
    """Make positions 0..depth-1 of every layer's KV cache hold plausible values.

    Untimed setup: attention cost does not depend on the values, so random
    float16 numbers are written straight into the cache (seconds instead of the
    minutes a token-by-token prefill of a long depth would take).
    """
    if depth <= 0:
        return
    c = model.config
    rng = np.random.default_rng(seed)
    host = (rng.standard_normal((c.n_kv_heads, depth, c.head_dim), dtype=np.float32)
            .astype(np.float16))                                  # (n_kv, depth, head_dim)
    try:
        dev = model.backend.upload(host)
        for L in model.layers:
            L.k_cache[:, :depth, :] = dev
            L.v_cache[:, :depth, :] = dev
        model.backend.synchronize()
    except (TypeError, ValueError, AttributeError):
        # a backend whose cache cannot be assigned to: fill it the honest way
        ids = rng.integers(0, c.vocab_size, size=depth).tolist()
        model.prefill(ids, 0)


def time_test(model, test: Test, n: int, rng) -> float:
    """Seconds for one run of ``test`` with size n (the KV prefix is already filled)."""
    vocab = model.config.vocab_size
    ids = rng.integers(0, vocab, size=n).tolist()
    if test.kind == "pp":
        t0 = time.perf_counter()
        model.prefill(ids, 0)          # returns host logits: the work has finished
        return time.perf_counter() - t0
    fwd = model.forward
    pos0 = test.depth
    t0 = time.perf_counter()
    for i, tok in enumerate(ids):
        fwd(tok, pos0 + i)             # returns host logits: synchronised
    return time.perf_counter() - t0


@dataclass
class BenchConfig:
    backends: list[str]
    threads: list[int]
    tests: list[Test]
    repetitions: int = 3
    seed: int = 0
    context: int | None = None
    overhead: bool = True
    progress: bool = True


def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    # disable=None: tqdm stays silent when stderr is not a terminal
    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, disable=None,
                unit="run", dynamic_ncols=True)


def run_bench(src: ModelSource, cfg: BenchConfig) -> list[dict]:
    """Run every (backend, threads, test) and return one result dict per row."""
    if cfg.repetitions < 1:
        raise InvalidArgumentError(f"repetitions must be >= 1, got {cfg.repetitions}")
    context = cfg.context or needed_context(cfg.tests)
    if context < needed_context(cfg.tests):
        raise InvalidArgumentError(
            f"--context {context} is smaller than the largest test needs ({needed_context(cfg.tests)})")
    results: list[dict] = []
    overhead = issue_overhead_s(src) if cfg.overhead else None
    from ..threads import logical_cpus
    for be_name in cfg.backends:
        backend = make_backend(be_name, cfg.threads[0])
        model = bind_model(src, backend, context)
        wbytes = weight_bytes_read_per_token(model)
        # untimed: positions below the deepest tg depth hold values once, for every test
        fill_cache_to_depth(model, max((t.depth for t in cfg.tests), default=0), cfg.seed)
        thread_list = cfg.threads if varies_threads(backend) else [int(getattr(backend, "threads", 1))]
        total = len(thread_list) * len(cfg.tests) * (cfg.repetitions + 1)
        bar = _progress(total, cfg.progress, f"bench {be_name}")
        try:
            for t in thread_list:
                threads_now = set_threads(model, t) if varies_threads(backend) else t
                for ti, test in enumerate(cfg.tests):
                    if bar is not None:
                        bar.set_postfix_str(f"t={t} {test.name}")
                    rng = np.random.default_rng([cfg.seed, ti, t])
                    # pp warms up with a full prefill chunk so GEMM shapes are planned before timing
                    warm = min(test.n, model.prefill_chunk if test.kind == "pp" else WARMUP_TG)
                    time_test(model, test, warm, rng)
                    if bar is not None:
                        bar.update(1)
                    samples = []
                    for _ in range(cfg.repetitions):
                        dt = time_test(model, test, test.n, rng)
                        samples.append(test.n / dt)
                        if bar is not None:
                            bar.update(1)
                    results.append(_result_row(src, model, backend, threads_now, test, samples,
                                               wbytes, overhead, logical_cpus()))
        finally:
            if bar is not None:
                bar.close()
        del model, backend
    return results


def _result_row(src, model, backend, threads, test: Test, samples, wbytes, overhead, ncpu) -> dict:
    med = statistics.median(samples)
    row = {
        "model": src.label,
        "model_type": src.model_type,
        "weight_format": src.weight_format,
        "file_bytes": src.file_bytes,
        "model_path": src.path,
        "synthetic": src.preset,
        "model_bytes": src.weight_bytes,
        "n_params": int(src.config.n_params),
        "backend": backend.name,
        "kernel_variant": getattr(backend, "kernel_variant", ""),
        "threads": int(threads),
        "logical_cpus": ncpu,
        "test": test.name,
        "n_prompt": test.n if test.kind == "pp" else 0,
        "n_gen": test.n if test.kind == "tg" else 0,
        "depth": test.depth,
        "repetitions": len(samples),
        "tokens_per_s": med,
        "tokens_per_s_stdev": statistics.stdev(samples) if len(samples) > 1 else 0.0,
        "tokens_per_s_min": min(samples),
        "tokens_per_s_max": max(samples),
        "samples_tokens_per_s": samples,
        "bytes_per_token": None,
        "gb_per_s": None,
        "read_bandwidth_gb_s": None,
        "bandwidth_source": None,
        "roofline_pct": None,
        "roofline_pct_measured": None,
        "issue_overhead_pct": None,
    }
    if test.kind == "tg":
        bpt = wbytes + kv_bytes_read(model, test.depth, test.n)
        gbps = bpt * med / 1e9
        bw, bw_src = read_bandwidth(backend, threads, wbytes)
        raw = (100.0 * gbps / bw) if bw else None
        # above 100% the probe underestimated what this working set can stream (a noisy
        # probe run, a different access pattern): the honest statement is "at the roofline"
        row.update(bytes_per_token=int(round(bpt)), gb_per_s=gbps, read_bandwidth_gb_s=bw,
                   bandwidth_source=bw_src, roofline_pct=min(raw, 100.0) if raw is not None else None,
                   roofline_pct_measured=raw)
        if overhead is not None and not backend.captures_decode:
            row["issue_overhead_pct"] = 100.0 * overhead * med
    return row


# -- formatting -------------------------------------------------------------------------
def _fmt_bytes(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def _fmt_params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def format_markdown(results: list[dict]) -> str:
    head = ["model", "size", "params", "backend", "variant", "threads", "test", "t/s", "GB/s", "roofline"]
    align = ["---", "---:", "---:", "---", "---", "---:", "---:", "---:", "---:", "---:"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
    clamped = False
    for r in results:
        gb = f"{r['gb_per_s']:.2f}" if r["gb_per_s"] is not None else ""
        rf = f"{r['roofline_pct']:.1f}%" if r["roofline_pct"] is not None else ""
        measured = r.get("roofline_pct_measured")
        if measured is not None and measured > 100.0:
            rf += "*"
            clamped = True
        size = r.get("file_bytes") or r["model_bytes"]
        lines.append("| " + " | ".join([
            r.get("model_type") or r["model"], _fmt_bytes(size), _fmt_params(r["n_params"]), r["backend"],
            r["kernel_variant"], str(r["threads"]), r["test"],
            f"{r['tokens_per_s']:.2f} ± {r['tokens_per_s_stdev']:.2f}", gb, rf]) + " |")
    notes = []
    for name, mtype, held, synth, fmt in dict.fromkeys(
            (r["model"], r.get("model_type"), r["model_bytes"], r.get("synthetic"), r.get("weight_format"))
            for r in results):
        if synth:
            notes.append(f"{mtype}: {name}, random {fmt or 'F16'} weights; size = the weights held")
        else:
            notes.append(f"{mtype}: {name}; size = the file on disk; weights held in memory "
                         f"({fmt or 'as loaded'}): {_fmt_bytes(held)}")
    if clamped:
        notes.append("* measured above the probed bandwidth (shown as 100%): the probe "
                     "underestimated what this working set can stream")
    bws = {}
    for r in results:
        if r["read_bandwidth_gb_s"] is not None:
            bws[(r["backend"], r["threads"])] = (r["read_bandwidth_gb_s"], r["bandwidth_source"])
    if bws:
        parts = [(f"{be} {t} thread{'s' if t != 1 else ''}" if be == "cpu" else be)
                 + f": {bw:.1f} GB/s ({srcname})" for (be, t), (bw, srcname) in sorted(bws.items())]
        notes.append("read bandwidth measured in this run: " + "; ".join(parts))
    tg = [r for r in results if r["bytes_per_token"] is not None]
    if tg:
        r = tg[0]
        notes.append(f"bytes read per generated token: weights + KV cache attended "
                     f"(e.g. {r['test']}: {r['bytes_per_token'] / 1e6:.1f} MB)")
    ov = [r for r in results if r["issue_overhead_pct"] is not None]
    if ov:
        parts = [f"{r['backend']} t={r['threads']} {r['test']}: {r['issue_overhead_pct']:.1f}%" for r in ov]
        notes.append("share of decode time spent issuing ops in Python (outside the kernels): "
                     + "; ".join(parts))
    if notes:
        lines.append("")
        lines.extend(notes)
    return "\n".join(lines)


CSV_COLUMNS = ["model", "model_type", "weight_format", "file_bytes", "model_path", "synthetic", "model_bytes", "n_params", "backend",
               "kernel_variant", "threads", "logical_cpus", "test", "n_prompt", "n_gen", "depth",
               "repetitions", "tokens_per_s", "tokens_per_s_stdev", "tokens_per_s_min",
               "tokens_per_s_max", "bytes_per_token", "gb_per_s", "read_bandwidth_gb_s",
               "bandwidth_source", "roofline_pct", "roofline_pct_measured", "issue_overhead_pct"]


def format_csv(results: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in results:
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_COLUMNS})
    return buf.getvalue().rstrip("\n")


def format_json(results: list[dict]) -> str:
    return json.dumps(results, indent=2)


def format_jsonl(results: list[dict]) -> str:
    """One JSON object per line (llama-bench's -o jsonl)."""
    return "\n".join(json.dumps(r) for r in results)


def format_results(results: list[dict], fmt: str) -> str:
    return {"md": format_markdown, "json": format_json, "jsonl": format_jsonl, "csv": format_csv}[fmt](results)


# -- the CLI ----------------------------------------------------------------------------
def add_common_bench_args(p, add_model_args) -> None:
    add_model_args(p)
    from .synthetic import preset_names
    p.add_argument("--synthetic", metavar="PRESET",
                   help=f"random-weight model with real shapes instead of -m (presets: {', '.join(preset_names())})")
    p.add_argument("-r", "--repetitions", default="3", help="timed runs per test after one warm-up (default 3)")
    p.add_argument("--seed", default="0", help="seed of the synthetic weights and token ids (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_bench_parser(sub, add_model_args) -> None:
    b = sub.add_parser("bench", help="measure prompt (pp) and generation (tg) speed, llama-bench style",
                       description="Measure tokens/s for prompt processing (ppN) and generation (tgN, "
                       "optionally at a KV-cache depth), with the roofline of measured read bandwidth. "
                       "-t, -p, -n, -d, --backend take comma lists.")
    add_common_bench_args(b, add_model_args)
    b.add_argument("-p", "--n-prompt", default="512", help="prompt sizes, e.g. 128,512 (default 512; 0 = none)")
    b.add_argument("-n", "--n-gen", default="128", help="generation sizes (default 128; 0 = none)")
    b.add_argument("-d", "--depth", default="0", help="KV-cache depths for tg tests (default 0)")
    b.add_argument("-o", "--output", default="md", help="md (default), json, jsonl or csv")
    b.set_defaults(func=cmd_bench)


def parse_common(a) -> tuple[list[str], int, int]:
    backends = parse_backends(a.backend)
    reps = parse_int_list(a.repetitions, "--repetitions", minimum=1)
    if len(reps) != 1:
        raise InvalidArgumentError("--repetitions takes one number")
    try:
        seed = int(str(a.seed).strip())
    except ValueError:
        raise InvalidArgumentError(f"--seed must be an integer, got {a.seed!r}") from None
    return backends, reps[0], seed


def default_thread_list(a) -> list[int]:
    from ..threads import resolve_threads
    if a.threads is None:
        return [resolve_threads(None)]
    return parse_int_list(a.threads, "--threads", minimum=1)


def cmd_bench(a) -> int:
    fmt = parse_output_format(a.output)
    backends, reps, seed = parse_common(a)
    threads = default_thread_list(a)
    pp = parse_int_list(a.n_prompt, "-p/--n-prompt", minimum=0)
    tg = parse_int_list(a.n_gen, "-n/--n-gen", minimum=0)
    depths = parse_int_list(a.depth, "-d/--depth", minimum=0)
    tests = plan_tests(pp, tg, depths)
    check_thread_counts(threads)
    context = a.context or needed_context(tests)
    from ..hub import model_path          # a Hugging Face name works here too
    src = load_source(model_path(a.model), a.synthetic, seed, backends, context, getattr(a, "quantize", None))
    cfg = BenchConfig(backends=backends, threads=threads, tests=tests, repetitions=reps,
                      seed=seed, context=context, progress=not a.no_progress)
    results = run_bench(src, cfg)
    out = format_results(results, fmt)
    sys.stdout.write(out + "\n")
    sys.stdout.flush()
    return 0


__all__ = ["add_bench_parser", "add_common_bench_args", "run_bench", "BenchConfig", "Test", "ModelSource",
           "load_source", "plan_tests", "parse_int_list", "format_results", "read_bandwidth",
           "weight_bytes_read_per_token", "kv_bytes_read", "CyllmError"]
