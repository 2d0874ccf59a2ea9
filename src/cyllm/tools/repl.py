"""`cyllm chat`: a conversation at the terminal that behaves like a good REPL.

- Line editing and history come from the standard library's ``readline``
  (history in $XDG_STATE_HOME/cyllm/chat_history); bracketed paste is switched
  on, so a pasted text arrives whole, newlines included, however long (the
  terminal's 4095-byte line buffer only limits a plain ``input()``).
- A line ending in ``\\`` continues on the next; ``\"\"\"`` opens and closes a
  block of lines.
- Ctrl-C during an answer stops it and returns to the prompt (what was said
  stays in the conversation); Ctrl-C at an empty prompt, or twice, leaves;
  Ctrl-D too.
- Commands: /help /clear (/reset) /system /save /load /exit (/quit).
- A full context drops the oldest turns (the system prompt stays), with one
  line saying so, instead of ending the chat.
- Statistics: one line at the end (every answer with --verbose).

When stdin is not a terminal every line is a message (the same commands and
continuation rules apply) and nothing but the answers goes to stdout.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import CyllmError, InvalidArgumentError
from .frontend import load_model, sampling_kwargs, use_chat_template, write_out
from .textinput import check_text_arg, stdin_is_tty

HELP = """commands:
  /help             this list
  /clear, /reset    forget the conversation (the system prompt stays)
  /system [TEXT]    show the system prompt, or set it to TEXT
  /save FILE        write the conversation to FILE (JSON)
  /load FILE        continue a conversation written by /save
  /exit, /quit      leave (also Ctrl-D, or Ctrl-C at an empty prompt)
input:
  a line ending in \\ continues on the next; \"\"\" opens and closes a block of lines;
  pasted text arrives whole; //text sends a message that starts with /.
  Ctrl-C stops an answer (what was said stays in the conversation)."""

MAX_LINE_BYTES = 16 << 20            # one piped line; bounds a newline-free stream
MAX_CONVERSATION_BYTES = 16 << 20    # /load
ROLES = ("system", "user", "assistant")


def notice(msg: str) -> None:
    from ..oneline import one_line
    print(f"cyllm: {one_line(msg)}", file=sys.stderr, flush=True)


# -- statistics over the whole chat ------------------------------------------------------
@dataclass
class Totals:
    answers: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_s: float = 0.0
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_s: float = 0.0

    def add(self, st) -> None:
        if st is None:
            return
        self.answers += 1
        self.prompt_tokens += st.prompt_tokens
        self.cached_tokens += st.cached_tokens
        self.prefill_s += st.prefill_s
        self.generated_tokens += st.generated_tokens
        self.decode_steps += st.decode_steps
        self.decode_s += st.decode_s

    def line(self) -> str:
        pre = self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0
        dec = self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0
        cached = f" (+{self.cached_tokens} cached)" if self.cached_tokens else ""
        return (f"chat: {self.answers} answer{'s' if self.answers != 1 else ''} | prompt: "
                f"{self.prompt_tokens} tokens{cached}, {pre:.1f} tok/s | generated: "
                f"{self.generated_tokens} tokens, {dec:.1f} tok/s")


# -- input ---------------------------------------------------------------------------------
class _Lines:
    """Assembles messages from physical lines: ``\\`` continuation and \"\"\" blocks."""

    def line(self, prompt: str) -> str | None:          # None: end of input
        raise NotImplementedError

    def read(self) -> str | None:
        first = self.line("> ")
        if first is None:
            return None
        if first.lstrip().startswith('"""'):
            body = first.lstrip()[3:]
            if body.rstrip().endswith('"""'):
                return body.rstrip()[:-3]
            parts = [body] if body else []
            while True:
                nxt = self.line("... ")
                if nxt is None:
                    break
                if nxt.rstrip().endswith('"""'):
                    last = nxt.rstrip()[:-3]
                    if last:
                        parts.append(last)
                    break
                parts.append(nxt)
            return "\n".join(parts)
        parts = []
        line = first
        while line.endswith("\\"):
            parts.append(line[:-1])
            line = self.line("... ")
            if line is None:
                line = ""
                break
        parts.append(line)
        return "\n".join(parts)

    def close(self) -> None:
        pass


class PipeInput(_Lines):
    """Lines of a non-terminal stdin, decoded strictly (a bad line is a one-line error)."""

    def __init__(self, stream):
        self.stream = stream
        self.n = 0

    def line(self, prompt: str) -> str | None:
        if self.stream is None:
            return None
        raw = self.stream.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return None
        self.n += 1
        if len(raw) > MAX_LINE_BYTES:
            raise InvalidArgumentError(f"line {self.n} of the input is longer than {MAX_LINE_BYTES >> 20} MiB")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidArgumentError(f"line {self.n} of the input is not valid UTF-8 "
                                       f"(byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
        if self.n == 1 and text.startswith("\ufeff"):
            text = text[1:]
        return text[:-2] if text.endswith("\r\n") else text.rstrip("\n")


def history_path() -> Path:
    state = os.environ.get("XDG_STATE_HOME")
    base = Path(state).expanduser() if state and os.path.isabs(os.path.expanduser(state)) \
        else Path.home() / ".local" / "state"
    return base / "cyllm" / "chat_history"


class TerminalInput(_Lines):
    """readline at a terminal: editing, history, bracketed paste, Ctrl-C handling."""

    def __init__(self):
        self._interrupted = False        # the previous key was a Ctrl-C at the prompt
        self.readline = None
        try:
            import readline
        except ImportError:              # a Python without readline: plain input() still works
            return
        self.readline = readline
        if "libedit" not in (readline.__doc__ or ""):
            readline.parse_and_bind("set enable-bracketed-paste on")
        readline.set_history_length(1000)
        try:
            readline.read_history_file(history_path())
        except (OSError, ValueError):
            pass

    def line(self, prompt: str) -> str | None:
        while True:
            try:
                text = input(prompt)
            except EOFError:
                print(file=sys.stderr)
                return None
            except UnicodeDecodeError:
                notice("that line is not valid UTF-8 text; type it again")
                continue
            except KeyboardInterrupt:
                typed = bool(self.readline.get_line_buffer()) if self.readline else False
                if self._interrupted or (not typed and prompt == "> "):
                    print(file=sys.stderr)
                    return None
                self._interrupted = True
                print("^C (Ctrl-C again or Ctrl-D to leave)", file=sys.stderr)
                prompt = "> "
                continue
            self._interrupted = False
            return text

    def read(self) -> str | None:
        try:
            return super().read()
        except KeyboardInterrupt:        # raised inside a continuation: drop the message
            return ""

    def close(self) -> None:
        if self.readline is None:
            return
        path = history_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.readline.write_history_file(path)
        except OSError:
            pass                         # a read-only home: no history, no error


# -- the conversation ----------------------------------------------------------------------
class ChatRepl:
    def __init__(self, model, chat, max_tokens: int, stop: list[str], verbose: bool, quiet: bool,
                 interactive: bool):
        self.model = model
        self.tok = model.tokenizer
        self.chat = chat
        self.max_tokens = max_tokens
        self.stop = stop
        self.verbose = verbose and not quiet
        self.quiet = quiet
        self.interactive = interactive
        self.totals = Totals()

    # -- context management
    def count(self, messages: list[dict]) -> int:
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True)
        return len(self.tok.encode(text, add_special_tokens=False))

    def reserve(self) -> int:
        """Room kept free for the answer when older turns are dropped."""
        return max(1, min(self.max_tokens, self.model.context // 4))

    def fit(self, messages: list[dict]) -> tuple[list[dict], int, int]:
        """Drop the oldest turns (never the system prompt, never the last message) until the
        conversation and room for an answer fit; returns (messages, dropped, tokens).

        Turns go in one order (the oldest first, a user message with the answer after it) and
        fewer messages never take more tokens, so the fewest drops that fit are found by
        bisection: a few renders of the template, not one per dropped turn (a /load of a few
        thousand messages rendered and tokenized the conversation thousands of times)."""
        msgs = list(messages)
        limit = self.model.context - self.reserve()
        n = self.count(msgs)
        if n <= limit:
            return msgs, 0, n
        first = 1 if msgs and msgs[0]["role"] == "system" else 0
        cuts = [0]                  # cuts[k]: messages gone after k turns are dropped
        while first + cuts[-1] < len(msgs) - 1:
            d = cuts[-1] + 1
            if first + d < len(msgs) - 1 and msgs[first + d]["role"] == "assistant":
                d += 1              # a turn is a user message and the answer to it
            cuts.append(d)

        def kept(k: int) -> list[dict]:
            return msgs[:first] + msgs[first + cuts[k]:]
        lo, hi, best = 1, len(cuts) - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            m = self.count(kept(mid))
            if m <= limit:
                best, hi = (mid, m), mid - 1
            else:
                lo = mid + 1
        if best is None:            # not even the last message alone fits: keep just it
            k = len(cuts) - 1
            best = (k, self.count(kept(k)) if k else n)
        k, m = best
        return kept(k), cuts[k], m

    def _system(self) -> str | None:
        m = self.chat.messages
        return m[0]["content"] if m and m[0]["role"] == "system" else None

    # -- one user turn
    def say(self, text: str) -> None:
        msgs, dropped, n = self.fit(self.chat.messages + [{"role": "user", "content": text}])
        if n > self.model.context:
            notice(f"this message does not fit: with the system prompt it takes {n} tokens of the "
                   f"{self.model.context} in the context (use a larger --context)")
            return
        if dropped:
            notice(f"context full: dropped the {dropped} oldest message{'s' if dropped != 1 else ''} "
                   "(the system prompt stays)")
        self.chat.messages = msgs[:-1]            # Chat.send appends the user message itself
        session = self.chat.session
        before = session.tokens
        pieces: list[str] = []
        gen = self.chat.send(text, max_tokens=self.max_tokens, stop=self.stop)
        interrupted = False
        try:
            for piece in gen:
                pieces.append(piece)
                write_out(piece)
        except KeyboardInterrupt:
            interrupted = True
            gen.close()
            if session.tokens is before:
                # stopped inside prefill: part of the cache beyond the old common prefix may
                # already hold the new text, so nothing in it can be trusted any more
                session.tokens = []
            if self.chat.messages and self.chat.messages[-1]["role"] == "user":
                if pieces:
                    self.chat.messages.append({"role": "assistant", "content": "".join(pieces)})
                else:
                    self.chat.messages.pop()       # nothing said yet: as if never asked
        write_out("\n")
        stats = self.chat.last_stats
        self.totals.add(stats)
        if interrupted:
            notice("answer stopped (Ctrl-C again at the prompt leaves)")
        elif stats is not None and stats.stop_reason == "context":
            notice("the answer was cut off: the context is full (the oldest turns are dropped "
                   "at your next message)")
        if self.verbose and stats is not None:
            print(stats.line(), file=sys.stderr)

    # -- commands
    def command(self, line: str) -> bool:
        """Run one /command; False means leave."""
        name, _, arg = line[1:].partition(" ")
        name, arg = name.lower().strip(), arg.strip()
        if name in ("exit", "quit", "bye"):
            return False
        if name in ("help", "?", "h"):
            print(HELP, file=sys.stderr)
        elif name in ("clear", "reset"):
            system = self._system()
            self.chat.messages = [{"role": "system", "content": system}] if system else []
            notice("conversation cleared" + (" (the system prompt stays)" if system else ""))
        elif name == "system":
            self._set_system(arg)
        elif name == "save":
            self._save(arg)
        elif name == "load":
            self._load(arg)
        else:
            from .argparsing import suggest
            known = ["/help", "/clear", "/reset", "/system", "/save", "/load", "/exit", "/quit"]
            notice(f"unknown command /{name}{suggest('/' + name, known)}; /help lists them "
                   "(//text sends a message that starts with /)")
        return True

    def _set_system(self, text: str) -> None:
        msgs = self.chat.messages
        if not text:
            current = self._system()
            notice(f"system prompt: {current}" if current else "no system prompt (/system TEXT sets one)")
            return
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {"role": "system", "content": text}
        else:
            msgs.insert(0, {"role": "system", "content": text})
        try:
            self.count(msgs)
        except CyllmError as e:
            del msgs[0]
            notice(f"the chat template does not accept a system prompt ({e})")
            return
        notice("system prompt set")

    def _save(self, arg: str) -> None:
        if not arg:
            notice("/save needs a file name")
            return
        path = Path(arg).expanduser()
        data = json.dumps({"messages": self.chat.messages}, ensure_ascii=False, indent=1)
        try:
            path.write_text(data + "\n", encoding="utf-8")
        except OSError as e:
            notice(f"cannot write {arg}: {e.strerror or e}")
            return
        notice(f"saved {len(self.chat.messages)} messages to {arg}")

    def _load(self, arg: str) -> None:
        if not arg:
            notice("/load needs a file name")
            return
        try:
            msgs = read_conversation(Path(arg).expanduser())
        except InvalidArgumentError as e:
            notice(str(e))
            return
        if not msgs:
            notice(f"{arg} holds no messages")
            return
        try:
            fitted, dropped, n = self.fit(msgs)
        except CyllmError as e:
            notice(f"cannot use {arg}: {e}")
            return
        self.chat.messages = fitted
        extra = f"; the {dropped} oldest were dropped to fit the context" if dropped else ""
        notice(f"loaded {len(msgs)} messages from {arg}{extra}")


def read_conversation(path: Path) -> list[dict]:
    """Messages from a /save file (or any JSON list of {"role", "content"}), checked."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONVERSATION_BYTES + 1)
    except OSError as e:
        raise InvalidArgumentError(f"cannot read {path}: {e.strerror or e}") from None
    if len(raw) > MAX_CONVERSATION_BYTES:
        raise InvalidArgumentError(f"{path} is larger than {MAX_CONVERSATION_BYTES >> 20} MiB")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise InvalidArgumentError(f"{path} is not a conversation saved by /save (not UTF-8 JSON)") from None
    if isinstance(data, dict):
        data = data.get("messages")
    if not isinstance(data, list):
        raise InvalidArgumentError(f"{path}: expected a list of messages")
    out = []
    for i, m in enumerate(data):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise InvalidArgumentError(f"{path}: message {i + 1} is not "
                                       "{\"role\": system|user|assistant, \"content\": text}")
        if m["role"] == "system" and i != 0:
            raise InvalidArgumentError(f"{path}: message {i + 1}: a system prompt must come first")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def run_chat(a) -> int:
    from ..generate import Chat

    system = check_text_arg(a.system, "the system prompt (-s)")
    stop = [check_text_arg(s, "a --stop text") for s in a.stop]
    interactive = stdin_is_tty()
    model = load_model(a)
    end = use_chat_template(model, a.chat_template)
    if end and end not in stop:
        stop.append(end)
    # render once now: a template that rejects this conversation's shape fails before any typing
    probe = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "hi"}]
    model.tokenizer.apply_chat_template(probe, add_generation_prompt=True)
    chat = Chat(model, system=system, **sampling_kwargs(a))
    repl = ChatRepl(model, chat, a.max_tokens, stop, a.verbose, a.no_stats, interactive)
    if interactive:
        inp: _Lines = TerminalInput()
        name = model.config.name or "the model"
        print(f"cyllm chat with {name} ({model.context} tokens of context). /help lists the commands; "
              "Ctrl-C stops an answer; Ctrl-D or /exit leaves.", file=sys.stderr)
    else:
        inp = PipeInput(getattr(sys.stdin, "buffer", None) if sys.stdin is not None else None)
    try:
        while True:
            try:
                text = inp.read()
            except KeyboardInterrupt:
                break
            if text is None:
                break
            if not text.strip():
                continue
            stripped = text.strip()
            if stripped.startswith("/") and not stripped.startswith("//"):
                if not repl.command(stripped):
                    break
                continue
            if stripped.startswith("//"):
                text = text.replace("/", "", 1)
            try:
                repl.say(text)
            except KeyboardInterrupt:          # before the answer began (templating the turn)
                if not interactive:
                    raise
                notice("stopped")
            except CyllmError as e:
                if not interactive:
                    raise
                notice(f"error: {e}")
                if chat.messages and chat.messages[-1]["role"] == "user":
                    chat.messages.pop()
    finally:
        inp.close()
        if not a.no_stats and repl.totals.answers:
            print(repl.totals.line(), file=sys.stderr)
    return 0


__all__ = ["run_chat", "ChatRepl", "read_conversation", "HELP", "Totals"]
