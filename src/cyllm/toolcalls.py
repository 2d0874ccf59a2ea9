"""OpenAI tool calling: the request's tools go to the model's chat template, and the calls
the model writes come back as ``tool_calls``.

A model calls a tool in the format its chat template teaches it; the template's text
tells which (checked against the real templates of llama.cpp's tests):

- "hermes": ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, a block a call
  (Qwen2.5, Qwen3, Hermes 2/3);
- "mistral": ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral Nemo), or
  ``[TOOL_CALLS]name[ARGS]{...}`` a call (Mistral Small 3.2, Devstral);
- "llama3": the whole answer one object ``{"name": ..., "parameters": {...}}``, after
  ``<|python_tag|>`` where the model writes one (Llama 3.1-3.3).

A template that names none of these takes no tools: such a request is refused, not
answered as if the tools were not there. ``tool_choice`` "required" or one named function
is enforced by a grammar (llguidance, as response_format is) for the hermes and llama3
formats, whose calls are plain text; Mistral's start with a control token the grammar
engine cannot write. Output that looks like a call but does not parse as one (bad JSON,
a function the request did not offer) stays content, as llama.cpp's server leaves it.
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
MARKERS = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",), "llama3": ("<|python_tag|>",)}


@dataclass
class ToolRequest:
    tools: list[dict]           # as the request gave them: {"type": "function", "function": {...}}
    choice: str                 # "auto", "required", or the one function's name
    format: str                 # "hermes" | "mistral" | "llama3"

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}


def tool_format(template: str | None) -> str | None:
    """The call format a chat template teaches, or None (it takes no tools)."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if '"parameters"' in template:
        return "llama3"
    return None


def check_tools(tools, tool_choice, template: str | None) -> ToolRequest | None:
    """The request's ``tools`` and ``tool_choice`` checked; None when no tool may be called."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidArgumentError(f"tool_choice={short(tool_choice)} needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidArgumentError(f"tools must be a list of at most {MAX_TOOLS} functions")
    seen = set()
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
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise InvalidArgumentError(f"tools[{i}].function.parameters must be a JSON schema object")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise InvalidArgumentError(f"tools[{i}].function.description must be a string")
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
    if fmt is None:
        raise InvalidArgumentError("this model's chat template has no tool-call format (it does not "
                                   "describe tools to the model): tools cannot be used with it")
    if choice != "auto" and fmt == "mistral":
        raise InvalidArgumentError(f"tool_choice={short(tool_choice)} cannot be enforced for this model's "
                                   "tool calls (they start with a control token); use 'auto'")
    return ToolRequest(tools=tools, choice=choice, format=fmt)


def tool_grammar(req: ToolRequest) -> str | None:
    """llguidance (Lark) grammar that makes the answer one call of the allowed functions
    (tool_choice "required" or a name); None for "auto"."""
    if req.choice == "auto":
        return None
    key = "parameters" if req.format == "llama3" else "arguments"
    calls = []
    for t in req.tools:
        fn = t["function"]
        if req.choice != "required" and fn["name"] != req.choice:
            continue
        params = fn.get("parameters") or {"type": "object"}
        calls.append({"type": "object", "properties": {"name": {"const": fn["name"]}, key: params},
                      "required": ["name", key], "additionalProperties": False})
    schema = dict(calls[0]) if len(calls) == 1 else {"anyOf": calls}
    schema["x-guidance"] = JSON_OPTIONS
    body = f"%json {json.dumps(schema)}"
    if req.format == "hermes":
        return f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: {body}\n'
    return f"start: {body}\n"


def call_start(req: ToolRequest, text: str) -> int:
    """Where a call may begin in ``text`` (the output so far): the first marker, or a
    trailing part of one still being written; len(text) if none. The llama3 format's
    bare object counts from the start of an answer that opens with '{'."""
    if req.format == "llama3" and text.lstrip().startswith("{"):
        return len(text) - len(text.lstrip())
    best = len(text)
    for m in MARKERS[req.format]:
        i = text.find(m)
        if i >= 0:
            best = min(best, i)
            continue
        for k in range(min(len(m) - 1, len(text)), 0, -1):      # text ends with m[:k]
            if text.endswith(m[:k]):
                best = min(best, len(text) - k)
                break
    return best


def parse_calls(req: ToolRequest, text: str) -> tuple[str, list[dict]]:
    """(content, calls) of a whole answer; calls: [{"name", "arguments" (a JSON string)}].
    An answer whose calls do not all parse is all content."""
    start = call_start(req, text)
    head, tail = text[:start], text[start:]
    try:
        calls = {"hermes": _hermes, "mistral": _mistral, "llama3": _llama3}[req.format](tail)
    except (ValueError, TypeError, KeyError, AttributeError):
        return text, []
    if not calls or any(c["name"] not in req.names for c in calls):
        return text, []
    return head, calls


def new_call_id() -> str:
    """A call id: 9 letters and digits (Mistral's templates refuse any other shape)."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


def _call(obj, key: str = "arguments") -> dict:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a call")
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        json.loads(args)                 # a JSON string already: it must hold JSON
        return {"name": obj["name"], "arguments": args}
    if not isinstance(args, dict):
        raise ValueError("arguments must be an object")
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def _hermes(tail: str) -> list[dict]:
    calls = []
    for block in tail.split("<tool_call>")[1:]:
        body, closed, rest = block.partition("</tool_call>")
        if closed and rest.strip():
            raise ValueError("text after a call")
        calls.append(_call(json.loads(body)))
    return calls


def _mistral(tail: str) -> list[dict]:
    calls = []
    for part in tail.split("[TOOL_CALLS]")[1:]:
        part = part.strip()
        if part.startswith("["):
            objs = json.loads(part)
            if not isinstance(objs, list):
                raise ValueError("not a list of calls")
            calls.extend(_call(o) for o in objs)
        else:
            name, sep, args = part.partition("[ARGS]")
            if not sep:
                raise ValueError("no [ARGS]")
            calls.append(_call({"name": name.strip(), "arguments": json.loads(args)}))
    return calls


def _llama3(tail: str) -> list[dict]:
    body = tail.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    obj = json.loads(body)
    objs = obj if isinstance(obj, list) else [obj]
    return [_call(o, "parameters") for o in objs]
