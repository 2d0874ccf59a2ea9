"""Structured output: JSON (any object, or one JSON schema) enforced token by token.

The grammar engine is llguidance, the one llama.cpp uses for JSON schemas. It
works from the tokenizer's own JSON (``tokenizers.Tokenizer.to_str()``), which
cyllm's Tokenizer wraps for Hugging Face directories and GGUF files alike, so
the token mask is computed over exactly the vocabulary the model samples from
(outlines-core and xgrammar need a vocabulary export of their own; llguidance
takes the tokenizer as it is and computes a mask in well under a millisecond).

A GrammarConstraint plugs into sampling.Sampler: ``apply(x)`` sets the
logits of tokens the grammar forbids to -inf, ``accept(token)`` advances it.
When the JSON value is complete only the end-of-sequence token is allowed.

Some schemas match no value at all although llguidance compiles them (a
``$ref`` that leads only back to itself, {"$ref": "#"}): llguidance finds the
dead end only when it computes a token mask, and then allows nothing but the
end-of-sequence token, which would end the answer as an empty (or cut) value
with finish_reason "stop". So the constraint computes its first mask when it
is built (the request is refused before it runs) and checks every later one
(the generation stops with that error).
"""

from __future__ import annotations

import json
import threading
import weakref

import numpy as np

from .errors import InvalidArgumentError
from .jsonio import short
from .oneline import one_line

# JSON layout: one space after ':' and ',' (how people and models write JSON),
# no free whitespace (a small model could otherwise loop on newlines)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_tokenizers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise InvalidArgumentError(
            "response_format needs the llguidance package: pip install 'cyllm[server]'") from None
    return llguidance


def ll_tokenizer(model):
    """llguidance's view of the model's tokenizer, built once per tokenizer (~0.5 s)."""
    tok = model.tokenizer
    with _lock:
        lt = _tokenizers.get(tok)
        if lt is None:
            llg = _llguidance()
            eos = sorted(set(tok.eos_ids) | set(model.config.eos_token_ids))
            # n_vocab = the model's logit count (may exceed the tokenizer's: padded embeddings)
            lt = llg.LLTokenizer(tok.backend.to_str(), n_vocab=model.config.vocab_size,
                                 eos_token=eos or None)
            _tokenizers[tok] = lt
        return lt


def grammar_for(response_format) -> str | None:
    """llguidance grammar text for an OpenAI ``response_format`` (None: free text).

    Accepted: {"type": "text"}, {"type": "json_object"} (llama-cpp-python's
    {"type": "json_object", "schema": {...}} too), {"type": "json_schema",
    "json_schema": {"name": ..., "schema": {...}, "strict": ...}}.
    """
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise InvalidArgumentError("response_format must be an object with a 'type'")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema", {"type": "object"})
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidArgumentError("response_format.json_schema must be an object with a 'schema'")
        schema = spec.get("schema", {})
    else:
        raise InvalidArgumentError(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {short(kind)}")
    if not isinstance(schema, (dict, bool)):
        raise InvalidArgumentError("the JSON schema must be an object")
    llg = _llguidance()
    try:
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise InvalidArgumentError(f"invalid JSON schema: {one_line(e, 300)}") from None


class GrammarConstraint:
    """One generation's grammar state: a token mask before each sample."""

    def __init__(self, model, grammar: str):
        llg = _llguidance()
        lt = ll_tokenizer(model)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, lt)
        if is_error:
            # the engine's messages may run over several lines (a regex's parse error): one line
            raise InvalidArgumentError(f"invalid JSON schema: {one_line(messages[0] if messages else 'rejected', 300)}")
        self._m = llg.LLMatcher(lt, grammar, log_level=0)
        if self._m.is_error():
            raise InvalidArgumentError(f"invalid JSON schema: {one_line(self._m.get_error(), 300)}")
        vocab = model.config.vocab_size
        self._vocab = vocab
        self._mask = np.zeros((vocab + 31) // 32, np.int32)     # (words,) one bit per token
        self._bits = np.empty(vocab, np.uint8)                   # (vocab,) 1 = allowed
        self._mask_ready = False                                 # _mask is the one for the next token
        self._compute_mask()
        if self._m.is_error():
            raise InvalidArgumentError("invalid JSON schema: no JSON value matches it "
                                       "(a $ref that leads only back to itself, like {\"$ref\": \"#\"}?)")

    def _compute_mask(self) -> None:
        self._m.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        self._mask_ready = True

    def apply(self, x: np.ndarray) -> None:
        """Forbidden tokens of logits x (vocab,) f32 -> -inf, in place."""
        if not self._mask_ready:         # the first one was computed by __init__
            self._compute_mask()
        self._mask_ready = False
        if self._m.is_error():
            raise InvalidArgumentError("the JSON schema allows no way to go on from the output so far: "
                                       "no JSON value matches it (a $ref that leads only back to itself?)")
        self._bits[:] = np.unpackbits(self._mask.view(np.uint8), count=self._vocab, bitorder="little")
        np.copyto(x, np.float32(-np.inf), where=self._bits == 0)

    def accept(self, token: int) -> None:
        self._mask_ready = False
        if not self._m.consume_token(token):
            # a token drawn under the mask is refused where the engine hits one of its limits
            # (a schema whose values never end, {"required": ["c"]} with c of the same type,
            # or thousands of properties: "Current row has 20007 items; max is 2000"); its
            # error is a multi-line dump of the parser state, so one line of it
            raise InvalidArgumentError(
                "the grammar engine gave up on this JSON schema (one whose values never end, or "
                f"too large a one?): {one_line((self._m.get_error() or 'no reason given').strip().splitlines()[0], 160)}")

    @property
    def complete(self) -> bool:
        return self._m.is_accepting()
