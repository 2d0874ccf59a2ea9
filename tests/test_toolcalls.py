"""OpenAI tool calling (cyllm/toolcalls.py, completions.py).

References: transformers' apply_chat_template(tools=...) renders the prompt of real chat
templates (llama.cpp's test copies of Qwen2.5's, Qwen3's, Llama 3.2's, Mistral Nemo's,
Hermes 3's and Granite 3.3's); the official `openai` client reads the answers, streamed and whole, from the
HTTP server; `jsonschema` checks each call's arguments against the tool's parameters. The
models are the tiny random ones of the family tests, so a call only comes out whole where
tool_choice forces it (a grammar); the formats' parsing is checked on written answers.
"""

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp_tools import family_material, llamacpp_template, or_skip  # noqa: E402,F401

import cyllm  # noqa: E402
from cyllm.errors import CyllmError, InvalidArgumentError  # noqa: E402
from cyllm.toolcalls import (CallScan, ToolRequest, calls_in_content, check_tools, generic_history,  # noqa: E402
                             generic_messages, history_arguments, parse_calls, tool_format, tool_grammar)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "a + b",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                   "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                  "b": {"type": "integer", "minimum": 0, "maximum": 9}}}}}
# parameters as pydantic (and openai.pydantic_function_tool) write them: "#/$defs/..." references
WHERE = {"type": "function", "function": {
    "name": "where", "description": "where a city is",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "$defs": {"City": {"type": "string", "enum": ["Paris", "Lima"]}},
                   "properties": {"city": {"$ref": "#/$defs/City"}}}}}
TOOLS = [WEATHER, ADD]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# a conversation that went through one call (ids of 9 letters and digits: Mistral's rule)
HISTORY = QUESTION + [
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a1b2c3d4e", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "a1b2c3d4e", "name": "get_weather", "content": "sunny, 21 C"}]

# (template, tiny model kind whose tokenizer renders it, call format)
TEMPLATES = [("Qwen-Qwen2.5-7B-Instruct", "qwen2", "hermes"), ("Qwen-Qwen3-0.6B", "qwen3", "hermes"),
             ("meta-llama-Llama-3.2-3B-Instruct", "llama32", "llama3"),
             ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "llama32", "hermes"),
             ("mistralai-Mistral-Nemo-Instruct-2407", "mistral_swa", "mistral"),
             ("ibm-granite-granite-3.3-2B-Instruct", "granite", "granite")]


def _template(name):
    return or_skip(llamacpp_template, name)


@pytest.fixture(scope="module")
def models(family_material):
    """kind -> a loaded tiny model (its template replaced per test)."""
    cache = {}

    def get(kind, template):
        if kind not in cache:
            cache[kind] = cyllm.load(family_material.hf_dir(kind), backend="numpy", context=4096)
        cache[kind].tokenizer.chat_template = template
        return cache[kind]
    return get


@pytest.mark.parametrize("name,kind,fmt", TEMPLATES)
def test_tools_render_as_transformers_renders_them(family_material, models, name, kind, fmt):
    """The prompt of a request with tools, and of a conversation that went through a call, is
    the one transformers renders from the same template; each template's format is detected.
    Granite 3.3's template drops an assistant turn's tool_calls: the call goes back into the
    turn's content as the template's system prompt tells the model to write one."""
    from transformers import AutoTokenizer
    template = _template(name)
    assert tool_format(template) == fmt
    llm = models(kind, template)
    hf = AutoTokenizer.from_pretrained(family_material.hf_dir(kind))
    for messages in (QUESTION, HISTORY):
        # earlier calls' arguments as objects, as cyllm hands them to the template
        given = calls_in_content(history_arguments(messages), fmt, template)
        if fmt == "granite" and messages is HISTORY:
            assert given[1] == {"role": "assistant", "content": '<|tool_call|>[{"name": "get_weather", '
                                '"arguments": {"city": "Paris", "days": 1}}]'}
        else:
            assert given == history_arguments(messages)
        # and a later request without tools (Granite's: the calls folded the same way)
        for tools in (TOOLS, None) if fmt == "granite" else (TOOLS,):
            want = hf.apply_chat_template(given, tools=tools, chat_template=template,
                                          tokenize=False, add_generation_prompt=True)
            assert (tools is None or "get_weather" in want) and '\\"city' not in want
            got = llm.create_chat_completion(messages=messages, tools=tools, max_tokens=1)["usage"]["prompt_tokens"]
            assert got == len(llm.tokenizer.encode(want, add_special_tokens=False))


def test_tool_use_template_as_transformers_picks_it(family_material, tmp_path):
    """A model that ships two named templates ("default" and "tool_use", as Hermes 2 Pro and
    Command R do in tokenizer_config.json) renders requests with tools with the second and
    the rest with the first, as transformers picks them."""
    import shutil

    from transformers import AutoTokenizer
    d = tmp_path / "two-templates"
    shutil.copytree(family_material.hf_dir("qwen3"), d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": _template("Qwen-Qwen2.5-7B-Instruct")},
                            {"name": "tool_use", "template": _template("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use")}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "chat_template.jinja").unlink(missing_ok=True)
    llm = cyllm.load(d, backend="numpy")
    hf = AutoTokenizer.from_pretrained(d)
    for tools in (None, TOOLS):
        want = hf.apply_chat_template(QUESTION, tools=tools, tokenize=False, add_generation_prompt=True)
        assert llm.tokenizer.apply_chat_template(QUESTION, **({"tools": tools} if tools else {})) == want
    assert "You are a function calling AI model" in want
    # transformers 5 saves the two as chat_template.jinja and additional_chat_templates/tool_use.jinja
    saved = tmp_path / "saved"
    shutil.copytree(d, saved)
    hf.save_pretrained(saved)
    assert (saved / "additional_chat_templates" / "tool_use.jinja").is_file()
    assert cyllm.load(saved, backend="numpy").tokenizer.apply_chat_template(QUESTION, tools=TOOLS) == want
    # llama.cpp's converter writes the second as tokenizer.chat_template.tool_use
    from llamacpp_tools import convert_hf_to_gguf
    from tinymodels import GGUF_PRE, KIND_TOKENIZER
    gguf = or_skip(convert_hf_to_gguf, d, tmp_path / "two.gguf", "f32", GGUF_PRE[KIND_TOKENIZER["qwen3"]])
    tok = cyllm.load(gguf, backend="numpy").tokenizer
    assert tok.apply_chat_template(QUESTION, tools=TOOLS) == want
    assert tok.apply_chat_template(QUESTION) == hf.apply_chat_template(QUESTION, tokenize=False,
                                                                       add_generation_prompt=True)
    # and cyllm's own writers keep it: quantize (HF -> GGUF) and convert (GGUF -> HF, read by transformers)
    from cyllm.tools.convert import convert_gguf_to_hf
    from cyllm.tools.quantize import quantize
    for src in (d, saved):
        quantize(src, tmp_path / f"{src.name}-q8.gguf", "q8_0")
        assert cyllm.load(tmp_path / f"{src.name}-q8.gguf", backend="numpy").tokenizer.apply_chat_template(
            QUESTION, tools=TOOLS) == want
    back = AutoTokenizer.from_pretrained(convert_gguf_to_hf(gguf, tmp_path / "back"))
    assert back.apply_chat_template(QUESTION, tools=TOOLS, tokenize=False, add_generation_prompt=True) == want
    # a template set by hand renders tool requests too
    tok.chat_template = _template("Qwen-Qwen3-0.6B")
    assert tok.apply_chat_template(QUESTION, tools=TOOLS) == hf.apply_chat_template(
        QUESTION, tools=TOOLS, chat_template=_template("Qwen-Qwen3-0.6B"), tokenize=False, add_generation_prompt=True)


def _schema(name):
    return {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS + [WHERE]}[name]


@pytest.mark.parametrize("name,kind", [("Qwen-Qwen3-0.6B", "qwen3"), ("meta-llama-Llama-3.2-3B-Instruct", "llama32"),
                                       ("microsoft-Phi-3.5-mini-instruct", "qwen3")])
def test_forced_calls_through_the_openai_client(models, name, kind):
    """tool_choice "required" and a named function, on the HTTP server, read by the openai
    client: one call of an offered function, its arguments valid for its parameters
    (jsonschema, which follows WHERE's $defs), finish_reason "tool_calls" and no content;
    streamed deltas give the same."""
    openai = pytest.importorskip("openai")
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    from test_server import start_server
    llm = models(kind, _template(name))
    srv, thread, url = start_server(llm)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        tools = TOOLS + [WHERE]
        for choice, want in (("required", None), ({"type": "function", "function": {"name": "add"}}, "add"),
                             ({"type": "function", "function": {"name": "where"}}, "where")):
            for seed in (1, 2):
                r = client.chat.completions.create(model="m", messages=QUESTION, tools=tools, tool_choice=choice,
                                                   max_tokens=80, seed=seed)
                c = r.choices[0]
                assert c.finish_reason == "tool_calls" and c.message.content is None
                (call,) = c.message.tool_calls
                assert call.type == "function" and len(call.id) == 9 and call.id.isalnum()
                assert call.function.name in ("get_weather", "add", "where") and want in (None, call.function.name)
                jsonschema.validate(json.loads(call.function.arguments), _schema(call.function.name))
                stream = client.chat.completions.create(model="m", messages=QUESTION, tools=tools,
                                                        tool_choice=choice, max_tokens=80, seed=seed, stream=True)
                name_, args, finish, text = "", "", None, ""
                for chunk in stream:
                    d = chunk.choices[0].delta
                    text += d.content or ""
                    for tc in d.tool_calls or ():
                        assert tc.index == 0
                        name_ += tc.function.name or ""
                        args += tc.function.arguments or ""
                    finish = chunk.choices[0].finish_reason or finish
                assert (name_, json.loads(args), finish, text.strip()) == (
                    call.function.name, json.loads(call.function.arguments), "tool_calls", "")
        # the answer goes back to the model as a tool message (content null, as clients send a
        # call's turn): the conversation renders and runs
        history = [dict(m, content=None) if m.get("tool_calls") else m for m in HISTORY]
        r = client.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=4, seed=1)
        assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        llm.prompt_cache = None


def test_tool_requests_checked(models):
    llm = models("qwen3", _template("Qwen-Qwen3-0.6B"))
    ask = dict(messages=QUESTION, max_tokens=1)
    for bad, msg in ((dict(tools={"a": 1}), "list"), (dict(tools=[{"type": "function"}]), "tools[0]"),
                     (dict(tools=[{"type": "function", "function": {"name": "no spaces"}}]), "name"),
                     (dict(tools=[WEATHER, WEATHER]), "second function"),
                     (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "not among"),
                     (dict(tools=TOOLS, tool_choice="always"), "tool_choice"),
                     (dict(tool_choice="required"), "needs tools"),
                     (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]), "schema"),
                     (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
                      "response_format")):
        with pytest.raises(InvalidArgumentError, match=re.escape(msg)):
            llm.create_chat_completion(**ask, **bad)
    # a template that teaches a call format cyllm does not read takes no tools; "none" renders without them
    llm = models("qwen3", _template("Qwen3-Coder"))
    with pytest.raises(InvalidArgumentError, match="does not read"):
        llm.create_chat_completion(**ask, tools=TOOLS)
    assert llm.create_chat_completion(**ask, tools=TOOLS, tool_choice="none")["choices"][0]["finish_reason"]
    # a non-object schema cannot be a function's arguments; parallel_tool_calls is a boolean
    for bad, msg in (({"type": "string"}, "schema of an object"), ({"type": "array"}, "schema of an object")):
        with pytest.raises(InvalidArgumentError, match=msg):
            check_tools([{"type": "function", "function": {"name": "f", "parameters": bad}}], "auto",
                        _template("Qwen-Qwen3-0.6B"))
    with pytest.raises(InvalidArgumentError, match="parallel_tool_calls"):
        check_tools(TOOLS, "auto", _template("Qwen-Qwen3-0.6B"), "yes")
    # Mistral's forced call starts with its control token: a vocabulary without one cannot
    req = check_tools(TOOLS, "required", _template("mistralai-Mistral-Nemo-Instruct-2407"))
    with pytest.raises(InvalidArgumentError, match="no \\[TOOL_CALLS\\] token"):
        tool_grammar(req, lambda text: None)


@pytest.mark.parametrize("name,fmt", [("Qwen3-Coder", None), ("GLM-4.6", None), ("unsloth-Apriel-1.5", None),
                                      ("CohereForAI-c4ai-command-r7b-12-2024-tool_use", None),
                                      ("Qwen-QwQ-32B", "hermes"), ("meta-llama-Llama-3.3-70B-Instruct", "llama3"),
                                      ("Mistral-Small-3.2-24B-Instruct-2506", "mistral"),
                                      ("ibm-granite-granite-4.0", "hermes"),
                                      ("unsloth-mistral-Devstral-Small-2507", "mistral"),
                                      ("microsoft-Phi-3.5-mini-instruct", "generic"),
                                      ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "generic")])
def test_call_formats_of_more_templates(name, fmt):
    """Templates whose calls this module does not read (Qwen3-Coder's XML, GLM's, Apriel's
    list, Command R's) take no tools; the rest get their format."""
    assert tool_format(_template(name)) == fmt


def test_forced_grammars_compile(models):
    """The grammars of every format and choice compile against a real vocabulary, a forced
    Mistral call opens with the control token alone, and a schema with $defs keeps them."""
    llg = pytest.importorskip("llguidance")
    from cyllm.grammar import GrammarConstraint, ll_tokenizer
    llm = models("qwen3", _template("Qwen-Qwen3-0.6B"))
    lt = ll_tokenizer(llm)
    special = llm.tokenizer.token_to_id("<|im_start|>")
    refs = {"type": "object", "$defs": {"City": {"type": "string", "enum": ["Paris", "Lima"]}},
            "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"]}
    tools = TOOLS + [{"type": "function", "function": {"name": "where", "parameters": refs}}]
    for fmt, args_form in (("hermes", False), ("llama3", False), ("mistral", False), ("mistral", True),
                           ("granite", False)):
        for choice in ("required", "where"):
            req = ToolRequest(tools=check_tools(tools, "auto", _template("Qwen-Qwen3-0.6B")).tools, choice=choice,
                              format=fmt, args_form=args_form)
            g = tool_grammar(req, lambda text: special)
            bad, msgs = llg.LLMatcher.validate_grammar_with_warnings(g, lt)
            assert not bad, (fmt, choice, msgs)
            x = np.zeros(llm.config.vocab_size, np.float32)
            GrammarConstraint(llm, g).apply(x)          # the first token's mask
            allowed = np.flatnonzero(np.isfinite(x)).tolist()
            if fmt in ("mistral", "granite"):          # the control token the list follows
                assert allowed == [special]
            else:
                assert special not in allowed and len(allowed) > 0


def _req(fmt):
    return ToolRequest(tools=TOOLS, choice="auto", format=fmt)


CALL = {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}
ADD_CALL = {"name": "add", "arguments": '{"a": 1, "b": 2}'}


@pytest.mark.parametrize("fmt,answer,content,calls", [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     "Let me look.\n", [CALL, ADD_CALL]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}', "", [CALL]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None, []),
    ("hermes", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', None, []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
                '{"name": "add", "arguments": {"a": 1, "b": 2}}]', "", [CALL, ADD_CALL]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
     "", [CALL, ADD_CALL]),
    ("llama3", ' {"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', " ", [CALL]),
    ("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [ADD_CALL]),
    ("llama3", '{"name": "get_weather"', None, []),
    ("llama3", "The weather is fine.", None, []),
    # a reasoning block that mentions the tag is not a call; the call after it is
    ("hermes", '<think>\nI should emit a <tool_call> for it.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
               '"arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
     "<think>\nI should emit a <tool_call> for it.\n</think>\n\n", [CALL]),
    # text between calls, and a block that is no call, stay content
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> and '
               '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
     ' and <tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', [ADD_CALL]),
    ("hermes", '<tool_call>{"name": "add", "arguments": "[1, 2]"}</tool_call>', None, []),
    ("hermes", '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>', "", [ADD_CALL]),
    ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris", "days": 2}', "", [CALL]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
               '{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [CALL, ADD_CALL]),
    ("llama3", '<think>{"name": "x"}</think>{"name": "add", "parameters": {"a": 1, "b": 2}}',
     '<think>{"name": "x"}</think>', [ADD_CALL]),
    ("generic", '{"tool_call": {"name": "add", "arguments": {"a": 1, "b": 2}}}', "", [ADD_CALL]),
    ("generic", '{"response": "It is sunny."}', "It is sunny.", []),
    ("generic", '{"response": "It is su', "It is su", []),       # cut by the token limit: what it said
    ("generic", '{"response": "a \\"b\\" \\u00e9\\ud83d\\ude00\\n"}', 'a "b" \u00e9\U0001f600\n', []),
    ("generic", '{"tool_call": {"name": "rm_rf", "arguments": {}}}', None, []),
    ("granite", 'Let me look. <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
                '{"name": "add", "arguments": {"a": 1, "b": 2}}]', "Let me look. ", [CALL, ADD_CALL]),
    ("granite", '<|tool_call|>{"name": "add", "arguments": {"a": 1, "b": 2}}', "", [ADD_CALL]),
    ("granite", '<|tool_call|>[{"name": "add", "arguments": {"a": 1, "b": 2}}', None, []),
    ("granite", '<|tool_call|>[{"name": "rm_rf", "arguments": {}}]', None, []),
    ("granite", '<think>a <|tool_call|> maybe</think><|tool_call|>[{"name": "add", "arguments": {"a": 1, "b": 2}}]',
     "<think>a <|tool_call|> maybe</think>", [ADD_CALL]),
])
def test_answers_parse_into_calls(fmt, answer, content, calls):
    """Each format's calls (several, unclosed at the end of the answer, the two Mistral forms);
    a cut or unknown call stays content. Streamed in pieces of 3 characters, the content that
    goes out before the end never holds a call's text, and the generic format's plain answer
    streams decoded (escapes, a surrogate pair split across pieces)."""
    req = _req(fmt)
    got_content, got_calls = parse_calls(req, answer)
    assert got_calls == calls
    assert got_content == (answer if content is None else content)
    scan = CallScan(req)
    streamed = "".join(scan.push(answer[i:i + 3]) for i in range(0, len(answer), 3))
    rest, final = scan.finish()
    assert final == calls and streamed + rest == got_content
    if calls:
        assert "get_weather" not in streamed and "add" not in streamed.replace("Let me look", "")


def test_hostile_parameter_schemas(models):
    """A tool's parameters that no grammar can hold, that match nothing or that fill the
    prompt are a clear error (or, where the grammar engine bounds them, an answer) under a
    forced call: never a crash or a hang (the schemas of the server's fuzz test)."""
    from test_fuzz import HOSTILE_SCHEMAS
    pytest.importorskip("llguidance")
    llm = models("qwen3", _template("Qwen-Qwen3-0.6B"))
    for schema in HOSTILE_SCHEMAS:
        tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
        try:
            r = llm.create_chat_completion(messages=QUESTION, tools=[tool], tool_choice="required", max_tokens=8)
        except CyllmError:          # InvalidArgumentError, or ContextFullError: the tools fill the prompt
            continue
        assert r["choices"][0]["finish_reason"] in ("length", "tool_calls", "stop")


def test_parallel_tool_calls_false_keeps_the_first():
    req = ToolRequest(tools=TOOLS, choice="auto", format="hermes", parallel=False)
    answer = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
              '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>')
    assert parse_calls(req, answer) == ("", [ADD_CALL])


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "where"}}])
def test_generic_tools_on_a_template_without_them(models, choice):
    """A template that knows nothing of tools (Phi-3.5's here) gets them in a system message and
    answers one JSON object: a call of an offered function whose arguments fit its schema
    (jsonschema), or with "auto" possibly a plain answer; a conversation that went through a
    call renders with the call and its result, and runs."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    llm = models("qwen3", _template("microsoft-Phi-3.5-mini-instruct"))
    tools = TOOLS + [WHERE]
    for seed in (1, 2, 3):
        r = llm.create_chat_completion(messages=QUESTION, tools=tools, tool_choice=choice, max_tokens=80, seed=seed)
        c = r["choices"][0]
        if c["finish_reason"] == "tool_calls":
            (call,) = c["message"]["tool_calls"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), _schema(call["function"]["name"]))
            assert c["message"]["content"] is None and (choice != "where" or call["function"]["name"] == "where")
        else:
            assert choice == "auto" and isinstance(c["message"]["content"], str)
    prompt = llm.tokenizer.apply_chat_template(
        generic_messages(check_tools(tools, choice, llm.tokenizer.chat_template), history_arguments(HISTORY)))
    assert '"get_weather"' in prompt and "sunny, 21 C" in prompt and '{"tool_call": {"name": "get_weather", ' \
        '"arguments": {"city": "Paris", "days": 1}}}' in prompt
    assert llm.create_chat_completion(messages=HISTORY, tools=tools, tool_choice=choice, max_tokens=4)["choices"]


def test_generic_grammar_allows_a_plain_answer(models):
    """The generic format's "auto" grammar (llguidance) takes a plain answer as well as a call,
    token by token; "required" takes only the call. A function whose parameters give no type
    is still called with an object."""
    llg = pytest.importorskip("llguidance")
    from cyllm.grammar import ll_tokenizer
    llm = models("qwen3", _template("microsoft-Phi-3.5-mini-instruct"))
    lt = ll_tokenizer(llm)
    tools = TOOLS + [{"type": "function", "function": {"name": "ping", "parameters": {}}}]
    answers = {'{"response": "It is \\"sunny\\",\\n\u00e9t\u00e9."}': ("auto",),
               '{"tool_call": {"name": "add", "arguments": {"a": 1, "b": 2}}}': ("auto", "required"),
               '{"tool_call": {"name": "ping", "arguments": {}}}': ("auto", "required"),
               '{"tool_call": {"name": "ping", "arguments": []}}': ()}
    for choice in ("auto", "required"):
        g = tool_grammar(check_tools(tools, choice, llm.tokenizer.chat_template), llm.tokenizer.token_to_id)
        for text, ok_for in answers.items():
            m = llg.LLMatcher(lt, g, log_level=0)
            took = all(m.consume_token(t) for t in llm.tokenizer.encode(text, add_special_tokens=False))
            assert (took and m.is_accepting()) == (choice in ok_for), (choice, text)


def test_generic_history_keeps_turns_alternating(models):
    """A conversation through two calls, on templates that know no tool turns and insist that
    user and assistant alternate (Gemma 2's, which also refuses a system role, and Phi-3.5's):
    the results after a call become one user turn named by their calls, the assistant's text
    beside its calls stays, and it renders, with tools and without (tool_choice "none")."""
    two = [{"role": "user", "content": "Weather in Paris and Lima?"},
           {"role": "assistant", "content": "Let me check both.", "tool_calls": [
               {"id": "a1b2c3d4e", "type": "function", "function": {"name": "get_weather",
                                                                   "arguments": '{"city": "Paris", "days": 1}'}},
               {"id": "f5g6h7i8j", "type": "function", "function": {"name": "get_weather",
                                                                   "arguments": '{"city": "Lima", "days": 1}'}}]},
           {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "sunny"},
           {"role": "tool", "tool_call_id": "f5g6h7i8j", "content": "fog"}]
    turns = generic_history(history_arguments(two))
    assert [m["role"] for m in turns] == ["user", "assistant", "user"]
    assert turns[1]["content"].startswith("Let me check both.\n")
    results = [json.loads(line)["tool_response"] for line in turns[2]["content"].split("\n")]
    assert results == [{"name": "get_weather", "id": "a1b2c3d4e", "content": "sunny"},
                       {"name": "get_weather", "id": "f5g6h7i8j", "content": "fog"}]
    for name in ("google-gemma-2-2b-it", "microsoft-Phi-3.5-mini-instruct"):
        llm = models("qwen3", _template(name))
        for choice in ("auto", "none"):
            r = llm.create_chat_completion(messages=two, tools=TOOLS, tool_choice=choice, max_tokens=2)
            assert r["usage"]["prompt_tokens"] > 0
        with pytest.raises(InvalidArgumentError, match="tool_calls"):
            llm.create_chat_completion(messages=[two[0], dict(two[1], tool_calls=[{"function": {}}])], max_tokens=1)


def test_json_nested_past_the_decoders_depth_stays_text():
    """Calls and earlier arguments nested deeper than Python's JSON decoder recurses (a model's
    output, a client's history) are content, or arguments kept as the text they came as: never
    a RecursionError out of a request. A lone high surrogate's escape in a streamed plain answer
    does not swallow the escape after it."""
    from cyllm.toolcalls import ResponseStream
    deep = "[" * 100_000
    for fmt, head in (("generic", '{"tool_call": {"name": "add", "arguments": {"a": '), ("hermes", "<tool_call>"),
                      ("mistral", "[TOOL_CALLS]"), ("llama3", ""), ("granite", "<|tool_call|>")):
        text = head + ('[{"name": "add", "arguments": ' if fmt != "generic" else "") + deep
        assert parse_calls(_req(fmt), text) == (text, [])
    calls = [{"id": "a1b2c3d4e", "type": "function", "function": {"name": "add", "arguments": deep}}]
    assert history_arguments([{"role": "assistant", "content": "", "tool_calls": calls}])[0][
        "tool_calls"][0]["function"]["arguments"] == deep
    for text, want in (('{"response": "\\ud800ab\\', None), ('{"response": "\\ud800ab\\n', "\n")):
        got = ResponseStream().new_text(text)
        assert got.endswith("ab") if want is None else got.endswith("ab\n")
