"""Token sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, seed.

The greedy path (temperature 0) is an argmax and allocates nothing. The
stochastic path works in buffers allocated once per Sampler; only the
top-k/top-p candidate selection creates small index arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import InvalidArgumentError


@dataclass
class SamplingParams:
    temperature: float = 0.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0                # 1 = off
    min_p: float = 0.0                # 0 = off
    repetition_penalty: float = 1.0   # 1 = off
    repeat_last_n: int = 64           # window of recent tokens the penalty looks at
    seed: int | None = None

    def __post_init__(self) -> None:
        def bad(msg):
            raise InvalidArgumentError(msg)
        if not np.isfinite(self.temperature) or self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            bad(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not np.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.repeat_last_n < 0:
            bad(f"repeat_last_n must be >= 0, got {self.repeat_last_n}")


class Sampler:
    def __init__(self, vocab_size: int, params: SamplingParams | None = None):
        self.params = params or SamplingParams()
        self.rng = np.random.default_rng(self.params.seed)
        self._buf = np.empty(vocab_size, dtype=np.float32)     # (vocab,) working logits

    def sample(self, logits: np.ndarray, recent: list[int] | None = None) -> int:
        """Choose the next token from logits (vocab,) f32; ``recent`` = tokens seen so far."""
        p = self.params
        x = logits
        if p.repetition_penalty != 1.0 and recent:
            x = self._buf
            np.copyto(x, logits)
            window = np.unique(np.asarray(recent[-p.repeat_last_n:] if p.repeat_last_n else recent))
            vals = x[window]
            # the published (CTRL) rule: shrink positive logits, push negative ones further down
            x[window] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.temperature == 0.0:
            return int(np.argmax(x))
        return self._sample_stochastic(x)

    def _sample_stochastic(self, logits: np.ndarray) -> int:
        p = self.params
        x = self._buf
        if x is not logits:
            np.copyto(x, logits)
        x /= np.float32(p.temperature)
        vocab = x.shape[0]
        # candidate set: indices sorted by descending logit, cut by top-k
        if 0 < p.top_k < vocab:
            cand = np.argpartition(x, vocab - p.top_k)[vocab - p.top_k:]
        else:
            cand = np.arange(vocab)
        cand = cand[np.argsort(x[cand], kind="stable")[::-1]]
        logit = x[cand].astype(np.float64)
        probs = np.exp(logit - logit[0])
        probs /= probs.sum()
        keep = len(cand)
        if p.top_p < 1.0:
            # smallest prefix whose mass reaches top_p (always at least one token)
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
        if p.min_p > 0.0:
            keep = min(keep, max(1, int(np.count_nonzero(probs >= p.min_p * probs[0]))))
        probs = probs[:keep] / probs[:keep].sum()
        return int(cand[self.rng.choice(keep, p=probs)])
