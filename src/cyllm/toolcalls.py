"""OpenAI tool calling: the request's tools go to the model's chat template, and the calls
the model writes come back as ``tool_calls``.

A model calls a tool in the format its chat template teaches it; the template's text
tells which (checked against the real templates of llama.cpp's tests):

- "hermes": ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, a block a call
  (Qwen2.5, Qwen3, QwQ, Hermes 2 Pro/3);
- "mistral": ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral Nemo), or
  ``[TOOL_CALLS]name[ARGS]{...}`` a call, with ``[CALL_ID]id`` before ``[ARGS]`` where the
  template writes one (Mistral Small 3.2, Devstral, Ministral 3);
- "llama3": the answer one object ``{"name": ..., "parameters": {...}}`` (or several,
  separated by ';'), after ``<|python_tag|>`` where the model writes one (Llama 3.1-3.3);
- "granite": ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]``, the list after the
  control token (Granite 3.x); earlier calls go back into their assistant turns in the same
  syntax where the template renders only a turn's content;
- "generic": a template that does not mention tools at all (Gemma 3, Phi-3.5, SmolLM2,
  DeepSeek's R1 distills): the tools and the answer's shape are described in a system
  message, and a grammar makes the answer one JSON object, ``{"tool_call": {"name": ...,
  "arguments": {...}}}`` or ``{"response": "..."}`` (what llama.cpp's server does for such
  templates); earlier calls and results go back in the same JSON.

A template that mentions tools in a syntax this module does not read (Qwen3-Coder's XML
calls, GLM's, Command R's) takes none: such a request is refused, not answered as if the
tools were not there. ``tool_choice`` "required" or one named function is enforced by a grammar
(llguidance, as response_format is); Mistral's calls start with its [TOOL_CALLS] control
token, which the grammar names by id. Text of a reasoning block (``<think>...</think>``)
is never a call. A call that does not parse (bad JSON, a function the request did not
offer) stays content, as llama.cpp's server leaves it.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass

from .errors import InvalidArgumentError
from .grammar import JSON_OPTIONS
from .jsonio import short

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")     # OpenAI's rule for function names
_ID_CHARS = string.ascii_letters + string.digits
# where a call starts in the output, per format (the hold-back of streamed content)
MARKERS = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",), "llama3": ("<|python_tag|>",),
           "granite": ("<|tool_call|>",)}
# call syntaxes this module does not read: a template that teaches one takes no tools
_UNREAD = ("<function=", "<arg_key>", "<tool_calls>", "<invoke ")
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


@dataclass
class ToolRequest:
    tools: list[dict]           # as the template gets them: {"type": "function", "function": {...}}
    choice: str                 # "auto", "required", or the one function's name
    format: str                 # "hermes" | "mistral" | "llama3" | "granite" | "generic"
    parallel: bool = True       # parallel_tool_calls: False keeps the first call only
    args_form: bool = False     # mistral: name[ARGS]{...} calls (else one JSON list)

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}


def tool_format(template: str | None) -> str | None:
    """The call format a chat template teaches, "generic" where it knows nothing of tools,
    or None (it teaches one this module does not read)."""
    if not template or any(m in template for m in _UNREAD):
        return None
    if "tools" not in template:
        return "generic"
    if "<|tool_call|>" in template:
        return "granite"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if '"parameters"' in template and "<|start_header_id|>" in template:
        return "llama3"
    return None


def check_tools(tools, tool_choice, template: str | None, parallel=None) -> ToolRequest | None:
    """The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` checked; None when
    no tool may be called."""
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidArgumentError(f"parallel_tool_calls must be true or false, got {short(parallel)}")
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidArgumentError(f"tool_choice={short(tool_choice)} needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidArgumentError(f"tools must be a list of at most {MAX_TOOLS} functions")
    seen, given = set(), []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise InvalidArgumentError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidArgumentError(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', "
                                       f"got {short(name)}")
        if name in seen:
            raise InvalidArgumentError(f"tools[{i}]: a second function named {name!r}")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not (isinstance(params, dict) and params.get("type", "object") == "object"):
            raise InvalidArgumentError(f"tools[{i}].function.parameters must be a JSON schema of an object")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise InvalidArgumentError(f"tools[{i}].function.description must be a string")
        # the fields templates read without checking (Hermes' fail on a tool without them)
        full = dict(fn, description=fn.get("description") or "",
                    parameters=params if params is not None else {"type": "object", "properties": {}})
        given.append(dict(t, function=full))
    if tool_choice is None:
        choice = "auto"
    elif tool_choice in ("none", "auto", "required"):
        choice = tool_choice
    elif (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
          and isinstance(tool_choice.get("function"), dict)):
        choice = tool_choice["function"].get("name")
        if not isinstance(choice, str) or choice not in seen:
            raise InvalidArgumentError(f"tool_choice names {short(choice)}, which is not among the tools")
    else:
        raise InvalidArgumentError("tool_choice must be 'none', 'auto', 'required' or "
                                   "{'type': 'function', 'function': {'name': ...}}")
    if choice == "none":
        return None
    fmt = tool_format(template)
    if not template:
        raise InvalidArgumentError("this model has no chat template: tools need one")
    if fmt is None:
        raise InvalidArgumentError("this model's chat template teaches a tool-call format that cyllm does "
                                   "not read (it reads <tool_call> blocks, Mistral's [TOOL_CALLS], Llama "
                                   "3's JSON calls and Granite's <|tool_call|> lists): tools cannot be used "
                                   "with it")
    return ToolRequest(tools=given, choice=choice, format=fmt, parallel=parallel is not False,
                       args_form=fmt == "mistral" and "[ARGS]" in template)


def tool_grammar(req: ToolRequest, token_id) -> str | None:
    """llguidance (Lark) grammar that makes the answer one call of the allowed functions
    (tool_choice "required" or a name), or in the generic format one JSON answer; None for
    "auto" in the others. ``token_id(text)``: the id of a special token (Mistral's
    [TOOL_CALLS], Granite's <|tool_call|>), or None."""
    if req.choice == "auto" and req.format != "generic":
        return None
    key = "parameters" if req.format == "llama3" else "arguments"
    rules = []
    for t in req.tools:
        fn = t["function"]
        if req.choice not in ("auto", "required") and fn["name"] != req.choice:
            continue
        # each schema stays the root of its own %json, so its "#/$defs/..." references resolve
        # "type": "object" said again: a schema without one would let any JSON value through
        schema = dict(fn["parameters"], type="object", **{"x-guidance": JSON_OPTIONS})
        args = f"a{len(rules)}: %json {json.dumps(schema)}"
        if req.args_form:
            head = json.dumps(fn["name"] + "[ARGS]")
            rules.append((f"{head} a{len(rules)}", args))
        else:
            head = json.dumps('{"name": ' + json.dumps(fn["name"]) + f', "{key}": ')
            rules.append((f'{head} a{len(rules)} "}}"', args))
    lines = ["call: " + " | ".join(f"c{i}" for i in range(len(rules)))]
    for i, (body, args) in enumerate(rules):
        lines += [f"c{i}: {body}", args]
    if req.format == "hermes":
        start = r'start: "<tool_call>\n" call "\n</tool_call>"'
    elif req.format == "llama3":
        start = "start: call"
    elif req.format == "generic":
        start = 'start: "{\\"tool_call\\": " call "}"'
        if req.choice == "auto":
            # spelled out as the call is: a bare %json object beside it is never taken (llguidance 1.9)
            text = {"type": "string", "x-guidance": JSON_OPTIONS}
            start += f' | "{{\\"response\\": " answer "}}"\nanswer: %json {json.dumps(text)}'
    else:       # mistral, granite: the calls after a control token, which the model writes as one
        marker = MARKERS[req.format][0]
        tid = token_id(marker)
        if tid is None:
            raise InvalidArgumentError(f"tool_choice cannot be enforced: the vocabulary has no {marker} token")
        start = f"start: <[{int(tid)}]> call" if req.args_form else f'start: <[{int(tid)}]> "[" call "]"'
    return "\n".join([start] + lines) + "\n"


def generic_history(messages: list[dict]) -> list[dict]:
    """A conversation through tools for a template that knows only user and assistant turns:
    each call becomes the JSON the model answers in (after the turn's text, if any), and the
    results that follow a turn become one user turn of {"tool_response": ...} objects, each
    named by its call's function and id."""
    names = {}
    out: list[dict] = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = _plain_calls(m)
            names.update((c["id"], c["function"]["name"]) for c in m["tool_calls"] if isinstance(c.get("id"), str))
            body = json.dumps({"tool_call": calls[0]} if len(calls) == 1 else {"tool_calls": calls}, ensure_ascii=False)
            m = {"role": "assistant", "content": f"{m['content']}\n{body}" if m.get("content") else body}
        elif m.get("role") == "tool":
            cid = m.get("tool_call_id")
            name = names.get(cid, m.get("name")) if isinstance(cid, str) else m.get("name")
            result = json.dumps({"tool_response": {"name": name, "id": cid, "content": m.get("content")}},
                                ensure_ascii=False, default=str)      # an id from Python may be anything
            if out and out[-1].get("tool_results"):
                out[-1] = dict(out[-1], content=out[-1]["content"] + "\n" + result)
                continue
            m = {"role": "user", "content": result, "tool_results": True}
        out.append(m)
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


def generic_messages(req: ToolRequest, messages: list[dict], system_role: bool = True) -> list[dict]:
    """The conversation for a template that knows nothing of tools: the tools and the answer's
    shape in the system message (or, where the template takes none, at the head of the first
    user turn), earlier calls and results as generic_history writes them."""
    shape = '{"tool_call": {"name": <one of the tools>, "arguments": <an object of its parameters>}}'
    if req.choice == "auto":
        shape += ' to call a tool, or {"response": <your answer>} to answer without one'
    tools = json.dumps([t["function"] for t in req.tools], ensure_ascii=False)
    guide = (f"You have these tools (each with a JSON schema of its parameters):\n{tools}\n\n"
             f"Reply with one JSON object only: {shape}.")
    out = generic_history(messages)
    first = out[0] if out else {}
    if first.get("role") == "system":
        out[0] = dict(first, content=f"{first['content']}\n\n{guide}" if first["content"] else guide)
    else:
        out.insert(0, {"role": "system", "content": guide})
    if not system_role:             # the system turn folded into the first user one
        sys_text = out.pop(0)["content"]
        k = next((i for i, m in enumerate(out) if m.get("role") == "user"), None)
        if k is None:
            out.insert(0, {"role": "user", "content": sys_text})
        else:
            out[k] = dict(out[k], content=f"{sys_text}\n\n{out[k]['content']}")
    return out


def calls_in_content(messages: list[dict], fmt: str | None, template: str) -> list[dict]:
    """The conversation with each earlier call written into its assistant turn as the model
    writes it (Granite's ``<|tool_call|>[...]`` after the turn's text), where the format is
    one of a marker and a list and the template renders only a turn's content (Granite 3.3's
    drops tool_calls); otherwise as it is."""
    if fmt != "granite" or "tool_calls" in template:
        return messages
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            body = MARKERS[fmt][0] + json.dumps(_plain_calls(m), ensure_ascii=False)
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = (m.get("content") or "") + body
        out.append(m)
    return out


def _plain_calls(message: dict) -> list[dict]:
    """An assistant turn's calls as the models write them: [{"name", "arguments"}]."""
    return [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in message["tool_calls"]]


def _search_from(text: str) -> int:
    """Where calls may be looked for: after a closed reasoning block; nowhere inside an open one."""
    close = text.rfind(_THINK_CLOSE)
    if close >= 0:
        return close + len(_THINK_CLOSE)
    return len(text) if _THINK_OPEN in text else 0


def call_start(req: ToolRequest, text: str) -> int:
    """Where a call may begin in ``text`` (the output so far): the first marker, or a
    trailing part of one still being written; len(text) if none. The llama3 format's
    bare object counts from the start of an answer (or of what follows its reasoning)
    that opens with '{'."""
    if req.format == "generic":
        return 0                 # the whole answer is one JSON object: content or a call
    base = _search_from(text)
    rest = text[base:]
    if req.format == "llama3" and rest.lstrip().startswith("{"):
        return base + len(rest) - len(rest.lstrip())
    best = len(text)
    for m in MARKERS[req.format]:
        i = rest.find(m)
        if i >= 0:
            best = min(best, base + i)
            continue
        for k in range(min(len(m) - 1, len(rest)), 0, -1):      # text ends with m[:k]
            if rest.endswith(m[:k]):
                best = min(best, len(text) - k)
                break
    return best


def parse_calls(req: ToolRequest, text: str) -> tuple[str, list[dict]]:
    """(content, calls) of a whole answer; calls: [{"name", "arguments" (a JSON string)}].
    Text that does not parse as calls of the offered functions is content."""
    start = call_start(req, text)
    head, tail = text[:start], text[start:]
    try:
        if req.format == "generic":
            return _generic(text, req.names)
        if req.format == "hermes":
            other, calls = _hermes(tail, req.names)
        else:
            other, calls = "", {"mistral": _mistral, "llama3": _llama3, "granite": _granite}[req.format](tail)
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        # RecursionError: JSON nested past what Python's decoder recurses into
        return text, []
    if not calls or any(c["name"] not in req.names for c in calls):
        return text, []
    return head + other, calls if req.parallel else calls[:1]


class CallScan:
    """Streamed content of an answer that may call tools: text goes out until a call may
    start (call_start); the rest waits for the end, when it is parsed. In the
    generic format (one JSON object) a plain answer's string streams as it is decoded."""

    def __init__(self, req: ToolRequest):
        self._req = req
        self._text = ""
        self._released = 0          # characters of the content already out
        self._answer = ResponseStream() if req.format == "generic" else None

    def push(self, piece: str) -> str:
        self._text += piece
        if self._answer is not None:
            out = self._answer.new_text(self._text)
            self._released += len(out)
            return out
        cut = max(call_start(self._req, self._text), self._released)
        out = self._text[self._released:cut]
        self._released = cut
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(content not yet released, calls)."""
        content, calls = parse_calls(self._req, self._text)
        return content[self._released:], calls


def new_call_id() -> str:
    """A call id: 9 letters and digits (Mistral's templates refuse any other shape)."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


def history_arguments(messages: list[dict]) -> list[dict]:
    """The conversation with earlier calls checked (OpenAI's shape: a list of {"id", "type",
    "function": {"name", "arguments"}}) and their arguments as objects: OpenAI clients send
    them as JSON text, and templates that write them with tojson (Llama 3, Mistral) would
    quote that text again; llama.cpp's server turns them into objects the same way."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list) or m.get("role") != "assistant":
                raise InvalidArgumentError(f"messages[{i}].tool_calls must be a list, in an assistant message")
            fixed = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                        and isinstance(fn.get("arguments", "{}"), (str, dict))):
                    raise InvalidArgumentError(f"messages[{i}].tool_calls[{j}] must be {{'id': ..., 'type': "
                                               "'function', 'function': {'name': ..., 'arguments': ...}}")
                args = fn.get("arguments", "{}")
                if isinstance(args, str):
                    try:
                        parsed = json.loads(args)
                    except (ValueError, RecursionError):     # nested past the decoder's depth
                        parsed = None
                    args = parsed if isinstance(parsed, dict) else args
                fixed.append(dict(c, function=dict(fn, arguments=args)))
            m = dict(m, tool_calls=fixed)
        out.append(m)
    return out


def _text(s: str) -> str:
    """``s`` without lone surrogates: a model may write an escape like \\ud800 in its JSON,
    which json.loads keeps and no response can encode (each becomes U+FFFD)."""
    return s.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


def _call(obj, key: str = "arguments") -> dict:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a call")
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        args = json.loads(args)          # arguments written as JSON text: it must hold an object
    if not isinstance(args, dict):
        raise ValueError("arguments must be an object")
    return {"name": obj["name"], "arguments": _text(json.dumps(args, ensure_ascii=False))}


def _hermes(tail: str, names: set[str]) -> tuple[str, list[dict]]:
    """(text outside the calls, calls): a block that does not parse as a call of an offered
    function stays text."""
    other, calls = [], []
    for k, block in enumerate(tail.split("<tool_call>")):
        if k == 0:
            other.append(block)
            continue
        body, _, rest = block.partition("</tool_call>")
        try:
            call = _call(json.loads(body))
        except (ValueError, TypeError, RecursionError):
            call = None
        if call is None or call["name"] not in names:
            other.append("<tool_call>" + block)
            continue
        calls.append(call)
        other.append(rest)
    text = "".join(other)
    return (text if text.strip() else ""), calls


_RESPONSE = '{"response": "'      # how the grammar (JSON_OPTIONS' layout) opens a plain answer


_STRING_STOP = re.compile(r'["\\]')


def _string_end(body: str, i: int) -> int:
    """From boundary i of a JSON string's body (between characters and escapes), the last
    boundary the text so far reaches: before the closing quote, an escape cut at the end, or
    half of a surrogate pair."""
    while True:
        m = _STRING_STOP.search(body, i)
        if m is None:
            return len(body)
        i = m.start()
        if body[i] == '"':
            return i
        n = 2 if body[i + 1:i + 2] != "u" else 6        # \uXXXX
        if n == 6 and body[i + 2:i + 4].lower() in ("d8", "d9", "da", "db"):
            # a high surrogate waits for its low half where an escape follows it (a lone
            # one is kept whole: the text after it is no part of it)
            if i + 8 > len(body):
                return i
            if body[i + 6:i + 8] == "\\u":
                n = 12
        if i + n > len(body):
            return i
        i += n


def response_so_far(text: str) -> str | None:
    """The generic format's plain answer as far as it is written, or None where the output
    is not such an answer."""
    if not text.startswith(_RESPONSE):
        return None if not _RESPONSE.startswith(text) else ""
    body = text[len(_RESPONSE):]
    try:
        return _text(json.loads('"' + body[:_string_end(body, 0)] + '"'))
    except ValueError:
        return None


class ResponseStream:
    """The generic format's plain answer decoded as it is written: each call decodes only
    what the last one left (a streamed answer of n characters costs O(n), not O(n^2))."""

    def __init__(self):
        self._done = 0              # characters of the string's body decoded so far

    def new_text(self, text: str) -> str:
        """The answer's characters that ``text`` (the output so far) adds."""
        if not text.startswith(_RESPONSE):
            return ""
        body = text[len(_RESPONSE):]
        end = _string_end(body, self._done)
        if end <= self._done:
            return ""
        try:
            piece = _text(json.loads('"' + body[self._done:end] + '"'))
        except ValueError:          # no valid string: nothing streams, the end's parse decides
            return ""
        self._done = end
        return piece


def _generic(text: str, names: set[str]) -> tuple[str, list[dict]]:
    try:
        obj = json.loads(text)
    except ValueError:
        partial = response_so_far(text)         # an answer cut by the token limit: what it said
        if partial is None:
            raise
        return partial, []
    if isinstance(obj, dict) and isinstance(obj.get("response"), str) and len(obj) == 1:
        return _text(obj["response"]), []
    call = _call(obj["tool_call"])
    return ("", [call]) if call["name"] in names else (text, [])


def _json_calls(text: str) -> list[dict]:
    """The calls of one JSON list of them (or of one call object), the whole of ``text``."""
    obj = json.loads(text)
    return [_call(o) for o in (obj if isinstance(obj, list) else [obj])]


def _granite(tail: str) -> list[dict]:
    return [c for part in tail.split(MARKERS["granite"][0])[1:] for c in _json_calls(part)]


def _mistral(tail: str) -> list[dict]:
    calls = []
    for part in tail.split("[TOOL_CALLS]")[1:]:
        part = part.strip()
        if part.startswith("["):
            calls.extend(_json_calls(part))
        else:
            name, sep, args = part.partition("[ARGS]")
            if not sep:
                raise ValueError("no [ARGS]")
            name = name.partition("[CALL_ID]")[0]
            calls.append(_call({"name": name.strip(), "arguments": json.loads(args)}))
    return calls


def _llama3(tail: str) -> list[dict]:
    body = tail.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):]
    dec, calls, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
        if i == len(body):
            break
        obj, i = dec.raw_decode(body, i)
        calls.extend(_call(o, "parameters") for o in (obj if isinstance(obj, list) else [obj]))
    return calls
