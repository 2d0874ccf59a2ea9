"""Chat templates: jinja2 as transformers runs it, bounded in time, size and depth.

A chat template comes from a file (tokenizer_config.json, chat_template.jinja,
a GGUF's metadata) or the command line, so it is hostile input. jinja2's
sandbox already blocks attribute escapes and mutation of lists and dicts; it
does not bound work. A template can loop 10^10 times (two nested
``range(100000)``), build a string of gigabytes (``"x" * 10**10``, a namespace
string doubled in a loop, ``lipsum(10**7)``), raise ``{{ 1/0 }}`` or recurse
without end. Here every such path is bounded:

- time: a deadline (``MAX_SECONDS``), checked on every loop iteration (each
  ``for`` iterates through a guard), every call, filter and output piece;
- size: sequence repetition, ``+``, ``~`` and ``%``, every call's and filter's
  result, block captures and the rendered prompt are held to ``MAX_CHARS``;
  integers to ``MAX_INT_BITS``; integer arguments of calls and filters (widths,
  counts) to ``MAX_INT_ARG``; ``lipsum`` is gone;
- depth: macro and recursive-loop recursion ends in RecursionError;

and every failure is one :class:`TokenizerError` line, its text escaped (a
template's own exception text cannot forge extra lines). Rendering settings
follow transformers (trim_blocks, lstrip_blocks, ``raise_exception``,
``strftime_now``, a ``tojson`` that keeps non-ASCII text), so a template gives
the same prompt here as there.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
import types
from datetime import datetime

from .errors import TokenizerError
from .oneline import one_line

MAX_TEMPLATE_CHARS = 1 << 20     # real templates: a few KB, tool-calling ones up to ~60 KB
MAX_CHARS = 1 << 24              # any string or list a template builds, and the prompt itself
MAX_INT_ARG = 1 << 16            # a width, count or padding passed to a call or filter
MAX_INT_BITS = 4096              # integers a template computes
MAX_SECONDS = 5.0                # real templates render in milliseconds

_state = threading.local()       # .deadline of the render running on this thread


class TemplateLimitError(Exception):
    """A template exceeded a bound (time, size, integer)."""


class TemplateRaised(Exception):
    """The template called raise_exception(message)."""


def _tick() -> None:
    deadline = getattr(_state, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise TemplateLimitError(f"chat template ran longer than {MAX_SECONDS:g} s")


def _size(value) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)) else 0


def _check_size(value, what: str = "a value"):
    n = _size(value)
    if n > MAX_CHARS:
        raise TemplateLimitError(f"chat template built {what} of {n} items (at most {MAX_CHARS})")
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        raise TemplateLimitError(f"chat template computed an integer of {value.bit_length()} bits "
                                 f"(at most {MAX_INT_BITS})")
    return value


def _check_int_args(what: str, args, kwargs) -> None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT_ARG:
            raise TemplateLimitError(f"chat template passed {_short_int(v)} to {what} (at most {MAX_INT_ARG})")


def _short_int(v: int) -> str:
    return str(v) if v.bit_length() < 64 else f"an integer of {v.bit_length()} bits"


# printf-style and str.format field widths/precisions: a huge one is a huge allocation
_PRINTF_WIDTH = re.compile(r"%[-+ #0]*(\*|\d+)?(?:\.(\*|\d+))?")
_FORMAT_SPEC = re.compile(r"\{[^{}]*:([^{}]*)(\{)?")


def _check_printf(fmt: str) -> None:
    for m in _PRINTF_WIDTH.finditer(fmt):
        for g in m.groups():
            if g == "*" or (g and (len(g) > 6 or int(g) > MAX_INT_ARG)):
                raise TemplateLimitError(f"chat template format width {g} is not allowed (at most {MAX_INT_ARG})")


def _check_format(fmt: str) -> None:
    for m in _FORMAT_SPEC.finditer(fmt):
        if m.group(2):
            raise TemplateLimitError("chat template format specs may not nest replacement fields")
        for digits in re.findall(r"\d+", m.group(1)):
            if len(digits) > 6 or int(digits) > MAX_INT_ARG:
                raise TemplateLimitError(f"chat template format width {digits} is not allowed "
                                         f"(at most {MAX_INT_ARG})")


def _replace_size(s: str, old: str, new: str, count=-1) -> int:
    n = len(s) + 1 if old == "" else s.count(old)
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * (len(new) - len(old))


def _items(iterable) -> list:
    """An iterable as a list (its size must be known before a join allocates)."""
    if isinstance(iterable, (list, tuple)):
        return iterable
    try:
        return list(loop_guard(iterable))
    except TypeError:          # not iterable: let the join itself raise its own error
        return iterable


def _join_size(sep: str, items) -> int:
    if not isinstance(items, (list, tuple)):
        return 0
    return len(sep) * max(0, len(items) - 1) + sum(len(str(x)) for x in items)


# -- what a template can call ---------------------------------------------------------

def loop_guard(iterable):
    """Every ``for`` of a template iterates through this: the deadline holds inside loops."""
    for item in iterable:
        _tick()
        yield item


def concat_guard(*parts) -> str:
    """The ``~`` operator, with its result size bounded."""
    _tick()
    strs = [str(p) for p in parts]
    total = sum(map(len, strs))
    if total > MAX_CHARS:
        raise TemplateLimitError(f"chat template built a string of {total} characters (at most {MAX_CHARS})")
    return "".join(strs)


def _bounded_concat(pieces) -> str:
    """environment.concat: joins block captures, macro bodies and the rendered output."""
    out, total = [], 0
    for p in pieces:
        _tick()
        total += len(p)
        if total > MAX_CHARS:
            raise TemplateLimitError(f"chat template output exceeds {MAX_CHARS} characters")
        out.append(p)
    return "".join(out)


def raise_exception(message):
    raise TemplateRaised(message)


def strftime_now(fmt):
    return datetime.now().strftime(str(fmt)[:256])


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers overrides jinja's tojson: no HTML escaping, non-ASCII kept
    if isinstance(indent, int) and not isinstance(indent, bool) and not 0 <= indent <= 64:
        raise TemplateLimitError(f"chat template tojson indent {_short_int(indent)} is not allowed (0..64)")
    if isinstance(indent, str) and len(indent) > 64:
        raise TemplateLimitError("chat template tojson indent string is longer than 64 characters")
    return _check_size(json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                  sort_keys=sort_keys), "a JSON string")


def _guard_filter(name: str, f):
    """A filter with its arguments bounded (widths, counts) and its result size checked."""
    from jinja2.utils import _PassArg
    skip = 2 if _PassArg.from_obj(f) is not None else 1      # (context,) value, then the arguments

    @functools.wraps(f)
    def guarded(*args, **kwargs):
        _tick()
        value, rest = (args[skip - 1] if len(args) >= skip else None), args[skip:]
        if name != "tojson":
            _check_int_args(f"the {name} filter", rest, kwargs)
        if name == "replace" and isinstance(value, str) and len(rest) >= 2:
            if _replace_size(value, str(rest[0]), str(rest[1]), rest[2] if len(rest) > 2 else -1) > MAX_CHARS:
                raise TemplateLimitError(f"chat template replace would exceed {MAX_CHARS} characters")
        elif name == "join" and value is not None and not isinstance(value, (str, dict)):
            value = _items(value)
            args = (*args[:skip - 1], value, *rest)
            sep = rest[0] if rest else kwargs.get("d", "")
            if _join_size(str(sep), value) > MAX_CHARS:
                raise TemplateLimitError(f"chat template join would exceed {MAX_CHARS} characters")
        elif name == "indent" and isinstance(value, str):
            width = rest[0] if rest else kwargs.get("width", 4)
            w = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
            if len(value) + w * (value.count("\n") + 1) > MAX_CHARS:
                raise TemplateLimitError(f"chat template indent would exceed {MAX_CHARS} characters")
        elif name == "wordwrap" and isinstance(value, str):
            wrap = rest[2] if len(rest) > 2 else kwargs.get("wrapstring")
            if isinstance(wrap, str) and len(value) * (1 + len(wrap)) > MAX_CHARS:
                raise TemplateLimitError(f"chat template wordwrap would exceed {MAX_CHARS} characters")
        elif name == "format" and isinstance(value, str):
            _check_printf(value)
        return _check_size(f(*args, **kwargs), f"a value (filter {name})")

    return guarded


def _make_environment():
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for
        # training masks in transformers; for inference it renders its body
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context, operator, left, right):
            _tick()
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if _size(seq) and isinstance(n, int) and not isinstance(n, bool):
                        if _size(seq) * max(n, 0) > MAX_CHARS:
                            raise TemplateLimitError(f"chat template repeats a sequence of {_size(seq)} "
                                                     f"items {_short_int(n)} times (at most {MAX_CHARS} items)")
                if _is_int(left) and _is_int(right) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                    raise TemplateLimitError(f"chat template integers exceed {MAX_INT_BITS} bits")
            elif operator == "**":
                if _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
                    if right > MAX_INT_BITS or left.bit_length() * right > MAX_INT_BITS:
                        raise TemplateLimitError(f"chat template integers exceed {MAX_INT_BITS} bits")
            elif operator == "+":
                if _size(left) + _size(right) > MAX_CHARS:
                    raise TemplateLimitError(f"chat template built a value of more than {MAX_CHARS} items")
            elif operator == "%" and isinstance(left, str):
                _check_printf(left)
            return _check_size(super().call_binop(context, operator, left, right))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
            _tick()
            owner = getattr(__obj, "__self__", None)
            if isinstance(__obj, (types.BuiltinMethodType, types.MethodType)) and isinstance(
                    owner, (str, list, tuple, dict)):
                name = __obj.__name__
                _check_int_args(f"{type(owner).__name__}.{name}", args, kwargs)
                if name == "replace" and isinstance(owner, str) and len(args) >= 2:
                    if _replace_size(owner, str(args[0]), str(args[1]), args[2] if len(args) > 2 else -1) > MAX_CHARS:
                        raise TemplateLimitError(f"chat template replace would exceed {MAX_CHARS} characters")
                elif name == "join" and isinstance(owner, str) and len(args) == 1 and not isinstance(args[0], str):
                    args = (_items(args[0]),)
                    if _join_size(owner, args[0]) > MAX_CHARS:
                        raise TemplateLimitError(f"chat template join would exceed {MAX_CHARS} characters")
                elif name == "expandtabs" and isinstance(owner, str):
                    tab = args[0] if args else kwargs.get("tabsize", 8)
                    if isinstance(tab, int) and len(owner) * max(tab, 1) > MAX_CHARS:
                        raise TemplateLimitError(f"chat template expandtabs would exceed {MAX_CHARS} characters")
            return _check_size(super().call(__context, __obj, *args, **kwargs))

        def wrap_str_format(self, value):
            wrapped = super().wrap_str_format(value)
            if wrapped is not None:
                _check_format(value.__self__)
            return wrapped

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.concat = _bounded_concat
    env.globals.pop("lipsum", None)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.filters["tojson"] = tojson
    env.filters = {name: _guard_filter(name, f) for name, f in env.filters.items()}
    return env, jinja2


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


_ENV = None
_ENV_LOCK = threading.Lock()


def _environment():
    global _ENV
    with _ENV_LOCK:
        if _ENV is None:
            _ENV = _make_environment()
        return _ENV


def _guard_ast(tree, jinja2):
    """Route every ``for`` through loop_guard and every ``~`` through concat_guard."""
    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    def call(name, args, lineno):
        return nodes.Call(nodes.ImportedName(f"{__name__}.{name}", lineno=lineno), args, [], None, None,
                          lineno=lineno)

    class Guard(NodeTransformer):
        def visit_For(self, node):
            self.generic_visit(node)
            node.iter = call("loop_guard", [node.iter], node.lineno)
            return node

        def visit_Concat(self, node):
            self.generic_visit(node)
            return call("concat_guard", list(node.nodes), node.lineno)

    return Guard().visit(tree)


class ChatTemplate:
    """A compiled chat template; ``render(**variables)`` gives the prompt or one TokenizerError line."""

    def __init__(self, source: str):
        if not isinstance(source, str):
            raise TokenizerError(f"a chat template must be text, got {type(source).__name__}")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise TokenizerError(f"chat template of {len(source)} characters is beyond any real one "
                                 f"(at most {MAX_TEMPLATE_CHARS})")
        env, jinja2 = _environment()
        self.source = source
        try:
            tree = _guard_ast(env.parse(source), jinja2)
            self._template = env.from_string(tree)
        except jinja2.TemplateSyntaxError as e:
            raise TokenizerError(f"chat template does not compile: {one_line(e.message, 300)} "
                                 f"(line {e.lineno})") from None
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template does not compile: {one_line(e, 300)}") from None
        except RecursionError:
            raise TokenizerError("chat template does not compile: it nests too deeply") from None
        except MemoryError:
            raise TokenizerError("chat template does not compile: out of memory") from None

    def render(self, **variables) -> str:
        env, jinja2 = _environment()
        outer = getattr(_state, "deadline", None)
        _state.deadline = time.monotonic() + MAX_SECONDS if outer is None else outer
        try:
            return _bounded_concat(self._template.generate(**variables))
        except TemplateRaised as e:
            raise TokenizerError(f"chat template error: {one_line(e, 500)}") from None
        except TemplateLimitError as e:
            raise TokenizerError(one_line(e, 300)) from None
        except RecursionError:
            raise TokenizerError("chat template recursed too deeply") from None
        except MemoryError:
            raise TokenizerError("chat template ran out of memory") from None
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template failed to render: {one_line(e, 300)}") from None
        except Exception as e:  # noqa: BLE001 - a template can raise anything ({{ 1/0 }}, int('x'), ...)
            raise TokenizerError(f"chat template failed to render ({type(e).__name__}: "
                                 f"{one_line(e, 300)})") from None
        finally:
            _state.deadline = outer
