"""Context shift for `cyllm generate --context-shift` (llama.cpp's habit).

When the KV cache is full, the oldest half of the tokens after the first
``keep`` is dropped and generation goes on: the kept tokens plus the newest
half are run again as a prompt (their positions change, so their cache entries
must be recomputed; the first ``keep`` stay where they are and are reused).

Built on generate.py's pieces (Session, generate_tokens, stream_text) without
changing them; a generate() option could absorb this later.
"""

from __future__ import annotations

from typing import Callable, Iterator

from .generate import GenerationStats, Session, generate_tokens, stream_text
from .sampling import SamplingParams


def shifted_ids(tokens: list[int], keep: int) -> list[int] | None:
    """``tokens`` with the oldest half after the first ``keep`` removed; None when nothing can go."""
    keep = max(0, min(keep, len(tokens)))
    discard = (len(tokens) - keep) // 2
    if discard <= 0:
        return None
    return tokens[:keep] + tokens[keep + discard:]


def _shifting_tokens(session: Session, ids: list[int], max_tokens: int, params: SamplingParams,
                     stats: GenerationStats, keep: int, on_shift: Callable[[int], None]) -> Iterator[int]:
    remaining = max_tokens
    ttft = None
    while True:
        last = None
        for tok in generate_tokens(session, ids, remaining, params, stats):
            if ttft is None:
                ttft = stats.ttft_s
            last = tok
            remaining -= 1
            yield tok
        if ttft is not None:
            stats.ttft_s = ttft                  # a re-prefill after a shift is not a first token
        if stats.stop_reason != "context" or remaining <= 0 or last is None:
            return
        # the last sampled token is not in the cache yet: it continues the shifted prompt
        ids = shifted_ids(session.tokens + [last], keep)
        if ids is None:
            return
        on_shift(len(session.tokens) + 1 - len(ids))


def generate_shifting(model, ids: list[int], max_tokens: int, params: SamplingParams, stop: list[str],
                      keep: int, on_shift: Callable[[int], None]) -> Iterator[str]:
    """Stream text like generate.generate, shifting the context instead of stopping when it is full.

    ``keep``: tokens at the start that always stay (the BOS and any --keep tokens);
    ``on_shift(n)`` is called with the number of tokens dropped, each time.
    """
    stats = GenerationStats()
    model.last_stats = stats
    session = Session(model)
    tokens = _shifting_tokens(session, ids, max_tokens, params, stats, keep, on_shift)
    return stream_text(model.tokenizer, tokens, list(stop), stats)
