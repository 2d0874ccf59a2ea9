"""Token sampling: greedy, temperature, top-k, top-p, min-p, penalties, seed, constraints.

The greedy path (temperature 0) is an argmax and allocates nothing. The
stochastic path works in buffers allocated once per Sampler; only the
top-k/top-p candidate selection and the penalties create small arrays (of
the candidates, the recent tokens).

Order of the rules (llama.cpp's order for the ones it shares): repetition
penalty, frequency/presence penalties, logit bias, the grammar constraint's mask,
then temperature, top-k, top-p, min-p. Each Sampler owns its random generator, so
a seeded request draws the same numbers however requests interleave.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import CyllmError, InvalidArgumentError
from .jsonio import short


@dataclass
class SamplingParams:
    temperature: float = 0.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0                # 1 = off, 0 = only the most probable token (OpenAI's range [0, 1])
    min_p: float = 0.0                # 0 = off
    repetition_penalty: float = 1.0   # 1 = off
    repeat_last_n: int = 64           # window of recent tokens the penalty looks at
    seed: int | None = None
    frequency_penalty: float = 0.0    # OpenAI's: logit -= count * f over the tokens generated so far
    presence_penalty: float = 0.0     # OpenAI's: logit -= p for every token generated at least once
    logit_bias: dict[int, float] | None = None    # OpenAI's: token id -> added to its logit, in [-100, 100]

    def __post_init__(self) -> None:
        def bad(msg):
            raise InvalidArgumentError(msg)
        if not np.isfinite(self.temperature) or self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            bad(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            bad(f"top_p must be in [0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not np.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad(f"repeat_penalty (repetition_penalty) must be > 0, got {self.repetition_penalty}")
        if self.repeat_last_n < 0:
            bad(f"repeat_last_n must be >= 0, got {self.repeat_last_n}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not np.isfinite(v) or not -2.0 <= v <= 2.0:
                bad(f"{name} must be in [-2, 2], got {v}")
        for k, v in (self.logit_bias or {}).items():
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                bad(f"logit_bias keys must be token ids, got {short(k)}")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100.0 <= v <= 100.0:
                bad(f"logit_bias values must be numbers in [-100, 100], got {short(v)} for token {k}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad(f"seed must be an integer, got {short(self.seed)}")
        if self.seed == -1:
            self.seed = None               # llama.cpp's spelling of "a random seed"
        elif self.seed is not None and not 0 <= self.seed < 1 << 64:
            bad(f"seed must be in [0, 2^64) (or -1 for a random one), got {self.seed}")

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse a logit_bias that names a token past a vocabulary of ``vocab_size``."""
        if self.logit_bias and max(self.logit_bias) >= vocab_size:
            raise InvalidArgumentError(f"logit_bias names token {max(self.logit_bias)}, past the vocabulary "
                                       f"({vocab_size} tokens)")


class Sampler:
    """Chooses tokens for one generation.

    ``constraint`` (optional) has ``apply(x)`` that sets the logits of
    forbidden tokens to -inf in place and ``accept(token)`` that advances it
    (a grammar, see grammar.py). Call ``accept(token)`` after each token that
    is kept: it feeds the frequency/presence counts and the constraint.
    """

    def __init__(self, vocab_size: int, params: SamplingParams | None = None, constraint=None):
        self.params = params or SamplingParams()
        self.rng = np.random.default_rng(self.params.seed)
        self.constraint = constraint
        self._buf = np.empty(vocab_size, dtype=np.float32)     # (vocab,) working logits
        p = self.params
        self._penalize = p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        self._counts = np.zeros(vocab_size, np.int32) if self._penalize else None   # (vocab,)
        self._seen: list[int] = []                             # distinct generated tokens
        self.params.check_vocab(vocab_size)
        bias = self.params.logit_bias or {}
        self._bias_ids = np.fromiter(bias.keys(), np.int64, len(bias)) if bias else None      # (n,)
        self._bias = np.fromiter(bias.values(), np.float32, len(bias)) if bias else None      # (n,)

    def accept(self, token: int) -> None:
        """Record a kept token (penalty counts, constraint state)."""
        if self._counts is not None:
            if self._counts[token] == 0:
                self._seen.append(token)
            self._counts[token] += 1
        if self.constraint is not None:
            self.constraint.accept(token)

    def sample(self, logits: np.ndarray, recent: list[int] | None = None) -> int:
        """Choose the next token from logits (vocab,) f32; ``recent`` = tokens seen so far."""
        top = logits.max()          # NaN if any logit is: one pass, nothing allocated
        if not np.isfinite(top):
            # inf or nan weights (a corrupt block scale the kernels read as it is) or an
            # overflow in the forward pass: every later token would be noise
            raise CyllmError(f"the model's logits are not finite ({top}): its weights or a "
                             "forward pass hold inf or nan (a corrupt file?)")
        p = self.params
        x = logits
        penalized = False       # a multiplicative penalty can overflow float32 (below)
        if p.repetition_penalty != 1.0 and recent:
            x = self._working(logits)
            window = np.unique(np.asarray(recent[-p.repeat_last_n:] if p.repeat_last_n else recent))
            vals = x[window]
            # the published (CTRL) rule: shrink positive logits, push negative ones further down
            with np.errstate(over="ignore"):         # past float32's range: handled below
                x[window] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            penalized = True
        if self._penalize and self._seen:
            x = self._working(x)
            seen = np.asarray(self._seen)
            x[seen] -= self._counts[seen] * np.float32(p.frequency_penalty) + np.float32(p.presence_penalty)
            penalized = True
        if self._bias_ids is not None:
            x = self._working(x)
            np.add.at(x, self._bias_ids, self._bias)      # in place: no gathered copy a token
        if self.constraint is not None:
            x = self._working(x)
            self.constraint.apply(x)
        if penalized:
            # a tiny penalty can push a logit past float32's range: +inf would make the
            # softmax inf - inf = NaN; the largest finite value keeps the order (a bias in
            # [-100, 100] on finite logits and the grammar's -inf cannot)
            np.nan_to_num(x, copy=False, nan=-np.inf, posinf=np.finfo(np.float32).max, neginf=-np.inf)
        if p.temperature == 0.0:
            return int(np.argmax(x))
        return self._sample_stochastic(x)

    def _working(self, x: np.ndarray) -> np.ndarray:
        """The private buffer holding ``x`` (copied in unless it is already the buffer)."""
        if x is not self._buf:
            np.copyto(self._buf, x)
        return self._buf

    def _sample_stochastic(self, logits: np.ndarray) -> int:
        p = self.params
        x = self._buf
        if x is not logits:
            np.copyto(x, logits)
        vocab = x.shape[0]
        # candidate set: indices sorted by descending logit, cut by top-k; equal logits keep
        # ascending index order, so the first candidate is argmax's (greedy's) choice
        if 0 < p.top_k < vocab:
            cand = np.sort(np.argpartition(x, vocab - p.top_k)[vocab - p.top_k:])
        else:
            cand = np.arange(vocab)
        neg = x[cand]
        np.negative(neg, out=neg)               # descending by logit, ties in index order
        cand = cand[np.argsort(neg, kind="stable")]
        # the temperature divides differences from the best logit in float64: nothing overflows
        # (a temperature of 1e-40 makes every other token's weight exactly 0: greedy)
        top = float(x[cand[0]])
        if not np.isfinite(top):          # every token masked: nothing better than the first
            return int(cand[0])
        with np.errstate(over="ignore", invalid="ignore"):
            logit = (x[cand].astype(np.float64) - top) / p.temperature
        probs = np.exp(np.nan_to_num(logit, nan=-np.inf))
        probs /= probs.sum()
        keep = len(cand)
        if p.top_p < 1.0:
            # smallest prefix whose mass reaches top_p: at least the best token, which is all
            # that top_p=0 keeps (searchsorted finds index 0), even where others tie with it
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
        if p.min_p > 0.0:
            keep = min(keep, max(1, int(np.count_nonzero(probs >= p.min_p * probs[0]))))
        probs = probs[:keep] / probs[:keep].sum()
        return int(cand[self.rng.choice(keep, p=probs)])


class LogprobReader:
    """Log-probabilities of the model's distribution (log-softmax of the raw logits,
    before penalties, constraint and temperature), for the API's ``logprobs``."""

    def __init__(self, vocab_size: int):
        self._buf = np.empty(vocab_size, dtype=np.float64)     # (vocab,) shifted logits

    def read(self, logits: np.ndarray, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
        """(logprob of ``token``, [(id, logprob)] of the ``top`` most likely tokens, best first)."""
        x = self._buf
        np.copyto(x, logits)
        m = x.max()
        x -= m
        lse = np.log(np.exp(x).sum())      # exp allocates (vocab,): only on requests that ask for logprobs
        best: list[tuple[int, float]] = []
        if top > 0:
            k = min(top, x.shape[0])
            idx = np.argpartition(x, x.shape[0] - k)[x.shape[0] - k:]
            idx = idx[np.argsort(-x[idx], kind="stable")]
            best = [(int(i), float(x[i] - lse)) for i in idx]
        return float(x[token] - lse), best
