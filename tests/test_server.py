"""`cyllm serve` on the real default model, driven by the official `openai` client and raw HTTP.

The server runs in this process (uvicorn on 127.0.0.1, a free port, its own
thread) over the session's default model; references are computed
independently: greedy text from cyllm's Chat, logprobs from a fresh full
forward pass (model.logits) with NumPy's log-softmax, JSON checked by
`jsonschema`.
"""

import asyncio
import json
import logging
import socket
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from cyllm.generate import Chat, GenerationStats, Session  # noqa: E402
from cyllm.tools.server.app import create_app  # noqa: E402
from cyllm.tools.server.cli import listen, server_for  # noqa: E402
from cyllm.tools.server.prompt_cache import PromptCache  # noqa: E402
from cyllm.tools.server.worker import DONE, Job, ShuttingDown, Worker  # noqa: E402

QUESTION = [{"role": "user", "content": "What is the capital of Japan?"}]


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def start_server(model, api_key=None):
    app = create_app(model, "smollm2", api_key)
    sock = listen("127.0.0.1", 0)
    server = server_for(app, sock)
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="module")
def server(default_model):
    logger = logging.getLogger("cyllm.server")
    records = Records()
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    srv, thread, url = start_server(default_model)
    yield url, records
    srv.should_exit = True
    thread.join(timeout=10)
    logger.removeHandler(records)
    default_model.prompt_cache = None


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=120)


def wait_for_lines(records, start, needle, timeout=10.0):
    """Log lines after index ``start`` that contain ``needle`` (the server logs a request
    after its response has gone out, so the line may come a moment after the client is done)."""
    deadline = time.time() + timeout
    while True:
        found = [line for line in records.lines[start:] if needle in line]
        if found or time.time() > deadline:
            return found
        time.sleep(0.05)


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def fresh_logits(model, ids):
    out = model.logits(ids)
    model.kv_owner = None          # a direct forward pass wrote the cache behind the sessions' backs
    return out


# ----------------------------------------------------------------- answers
def test_chat_answer_equals_cyllm_chat_and_names_tokyo(client, default_model):
    r = client.chat.completions.create(model="anything", messages=QUESTION, max_tokens=16, temperature=0)
    text = r.choices[0].message.content
    assert "Tokyo" in text
    reference = "".join(Chat(default_model, temperature=0.0).send(QUESTION[0]["content"], max_tokens=16))
    assert text == reference
    assert r.object == "chat.completion" and r.model == "smollm2"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_stream_equals_plain_and_reports_usage(client):
    kw = dict(model="m", messages=[{"role": "user", "content": "Name three colours."}], max_tokens=20,
              temperature=0.7, seed=11)
    plain = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stop_string_and_list(client):
    full = client.completions.create(model="m", prompt="1, 2, 3,", max_tokens=12, temperature=0).choices[0]
    assert full.text.startswith(" 4, 5, 6")
    cut = client.completions.create(model="m", prompt="1, 2, 3,", max_tokens=12, temperature=0, stop=", 6")
    assert cut.choices[0].text == " 4, 5" and cut.choices[0].finish_reason == "stop"
    cut = client.completions.create(model="m", prompt="1, 2, 3,", max_tokens=12, temperature=0,
                                    stop=["7", " 5,"])
    assert cut.choices[0].text == " 4,"


def test_top_p_zero_is_greedy_whatever_the_seed(client):
    """top_p is in [0, 1] (OpenAI); 0 keeps only the most probable token, so at temperature 1 every
    seed gives the greedy (temperature 0) text, where top_p 1 lets the seeds differ."""
    kw = dict(model="m", prompt="Once upon a time", max_tokens=24)
    greedy = client.completions.create(temperature=0, **kw).choices[0].text
    for seed in (1, 2, 3, 4):
        assert client.completions.create(temperature=1.0, top_p=0, seed=seed, **kw).choices[0].text == greedy
    free = {client.completions.create(temperature=1.0, top_p=1, seed=seed, **kw).choices[0].text for seed in (1, 2)}
    assert free != {greedy}


def test_seed_repeats_and_differs(client):
    kw = dict(model="m", prompt="Once upon a time", max_tokens=24, temperature=1.0)
    a = client.completions.create(seed=5, **kw).choices[0].text
    b = client.completions.create(seed=5, **kw).choices[0].text
    c = client.completions.create(seed=6, **kw).choices[0].text
    assert a == b and a != c


def test_n_choices_are_seeded_answers_of_their_own(client):
    """n choices come back with indices 0..n-1, choice 0 being the answer of the same request
    with n=1; with a seed the request repeats, and the choices differ from one another; the
    stream, grouped by index, carries the same texts; usage counts every choice's tokens."""
    kw = dict(model="m", prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=7, logprobs=0)
    r = client.completions.create(n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert texts[0] == client.completions.create(**kw).choices[0].text
    assert len(set(texts)) > 1
    assert [c.text for c in client.completions.create(n=3, **kw).choices] == texts
    assert r.usage.completion_tokens == sum(len(c.logprobs.token_logprobs) for c in r.choices)
    chunks = list(client.completions.create(n=3, stream=True, **kw))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    assert streamed == texts
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [c.finish_reason for c in r.choices]
    # best_of equal to n is n itself; more is not supported
    assert [c.text for c in client.completions.create(n=3, best_of=3, **kw).choices] == texts
    with pytest.raises(openai.BadRequestError, match="best_of=4"):
        client.completions.create(n=3, best_of=4, **kw)


def test_n_choices_keep_one_displaced_answer_in_the_prompt_cache(client, default_model):
    """Each choice displaces the one before it from the KV cache; the server's prompt cache
    keeps a copy of choice 0 (the one a client most likely continues), not of the later ones;
    the stats the log line reads count every choice and say each one's stop reason."""
    cache = default_model.prompt_cache
    eos = default_model.tokenizer.eos_id
    kw = dict(model="m", prompt="Write a long story about a dragon.", max_tokens=40, temperature=1.0, seed=3,
              logit_bias={str(eos): -100} if eos is not None else None)
    client.completions.create(**dict(kw, seed=99))          # another answer to the prompt, live in the cache
    before = cache.saved
    r = client.completions.create(n=4, **kw)
    assert [c.finish_reason for c in r.choices] == ["length"] * 4
    assert cache.saved - before == 2           # the first answer (displaced by choice 0), and choice 0
    assert default_model.last_stats.generated_tokens == r.usage.completion_tokens == 160
    assert default_model.last_stats.stop_reason == "length,length,length,length"


def test_echo_keeps_the_conversation_it_displaces(client, default_model):
    """echo's scoring passes rewrite the KV cache from position 0: the server's prompt cache
    keeps a copy of the conversation they displace first, and the next turn of that
    conversation is restored from it (its prompt runs only the new tokens)."""
    cache = default_model.prompt_cache
    story = "Write a long story about a dragon who guards a library of forgotten songs."
    first = client.completions.create(model="m", prompt=story, max_tokens=40, temperature=0)
    saved, restored = cache.saved, cache.restored
    client.completions.create(model="m", prompt="An unrelated text to score. " * 8, max_tokens=0, echo=True,
                              logprobs=0)
    assert cache.saved == saved + 1
    more = story + first.choices[0].text + " The end."
    r = client.completions.create(model="m", prompt=more, max_tokens=2, temperature=0)
    assert cache.restored == restored + 1
    assert r.usage.prompt_tokens_details.cached_tokens >= len(default_model.tokenizer.encode(story))


def test_n_stats_count_a_choice_closed_midway(default_model):
    stats = GenerationStats()
    chunks = default_model.create_completion("Once upon a time", n=3, max_tokens=8, temperature=1.0, seed=4,
                                             stream=True, stats=stats,
                                             logit_bias={str(default_model.tokenizer.eos_id): -100})
    seen = 0
    for c in chunks:
        seen += bool(c["choices"] and c["choices"][0]["index"] == 1 and c["choices"][0]["text"])
        if seen == 3:
            break
    chunks.close()
    assert 8 + 3 <= stats.generated_tokens < 16


def test_n_echo_choices_share_the_prompt_logprobs(client, default_model):
    """echo with n: every choice starts with the prompt and its logprobs (scored once)."""
    prompt = "The capital of France is"
    r = client.completions.create(model="m", prompt=prompt, max_tokens=3, temperature=1.0, seed=3, n=2,
                                  echo=True, logprobs=1)
    k = len(default_model.tokenizer.encode(prompt))
    for c in r.choices:
        assert c.text.startswith(prompt) and len(c.logprobs.tokens) > k
    a, b = (c.logprobs for c in r.choices)
    assert a.token_logprobs[:k] == b.token_logprobs[:k] and a.token_logprobs[0] is None
    assert r.usage.completion_tokens == len(a.tokens) + len(b.tokens) - 2 * k


def test_n_greedy_chat_choices_are_the_one_greedy_answer(client):
    one = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=10, temperature=0)
    r = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=10, temperature=0, n=2)
    assert [c.message.content for c in r.choices] == [one.choices[0].message.content] * 2
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 2 * one.usage.completion_tokens
    assert r.usage.prompt_tokens == one.usage.prompt_tokens


def test_logprobs_equal_a_fresh_forward_pass(client, default_model):
    r = client.completions.create(model="m", prompt="The capital of France is", max_tokens=6, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    tok = default_model.tokenizer
    prompt = tok.encode("The capital of France is")
    gen = tok.encode(r.choices[0].text, add_special_tokens=False)
    ref = log_softmax(fresh_logits(default_model, prompt + gen)[len(prompt) - 1:-1])   # (n_gen, vocab)
    assert len(lp.token_logprobs) == len(gen) == r.usage.completion_tokens
    for i, t in enumerate(gen):
        assert lp.tokens[i] == tok.decode([t])
        assert abs(lp.token_logprobs[i] - ref[i, t]) < 2e-3
        best = np.argsort(-ref[i])[:3]
        assert list(lp.top_logprobs[i]) == [tok.decode([j]) for j in best]     # greedy: best first
        np.testing.assert_allclose(list(lp.top_logprobs[i].values()), ref[i, best], atol=2e-3)
    chat = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert content[0].top_logprobs[0].token == content[0].token
    assert content[0].logprob <= 0 and bytes(content[0].bytes).decode() == content[0].token


def test_logit_bias_steers_greedy_like_numpy(client, default_model):
    """logit_bias ({"token id": bias}, OpenAI's) is added to the logits before the choice: the
    greedy text equals NumPy's argmax of fresh logits + bias, step by step, with the unbiased
    first token banned (-100) and another pushed up."""
    tok = default_model.tokenizer
    prompt = tok.encode("The capital of France is")
    first = int(np.argmax(fresh_logits(default_model, prompt)[-1]))
    bias = {first: -100.0, tok.encode(" Lyon", add_special_tokens=False)[0]: 3.5}
    gen = []
    for _ in range(5):
        x = fresh_logits(default_model, prompt + gen)[-1].astype(np.float64)
        for t, b in bias.items():
            x[t] += b
        gen.append(int(np.argmax(x)))
    r = client.completions.create(model="m", prompt="The capital of France is", max_tokens=5, temperature=0,
                                  logit_bias={str(t): b for t, b in bias.items()})
    assert gen[0] != first and r.choices[0].text == tok.decode(gen)
    chat = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=3, temperature=0,
                                          logit_bias={str(first): 100})
    assert chat.usage.completion_tokens == 3 and chat.choices[0].message.content == tok.decode([first] * 3)


def test_echo_scores_the_prompt_like_a_fresh_pass(client, default_model):
    """echo + logprobs + max_tokens 0 (how evaluation harnesses score a text through an
    OpenAI endpoint): the prompt comes back, and each of its tokens' logprob given the ones
    before equals NumPy's log-softmax of a fresh forward pass, past the 256-token chunks of
    the scoring pass too; with max_tokens > 0 the answer follows, as without echo."""
    tok = default_model.tokenizer
    prompt = "The capital of France is Paris. " * 45                    # > 256 tokens
    ids = tok.encode(prompt)
    assert len(ids) > 300
    r = client.completions.create(model="m", prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0)
    c = r.choices[0]
    ref = log_softmax(fresh_logits(default_model, ids))                # (n, vocab)
    lp = c.logprobs
    assert c.text == prompt and len(lp.tokens) == len(ids) == r.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in (1, 2, 100, 255, 256, 257, len(ids) - 1):
        assert abs(lp.token_logprobs[i] - ref[i - 1, ids[i]]) < 2e-3, i
        best = np.argsort(-ref[i - 1])[:2]
        assert list(lp.top_logprobs[i]) == [tok.decode([j]) for j in best]
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(prompt)
    plain = client.completions.create(model="m", prompt="Once upon a time", max_tokens=6, temperature=0)
    both = client.completions.create(model="m", prompt="Once upon a time", max_tokens=6, temperature=0, echo=True,
                                     logprobs=0)
    assert both.choices[0].text == "Once upon a time" + plain.choices[0].text
    n = len(tok.encode("Once upon a time"))
    # the scoring passes left the prompt in the cache: the answer ran only its last token again
    assert both.usage.prompt_tokens == n and both.usage.prompt_tokens_details.cached_tokens == n - 1
    offs = both.choices[0].logprobs.text_offset
    assert offs[n] >= len("Once upon a time") and offs == sorted(offs)


def test_logprob_bytes_of_split_characters(client):
    """Tokens that hold part of a character (a byte-level vocabulary splits emoji) carry
    their own bytes, so the entries' bytes joined are the content's UTF-8 (OpenAI's reason
    for the field), and name themselves ``bytes:\\x..`` rather than a replacement char."""
    schema = {"type": "object", "properties": {"e": {"const": "\U0001f409\U0001f525"}}, "required": ["e"],
              "additionalProperties": False}
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Two emoji please"}], max_tokens=64, temperature=0,
        logprobs=True, top_logprobs=2,
        response_format={"type": "json_schema", "json_schema": {"name": "e", "schema": schema}})
    text = r.choices[0].message.content
    assert json.loads(text) == {"e": "\U0001f409\U0001f525"}, text
    content = r.choices[0].logprobs.content
    assert b"".join(bytes(e.bytes) for e in content) == text.encode("utf-8")
    split = [e for e in content if e.token.startswith("bytes:")]
    assert split, "no token held part of a character: the test proves nothing"
    for e in split:
        assert "\ufffd" not in e.token and e.token == "bytes:" + "".join(f"\\x{b:02x}" for b in e.bytes)


def test_json_schema_output_validates(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=40, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "A JSON object please."}],
                                       max_tokens=60, temperature=0, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},                  # llguidance compiles it, and finds the dead end at the first token
    {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]},   # ... after '{"a": '
], ids=["at-the-start", "mid-value"])
def test_json_schema_that_matches_nothing_is_an_error_not_empty_content(client, schema):
    """No JSON value matches these schemas: the answer is an error naming the schema, never
    a 200 whose content is empty or cut and still says finish_reason "stop"."""
    kw = dict(model="m", messages=[{"role": "user", "content": "A JSON value please."}], max_tokens=20,
              temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw)
    assert "schema" in e.value.message and "no JSON value matches" in e.value.message
    # streamed: refused before the stream starts, or an error event where the value cannot go on
    with pytest.raises(openai.APIError, match="no JSON value matches"):
        for _ in client.chat.completions.create(stream=True, **kw):
            pass


def test_json_schema_whose_values_never_end_is_one_line_400(client):
    """Every value of this schema nests without end ("c" required, of the schema's own type):
    llguidance lets tokens through until one of its limits, then refuses one. The answer is a
    400 of one line naming the schema, not the parser's multi-line state."""
    schema = {"$ref": "#/$defs/a",
              "$defs": {"a": {"type": "object", "properties": {"c": {"$ref": "#/$defs/a"}}, "required": ["c"]}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4000, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    message = e.value.message
    assert "grammar engine gave up on this JSON schema" in message and "\n" not in message, message
    assert len(message) < 400, message


# ---------------------------------------------------------- errors, routes
def post(url, body, path="/v1/chat/completions", **kw):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=60, **kw)


@pytest.mark.parametrize("body, words", [
    (b"{not json", "parse the JSON"),
    (b"[1, 2]", "JSON object"),
    ({"model": "m"}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"messages": [{"role": "user"}]}, "messages[0] (user) has no 'content'"),
    ({"messages": [{"role": "system", "content": None}, {"role": "user", "content": "hi"}]}, "(system) has no"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1.5}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 7}, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": 3}, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 17}, "n must be in [1, 16]"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n must be in [1, 16]"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2.0}, "n must be an integer"),
    ({"messages": [{"role": "user", "content": "hi"}], "best_of": 2}, "best_of=2"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}, "frobnicate"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 101}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": [1]}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "stats": 1}, "stats"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": 0}, "stream"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}, "stream"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "yaml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}}, "schema"),
])
def test_bad_requests_get_openai_errors(server, body, words):
    r = post(server[0], body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and words.lower() in err["message"].lower()


@pytest.mark.parametrize("raw", [b"1e400", b"-1e400", b"NaN"])
def test_non_finite_numbers_are_refused_in_words(server, raw):
    """JSON's 1e400 parses as inf (and Python's json reads NaN): the message says what is wrong
    with the value, not a range made of None."""
    r = post(server[0], b'{"messages": [{"role": "user", "content": "hi"}], "temperature": ' + raw + b"}")
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("temperature must be a finite number, got ") and "None" not in message, message


def test_stream_null_means_not_streamed(server):
    """OpenAI's schema has stream: boolean | null; null is the default, false."""
    body = {"messages": QUESTION, "max_tokens": 4, "temperature": 0, "stream": None, "stream_options": None}
    r = post(server[0], body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json"), r.text
    assert r.json()["object"] == "chat.completion" and r.json()["usage"]["completion_tokens"] == 4


def test_null_max_tokens_on_completions_means_16(server):
    """null is the default: /v1/completions' max_tokens default is 16 (OpenAI's), not the
    Python API's None (up to the context)."""
    body = {"prompt": "Once upon a time", "temperature": 0}
    plain = post(server[0], body, "/v1/completions")
    nulled = post(server[0], dict(body, max_tokens=None, stop=None, seed=None, n=None), "/v1/completions")
    assert plain.status_code == nulled.status_code == 200, nulled.text
    assert plain.json()["usage"]["completion_tokens"] <= 16
    assert nulled.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    assert nulled.json()["usage"]["completion_tokens"] == plain.json()["usage"]["completion_tokens"]


def test_body_that_stops_arriving_is_408(server, monkeypatch):
    """Content-Length promises more than comes and the client waits: after BODY_IDLE_S without a
    byte the server answers 408 and closes, instead of holding the connection."""
    from cyllm.tools.server import app as server_app
    monkeypatch.setattr(server_app, "BODY_IDLE_S", 0.5)
    host, port = server[0].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        s.settimeout(20)
        t0 = time.time()
        parts = []
        while chunk := s.recv(4096):        # until the server closes: head and body may come apart
            parts.append(chunk)
        head = b"".join(parts)
    assert head.startswith(b"HTTP/1.1 408 "), head[:200]
    assert b"stopped arriving" in head or b"Content-Length" in head
    assert time.time() - t0 < 15


def test_prompt_longer_than_context_is_400(server, default_model):
    r = post(server[0], {"prompt": "hello " * (default_model.context + 10), "max_tokens": 2}, "/v1/completions")
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=QUESTION, temperature=-1)


def test_routes(server):
    url = server[0]
    r = httpx.get(url + "/v1/nowhere")
    assert r.status_code == 404 and "error" in r.json()
    assert httpx.get(url + "/v1/chat/completions").status_code == 405
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    models = httpx.get(url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "smollm2"
    for path, status in (("/health", 200), ("/v1/models", 200), ("/v1/models/smollm2", 200),
                         ("/v1/models/other", 404), ("/v1/completions", 405)):
        r = httpx.head(url + path)
        assert r.status_code == status and r.content == b"", (path, r.status_code)


def test_api_key(default_model):
    srv, thread, url = start_server(default_model, api_key="sekrit")
    try:
        assert httpx.get(url + "/health").status_code == 200
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "sekrit"},
                        {"authorization": "Bearer s\u00e9krit".encode("latin-1")}):
            r = httpx.get(url + "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models", headers={"authorization": "Bearer sekrit"}).status_code == 200
        c = openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0)
        assert c.completions.create(model="m", prompt="Hi", max_tokens=2).usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


# ------------------------------------------------------ scheduling, cache
def test_concurrent_clients_get_the_sequential_answers(client):
    reqs = [dict(model="m", prompt=p, max_tokens=10, temperature=0.9, seed=s)
            for p, s in (("The sea is", 1), ("My favourite food is", 2), ("In 1990,", 3), ("Dogs and cats", 4))]
    sequential = [client.completions.create(**r).choices[0].text for r in reqs]
    concurrent = [None] * len(reqs)

    def one(i):
        concurrent[i] = client.completions.create(**reqs[i]).choices[0].text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert concurrent == sequential


def test_client_dropping_mid_stream_stops_its_generation(server):
    url, records = server
    body = {"model": "m", "prompt": "1, 2, 3, 4, 5,", "max_tokens": 3000, "temperature": 0, "stream": True}
    n_before = len(records.lines)
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: "):
                got += 1
                if got == 3:
                    break
    t0 = time.perf_counter()
    r = post(url, {"model": "m", "prompt": "Hello", "max_tokens": 3, "temperature": 0}, "/v1/completions")
    waited = time.perf_counter() - t0
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert waited < 30.0           # the dropped request would have taken minutes
    dropped = wait_for_lines(records, n_before, "client disconnected")
    assert len(dropped) == 1, records.lines[n_before:]
    generated = int(dropped[0].split("generated ")[1].split()[0])
    assert generated < 100          # not the 3000 it asked for


def test_client_leaving_while_uploading_its_body_is_one_quiet_log_line(server):
    """A body cut short (Content-Length says 1000, 14 bytes come, the socket closes) is logged as
    one line saying the client disconnected: no traceback, no 500, and the server serves on."""
    url, records = server
    n_before = len(records.lines)
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"messages\": [")
        time.sleep(0.3)             # the server is now reading the body
    lines = wait_for_lines(records, n_before, "POST /v1/chat/completions")
    assert len(lines) == 1 and lines[0].endswith("| client disconnected"), records.lines[n_before:]
    assert " 500 " not in lines[0] and "request failed" not in records.lines[n_before:]
    r = post(url, {"prompt": "Hello", "max_tokens": 2, "temperature": 0}, "/v1/completions")
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_follow_up_turn_reuses_the_cache_with_fresh_run_logits(client, default_model, server):
    url, records = server
    system = {"role": "system", "content": "You are a terse geography tutor."}
    first = client.chat.completions.create(model="m", messages=[system] + QUESTION, max_tokens=12, temperature=0)
    answer = first.choices[0].message.content
    convo = [system] + QUESTION + [{"role": "assistant", "content": answer},
                                   {"role": "user", "content": "And of Italy?"}]
    n_before = len(records.lines)
    second = client.chat.completions.create(model="m", messages=convo, max_tokens=4, temperature=0,
                                            logprobs=True, top_logprobs=1)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens
    assert cached < second.usage.prompt_tokens
    assert wait_for_lines(records, n_before, f"({cached} cached)"), records.lines[n_before:]
    # the same logprobs as a fresh evaluation of the whole conversation
    tok = default_model.tokenizer
    ids = tok.encode(tok.apply_chat_template(convo, add_generation_prompt=True), add_special_tokens=False)
    assert len(ids) == second.usage.prompt_tokens
    ref = log_softmax(fresh_logits(default_model, ids)[-1])
    first_tok = second.choices[0].logprobs.content[0]
    assert first_tok.token == tok.decode([int(np.argmax(ref))])
    assert abs(first_tok.logprob - ref.max()) < 2e-3


def test_two_alternating_conversations_both_keep_their_cache(client, default_model):
    def convo(system, question):
        return [{"role": "system", "content": system}, {"role": "user", "content": question}]

    a = convo("You are a patient teacher who answers questions about European capitals and rivers "
              "in one short sentence.", "What is the capital of Spain?")
    b = convo("You are a poet. Every answer you give is a rhyming couplet about the sea and ships.",
              "Write about the morning.")
    a1 = client.chat.completions.create(model="m", messages=a, max_tokens=8, temperature=0)
    client.chat.completions.create(model="m", messages=b, max_tokens=8, temperature=0)   # displaces a
    a2_msgs = a + [{"role": "assistant", "content": a1.choices[0].message.content},
                   {"role": "user", "content": "And of Portugal?"}]
    a2 = client.chat.completions.create(model="m", messages=a2_msgs, max_tokens=3, temperature=0,
                                        logprobs=True)
    assert a2.usage.prompt_tokens_details.cached_tokens >= a1.usage.prompt_tokens
    tok = default_model.tokenizer
    ids = tok.encode(tok.apply_chat_template(a2_msgs, add_generation_prompt=True), add_special_tokens=False)
    ref = log_softmax(fresh_logits(default_model, ids)[-1])
    first = a2.choices[0].logprobs.content[0]
    assert first.token == tok.decode([int(np.argmax(ref))]) and abs(first.logprob - ref.max()) < 2e-3


def test_prompt_cache_keeps_within_its_capacity(default_model):
    tok = default_model.tokenizer
    c = default_model.config
    per_token = c.n_layers * 2 * c.n_kv_heads * c.head_dim * 2
    texts = [" ".join(f"{w}{i}" for i in range(40)) for w in ("apple", "river", "stone")]
    ids = [tok.encode(t) for t in texts]
    cache = PromptCache(default_model, capacity_bytes=per_token * (len(ids[0]) + len(ids[1]) + 10))
    previous = default_model.prompt_cache
    default_model.prompt_cache = cache
    default_model.kv_owner = None
    try:
        for x in ids + [ids[0]]:
            Session(default_model).feed(x)
        # apple was saved when river came, evicted (oldest) when stone was saved for apple's return
        assert cache.saved == 3 and len(cache) == 2 and cache.nbytes <= cache.capacity
        assert cache.restored == 0
        stats = GenerationStats()
        logits = Session(default_model).feed(ids[2], stats).copy()
        assert cache.restored == 1 and stats.cached_tokens == len(ids[2]) - 1
        np.testing.assert_allclose(logits, fresh_logits(default_model, ids[2])[-1], atol=2e-3, rtol=1e-3)
    finally:
        default_model.prompt_cache = previous


# ---------------------------------------------------------------- shutdown
def endless_job(loop) -> Job:
    """A job whose chunks never end by themselves; like a generation's, they poll the cancel flag
    and, when it fires, end with stop_reason "cancelled"."""
    job = Job(None, loop)

    def chunks(cancel):
        while not cancel():
            yield {"choices": []}
            time.sleep(0.01)
        job.stats.stop_reason = "cancelled"

    job.start = chunks
    return job


def job_items(loop, job) -> list:
    """What the worker posted to ``job`` (its items arrive through ``loop``)."""
    loop.run_until_complete(asyncio.sleep(0.05))
    items = []
    while not job.items.empty():
        items.append(job.items.get_nowait())
    return items


def test_worker_close_stops_running_and_queued_jobs_with_shutting_down():
    """Closing the worker cancels a running job (instead of waiting for it) and a queued one:
    each ends with a ShuttingDown error, then DONE."""
    loop = asyncio.new_event_loop()
    try:
        worker = Worker()
        running, queued = endless_job(loop), endless_job(loop)
        worker.submit(running)
        worker.submit(queued)
        deadline = time.time() + 10
        while running.t_started is None:
            assert time.time() < deadline
            time.sleep(0.01)
        t0 = time.perf_counter()
        worker.close()
        assert time.perf_counter() - t0 < 1.0
        for job in (running, queued):
            items = job_items(loop, job)
            assert isinstance(items[-2], ShuttingDown) and items[-1] is DONE, items[-3:]
            assert job.shutdown and job.cancelled.is_set()
        late = endless_job(loop)            # submitted after the shutdown began: ended at once
        worker.submit(late)
        items = job_items(loop, late)
        assert len(items) == 2 and isinstance(items[0], ShuttingDown) and items[1] is DONE
    finally:
        loop.close()


def test_cancelled_collect_cancels_its_job():
    """The task gathering a plain answer can be cancelled from outside (the server's graceful
    timeout): the job's generation must stop with it instead of running on."""
    from starlette.requests import Request

    from cyllm.tools.server.app import _collect

    async def never_disconnects():
        await asyncio.sleep(3600)

    async def scenario():
        job = Job(None, asyncio.get_running_loop())
        request = Request({"type": "http", "method": "POST", "path": "/", "headers": []}, never_disconnects)
        task = asyncio.ensure_future(_collect(request, job))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return job.cancelled.is_set()

    assert asyncio.run(scenario())
