"""Tokenizer: a thin layer over the `tokenizers` library plus chat templates.

Encoding follows what Hugging Face's AutoTokenizer does for a tokenizer.json
model: the tokenizer's own post-processor decides whether BOS is added. A GGUF
model states it in its metadata instead (``add_bos``), which then wins.

Chat templates are rendered with the same jinja2 settings transformers uses
(sandboxed, trim_blocks + lstrip_blocks, ``raise_exception``/``strftime_now``
helpers, a ``tojson`` that keeps non-ASCII text), so a template produces the
same prompt string here as there; template_sandbox bounds their time and size.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

from .errors import InvalidArgumentError, TokenizerError
from .jsonio import JsonObject, read_json_file
from .oneline import one_line
from .template_sandbox import MAX_TEMPLATE_CHARS, ChatTemplate

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    def __init__(self, tok, bos_id: int | None, eos_ids, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None,
                 add_bos: bool | None = None, template_vars: dict | None = None,
                 aliases: dict[int, int] | None = None, tool_template: str | None = None):
        self._tok = tok
        self._vocab = tok.get_vocab_size(with_added_tokens=True)
        # id -> the id of the same piece: a GGUF token list may spell one piece twice, and the
        # tokenizer keeps the first, so the second must decode as the first does
        self._aliases = dict(aliases or {})
        self.bos_id = bos_id
        order: list[int] = []
        for i in eos_ids or ():
            if i is not None and i not in order:
                order.append(int(i))
        self._eos_order = order
        self._eos = frozenset(order)
        self._chat_template = chat_template
        # the template a model ships for requests with tools, where it ships two (tokenizer_config's
        # "tool_use" entry, GGUF's tokenizer.chat_template.tool_use: Hermes 2 Pro, Command R)
        self.tool_template = tool_template
        # special-token strings for the template; fall back to the vocab's spelling
        if bos_token is None and bos_id is not None:
            bos_token = tok.id_to_token(bos_id)
        if eos_token is None and order:
            eos_token = tok.id_to_token(order[0])
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos = add_bos
        self._template_vars = dict(template_vars or {})
        self._compiled: dict[str, tuple] = {}       # "chat" | "tool" -> (source, compiled template)
        self._bytes = None
        self._pieces = None     # _PieceBytes, built on the first token_bytes()

    # ----------------------------------------------------------------- basics
    @property
    def vocab_size(self) -> int:
        return self._vocab

    def cover_ids(self, n: int) -> None:
        """Accept every id of a model's vocabulary of ``n`` (its embedding rows). Models pad
        their embeddings past the tokenizer's pieces (Qwen2.5: 151936 rows, 151665 pieces);
        an id without a piece decodes to no text, as transformers decodes it, instead of
        stopping a generation that sampled it."""
        self._vocab = max(self._vocab, int(n))

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def eos_id(self) -> int | None:
        """The first (primary) end-of-sequence id, or None."""
        return self._eos_order[0] if self._eos_order else None

    def is_eos(self, token_id: int) -> bool:
        return token_id in self._eos

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(self._aliases.get(token_id, token_id))

    @property
    def backend(self):
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise InvalidArgumentError(f"encode() needs a str, got {type(text).__name__}")
        if self.add_bos is None:
            return list(self._encode(text, add_special_tokens).ids)
        ids = list(self._encode(text, False).ids)
        if add_special_tokens and self.add_bos and self.bos_id is not None:
            if not ids or ids[0] != self.bos_id:
                ids.insert(0, self.bos_id)
        return ids

    def _encode(self, text: str, add_special_tokens: bool):
        # the library's encode holds the GIL throughout (a 5 MB text: ~7 s in which a server's
        # other requests and streams stand still); encode_batch lets it go and gives the same
        # ids for one text
        try:
            if len(text) < _LONG_TEXT:
                return _guarded(self._tok.encode, text, add_special_tokens=add_special_tokens)
            return _guarded(self._tok.encode_batch, [text], add_special_tokens=add_special_tokens)[0]
        except TokenizerError:
            _check_unicode(text)        # the likelier cause, said plainly; else the library's words
            raise

    def _check_ids(self, ids) -> list[int]:
        # ids checked against the vocabulary, each as the tokenizer knows it (a GGUF piece
        # spelled twice: its first id)
        out = []
        for i in ids:
            try:
                v = int(i)
            except (TypeError, ValueError):
                raise InvalidArgumentError(f"token id {i!r} is not an integer") from None
            if v != i or not 0 <= v < self._vocab:
                raise InvalidArgumentError(f"token id {i!r} is out of range [0, {self._vocab})")
            out.append(self._aliases.get(v, v))
        return out

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return _guarded(self._tok.decode, self._check_ids(ids), skip_special_tokens=skip_special_tokens)

    def special_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special (a BOS, <|endoftext|>, control tokens)."""
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def _byte_ids(self) -> frozenset[int]:
        """Ids of byte-fallback tokens ``<0xNN>`` (SentencePiece-style vocabularies)."""
        if self._bytes is None:
            self._bytes = frozenset(
                i for t, i in self._tok.get_vocab(with_added_tokens=False).items()
                if len(t) == 6 and t.startswith("<0x") and t.endswith(">"))
        return self._bytes

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for inside a text: for byte-level and byte-fallback
        vocabularies possibly part of one UTF-8 character (what OpenAI's logprob ``bytes``
        carry). A leading-space marker counts as its space, which ``decode`` strips at the
        start of a text; an added token is its content."""
        (token_id,) = self._check_ids([token_id])
        if self._pieces is None:
            self._pieces = _PieceBytes(self)
        return self._pieces.of(token_id)

    def stream_decoder(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)

    # ---------------------------------------------------------- chat template
    @property
    def chat_template(self) -> str | None:
        """The chat template's jinja source. One assigned here renders every conversation,
        with tools or without (it replaces a tool_use template the model shipped)."""
        return self._chat_template

    @chat_template.setter
    def chat_template(self, source: str | None) -> None:
        self._chat_template = source
        self.tool_template = None

    def template_source(self, tools: bool = False) -> str | None:
        """The template a conversation renders with: the tool-use one for requests with tools,
        where the model ships one."""
        return self.tool_template if tools and self.tool_template else self.chat_template

    def _template(self, tools: bool = False):
        # compiled for the source it was built from: a template assigned to chat_template or
        # tool_template later must not render with the old one
        source = self.template_source(tools)
        kind = "chat" if source is self.chat_template else "tool"
        done = self._compiled.get(kind)
        if done is None or done[0] is not source:
            if not source:
                raise TokenizerError(
                    "this model has no chat template (no chat_template in tokenizer_config.json "
                    "or chat_template.jinja); pass a plain prompt instead")
            done = self._compiled[kind] = (source, _compile_template(source))
        return done[1]

    def set_chat_template(self, source: str) -> None:
        """Use ``source`` (jinja text) as the chat template; compiled now, so a bad one fails at once."""
        self._compiled["chat"] = (source, _compile_template(source))
        self.chat_template = source

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kwargs) -> str:
        """Render ``messages`` ([{"role", "content"}, ...]) to the prompt string.

        The result already holds any BOS the template writes: encode it with
        ``add_special_tokens=False`` (as transformers does) to avoid a double BOS.
        """
        if not isinstance(messages, (list, tuple)) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise InvalidArgumentError(
                "messages must be a list of {'role': ..., 'content': ...} dicts")
        template = self._template(tools=bool(kwargs.get("tools")))
        variables = dict(self._template_vars)
        variables.update(bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        variables.update(kwargs)
        # bounded in time, output size and recursion; every failure is one TokenizerError line
        return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                               **variables)

    # ------------------------------------------------------------ from files
    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer | None":
        """Tokenizer of a Hugging Face model directory, or None without tokenizer.json."""
        d = Path(path)
        tpath = d / "tokenizer.json"
        if not tpath.is_file():
            return None
        import tokenizers
        raw = tpath.read_bytes()
        _check_tokenizer_steps(raw, tpath)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise TokenizerError(f"{one_line(tpath)}: cannot load tokenizer (not UTF-8 text)") from None
        tok = _guarded(tokenizers.Tokenizer.from_str, text, what=f"{one_line(tpath)}: cannot load tokenizer")
        # a file's padding and truncation are settings for batches of training text: a prompt is
        # encoded whole (truncation would drop part of it unseen; a fixed padding length of 10^8
        # allocated gigabytes)
        tok.no_padding()
        tok.no_truncation()

        tcfg = _read_json(d / "tokenizer_config.json")
        mcfg = _read_json(d / "config.json")
        gcfg = _read_json(d / "generation_config.json")

        bos_token = _token_str(tcfg, "bos_token")
        eos_token = _token_str(tcfg, "eos_token")
        bos_id = tok.token_to_id(bos_token) if bos_token else None
        if bos_id is None:
            for src in (gcfg, mcfg):
                ids = src.token_ids("bos_token_id")
                if ids:
                    bos_id = ids[0]
                    break
        eos_ids: list[int] = []
        if eos_token and tok.token_to_id(eos_token) is not None:
            eos_ids.append(tok.token_to_id(eos_token))
        for src in (gcfg, mcfg):
            eos_ids += src.token_ids("eos_token_id")
        vocab = tok.get_vocab_size(with_added_tokens=True)
        eos_ids = [i for i in eos_ids if 0 <= i < vocab]
        if bos_id is not None and not 0 <= bos_id < vocab:
            bos_id = None

        templates = hf_chat_templates(d, tcfg)

        extra = {}
        for key in ("unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
            s = _token_str(tcfg, key)
            if s is not None:
                extra[key] = s
        add = tcfg.list("additional_special_tokens")
        if add is not None:
            extra["additional_special_tokens"] = [t for t in (_token_value(tcfg, "additional_special_tokens", x)
                                                              for x in add) if t]
        return cls(tok, bos_id, eos_ids, bos_token=bos_token,
                   eos_token=eos_token, add_bos=None, template_vars=extra, chat_template=templates.get("default"),
                   tool_template=templates.get("tool_use"))


class StreamDecoder:
    """Incremental detokenization: feed ids one by one, get the new text.

    Decodes a short window ``ids[start:]`` and emits the characters beyond
    those already emitted from it. The window begins at the previous point
    where the text was complete, so the decoder sees one earlier token and
    applies its leading-space rules (SentencePiece strip, Metaspace) as it
    would on the whole sequence. Trailing U+FFFD are held back: they are the
    first bytes of a multi-byte UTF-8 character whose byte tokens have not all
    arrived (or invalid bytes, emitted as soon as real text follows them).
    The concatenation of every ``add()`` and the final ``flush()`` equals
    ``decode(all ids)`` for valid UTF-8 output. (One exception, by design:
    a byte-fallback decoder turns a whole run of ``<0xNN>`` tokens into U+FFFD
    when the run is invalid, so valid characters already streamed from a run
    that later turns invalid are not taken back; holding every run to its end
    would delay CJK/emoji text of SentencePiece models by many tokens.)
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._t = tokenizer
        self._skip = skip_special_tokens
        # tokens a window must not start with: skipped specials vanish and make
        # the next token "first"; a byte token may continue a run of bytes that
        # the decoder groups into characters
        self._no_start = tokenizer._byte_ids() | (
            tokenizer.special_ids() if skip_special_tokens else frozenset())
        self._ids: list[int] = []
        self._start = 0      # window start (token index)
        self._stable = 0     # token index where the text was last complete
        self._emitted = 0    # chars of decode(ids[start:]) already emitted

    def _dec(self, ids) -> str:
        return _guarded(self._t._tok.decode, ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        self._ids.extend(self._t._check_ids([token_id]))
        text = self._dec(self._ids[self._start:])
        complete = len(text.rstrip(REPLACEMENT_CHAR))
        delta = text[self._emitted:complete] if complete > self._emitted else ""
        self._emitted = max(self._emitted, complete)
        if complete == len(text):
            # slide the window to the last complete point, stepping back to a
            # token the decoder treats the same at the start of a text as
            # inside it
            start = self._stable
            while start > 0 and self._ids[start] in self._no_start:
                start -= 1
            if start != self._start:
                self._start = start
                self._emitted = len(self._dec(self._ids[start:]))
            self._stable = len(self._ids)
        return delta

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end)."""
        text = self._dec(self._ids[self._start:])
        delta = text[self._emitted:]
        self._emitted = len(text)
        return delta


class _PieceBytes:
    """Token id -> the bytes it decodes to, read from the tokenizer's decoder chain: ByteLevel
    (GPT-2's byte-to-character table, inverted), ByteFallback (``<0xNN>`` pieces) and the
    Replace/Metaspace steps that turn a space marker back into a space. Strip is left out:
    it applies to the start of a whole text, not to a token inside one."""

    def __init__(self, tokenizer: Tokenizer):
        tok = self._tok = tokenizer.backend
        steps = []

        def walk(d):
            if isinstance(d, dict):
                steps.append(d)
                for sub in d.get("decoders") or ():
                    walk(sub)
        try:        # the decoder's own JSON: to_str() would serialize the whole vocabulary
            decoder = tok.decoder
            walk(json.loads(decoder.__getstate__()) if decoder is not None else None)
        except (ValueError, TypeError, AttributeError):
            steps = []
        kinds = {d.get("type") for d in steps}
        self._byte_level = _unicode_to_byte() if "ByteLevel" in kinds else None
        self._byte_ids = tokenizer._byte_ids() if "ByteFallback" in kinds else frozenset()
        self._replace: list[tuple[str, str]] = []
        for d in steps:
            if d.get("type") == "Replace" and isinstance(d.get("pattern"), dict):
                pat, content = d["pattern"].get("String"), d.get("content")
                if isinstance(pat, str) and pat and isinstance(content, str):
                    self._replace.append((pat, content))
            elif d.get("type") == "Metaspace":
                mark = d.get("replacement", "\u2581")
                if isinstance(mark, str) and mark:
                    self._replace.append((mark, " "))
        self._added = {i: t.content for i, t in tok.get_added_tokens_decoder().items()}

    def of(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level is not None and all(c in self._byte_level for c in piece):
            return bytes(self._byte_level[c] for c in piece)
        if token_id in self._byte_ids and all(c in "0123456789abcdefABCDEF" for c in piece[3:5]):
            return bytes([int(piece[3:5], 16)])         # a <0xNN> piece
        for pat, content in self._replace:
            piece = piece.replace(pat, content)
        return piece.encode("utf-8")


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the character that stands for each byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


# ---------------------------------------------------------------- helpers
_LONG_TEXT = 1 << 14      # characters from which encode releases the GIL (Tokenizer._encode)


def _check_unicode(text: str) -> None:
    """InvalidArgumentError for a str that is not Unicode text: a lone surrogate (JSON's
    "\\ud800" decodes to one), on which the library fails with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgumentError(
            f"the text is not valid Unicode: a lone surrogate U+{ord(text[e.start]):04X} at character {e.start}"
        ) from None


def _check_tokenizer_steps(raw: bytes, path: Path) -> None:
    """Refuse the normalizer steps the `tokenizers` library panics on (printing Rust's panic
    text) or sizes an allocation from: a Precompiled charsmap whose trie size lies (0xFFFFFFFF
    asked for 8 GB) and a Replace of an empty string (an index past the text)."""
    if b'"Precompiled"' not in raw and b'"Replace"' not in raw and b"\\u" not in raw:
        return          # no such step, nor an escape that could spell one: spare a parse of a large file
    try:
        tj = json.loads(raw)
    except (ValueError, RecursionError):
        return                          # the library's own load reports it
    stack = [tj.get("normalizer"), tj.get("pre_tokenizer"), tj.get("decoder")] if isinstance(tj, dict) else []
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        for key in ("normalizers", "pretokenizers", "decoders"):
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        kind = node.get("type")
        if kind == "Precompiled":
            try:
                blob = base64.b64decode(node.get("precompiled_charsmap") or "", validate=True)
            except (ValueError, TypeError):
                blob = b""
            trie = int.from_bytes(blob[:4], "little") if len(blob) >= 4 else -1
            if blob and not (0 <= trie <= len(blob) - 4 and trie % 4 == 0):
                raise TokenizerError(f"{one_line(path)}: its Precompiled normalizer's charsmap is malformed")
        elif kind == "Replace":
            pattern = node.get("pattern")
            if isinstance(pattern, dict) and "" in (pattern.get("String"), pattern.get("Regex")):
                raise TokenizerError(f"{one_line(path)}: a Replace step with an empty pattern")


def _guarded(fn, *args, what: str = "the tokenizer failed on this text", **kwargs):
    """Call the `tokenizers` library: its failures on a hostile tokenizer.json become one line.

    A pre-tokenizer regex from the file can backtrack past Oniguruma's retry limit;
    the library then panics, which reaches Python as pyo3's PanicException, a
    BaseException (not an Exception) that no ordinary handler catches.
    """
    try:
        return fn(*args, **kwargs)
    except (KeyboardInterrupt, SystemExit, GeneratorExit, MemoryError):
        raise
    except BaseException as e:  # noqa: BLE001 - PanicException and the library's plain Exceptions
        raise TokenizerError(f"{what} ({type(e).__name__}: {one_line(e, 300)})") from None


def _compile_template(source: str) -> ChatTemplate:
    """A chat template compiled in the bounded sandbox (template_sandbox); TokenizerError when bad."""
    return ChatTemplate(source)


def _read_json(path: Path) -> JsonObject:
    return read_json_file(path, TokenizerError, missing_ok=True)


def read_template_file(path: Path) -> str:
    """A chat template file (jinja text), bounded like the templates in JSON configs."""
    try:
        size = path.stat().st_size
        if size > MAX_TEMPLATE_CHARS:
            raise TokenizerError(f"{one_line(path)}: a chat template of {size} bytes is beyond any real one "
                                 f"(at most {MAX_TEMPLATE_CHARS})")
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise TokenizerError(f"cannot read {one_line(path)} ({one_line(e.strerror or e)})") from None
    except UnicodeDecodeError:
        raise TokenizerError(f"{one_line(path)} is not UTF-8 text") from None


def _token_value(cfg: JsonObject, key: str, value) -> str | None:
    """A special token: a string or {"content": str} (transformers' AddedToken form); None = null."""
    text = value.get("content") if isinstance(value, dict) else value
    if value is not None and not isinstance(text, str):
        raise cfg.fail(key, 'a string or {"content": string}', value)
    if text is not None and not text.isascii():
        try:
            text.encode("utf-8")      # JSON escapes may leave lone surrogates, which no token is
        except UnicodeEncodeError:
            raise cfg.fail(key, "text without lone surrogates", value) from None
    return text


def _token_str(cfg: JsonObject, key: str) -> str | None:
    return _token_value(cfg, key, cfg.get(key))


def hf_chat_templates(d: Path, cfg: JsonObject) -> dict[str, str]:
    """A Hugging Face directory's chat templates by name ("default", "tool_use", ...):
    tokenizer_config's chat_template (a string, or a list of {"name", "template"}, an only
    one being the default), then the files transformers 5 writes instead, which win:
    chat_template.jinja (the default) and additional_chat_templates/NAME.jinja."""
    value = cfg.get("chat_template")
    named: dict[str, str] = {}
    if isinstance(value, str):
        named["default"] = value
    elif value is not None:
        if not isinstance(value, list) or not all(
                isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                for t in value):
            raise cfg.fail("chat_template", 'a string or a list of {"name": string, "template": string}', value)
        named = {t["name"]: t["template"] for t in value}
        if "default" not in named and len(named) == 1:
            named = {"default": value[0]["template"]}
    if (d / "chat_template.jinja").is_file():
        named["default"] = read_template_file(d / "chat_template.jinja")
    extra = d / "additional_chat_templates"
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            named[path.stem] = read_template_file(path)
    return named
