"""Prefill + decode loop: streaming text, stop rules, chat turns, timing stats.

A Session owns what is in the model's KV cache (the token list), so a chat can
reuse the cache across turns: each turn re-renders the conversation with the
chat template and only the tokens after the longest common prefix are run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

from .errors import ContextFullError, InvalidArgumentError, TokenizerError
from .sampling import Sampler, SamplingParams


@dataclass
class GenerationStats:
    prompt_tokens: int = 0        # tokens run through prefill this call (cache hits excluded)
    cached_tokens: int = 0        # prompt tokens reused from the KV cache
    prefill_s: float = 0.0
    generated_tokens: int = 0
    decode_s: float = 0.0         # time in forward passes of generated tokens
    decode_steps: int = 0
    ttft_s: float = 0.0           # start of the call to the first generated token
    stop_reason: str = ""         # "eos" | "stop" | "length" | "context"

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


class Session:
    """The tokens held in a model's KV cache, position 0 onwards."""

    def __init__(self, model):
        self.model = model
        self.tokens: list[int] = []

    def feed(self, ids: list[int], stats: GenerationStats | None = None):
        """Make the cache hold exactly ``ids``; returns the logits after the last one."""
        model = self.model
        ids = model._check_ids(ids)
        if len(ids) > model.context:
            raise ContextFullError(
                f"the prompt has {len(ids)} tokens but the context window holds {model.context} "
                f"(use a larger --context or a shorter prompt)")
        common = 0
        limit = min(len(ids), len(self.tokens))
        while common < limit and ids[common] == self.tokens[common]:
            common += 1
        common = min(common, len(ids) - 1)          # the last token is always run: we need its logits
        t0 = time.perf_counter()
        logits = model.prefill(ids[common:], common)
        if stats is not None:
            stats.prefill_s += time.perf_counter() - t0
            stats.prompt_tokens += len(ids) - common
            stats.cached_tokens += common
        self.tokens = ids
        return logits

    def append(self, token: int):
        """Run one more token at the end of the cache; returns its logits."""
        logits = self.model.forward(token, len(self.tokens))
        self.tokens.append(token)
        return logits


def generate_tokens(session: Session, prompt_ids: list[int], max_tokens: int,
                    params: SamplingParams, stats: GenerationStats) -> Iterator[int]:
    """Yield sampled token ids; EOS ends the stream and is not yielded."""
    model = session.model
    t_start = time.perf_counter()
    logits = session.feed(prompt_ids, stats)
    sampler = Sampler(model.config.vocab_size, params)
    eos = set(model.config.eos_token_ids)
    if model.tokenizer is not None:
        eos |= set(model.tokenizer.eos_ids)
    stats.stop_reason = "length"
    for i in range(max_tokens):
        token = sampler.sample(logits, session.tokens)
        if i == 0:
            stats.ttft_s = time.perf_counter() - t_start
        if token in eos:
            stats.stop_reason = "eos"
            return
        stats.generated_tokens += 1
        yield token
        if i == max_tokens - 1:
            return
        if len(session.tokens) >= model.context:
            stats.stop_reason = "context"
            return
        t0 = time.perf_counter()
        logits = session.append(token)
        stats.decode_s += time.perf_counter() - t0
        stats.decode_steps += 1


def stream_text(tokenizer, tokens: Iterator[int], stop: list[str], stats: GenerationStats) -> Iterator[str]:
    """Detokenize a token stream incrementally, ending at the first stop string."""
    decoder = tokenizer.stream_decoder()
    hold = max((len(s) for s in stop), default=1) - 1     # a stop string may span pieces
    pending = ""
    for token in tokens:
        pending += decoder.add(token)
        if stop:
            cut = min((i for i in (pending.find(s) for s in stop) if i >= 0), default=-1)
            if cut >= 0:
                if cut:
                    yield pending[:cut]
                stats.stop_reason = "stop"
                tokens.close()
                return
        if len(pending) > hold:
            yield pending[: len(pending) - hold]
            pending = pending[len(pending) - hold:]
    pending += decoder.flush()
    if stop:
        cut = min((i for i in (pending.find(s) for s in stop) if i >= 0), default=-1)
        if cut >= 0:
            pending = pending[:cut]
            stats.stop_reason = "stop"
    if pending:
        yield pending


def _check_generation_args(max_tokens) -> None:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise InvalidArgumentError(f"the number of tokens to generate must be >= 0, got {max_tokens!r}")


def generate(model, prompt, max_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float = 1.0,
             seed: int | None = None, stop: list[str] | None = None,
             session: Session | None = None, stats: GenerationStats | None = None,
             add_special_tokens: bool = True) -> Iterator[str]:
    """Stream the continuation of ``prompt`` (a string, or a list of token ids) as text pieces.

    Arguments are checked before the first piece is produced; stats of the run
    are stored in ``stats`` (if given) and in ``model.last_stats``.
    """
    _check_generation_args(max_tokens)
    params = SamplingParams(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                            min_p=float(min_p), repetition_penalty=float(repetition_penalty), seed=seed)
    if model.tokenizer is None:
        raise TokenizerError("this model has no tokenizer (no tokenizer.json): use model.logits() with token ids")
    ids = model.tokenizer.encode(prompt, add_special_tokens=add_special_tokens) if isinstance(prompt, str) \
        else model._check_ids(prompt)
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
    return stream_text(model.tokenizer, tokens, list(stop or []), stats)


class Chat:
    """A multi-turn conversation that keeps its history in the KV cache."""

    def __init__(self, model, system: str | None = None, **sampling):
        if model.tokenizer is None:
            raise TokenizerError("this model has no tokenizer: chat needs one")
        self.model = model
        self.session = Session(model)
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.sampling = sampling
        self.last_stats: GenerationStats | None = None

    def send(self, text: str, max_tokens: int = 512, stop: list[str] | None = None) -> Iterator[str]:
        """Add a user turn and stream the assistant's answer."""
        self.messages.append({"role": "user", "content": text})
        rendered = self.model.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True)
        # the template already carries BOS and turn markers
        ids = self.model.tokenizer.encode(rendered, add_special_tokens=False)
        stats = GenerationStats()
        self.last_stats = stats
        pieces = generate(self.model, ids, max_tokens=max_tokens, stop=stop, session=self.session,
                          stats=stats, **self.sampling)
        answer = []
        for piece in pieces:
            answer.append(piece)
            yield piece
        self.messages.append({"role": "assistant", "content": "".join(answer)})
