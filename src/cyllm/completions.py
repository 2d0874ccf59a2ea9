"""OpenAI-shaped completions from Python: ``create_completion`` and ``create_chat_completion``.

They take the parameters of OpenAI's /v1/completions and /v1/chat/completions
(the same names, so a request body can be passed as keyword arguments) and
return the same dicts, or with ``stream=True`` an iterator of the same chunks,
as llama-cpp-python's functions of these names do. The HTTP server
(cyllm.tools.server) is a thin layer over them.

Sampling defaults are llama.cpp's (and the CLI's): temperature 0.8, top_k 40,
top_p 0.95, min_p 0.05, no penalties. ``Model.generate`` is greedy instead.

Everything is checked before generation starts (types, ranges, the prompt
length, the JSON schema): errors are CyllmError subclasses, which the server
turns into HTTP 400. A request reuses whatever prefix of its prompt is still
in the model's KV cache (see generate.Session) and reports it as
``usage.prompt_tokens_details.cached_tokens``.

Logprobs are those of the model's own distribution: log-softmax of the raw
logits, before penalties, logit bias, grammar mask and temperature.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from .errors import ContextFullError, InvalidArgumentError, TokenizerError
from .generate import GenerationStats, Session, StopScanner, check_stop, generate_tokens, sampling_params
from .jsonio import short
from .sampling import LogprobReader, Sampler, SamplingParams
from .toolcalls import (CallScan, ToolRequest, calls_in_content, check_tools, generic_history, generic_messages,
                        history_arguments, new_call_id, tool_format, tool_grammar)

DEFAULTS = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0,
                frequency_penalty=0.0, presence_penalty=0.0)
COMPLETION_MAX_TOKENS = 16       # OpenAI's (and llama-cpp-python's) default for /v1/completions
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16                 # n: each choice is a whole generation, one after another
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# accepted and ignored (OpenAI fields with no effect on one local model), or accepted
# only at the value that means "off"
_IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")
_OFF_VALUES = {"best_of": (None, 1), "suffix": (None, ""),       # best_of: completions take it (= n)
               "functions": (None, []), "function_call": (None, "none", "auto")}


@dataclass
class Request:
    """A checked request, ready to run."""
    object: str                 # "chat.completion" or "text_completion"
    ids: list[int]              # the whole prompt, tokenized
    max_tokens: int
    params: SamplingParams
    stop: list[str]
    logprobs: int | None        # alternatives per token to report, None: no logprobs
    grammar: str | None         # llguidance grammar text, None: free text
    model_name: str
    include_usage: bool
    id: str
    created: int
    tools: ToolRequest | None = None    # chat: the functions the answer may call
    echo: str | None = None             # completions: the prompt, sent back before the answer
    n: int = 1                          # choices: answers to the same prompt, each sampled anew


# ----------------------------------------------------------------- public API
def create_completion(llm, prompt, *, max_tokens: int | None = COMPLETION_MAX_TOKENS,
                      temperature: float = DEFAULTS["temperature"], top_p: float = DEFAULTS["top_p"],
                      top_k: int = DEFAULTS["top_k"], min_p: float = DEFAULTS["min_p"],
                      repeat_penalty: float = DEFAULTS["repeat_penalty"],
                      frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                      seed: int | None = None, stop: str | list[str] | None = None, stream: bool = False,
                      stream_options: dict | None = None, logprobs: int | None = None,
                      response_format: dict | None = None, logit_bias: dict | None = None,
                      echo: bool = False, n: int | None = 1, best_of: int | None = None, model: str | None = None,
                      stats: GenerationStats | None = None, cancel: Callable[[], bool] | None = None,
                      **other):
    """Continue ``prompt`` (a string, a list of token ids, or a list of one string).

    Returns a "text_completion" dict, or with ``stream=True`` an iterator of
    chunks. ``logprobs``: how many alternatives to report per token (0: only
    the chosen token). ``echo``: the prompt comes first in the text, and with
    ``logprobs`` each prompt token's log-probability given the ones before it
    (None for the first), as evaluation harnesses score texts (``max_tokens=0``:
    the prompt alone). ``n``: that many choices, generated one after another
    (the prompt is computed once; choice 0 is the answer n=1 would give, and a
    ``seed`` seeds every choice; ``best_of``, if given, must equal ``n``: the best
    n of n are the n choices). ``stats`` (optional) receives timings, summed
    over the choices; ``cancel`` (optional) is polled every step and ends the
    generation when it returns True.
    """
    _check_other(other)
    if best_of is not None and _int("best_of", best_of, 1) != (1 if n is None else n):
        raise InvalidArgumentError(f"best_of={short(best_of)} is not supported: only best_of equal to n "
                                   "(the n choices themselves)")
    ids = _prompt_ids(llm, prompt)
    echo = False if echo is None else _bool("echo", echo)      # null: the default
    lp = None if logprobs is None else _int("logprobs", logprobs, 0, MAX_TOP_LOGPROBS)
    req = _request(llm, "text_completion", ids, max_tokens, dict(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, repeat_penalty=repeat_penalty,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, seed=seed, logit_bias=logit_bias),
        stop, stream, stream_options, lp, response_format, model, n=n)
    if echo:
        text = prompt[0] if isinstance(prompt, list) and isinstance(prompt[0], str) else prompt
        req.echo = text if isinstance(text, str) else llm.tokenizer.decode(ids, skip_special_tokens=True)
    return run(llm, req, stream, stats, cancel)


def create_chat_completion(llm, messages, *, max_tokens: int | None = None,
                           max_completion_tokens: int | None = None,
                           temperature: float = DEFAULTS["temperature"], top_p: float = DEFAULTS["top_p"],
                           top_k: int = DEFAULTS["top_k"], min_p: float = DEFAULTS["min_p"],
                           repeat_penalty: float = DEFAULTS["repeat_penalty"],
                           frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                           seed: int | None = None, stop: str | list[str] | None = None, stream: bool = False,
                           stream_options: dict | None = None, logprobs: bool | None = None,
                           top_logprobs: int | None = None, response_format: dict | None = None,
                           tools: list | None = None, tool_choice=None, parallel_tool_calls: bool | None = None,
                           logit_bias: dict | None = None, n: int | None = 1,
                           model: str | None = None, stats: GenerationStats | None = None,
                           cancel: Callable[[], bool] | None = None, **other):
    """Answer a conversation ([{"role", "content"}, ...]) with the model's chat template.

    Returns a "chat.completion" dict, or with ``stream=True`` an iterator of
    "chat.completion.chunk" dicts. Without a token limit the answer may run
    until the context window is full. ``tools`` and ``tool_choice`` are OpenAI's
    (see toolcalls.py for the call formats and what tool_choice can enforce).
    ``n``: that many choices, as create_completion makes them.
    """
    _check_other(other)
    if max_tokens is not None and max_completion_tokens is not None and max_tokens != max_completion_tokens:
        raise InvalidArgumentError("max_tokens and max_completion_tokens are the same option: give one")
    limit = max_completion_tokens if max_completion_tokens is not None else max_tokens
    tok = _tokenizer(llm)
    calls = check_tools(tools, tool_choice, tok.template_source(tools=bool(tools)), parallel_tool_calls)
    forced = tool_grammar(calls, tok.token_to_id) if calls is not None else None
    if forced is not None and response_format is not None and response_format != {"type": "text"}:
        raise InvalidArgumentError("response_format cannot be combined with a tool_choice that forces a call, "
                                   "nor with tools on a model whose template knows none (its answers are JSON)")
    ids = _chat_ids(llm, messages, calls)
    want = False if logprobs is None else _bool("logprobs", logprobs)
    if top_logprobs is not None:
        top = _int("top_logprobs", top_logprobs, 0, MAX_TOP_LOGPROBS)
        if not want:
            raise InvalidArgumentError("top_logprobs needs logprobs: true")
    else:
        top = 0
    req = _request(llm, "chat.completion", ids, limit, dict(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, repeat_penalty=repeat_penalty,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, seed=seed, logit_bias=logit_bias),
        stop, stream, stream_options, top if want else None, response_format, model, forced, n)
    req.tools = calls
    return run(llm, req, stream, stats, cancel)


def run(llm, req: Request, stream: bool, stats: GenerationStats | None = None,
        cancel: Callable[[], bool] | None = None):
    """Run a checked request: the response dict, or an iterator of chunks."""
    stats = stats if stats is not None else GenerationStats()
    llm.last_stats = stats
    if stream:
        return _choices(llm, req, stats, cancel)
    req.include_usage = True
    return collect(_choices(llm, req, stats, cancel))


# ------------------------------------------------------------ request checks
def _check_other(other: dict) -> None:
    for key, value in other.items():
        if key in _IGNORED:
            continue
        if key in _OFF_VALUES:
            if any(value == ok and type(value) is type(ok) for ok in _OFF_VALUES[key]):
                continue
            raise InvalidArgumentError(f"{key}={short(value)} is not supported (cyllm has no best_of, "
                                       "suffix (insertion) or legacy functions API)")
        raise InvalidArgumentError(f"unsupported parameter: {short(key)}")


def _num(name, v, lo=None, hi=None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise InvalidArgumentError(f"{name} must be a number, got {type(v).__name__} {short(v)}")
    try:
        v = float(v)
    except OverflowError:            # an int past float's range (10**400)
        v = float("inf")
    # NaN compares false with every bound, and 1e400 in JSON parses as inf: neither is a setting
    if not np.isfinite(v):
        raise InvalidArgumentError(f"{name} must be a finite number, got {v}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"
        raise InvalidArgumentError(f"{name} must be {bounds}, got {v}")
    return v


def _int(name, v, lo=None, hi=None) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise InvalidArgumentError(f"{name} must be an integer, got {type(v).__name__} {short(v)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise InvalidArgumentError(f"{name} must be {bounds}, got {v}")
    return int(v)


def _bool(name, v) -> bool:
    if not isinstance(v, bool):
        raise InvalidArgumentError(f"{name} must be true or false, got {short(v)}")
    return v


def _request(llm, obj, ids, max_tokens, sampling, stop, stream, stream_options, logprobs,
             response_format, model_name, grammar: str | None = None, n=1) -> Request:
    from .grammar import grammar_for

    room = llm.context - len(ids)
    if room <= 0:
        raise ContextFullError(
            f"the prompt has {len(ids)} tokens but the context window holds {llm.context}: "
            f"no room to generate (use a larger --context or a shorter prompt)")
    limit = room if max_tokens is None else min(_int("max_tokens", max_tokens, 0), room)
    # null in a request body means "the default"
    sampling = {k: DEFAULTS[k] if v is None and k in DEFAULTS else v for k, v in sampling.items()}
    for k in ("temperature", "top_p", "min_p", "repeat_penalty", "frequency_penalty", "presence_penalty"):
        if k in sampling:
            sampling[k] = _num(k, sampling[k])
    if "top_k" in sampling:
        sampling["top_k"] = _int("top_k", sampling["top_k"], 0)
    if sampling.get("seed") is not None:
        _int("seed", sampling["seed"])
    params = sampling_params(**sampling)
    params.check_vocab(llm.config.vocab_size)
    _bool("stream", stream)
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict) or set(stream_options) - {"include_usage"}:
            raise InvalidArgumentError("stream_options must be {\"include_usage\": true|false}")
        if not stream:
            raise InvalidArgumentError("stream_options needs stream: true")
        include_usage = _bool("stream_options.include_usage", stream_options.get("include_usage", False))
    if model_name is not None and not isinstance(model_name, str):
        raise InvalidArgumentError(f"model must be a string, got {short(model_name)}")
    if grammar is None:
        grammar = grammar_for(response_format)
    if grammar is not None:
        from .grammar import GrammarConstraint
        GrammarConstraint(llm, grammar)       # a bad schema fails now, before any response starts
    n = 1 if n is None else _int("n", n, 1, MAX_CHOICES)
    prefix = "chatcmpl-" if obj == "chat.completion" else "cmpl-"
    return Request(object=obj, ids=ids, max_tokens=limit, params=params, stop=check_stop(stop),
                   logprobs=logprobs, grammar=grammar,
                   model_name=model_name or llm.config.name or "cyllm", include_usage=include_usage,
                   id=prefix + uuid.uuid4().hex[:24], created=int(time.time()), n=n)


def _tokenizer(llm):
    if llm.tokenizer is None:
        raise TokenizerError("this model has no tokenizer (no tokenizer.json): completions need one")
    return llm.tokenizer


def _prompt_ids(llm, prompt) -> list[int]:
    tok = _tokenizer(llm)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tok.encode(prompt, add_special_tokens=True)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in prompt):
        ids = llm._check_ids(prompt)
    else:
        raise InvalidArgumentError("prompt must be a string, a list of token ids, or a list of one string")
    if not ids:
        raise InvalidArgumentError("the prompt is empty (it encodes to no tokens)")
    return ids


def _content_text(i: int, content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidArgumentError(
                    f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidArgumentError(f"messages[{i}].content must be a string or a list of text parts")


def _chat_ids(llm, messages, calls: ToolRequest | None = None) -> list[int]:
    tok = _tokenizer(llm)
    if not isinstance(messages, list) or not messages:
        raise InvalidArgumentError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidArgumentError(f"messages[{i}] must be an object with a 'role'")
        if m["role"] not in CHAT_ROLES:
            raise InvalidArgumentError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                                       f"got {short(m['role'])}")
        if m.get("content") is None and m["role"] != "assistant":
            # only an assistant turn may go without (its tool_calls say what it did)
            raise InvalidArgumentError(f"messages[{i}] ({m['role']}) has no 'content'")
        msg = dict(m)      # other keys (name, tool_calls, tool_call_id) go to the template as they are
        msg["content"] = _content_text(i, m.get("content"))
        if msg["role"] == "developer":      # OpenAI's newer name for the system role
            msg["role"] = "system"
        rendered.append(msg)
    rendered = history_arguments(rendered)
    source = tok.template_source(tools=calls is not None)
    if source:      # earlier calls as the model wrote them, where the template drops tool_calls
        rendered = calls_in_content(rendered, calls.format if calls is not None else tool_format(source), source)
    if calls is not None and calls.format == "generic":
        # the template knows no tools: a system message tells them (or the first user turn,
        # where the template refuses a system role: Gemma 2's)
        try:
            text = tok.apply_chat_template(generic_messages(calls, rendered), add_generation_prompt=True)
        except TokenizerError:
            text = tok.apply_chat_template(generic_messages(calls, rendered, system_role=False),
                                           add_generation_prompt=True)
    elif calls is not None:
        text = tok.apply_chat_template(rendered, add_generation_prompt=True, tools=calls.tools)
    else:
        if tool_format(tok.chat_template) == "generic" and any(
                m["role"] == "tool" or m.get("tool_calls") for m in rendered):
            rendered = generic_history(rendered)       # earlier calls, for a template without tool turns
        text = tok.apply_chat_template(rendered, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)     # the template writes BOS itself
    if not ids:
        raise InvalidArgumentError("the conversation renders to an empty prompt")
    return ids


# ------------------------------------------------------------------ running
def _events(llm, req: Request, params: SamplingParams, stats: GenerationStats,
            cancel, keep_displaced: bool = True) -> Iterator[tuple[str, list]]:
    """(text, logprob entries) increments of one answer, sampled with ``params``; the end
    reason lands in stats.stop_reason. ``keep_displaced``: Session's.

    An entry is (token id, logprob, [(id, logprob)...], text offset); entries
    come with the text they start in, and a stop string cuts both.
    """
    vocab = llm.config.vocab_size
    constraint = None
    if req.grammar is not None:
        from .grammar import GrammarConstraint
        constraint = GrammarConstraint(llm, req.grammar)
    sampler = Sampler(vocab, params, constraint)
    reader = LogprobReader(vocab) if req.logprobs is not None else None
    seen: list = []

    def observe(logits, token):
        seen.append(reader.read(logits, token, req.logprobs))

    tokens = generate_tokens(Session(llm, keep_displaced), req.ids, req.max_tokens, sampler, stats, cancel,
                             observe if reader is not None else None)
    scanner = StopScanner(llm.tokenizer, req.stop)
    pending: deque = deque()     # entries whose text is not released yet
    try:
        for token in tokens:
            start = scanner.decoded
            text = scanner.push(token)
            if reader is not None:
                lp, top = seen.pop()
                pending.append((token, lp, top, start))
            entries = _release(pending, scanner.released)
            if text or entries:
                yield text, entries
            if scanner.stopped:
                stats.stop_reason = "stop"
                return
        if stats.stop_reason == "cancelled":
            return
        text = scanner.finish()
        if scanner.stopped:
            stats.stop_reason = "stop"
            entries = _release(pending, scanner.released)
        else:
            entries = list(pending)
        if text or entries:
            yield text, entries
    finally:
        tokens.close()


def _release(pending: deque, released: int) -> list:
    out = []
    while pending and pending[0][3] < released:
        out.append(pending.popleft())
    return out


def _finish_reason(stats: GenerationStats) -> str | None:
    return {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}.get(stats.stop_reason)


def usage(req: Request, stats: GenerationStats) -> dict:
    n = stats.generated_tokens
    return {"prompt_tokens": len(req.ids), "completion_tokens": n, "total_tokens": len(req.ids) + n,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens}}


def _token_text(tok, token_id: int) -> str:
    """A token as logprobs name it: its text, or, where its bytes are part of a UTF-8
    character (byte-level vocabularies split emoji and CJK), ``bytes:\\xNN...`` as OpenAI
    writes such tokens, so that no two of them share a name."""
    b = tok.token_bytes(token_id)
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{c:02x}" for c in b)


def _chat_logprobs(tok, entries) -> list[dict]:
    def one(i, lp):
        return {"token": _token_text(tok, i), "logprob": lp, "bytes": list(tok.token_bytes(i))}
    return [dict(one(i, lp), top_logprobs=[one(j, l) for j, l in top]) for i, lp, top, _ in entries]


def _text_logprobs(tok, entries) -> dict:
    return {"tokens": [_token_text(tok, i) for i, _, _, _ in entries],
            "token_logprobs": [lp for _, lp, _, _ in entries],
            "top_logprobs": [{_token_text(tok, j): l for j, l in top} for _, _, top, _ in entries],
            "text_offset": [off for _, _, _, off in entries]}


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s sampling: choice 0 draws as a request of one choice would; the others
    from seeds of their own, derived from the request's seed (or fresh ones without it)."""
    if index == 0 or params.seed is None:
        return params
    seed = np.random.SeedSequence(params.seed, spawn_key=(index,)).generate_state(1, np.uint64)[0]
    return dataclasses.replace(params, seed=int(seed))


def _add_stats(total: GenerationStats, one: GenerationStats) -> None:
    """A later choice's generation, counted into the request's stats, which hold the first
    choice's: the prompt's counts and the time to the first token stay that choice's (a later
    choice finds the prompt in the cache)."""
    for f in ("generated_tokens", "decode_s", "decode_steps"):
        setattr(total, f, getattr(total, f) + getattr(one, f))
    if one.stop_reason == "cancelled":
        total.stop_reason = "cancelled"


def _base(req: Request, obj: str) -> dict:
    return {"id": req.id, "object": obj, "created": req.created, "model": req.model_name}


def _choices(llm, req: Request, stats: GenerationStats, cancel) -> Iterator[dict]:
    """The chunks of every choice in turn (index 0 .. n-1), then the usage chunk if asked for.
    Choice 0 runs on ``stats`` itself, so a caller watching it (the server's time to first
    token) sees the first answer live; the others' counts are added as each ends (or is
    closed), and with n > 1 the stop reason becomes every choice's, joined by commas."""
    chat = req.object == "chat.completion"
    scored = None
    if not chat and req.echo is not None and req.logprobs is not None:
        scored = _prompt_logprobs(llm, req, cancel)     # the prompt's logprobs: once for every choice
    reasons = []
    for index in range(req.n):
        one = stats if index == 0 else GenerationStats()
        params = _choice_params(req.params, index)
        # a choice displaces the one before it from the KV cache: a server's prompt cache keeps
        # choice 0 (the one a client most likely continues), not the later ones
        keep = index <= 1
        try:
            if chat:
                yield from _chat_chunks(llm, req, params, one, cancel, index, keep)
            else:
                yield from _text_chunks(llm, req, params, one, cancel, index, scored, keep)
        finally:
            reasons.append(one.stop_reason)
            if index:
                _add_stats(stats, one)
        if one.stop_reason == "cancelled":
            return
    if req.n > 1:
        stats.stop_reason = ",".join(reasons)
    if req.include_usage:
        yield dict(_base(req, "chat.completion.chunk" if chat else "text_completion"), choices=[],
                   usage=usage(req, stats))


def _chat_chunks(llm, req: Request, params: SamplingParams, stats: GenerationStats, cancel,
                 index: int, keep: bool) -> Iterator[dict]:
    tok = llm.tokenizer
    base = _base(req, "chat.completion.chunk")

    def chunk(delta, finish=None, logprobs=None):
        c = dict(base, choices=[{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}])
        if req.include_usage:
            c["usage"] = None
        return c

    yield chunk({"role": "assistant", "content": ""})
    scan = CallScan(req.tools) if req.tools is not None else None
    for text, entries in _events(llm, req, params, stats, cancel, keep):
        lp = {"content": _chat_logprobs(tok, entries), "refusal": None} if req.logprobs is not None else None
        if scan is not None:
            text = scan.push(text)        # a call's text is held back until it is whole
            if not text and lp is None:
                continue
        yield chunk({"content": text}, logprobs=lp)
    if stats.stop_reason == "cancelled":
        return
    finish = _finish_reason(stats)
    if scan is not None:
        rest, calls = scan.finish()
        if rest:
            yield chunk({"content": rest})
        if calls:
            yield chunk({"tool_calls": [
                {"index": i, "id": new_call_id(), "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"]}} for i, c in enumerate(calls)]})
            finish = "tool_calls"
    yield chunk({}, finish=finish)


def _text_chunks(llm, req: Request, params: SamplingParams, stats: GenerationStats, cancel, index: int,
                 scored: dict | None, keep: bool) -> Iterator[dict]:
    """One choice's chunks; ``scored``: the prompt's logprobs where echo asks for them."""
    tok = llm.tokenizer
    base = _base(req, "text_completion")

    def chunk(text, finish=None, logprobs=None):
        c = dict(base, choices=[{"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}])
        if req.include_usage:
            c["usage"] = None
        return c

    shift = 0               # text_offset of the answer's tokens: after the echoed prompt
    if req.echo is not None:
        if cancel is not None and cancel():
            stats.stop_reason = "cancelled"
            return
        yield chunk(req.echo, logprobs=scored)
        shift = len(req.echo)
    # echo with max_tokens 0 scores the prompt only: no generation runs it through again
    scoring_only = req.echo is not None and req.max_tokens == 0
    if scoring_only:
        stats.stop_reason = "length"
        if scored is not None and index == 0:  # the scoring passes ran the prompt once (the server's log)
            stats.prompt_tokens = len(req.ids)
    for text, entries in () if scoring_only else _events(llm, req, params, stats, cancel, keep):
        entries = [(t, lp, top, off + shift) for t, lp, top, off in entries]
        yield chunk(text, logprobs=_text_logprobs(tok, entries) if req.logprobs is not None else None)
    if stats.stop_reason == "cancelled":
        return
    yield chunk("", finish=_finish_reason(stats))


PROMPT_LOGITS_CHUNK = 256      # prompt positions a pass: (256, vocab) floats, not (prompt, vocab)


def _prompt_logprobs(llm, req: Request, cancel=None) -> dict:
    """Logprobs of the prompt's own tokens (echo): token i given tokens 0..i-1, from fresh
    passes over the prompt in chunks (``cancel`` polled between them); None for the first
    token, which nothing predicts. text_offset counts in the echoed text: special tokens
    that are not in it (an added BOS) sit at the offset of what follows; those the prompt's
    text spells out (its own "<|endoftext|>") take their length. The passes leave the whole
    prompt in the KV cache, held by a session, so an answer that follows runs only its last
    token again."""
    tok = llm.tokenizer
    reader = LogprobReader(llm.config.vocab_size)
    out = {"tokens": [], "token_logprobs": [None], "top_logprobs": [None], "text_offset": []}
    dec, at = tok.stream_decoder(skip_special_tokens=True), 0
    special, echo = tok.special_ids(), req.echo or ""
    for t in req.ids:
        out["tokens"].append(_token_text(tok, t))
        out["text_offset"].append(at)
        piece = dec.add(t)
        if not piece and t in special:
            spelled = tok.id_to_token(t) or ""
            piece = spelled if spelled and echo.startswith(spelled, at) else ""
        at += len(piece)
    ids, step = req.ids, PROMPT_LOGITS_CHUNK
    for a, logits in Session(llm).score(ids, step, cancel) if len(ids) > 1 else ():
        for i in range(min(step, len(ids) - 1 - a)):
            lp, top = reader.read(logits[i], ids[a + i + 1], req.logprobs)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({_token_text(tok, j): v for j, v in top})
    return out


def collect(chunks: Iterator[dict]) -> dict:
    """The non-streamed response from a stream of chunks (that ends with the usage chunk);
    the chunks of several choices are told apart by their index."""
    first, use = None, None
    parts: dict[int, dict] = {}       # index -> that choice's pieces
    for c in chunks:
        first = first or c
        use = c.get("usage") or use
        for choice in c["choices"]:
            p = parts.setdefault(choice["index"], {"text": [], "finish": None, "calls": {}, "chat_lp": None,
                                                   "text_lp": None})
            p["text"].append(choice["delta"].get("content", "") if "delta" in choice else choice["text"])
            for d in choice.get("delta", {}).get("tool_calls") or ():
                # index -> the call, its arguments joined from the deltas
                call = p["calls"].setdefault(d["index"], {"id": d.get("id"), "type": "function",
                                                          "function": {"name": "", "arguments": ""}})
                call["function"]["name"] += d["function"].get("name") or ""
                call["function"]["arguments"] += d["function"].get("arguments") or ""
            p["finish"] = choice["finish_reason"] or p["finish"]
            lp = choice["logprobs"]
            if lp is not None and "content" in lp:
                p["chat_lp"] = (p["chat_lp"] or []) + lp["content"]
            elif lp is not None:
                p["text_lp"] = p["text_lp"] or {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                "text_offset": []}
                for k in p["text_lp"]:
                    p["text_lp"][k] += lp[k]
    if first is None:                 # cancelled before anything was produced
        return {}
    base = {"id": first["id"], "created": first["created"], "model": first["model"]}
    chat = first["object"] == "chat.completion.chunk"
    choices = []
    for i in sorted(parts):
        p = parts[i]
        if chat:
            message = {"role": "assistant", "content": "".join(p["text"])}
            if p["calls"]:
                message["tool_calls"] = [p["calls"][k] for k in sorted(p["calls"])]
                if not message["content"].strip():
                    message["content"] = None         # as OpenAI answers a call without text
            choices.append({"index": i, "message": message,
                            "logprobs": None if p["chat_lp"] is None else {"content": p["chat_lp"], "refusal": None},
                            "finish_reason": p["finish"]})
        else:
            choices.append({"text": "".join(p["text"]), "index": i, "logprobs": p["text_lp"],
                            "finish_reason": p["finish"]})
    return dict(base, object="chat.completion" if chat else "text_completion", choices=choices, usage=use)
