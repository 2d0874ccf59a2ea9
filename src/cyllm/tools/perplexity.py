"""Perplexity the way llama.cpp's ``llama-perplexity`` measures it.

Method (llama.cpp tools/perplexity, default mode):
- tokenize the whole text once, adding BOS if the model's tokenizer adds BOS;
- cut it into n = len(tokens) // ctx non-overlapping chunks of ctx tokens
  (the tail is dropped); at least 2 chunks are required;
- evaluate each chunk from an empty KV cache; if the tokenizer adds BOS, the
  chunk's first token is replaced by BOS for the evaluation;
- score only the second half: with first = ctx // 2, the logits at positions
  first .. ctx-2 predict tokens first+1 .. ctx-1 (ctx - 1 - first per chunk);
- ppl = exp(mean NLL); the "+/-" is the standard error of the mean NLL,
  sqrt((E[nll^2] - E[nll]^2) / (count - 1)), propagated through exp
  (multiplied by ppl).
"""

from __future__ import annotations

import math
import sys

import numpy as np

from ..errors import InvalidArgumentError

MIN_CTX = 4


def tokenize_for_perplexity(model, text: str) -> list[int]:
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise InvalidArgumentError("perplexity needs a model with a tokenizer")
    if not isinstance(text, str):
        raise InvalidArgumentError(f"perplexity needs a str, got {type(text).__name__}")
    if not text.strip():
        raise InvalidArgumentError("the text for perplexity is empty")
    return list(tok.encode(text, add_special_tokens=True))


def _adds_bos(model) -> bool:
    tok = model.tokenizer
    bos = getattr(tok, "bos_id", None)
    if bos is None:
        return False
    add = getattr(tok, "add_bos", None)
    if add is None:   # decided by the tokenizer's own post-processor: probe it
        probe = tok.encode("a", add_special_tokens=True)
        return bool(probe) and probe[0] == bos
    return bool(add)


def chunk_nll(logits: np.ndarray, chunk: list[int] | np.ndarray, first: int) -> np.ndarray:
    """Negative log-likelihoods of chunk[first+1:] from logits[first:-1] (float64 log-softmax)."""
    lg = np.asarray(logits[first:len(chunk) - 1], dtype=np.float64)          # (m, vocab)
    targets = np.asarray(chunk[first + 1:], dtype=np.int64)                   # (m,)
    mx = lg.max(axis=1, keepdims=True)
    lse = np.log(np.exp(lg - mx).sum(axis=1)) + mx[:, 0]
    return lse - lg[np.arange(len(targets)), targets]


def perplexity(model, text: str, ctx: int, progress: bool = True) -> tuple[float, float]:
    """(ppl, stderr of ppl) of ``text`` with chunks of ``ctx`` tokens (see module doc).

    progress: draw a bar on stderr (only when stderr is a terminal).
    """
    if isinstance(ctx, bool) or not isinstance(ctx, (int, np.integer)) or ctx < MIN_CTX:
        raise InvalidArgumentError(f"perplexity context must be an integer >= {MIN_CTX}, got {ctx!r}")
    ctx = int(ctx)
    limit = getattr(model, "context", None)
    if limit is not None and ctx > limit:
        raise InvalidArgumentError(
            f"perplexity context {ctx} is larger than the model's context window of {limit} tokens")
    tokens = tokenize_for_perplexity(model, text)
    n_chunks = len(tokens) // ctx
    if n_chunks < 2:
        raise InvalidArgumentError(
            f"the text is too short for perplexity: {len(tokens)} tokens, need at least "
            f"{2 * ctx} (two chunks of {ctx}); use a longer text or a smaller context (-c)")
    add_bos = _adds_bos(model)
    bos = model.tokenizer.bos_id
    first = ctx // 2
    total = 0.0
    total2 = 0.0
    count = 0

    bar = None
    if progress and _stderr_is_tty():          # a log file gets the result, not a hundred bar frames
        from tqdm import tqdm
        bar = tqdm(total=n_chunks, desc="perplexity", unit="chunk", file=sys.stderr, leave=True,
                   dynamic_ncols=True)
    try:
        for i in range(n_chunks):
            chunk = tokens[i * ctx:(i + 1) * ctx]
            if add_bos:
                chunk = [bos] + chunk[1:]
            nll = chunk_nll(model.logits(chunk), chunk, first)
            total += float(nll.sum())
            total2 += float((nll * nll).sum())
            count += len(nll)
            if bar is not None:
                bar.set_postfix_str(f"ppl={_exp(total / count):.4f}", refresh=False)
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return ppl_from_sums(total, total2, count)


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (ValueError, OSError):
        return False


def _exp(x: float) -> float:
    """e^x, inf past float64's range: a model whose mean negative log-likelihood is above ~709
    nats has a perplexity that no float holds, and says so as inf rather than an error."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


def ppl_from_sums(total: float, total2: float, count: int) -> tuple[float, float]:
    mean = total / count
    ppl = _exp(mean)
    if math.isinf(ppl):
        return ppl, math.inf
    var = total2 / count - mean * mean
    err = math.sqrt(var / (count - 1)) * ppl if var > 0 and count > 1 else 0.0
    return ppl, err


def format_ppl(ppl: float, err: float) -> str:
    """The CLI's last line, formatted like llama.cpp's final estimate (%.4f +/- %.5f)."""
    return f"PPL = {ppl:.4f} +/- {err:.5f}"
