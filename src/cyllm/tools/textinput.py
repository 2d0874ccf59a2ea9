"""Text the user hands in (-p, -f, stdin): strict UTF-8, bounded size, one clear error.

Bytes that are not UTF-8 are refused naming the first bad byte (in argv they
arrive as lone surrogates); a file or stdin is read up to a limit, so
``-f /dev/zero`` ends with an error instead of reading forever.
"""

from __future__ import annotations

import os
import sys

from ..errors import InvalidArgumentError

MAX_PROMPT_BYTES = 16 << 20      # far beyond any context window; bounds `-f /dev/zero`


def decode_utf8(raw: bytes, what: str) -> str:
    """Strict UTF-8 (a leading BOM dropped); one clear error naming the first bad byte."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InvalidArgumentError(f"{what} is not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})") from None


def check_text_arg(text: str | None, what: str) -> str | None:
    """An argv string (bytes that were not UTF-8 arrive as lone surrogates): refuse them clearly."""
    if text is None:
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        decode_utf8(os.fsencode(text), what)        # raises, naming the byte
    return text


def read_text_file(path: str, what: str, limit: int = MAX_PROMPT_BYTES) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as e:
        raise InvalidArgumentError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(raw) > limit:
        raise InvalidArgumentError(f"{what} {path} is larger than {limit >> 20} MiB")
    return decode_utf8(raw, f"{what} {path}")


def read_stdin_text(limit: int = MAX_PROMPT_BYTES) -> str:
    stdin = sys.stdin
    if stdin is None:                 # started with stdin closed
        return ""
    buf = getattr(stdin, "buffer", None)
    raw = buf.read(limit + 1) if buf is not None else stdin.read(limit + 1).encode("utf-8", "surrogateescape")
    if len(raw) > limit:
        raise InvalidArgumentError(f"the prompt on stdin is larger than {limit >> 20} MiB")
    return decode_utf8(raw, "the prompt on stdin")


def strip_one_newline(text: str) -> str:
    """`echo` ends what it prints with one newline; it is not part of the prompt."""
    if text.endswith("\r\n"):
        return text[:-2]
    return text[:-1] if text.endswith("\n") else text


def stdin_is_tty() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (ValueError, OSError):
        return False
