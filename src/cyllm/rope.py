"""Rotary position embeddings: frequencies and cos/sin tables for every rope type.

A layer's rope is fully described by a :class:`RopeSpec`. Scaling types reduce
to per-frequency divisors of the base inverse frequencies (linear: all equal the
factor; llama3: the published wavelength formula, or the divisors a GGUF stores
as its ``rope_freqs`` tensor, used as they are; longrope: the short or long
factors; yarn: 1 for the fast frequencies, the factor for the slow ones and a linear
ramp between) plus, for longrope and yarn, a magnitude factor on cos and sin. The arithmetic
follows Hugging Face transformers (float32 tables) so positions rotate alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import ModelLoadError, UnsupportedModelError
from .oneline import one_line

ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
F32_MAX = float(np.finfo(np.float32).max)       # the engine's arithmetic (and these tables) is float32


@dataclass(frozen=True)
class RopeSpec:
    theta: float                     # base
    dim: int                         # rotated dims per head (even; <= head_dim)
    scaling: dict | None = None      # {"rope_type": ..., ...} or None (default)

    def __post_init__(self) -> None:
        if (isinstance(self.theta, bool) or not isinstance(self.theta, (int, float))
                or not math.isfinite(self.theta) or not 1.0 < self.theta <= F32_MAX):
            raise ModelLoadError(f"config: rope theta must be a number > 1 within float32's range, "
                                 f"got {_short(self.theta)}")
        if self.dim <= 0 or self.dim % 2:
            raise ModelLoadError(f"config: the rotary dimension must be even and positive, got {self.dim}")
        kind = self.rope_type
        if kind not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope type {_short(kind)} is not supported (supported: {', '.join(ROPE_TYPES)})")
        if kind != "default":
            _check_scaling(kind, self.scaling, self.dim)

    @property
    def rope_type(self) -> str:
        return (self.scaling or {}).get("rope_type", "default")

    def inv_freq(self, context: int) -> np.ndarray:
        """(dim // 2,) float32 inverse frequencies, scaling applied for a cache of ``context``.

        A theta or scaling finite in float64 can still overflow float32 (as in transformers,
        whose float32 arithmetic this follows): a base frequency that does becomes 0; a
        scaled one that is not finite is refused."""
        with np.errstate(over="ignore", divide="ignore", invalid="ignore", under="ignore"):
            base = 1.0 / (self.theta ** (np.arange(0, self.dim, 2, dtype=np.int64).astype(np.float32) / self.dim))
            div = self.divisors(context)
            inv = base.astype(np.float32) if div is None else (base.astype(np.float64) / div).astype(np.float32)
        if not np.all(np.isfinite(inv)):
            raise ModelLoadError(f"config: rope theta {_short(self.theta)} with {self.rope_type} scaling gives "
                                 "frequencies float32 cannot hold")
        return inv

    def divisors(self, context: int) -> np.ndarray | None:
        s = self.scaling or {}
        kind = self.rope_type
        half = self.dim // 2
        if kind == "linear":
            return np.full(half, float(s["factor"]))
        if kind == "llama3":
            if "divisors" in s:
                return np.asarray(s["divisors"], dtype=np.float64)
            base = 1.0 / (self.theta ** (np.arange(0, self.dim, 2, dtype=np.int64).astype(np.float32) / self.dim))
            return base.astype(np.float64) / llama3_inv_freq(base.astype(np.float64), s)
        if kind == "longrope":
            # as llama.cpp: the long factors when the cache is longer than the trained context
            long = context > int(s["original_max_position_embeddings"])
            return np.asarray(s["long_factor" if long else "short_factor"], dtype=np.float64)
        if kind == "yarn":
            return yarn_divisors(self.theta, self.dim, s)
        return None

    def magnitude(self) -> float:
        """Factor on cos and sin (longrope's attention factor; 1 otherwise)."""
        s = self.scaling or {}
        if self.rope_type == "yarn":
            return yarn_magnitude(s)
        if self.rope_type != "longrope":
            return 1.0
        if s.get("attention_factor") is not None:
            return float(s["attention_factor"])
        factor = float(s.get("factor") or 1.0)
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(int(s["original_max_position_embeddings"])))

    def tables(self, n_pos: int, context: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin, each (n_pos, dim // 2) float32."""
        inv = self.inv_freq(n_pos if context is None else context)
        with np.errstate(over="ignore", invalid="ignore"):
            freqs = np.outer(np.arange(n_pos, dtype=np.float32), inv).astype(np.float32)   # (n_pos, half)
            cos, sin = np.cos(freqs), np.sin(freqs)
            m = self.magnitude()
            if m != 1.0:
                cos, sin = cos * np.float32(m), sin * np.float32(m)
        if not (np.all(np.isfinite(cos)) and np.all(np.isfinite(sin))):
            raise ModelLoadError(f"config: the rope tables of theta {_short(self.theta)} with {self.rope_type} "
                                 "scaling are not finite in float32")
        return cos.astype(np.float32), sin.astype(np.float32)


def _positive(value, what: str) -> float:
    # a real number only: float("8") or float(True) would let a string or a flag through
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ModelLoadError(f"config: rope scaling {what} must be a number, got {_short(value)}")
    try:
        v = float(value)
    except OverflowError:
        v = math.inf
    if not math.isfinite(v) or v <= 0:
        raise ModelLoadError(f"config: rope scaling {what} must be a finite number > 0, got {_short(value)}")
    return v


def _short(value) -> str:
    return one_line(repr(value), 40)


def _check_scaling(kind: str, s: dict, dim: int) -> None:
    half = dim // 2
    if kind == "linear":
        _positive(s.get("factor"), "factor")
    elif kind == "llama3":
        if "divisors" in s:
            d = np.asarray(s["divisors"], dtype=np.float64)
            if d.shape != (half,) or not np.all(np.isfinite(d)) or np.any(d <= 0):
                raise ModelLoadError(f"rope_freqs must hold {half} finite positive values")
            return
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in s and key in ("factor", "original_max_position_embeddings"):
                raise ModelLoadError(f"config: llama3 rope scaling lacks {key!r}")
            _positive(s.get(key, 1.0 if key == "low_freq_factor" else 4.0), key)
        if float(s.get("high_freq_factor", 4.0)) <= float(s.get("low_freq_factor", 1.0)):
            raise ModelLoadError("config: llama3 rope scaling needs high_freq_factor > low_freq_factor")
    elif kind == "longrope":
        for key in ("short_factor", "long_factor"):
            f = s.get(key)
            if not isinstance(f, (list, tuple, np.ndarray)) or len(f) != half:
                raise ModelLoadError(f"config: longrope {key} must be a list of {half} numbers")
            for x in f:
                _positive(x, f"{key} entry")
        orig = _positive(s.get("original_max_position_embeddings"), "original_max_position_embeddings")
        if orig < 2:     # its logarithm divides the attention factor
            raise ModelLoadError(f"config: longrope original_max_position_embeddings must be at least 2, "
                                 f"got {_short(s.get('original_max_position_embeddings'))}")
        if s.get("factor") is not None:
            _positive(s["factor"], "factor")
        if s.get("attention_factor") is not None:
            _positive(s["attention_factor"], "attention_factor")
    elif kind == "yarn":
        _positive(s.get("factor"), "factor")
        _positive(s.get("original_max_position_embeddings"), "original_max_position_embeddings")
        for key in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
            if s.get(key) is not None:
                _positive(s[key], key)
        if not isinstance(s.get("truncate", True), bool):
            raise ModelLoadError(f"config: yarn truncate must be true or false, got {_short(s.get('truncate'))}")


def yarn_divisors(theta: float, dim: int, s: dict) -> np.ndarray:
    """YaRN's per-frequency divisors: frequencies that turn more than beta_fast times over the
    original context keep theirs (1), those that turn fewer than beta_slow times are divided by
    the factor, and a linear ramp over the frequency index runs between (transformers' yarn)."""
    factor = float(s["factor"])
    orig = float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:      # the index whose frequency turns that often
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float64)
    keep = 1.0 - ramp                                   # 1: the frequency as trained (extrapolated)
    return 1.0 / (keep + (1.0 - keep) / factor)


def yarn_magnitude(s: dict) -> float:
    """YaRN's factor on cos and sin: attention_factor, else 0.1 ln(factor) + 1 (or the ratio of
    two such terms weighted by mscale and mscale_all_dim, as DeepSeek's configs give)."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = float(s["factor"])

    def mscale(weight: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return mscale(float(s["mscale"])) / mscale(float(s["mscale_all_dim"]))
    return mscale(1.0)


def llama3_inv_freq(inv_freq: np.ndarray, s: dict) -> np.ndarray:
    """Llama 3.1 frequency-dependent scaling of inverse frequencies (the published formula)."""
    factor = float(s["factor"])
    low = float(s.get("low_freq_factor", 1.0))
    high = float(s.get("high_freq_factor", 4.0))
    orig = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = orig / low, orig / high
    wavelen = 2 * math.pi / inv_freq
    out = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, out)


def llama3_params_from_divisors(divisors, theta: float, dim: int) -> dict | None:
    """The llama3 scaling parameters whose divisors these are (for writing config.json), or None.

    The largest divisor is the factor; the original context is searched over powers of two
    with the published low/high frequency factors (1, 4).
    """
    div = np.asarray(divisors, dtype=np.float64)
    base = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factor = float(np.max(div))
    for k in range(4, 21):
        params = {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 1 << k}
        if np.allclose(base / llama3_inv_freq(base, params), div, rtol=1e-3, atol=1e-4):
            return params
    return None
