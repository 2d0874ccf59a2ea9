"""Quantizing weights at load: float rows -> native blocks, and whole models (``--quantize``).

The bytes are those of cyllm.quant.reference.quantize (llama.cpp's reference
quantizers); the compiled twin (cyllm._ext.kernels.quantize_rows, C, threaded) is
used when the extension is built, the NumPy reference otherwise (~100x slower for
the K-quants). Which tensor gets which format follows llama.cpp's recipes
(quant/recipe.py), so ``cyllm.load(path, quantize="q4_k")`` holds what the
matching llama-quantize file would.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgumentError
from .formats import WeightFormat, format_by_name
from .matrix import QuantMatrix

# float32 elements converted per step: bounds the temporary whatever the matrix size
_CHUNK = 1 << 22
_SMALL_MATRIX = 1 << 22      # elements: below, quantize_weights gives a matrix one thread


def _native():
    try:
        from .._ext import kernels
        return kernels
    except ImportError:
        return None


def quantize_rows_f32(x: np.ndarray, fmt: WeightFormat | str, name: str = "weight",
                      threads: int | None = None) -> np.ndarray:
    """x (rows, cols) float32 -> (rows, row_bytes) uint8 blocks of fmt."""
    fmt = format_by_name(fmt) if isinstance(fmt, str) else fmt
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % fmt.block:
        raise InvalidArgumentError(
            f"{name}: cannot quantize shape {x.shape} to {fmt.name} (rows must be a multiple of "
            f"{fmt.block})")
    k = _native()
    if k is None:
        from .reference import quantize
        return quantize(x, fmt)
    from ..threads import resolve_threads, startable
    threads = startable(resolve_threads(threads))     # a team the system refuses: one clear error
    out = np.empty((x.shape[0], fmt.row_bytes(x.shape[1])), np.uint8)
    k.quantize_rows(out, x, fmt.name, threads)
    return out


def quantize_matrix(a: np.ndarray, fmt: WeightFormat | str, name: str = "weight",
                    threads: int | None = None) -> QuantMatrix:
    """A float matrix (rows, cols) (f16/f32/...) as a QuantMatrix of fmt, converted in
    row chunks so the float32 temporary stays small."""
    fmt = format_by_name(fmt) if isinstance(fmt, str) else fmt
    rows, cols = a.shape
    out = np.empty((rows, fmt.row_bytes(cols)), np.uint8)
    step = max(1, _CHUNK // max(cols, 1))
    for r0 in range(0, rows, step):
        part = slice(r0, min(r0 + step, rows))
        out[part] = quantize_rows_f32(np.asarray(a[part], np.float32), fmt, name, threads)
    return QuantMatrix(out, fmt, (rows, cols), name)


def dequantize_f16(qm: QuantMatrix) -> np.ndarray:
    """(rows, cols) float16 of a QuantMatrix (backends without native kernels for it),
    dequantized in row chunks by the NumPy reference; values beyond float16 become inf."""
    from .reference import dequantize
    out = np.empty(qm.shape, np.float16)
    step = max(1, _CHUNK // qm.cols)
    with np.errstate(over="ignore"):
        for r0 in range(0, qm.rows, step):
            out[r0:r0 + step] = dequantize(qm.data[r0:r0 + step], qm.fmt, qm.cols)
    return out


# --quantize at load: cyllm's names -> llama.cpp file types whose recipe is followed
QUANTIZE_AT_LOAD = {"q8_0": "q8_0", "q4_0": "q4_0", "q4_k": "q4_k_m"}


def check_quantize_type(qtype: str) -> str:
    key = str(qtype).strip().lower() if isinstance(qtype, str) else qtype
    if key not in QUANTIZE_AT_LOAD:
        raise InvalidArgumentError(f"unknown --quantize type {qtype!r} (supported: {', '.join(QUANTIZE_AT_LOAD)})")
    return key


def quantize_weights(config, weights: dict, qtype: str, threads: int | None = None) -> dict:
    """Every float matrix of `weights` (HF names) quantized in place of its float copy, with
    the format llama.cpp's recipe for `qtype` gives it (q4_k: the Q4_K_M recipe); matrices
    already quantized, vectors, and rows no format of the recipe holds stay as they are."""
    from ..families import family
    from .recipe import recipe
    key = check_quantize_type(qtype)
    fam = family(config.arch)
    rec = recipe(QUANTIZE_AT_LOAD[key], config.n_layers, has_output=not config.tie_word_embeddings,
                 n_experts=config.n_experts)
    jobs = {}                                           # name -> format, each name once
    for t, i, name in fam.expected_names(config):
        a = weights.get(name)
        if not isinstance(a, np.ndarray) or a.ndim != 2:
            continue
        fmt = rec.format_of(t.gguf_name(i), a.shape)
        if fmt is not None:
            jobs[name] = fmt
    from ..threads import resolve_threads, startable
    team = startable(resolve_threads(threads))
    # Small matrices (a mixture of experts' thousands: 18432 in Qwen3-30B-A3B) go one thread
    # each, `team` at a time: split over the team, one of them took longer than on one thread
    # (q4_0, 768 x 2048: 7.7 ms on two threads, 6.3 on one), the float32 copy being serial
    small = [j for j in jobs.items() if weights[j[0]].size < _SMALL_MATRIX]
    large = [j for j in jobs.items() if weights[j[0]].size >= _SMALL_MATRIX]
    if small:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(team) as pool:
            done = pool.map(lambda job: quantize_matrix(weights[job[0]], job[1], job[0], 1), small)
            for (name, _), q in zip(small, done):
                weights[name] = q
    for name, fmt in large:
        weights[name] = quantize_matrix(weights[name], fmt, name, team)
    return weights
