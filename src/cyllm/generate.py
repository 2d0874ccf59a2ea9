"""Prefill + decode loop: streaming text, stop rules, chat turns, timing stats.

The model has one KV cache and it has an owner: ``model.kv_owner`` is the
Session whose token list is what positions 0.. of the cache hold (None: no
one's, nothing is reused). A Session reuses the longest common prefix of its
tokens and the owner's, and only runs the rest; so a chat turn, a follow-up
request of the server, or any other session with the same beginning skips the
shared prefix, and nothing is reused that is not provably in the cache.

Two generators on one model (interleaved, or in two threads) are both
correct: every cache access takes ``model.lock`` for one step, and a session
that finds it no longer owns the cache first re-runs its own tokens (only
those past the common prefix with the current owner) and then goes on. So a
stale generator is slower, never wrong. The lock is held for one step at a
time, never across a ``yield``, so an abandoned generator blocks no one.

Model.prefill/forward/logits called directly do not know about sessions;
code that mixes them with sessions must set ``model.kv_owner = None`` (or the
Model does it itself in those methods: a Session re-claims ownership after
each of its own calls).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from .errors import ContextFullError, InvalidArgumentError, TokenizerError
from .jsonio import short
from .sampling import Sampler, SamplingParams

PREFILL_STEP = 256    # prompt tokens between two checks of a cancel flag


@dataclass
class GenerationStats:
    prompt_tokens: int = 0        # tokens run through prefill this call (cache hits excluded)
    cached_tokens: int = 0        # prompt tokens reused from the KV cache
    prefill_s: float = 0.0
    generated_tokens: int = 0
    decode_s: float = 0.0         # time in forward passes of generated tokens
    decode_steps: int = 0
    ttft_s: float = 0.0           # start of the call to the first generated token
    stop_reason: str = ""         # "eos" | "stop" | "length" | "context" | "cancelled" (completions'
                                  # n > 1: each choice's, joined by commas)
    recomputed_tokens: int = 0    # tokens re-run because another session had used the cache

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0

    def line(self) -> str:
        cached = f" (+{self.cached_tokens} cached)" if self.cached_tokens else ""
        return (f"prompt: {self.prompt_tokens} tokens{cached}, {self.prefill_tps:.1f} tok/s | "
                f"generated: {self.generated_tokens} tokens, {self.decode_tps:.1f} tok/s | "
                f"time to first token: {self.ttft_s * 1000:.0f} ms")


class GenerationCancelled(Exception):
    """Raised inside a generation loop when its cancel callback says stop (internal)."""


class Session:
    """One token sequence that wants to live in a model's KV cache, position 0 onwards.

    ``tokens`` is this session's sequence; it is in the cache while
    ``model.kv_owner is self``.
    """

    def __init__(self, model, keep_displaced: bool = True):
        self.model = model
        self.tokens: list[int] = []
        self._logits: np.ndarray | None = None     # (vocab,) f32 private copy of the latest logits
        # False: the sequence this one displaces from the cache is not worth a copy in a
        # server's prompt cache (another answer to the same prompt, completions' n choices)
        self.keep_displaced = keep_displaced

    @property
    def owns_cache(self) -> bool:
        return self.model.kv_owner is self

    def feed(self, ids: list[int], stats: GenerationStats | None = None,
             cancel: Callable[[], bool] | None = None) -> np.ndarray:
        """Make the cache hold exactly ``ids``; returns the logits after the last one.

        The returned array belongs to this session and is overwritten by its
        next step. ``cancel`` is polled every PREFILL_STEP tokens; when it
        returns True, GenerationCancelled is raised (the prefix run so far
        stays in the cache, owned by this session).
        """
        model = self.model
        ids = model._check_ids(ids)
        if len(ids) > model.context:
            raise ContextFullError(
                f"the prompt has {len(ids)} tokens but the context window holds {model.context} "
                f"(use a larger --context or a shorter prompt)")
        with model.lock:
            prompt_cache = getattr(model, "prompt_cache", None)     # tools/server/prompt_cache.py
            if prompt_cache is not None:
                prompt_cache.before_feed(ids, self.keep_displaced)      # may copy a saved conversation back in
            owner = model.kv_owner
            cached = owner.tokens if owner is not None else []
            common = 0
            limit = min(len(ids), len(cached))
            while common < limit and ids[common] == cached[common]:
                common += 1
            common = min(common, len(ids) - 1)      # the last token is always run: we need its logits
            # positions < common stay as they are; from here on the cache is ours
            self.tokens = ids[:common]
            model.kv_owner = self
            t0 = time.perf_counter()
            pos = common
            while pos < len(ids):
                if cancel is not None and cancel():
                    raise GenerationCancelled()
                end = len(ids) if cancel is None else min(len(ids), pos + PREFILL_STEP)
                logits = model.prefill(ids[pos:end], pos)
                self.tokens = ids[:end]
                model.kv_owner = self      # (again: a Model may clear it on direct prefill/forward calls)
                pos = end
            if stats is not None:
                stats.prefill_s += time.perf_counter() - t0
                stats.prompt_tokens += len(ids) - common
                stats.cached_tokens += common
            return self._keep(logits)

    def score(self, ids: list[int], chunk: int, cancel: Callable[[], bool] | None = None):
        """Run ``ids`` from position 0 in passes of ``chunk`` tokens, each yielding (start,
        logits of ids[start:start + chunk]: (<= chunk, vocab) f32, a new array), as scoring a
        text needs (every position's logits, so nothing cached is reused). The cache becomes
        this session's as the passes fill it; ``cancel`` is polled between them."""
        model = self.model
        ids = model._check_ids(ids)
        if len(ids) > model.context:
            raise ContextFullError(f"{len(ids)} tokens do not fit in the context window of {model.context} tokens")
        for start in range(0, len(ids), chunk):
            if cancel is not None and cancel():
                return
            with model.lock:
                prompt_cache = getattr(model, "prompt_cache", None)     # tools/server/prompt_cache.py
                if start == 0 and prompt_cache is not None:
                    prompt_cache.displace(ids, self.keep_displaced)     # before the passes overwrite it
                logits = model.prefill(ids[start:start + chunk], start, all_logits=True)
                self.tokens = ids[:start + chunk]
                model.kv_owner = self
            yield start, logits

    def append(self, token: int, stats: GenerationStats | None = None) -> np.ndarray:
        """Run one more token at the end of the sequence; returns its logits."""
        model = self.model
        with model.lock:
            if model.kv_owner is not self and self.tokens:
                # another session wrote the cache since our last step: put our tokens back first
                probe = GenerationStats()
                self.feed(self.tokens, probe)
                if stats is not None:
                    stats.recomputed_tokens += probe.prompt_tokens
            elif model.kv_owner is not self:
                model.kv_owner = None       # position 0 is about to change under the old owner
            logits = model.forward(token, len(self.tokens))
            self.tokens.append(token)
            model.kv_owner = self
            return self._keep(logits)

    def _keep(self, logits: np.ndarray) -> np.ndarray:
        # the backend reuses its logits buffer on the next forward, which may be another
        # session's (another thread's): copy it while the lock is held
        if self._logits is None or self._logits.shape != logits.shape:
            self._logits = np.empty_like(logits)
        np.copyto(self._logits, logits)
        return self._logits


def eos_ids(model) -> frozenset[int]:
    eos = set(model.config.eos_token_ids)
    if model.tokenizer is not None:
        eos |= set(model.tokenizer.eos_ids)
    return frozenset(eos)


def generate_tokens(session: Session, prompt_ids: list[int], max_tokens: int,
                    params: SamplingParams | Sampler, stats: GenerationStats,
                    cancel: Callable[[], bool] | None = None,
                    observer: Callable[[np.ndarray, int], None] | None = None) -> Iterator[int]:
    """Yield sampled token ids; EOS ends the stream and is not yielded.

    ``cancel`` is polled before every forward pass: True ends the stream
    (stop_reason "cancelled"). ``observer(logits, token)`` sees the raw
    logits each yielded token was drawn from (for logprobs).
    """
    model = session.model
    t_start = time.perf_counter()
    try:
        logits = session.feed(prompt_ids, stats, cancel)
    except GenerationCancelled:
        stats.stop_reason = "cancelled"
        return
    sampler = params if isinstance(params, Sampler) else Sampler(model.config.vocab_size, params)
    eos = eos_ids(model)
    stats.stop_reason = "length"
    for i in range(max_tokens):
        token = sampler.sample(logits, session.tokens)
        if i == 0:
            stats.ttft_s = time.perf_counter() - t_start
        if token in eos:
            stats.stop_reason = "eos"
            return
        sampler.accept(token)
        if observer is not None:
            observer(logits, token)
        stats.generated_tokens += 1
        yield token
        if i == max_tokens - 1:
            return
        if len(session.tokens) >= model.context:
            stats.stop_reason = "context"
            return
        if cancel is not None and cancel():
            stats.stop_reason = "cancelled"
            return
        t0 = time.perf_counter()
        logits = session.append(token, stats)
        stats.decode_s += time.perf_counter() - t0
        stats.decode_steps += 1


class StopScanner:
    """Incremental detokenization that ends at the first stop string.

    ``push(token)`` returns the text that is safe to release (a stop string
    may span pieces, so up to len(longest stop) - 1 characters are held back);
    ``finish()`` returns the rest. ``stopped`` turns True when a stop string
    appeared; the text before it is released, the stop string and what follows
    are not. ``decoded`` counts every character decoded so far, ``released``
    those released.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self._decoder = tokenizer.stream_decoder()
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._pending = ""
        self.decoded = 0
        self.released = 0
        self.stopped = False

    def push(self, token: int) -> str:
        piece = self._decoder.add(token)
        self._pending += piece
        self.decoded += len(piece)
        return self._scan(final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        piece = self._decoder.flush()
        self._pending += piece
        self.decoded += len(piece)
        return self._scan(final=True)

    def _scan(self, final: bool) -> str:
        if self._stop:
            cut = min((i for i in (self._pending.find(s) for s in self._stop) if i >= 0), default=-1)
            if cut >= 0:
                out = self._pending[:cut]
                self._pending = ""
                self.released += len(out)
                self.stopped = True
                return out
        n = len(self._pending) - (0 if final else self._hold)
        if n <= 0:
            return ""
        out, self._pending = self._pending[:n], self._pending[n:]
        self.released += n
        return out


def stream_text(tokenizer, tokens: Iterator[int], stop: list[str], stats: GenerationStats) -> Iterator[str]:
    """Detokenize a token stream incrementally, ending at the first stop string."""
    scanner = StopScanner(tokenizer, stop)
    try:
        for token in tokens:
            piece = scanner.push(token)
            if piece:
                yield piece
            if scanner.stopped:
                stats.stop_reason = "stop"
                return
        piece = scanner.finish()
        if scanner.stopped:
            stats.stop_reason = "stop"
        if piece:
            yield piece
    finally:
        tokens.close()      # ends the decode loop at once when our reader stops early


# every generated token is matched against each stop string: a server request of a million
# of them took ~60 ms a token (OpenAI's API takes at most 4)
MAX_STOP_STRINGS = 64


def check_stop(stop) -> list[str]:
    """``stop``: None, one string, or a list of strings (a string is ONE stop string)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise InvalidArgumentError(f"stop must be a string or a list of strings, got {short(stop)}")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgumentError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    return [s for s in stop if s]       # an empty stop string would end every generation at once


def _check_generation_args(max_tokens) -> None:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise InvalidArgumentError(f"the number of tokens to generate must be >= 0, got {short(max_tokens)}")


def sampling_params(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                    repetition_penalty: float | None = None, repeat_penalty: float | None = None,
                    frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                    repeat_last_n: int = 64, seed: int | None = None,
                    logit_bias: dict | None = None) -> SamplingParams:
    """SamplingParams from keyword arguments, with llama.cpp's name ``repeat_penalty``
    accepted for ``repetition_penalty``; types are checked (a str is not a number)."""
    if repetition_penalty is not None and repeat_penalty is not None and repetition_penalty != repeat_penalty:
        raise InvalidArgumentError("repeat_penalty and repetition_penalty are the same option: give one")
    penalty = repetition_penalty if repetition_penalty is not None else repeat_penalty
    given = "repeat_penalty" if repetition_penalty is None and repeat_penalty is not None else "repetition_penalty"
    floats = dict(temperature=temperature, top_p=top_p, min_p=min_p,
                  repetition_penalty=1.0 if penalty is None else penalty,
                  frequency_penalty=frequency_penalty, presence_penalty=presence_penalty)
    for name, v in floats.items():
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
            raise InvalidArgumentError(f"{given if name == 'repetition_penalty' else name} must be a number, "
                                       f"got {short(v)}")
    for name, v in (("top_k", top_k), ("repeat_last_n", repeat_last_n)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise InvalidArgumentError(f"{name} must be an integer, got {short(v)}")
    return SamplingParams(top_k=int(top_k), repeat_last_n=int(repeat_last_n), seed=seed,
                          logit_bias=_logit_bias(logit_bias), **{k: float(v) for k, v in floats.items()})


def _logit_bias(bias) -> dict[int, float] | None:
    """OpenAI's logit_bias ({"token id": bias}, the ids as JSON object keys: strings) as
    {int: float}; SamplingParams checks the ranges."""
    if bias is None or bias == {}:
        return None
    if not isinstance(bias, dict):
        raise InvalidArgumentError(f"logit_bias must be an object of token id -> bias, got {short(bias)}")
    out = {}
    for k, v in bias.items():
        if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 12:     # not "²" or "٣"
            tid = int(k)
        elif isinstance(k, (int, np.integer)) and not isinstance(k, bool) and k >= 0:
            tid = int(k)
        else:
            raise InvalidArgumentError(f"logit_bias keys must be token ids, got {short(k)}")
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not np.isfinite(v):
            raise InvalidArgumentError(f"logit_bias values must be numbers in [-100, 100], got {short(v)}")
        if tid in out:          # "1" and "01": which bias holds would be an accident of order
            raise InvalidArgumentError(f"logit_bias names token {tid} twice")
        out[tid] = float(v)
    return out


def generate(model, prompt, max_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float | None = None,
             seed: int | None = None, stop: str | list[str] | None = None,
             session: Session | None = None, stats: GenerationStats | None = None,
             add_special_tokens: bool = True, *, repeat_penalty: float | None = None,
             frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
             repeat_last_n: int = 64, logit_bias: dict | None = None) -> Iterator[str]:
    """Stream the continuation of ``prompt`` (a string, or a list of token ids) as text pieces.

    Defaults are greedy (temperature 0: the same text every time); the CLI
    samples (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05) and so does the
    OpenAI-style API (see README, "Server"). ``stop`` is one string or a list.
    Arguments are checked before the first piece is produced; stats of the run
    are stored in ``stats`` (if given) and in ``model.last_stats``.
    """
    _check_generation_args(max_tokens)
    params = sampling_params(temperature, top_k, top_p, min_p, repetition_penalty, repeat_penalty,
                             frequency_penalty, presence_penalty, repeat_last_n, seed, logit_bias)
    params.check_vocab(model.config.vocab_size)
    stop = check_stop(stop)
    if model.tokenizer is None:
        raise TokenizerError("this model has no tokenizer (no tokenizer.json): use model.logits() with token ids")
    if isinstance(prompt, str):
        ids = model.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    elif isinstance(prompt, (list, tuple, np.ndarray)):
        ids = model._check_ids(prompt) if len(prompt) else []
    else:
        raise InvalidArgumentError(f"the prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise InvalidArgumentError("the prompt is empty (it encodes to no tokens)")
    if len(ids) > model.context:
        raise ContextFullError(
            f"the prompt has {len(ids)} tokens but the context window holds {model.context} "
            f"(use a larger --context or a shorter prompt)")
    stats = stats if stats is not None else GenerationStats()
    model.last_stats = stats
    session = session or Session(model)
    tokens = generate_tokens(session, ids, max_tokens, params, stats)
    return stream_text(model.tokenizer, tokens, stop, stats)


class Chat:
    """A multi-turn conversation that keeps its history in the KV cache.

    Sampling options are those of ``generate`` (greedy by default). An answer
    the caller stops reading early is recorded as far as it was read, so the
    next turn follows a well-formed conversation.
    """

    def __init__(self, model, system: str | None = None, **sampling):
        if model.tokenizer is None:
            raise TokenizerError("this model has no tokenizer: chat needs one")
        sampling_params(**sampling)         # bad names or values fail here, not at the first turn
        self.model = model
        self.session = Session(model)
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.sampling = sampling
        self.last_stats: GenerationStats | None = None

    def send(self, text: str, max_tokens: int = 512, stop: str | list[str] | None = None) -> Iterator[str]:
        """Add a user turn and stream the assistant's answer."""
        if not isinstance(text, str):
            raise InvalidArgumentError(f"a chat message must be a string, got {type(text).__name__}")
        self.messages.append({"role": "user", "content": text})
        try:
            rendered = self.model.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True)
            # the template already carries BOS and turn markers
            ids = self.model.tokenizer.encode(rendered, add_special_tokens=False)
            stats = GenerationStats()
            pieces = generate(self.model, ids, max_tokens=max_tokens, stop=stop, session=self.session,
                              stats=stats, **self.sampling)
        except BaseException:
            self.messages.pop()             # the turn never started: leave the history as it was
            raise
        self.last_stats = stats
        answer: list[str] = []
        try:
            for piece in pieces:
                answer.append(piece)
                yield piece
        finally:
            # also when the caller stops reading early (close() or garbage collection)
            pieces.close()
            self.messages.append({"role": "assistant", "content": "".join(answer)})
