"""JSON from files cyllm did not write: bounded parsing and typed, range-checked fields.

``json.loads`` on hostile text fails in ways no caller expects: 50,000 nested
brackets raise RecursionError, an integer of 5,000 digits raises ValueError
(Python's int/str digit limit) and NaN/Infinity are accepted as numbers. Every
config reader (config.json, generation_config.json, tokenizer_config.json, the
shard index, a safetensors header) parses through :func:`parse_json`, which
bounds the file size, the nesting depth and the digits of an integer, and reads
fields through :class:`JsonObject`, whose accessors refuse a string where a
number belongs, a number where a flag belongs, a non-finite scale, and name the
file and the key in one line.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from .errors import CyllmError, ModelLoadError
from .oneline import one_line

MAX_DEPTH = 64                 # real configs nest 4-5 deep
MAX_INT_DIGITS = 64            # 1e30 written as an integer (a common model_max_length) has 31
MAX_FILE_BYTES = 256 << 20     # tokenizer_config.json of large vocabularies: a few MB
_REQUIRED = object()

# a JSON string literal, or an unterminated one running to the end of the text: the match
# can never fail once started, so the scan stays linear (a pattern that demands the closing
# quote is retried from every later quote of "a\"a\"a\"..., quadratic in the text)
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def short(value, limit: int = 40) -> str:
    """A value from a file, as one short printable line (for messages)."""
    return one_line(repr(value), limit)


def nesting_depth(text: str) -> int:
    """The deepest bracket nesting of JSON ``text`` (brackets inside strings not counted).

    Linear time and no recursion: strings are cut out, the brackets left are
    scanned as +1/-1 steps in chunks (the running depth carried between them).
    """
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text)).encode("ascii")
    depth, deepest, step = 0, 0, 1 << 22
    for s in range(0, len(brackets), step):
        b = np.frombuffer(brackets, dtype=np.uint8, count=min(step, len(brackets) - s), offset=s)
        delta = np.where((b == ord("[")) | (b == ord("{")), 1, -1).astype(np.int32)
        run = np.cumsum(delta, dtype=np.int64) + depth
        deepest = max(deepest, int(run.max()))
        depth = int(run[-1])
    return deepest


def parse_json(text: str | bytes, where: str, err: type[CyllmError] = ModelLoadError,
               max_depth: int = MAX_DEPTH) -> Any:
    """``text`` parsed as JSON, or ``err`` with one line naming ``where``; ``max_depth``: the
    deepest nesting taken (a server's request bodies carry JSON schemas, deeper than configs)."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError:
            raise err(f"{where} is not valid JSON (not UTF-8 text)") from None
    if len(text) > MAX_FILE_BYTES:
        raise err(f"{where} is {len(text)} characters long, beyond any real config ({MAX_FILE_BYTES})")
    depth = nesting_depth(text)
    if depth > max_depth:
        raise err(f"{where} nests {depth} levels deep (at most {max_depth})")

    def parse_int(s: str) -> int:
        if len(s) > MAX_INT_DIGITS:
            raise err(f"{where} holds an integer of {len(s.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
        return int(s)

    try:
        return json.loads(text, parse_int=parse_int)
    except json.JSONDecodeError as e:
        raise err(f"{where} is not valid JSON ({one_line(e.msg, 80)} at line {e.lineno} "
                  f"column {e.colno})") from None
    except RecursionError:      # the depth check makes this unreachable; kept as a guard
        raise err(f"{where} nests too deeply") from None


def read_json_file(path: Path, err: type[CyllmError] = ModelLoadError, *, missing_ok: bool = False,
                   name: str | None = None) -> "JsonObject":
    """A JSON object from ``path`` (an empty one when missing and ``missing_ok``).

    ``name`` is what messages call the file (default: the path).
    """
    where = one_line(name or path)
    try:
        if missing_ok and not path.is_file():
            return JsonObject({}, where, err)
        if path.exists() and not path.is_file():
            # a FIFO would block the read forever, a device (/dev/zero) never end it
            raise err(f"{where} is not a regular file")
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise err(f"{where} is {size} bytes, beyond any real config ({MAX_FILE_BYTES})")
        raw = path.read_bytes()
    except OSError as e:
        raise err(f"cannot read {where}: {one_line(e.strerror or e)}") from None
    data = parse_json(raw, where, err)
    if not isinstance(data, dict):
        raise err(f"{where}: expected a JSON object, got {_kind(data)}")
    return JsonObject(data, where, err)


def _kind(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    return "an object" if isinstance(v, dict) else type(v).__name__


class JsonObject(dict):
    """A parsed JSON object with typed accessors; messages name ``where`` and the key.

    Accessors take a default: when the key is missing (or null, for ``null_ok``
    fields) the default is returned as is; without a default the key is required.
    """

    def __init__(self, data: dict, where: str, err: type[CyllmError] = ModelLoadError, prefix: str = ""):
        super().__init__(data)
        self.where = where
        self.err = err
        self.prefix = prefix          # "rope_scaling." inside a nested object

    def fail(self, key: str, what: str, value) -> CyllmError:
        return self.err(f"{self.where}: {one_line(self.prefix + key, 60)} must be {what}, got {short(value)}")

    def _raw(self, key: str, default, null_ok: bool):
        if key not in self or (self[key] is None and null_ok):
            if default is _REQUIRED:
                raise self.err(f"{self.where}: missing required key {one_line(self.prefix + key, 60)!r}")
            return _REQUIRED
        return self[key]

    def int(self, key: str, default=_REQUIRED, *, minimum: int | None = None, maximum: int | None = None,
            null_ok: bool = True):
        v = self._raw(key, default, null_ok)
        if v is _REQUIRED:
            return default
        return check_int(v, key, minimum, maximum, self.fail)

    def number(self, key: str, default=_REQUIRED, *, positive: bool = False, null_ok: bool = False):
        v = self._raw(key, default, null_ok)
        if v is _REQUIRED:
            return default
        return check_number(v, key, positive, self.fail)

    def flag(self, key: str, default: bool = False) -> bool:
        v = self._raw(key, default, True)
        if v is _REQUIRED:
            return default
        if not isinstance(v, bool):
            raise self.fail(key, "true or false", v)
        return v

    def text(self, key: str, default=_REQUIRED, *, null_ok: bool = True):
        v = self._raw(key, default, null_ok)
        if v is _REQUIRED:
            return default
        if not isinstance(v, str):
            raise self.fail(key, "a string", v)
        return v

    def obj(self, key: str) -> "JsonObject | None":
        """A nested object (None when missing or null)."""
        v = self.get(key)
        if v is None:
            return None
        if not isinstance(v, dict):
            raise self.fail(key, "an object or null", v)
        return JsonObject(v, self.where, self.err, f"{self.prefix}{key}.")

    def list(self, key: str, item: str = "any", *, length: int | None = None):
        """A list (None when missing or null); ``item``: "str", "int", "number", "flag" or "any"."""
        v = self.get(key)
        if v is None:
            return None
        what = {"str": "strings", "int": "whole numbers", "number": "numbers", "flag": "flags",
                "any": "values"}[item]
        want = f"a list of {length} {what}" if length is not None else f"a list of {what}"
        if not isinstance(v, list) or (length is not None and len(v) != length):
            raise self.fail(key, want, v)
        ok = {"str": lambda x: isinstance(x, str),
              "int": lambda x: isinstance(x, int) and not isinstance(x, bool),
              "number": lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x),
              "flag": lambda x: isinstance(x, bool) or (isinstance(x, int) and x in (0, 1)),
              "any": lambda x: True}[item]
        if not all(ok(x) for x in v):
            raise self.fail(key, want, v)
        return v

    def token_ids(self, key: str) -> list[int]:
        """A bos/eos id field (a whole number, a list of them, or null) as a list.

        Ids outside [0, 2**31) are dropped: no vocabulary holds them, and some
        configs write -1 for "none".
        """
        v = self.get(key)
        vals = v if isinstance(v, list) else [] if v is None else [v]
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in vals):
            raise self.fail(key, "a token id, a list of token ids or null", v)
        return [x for x in vals if 0 <= x < 1 << 31]


def check_int(v, key: str, minimum=None, maximum=None, fail=None):
    """``v`` as an int in [minimum, maximum]; bools and floats are refused."""
    fail = fail or _plain_fail
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise fail(key, "a whole number", v)
    v = int(v)
    if minimum is not None and v < minimum:
        raise fail(key, f"a whole number >= {minimum}", v)
    if maximum is not None and v > maximum:
        raise fail(key, f"a whole number <= {maximum}", v)
    return v


def check_number(v, key: str, positive: bool = False, fail=None) -> float:
    """``v`` as a finite float (> 0 when ``positive``); bools and strings are refused."""
    fail = fail or _plain_fail
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise fail(key, "a number", v)
    try:
        f = float(v)
    except OverflowError:            # an int beyond float range
        f = math.inf
    if not math.isfinite(f) or (positive and f <= 0):
        raise fail(key, "a finite number > 0" if positive else "a finite number", v)
    return f


def _plain_fail(key, what, value):
    return ModelLoadError(f"config: {one_line(key, 60)} must be {what}, got {short(value)}")
