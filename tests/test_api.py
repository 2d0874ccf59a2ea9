"""The Python API under the server: KV-cache ownership, stop strings, Chat, penalties, create_*.

References: a fresh full forward pass (model.logits) for cache correctness,
the solo run of a generation for interleaved/threaded runs, and NumPy
re-implementations of OpenAI's penalty formula.
"""

import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import cyllm
from cyllm import Chat
from cyllm.completions import collect, create_completion
from cyllm.errors import ContextFullError, CyllmError, InvalidArgumentError
from cyllm.generate import GenerationStats, Session
from cyllm.sampling import Sampler, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp_tools import family_material  # noqa: E402,F401


def greedy(model, prompt, n=12, **kw):
    return "".join(model.generate(prompt, max_tokens=n, temperature=0.0, **kw))


def fresh_last_logits(model, ids):
    """The logits after ``ids`` from a fresh session: the prompt prefilled, the last token decoded
    (a generation's own path; with quantized weights prefill and decode round differently)."""
    model.kv_owner = None
    s = Session(model)
    s.feed(ids[:-1])
    out = s.append(ids[-1]).copy()
    model.kv_owner = None
    return out


# ---------------------------------------------------------- cache ownership
def test_session_after_another_session_matches_a_fresh_run(default_model):
    tok = default_model.tokenizer
    a_ids = tok.encode("The capital of France is")
    b_ids = tok.encode("Completely different words here")
    a, b = Session(default_model), Session(default_model)
    a.feed(a_ids)
    b.feed(b_ids)                       # b now owns the cache
    stats = GenerationStats()
    nxt = tok.encode(" Paris", add_special_tokens=False)[0]
    logits = a.append(nxt, stats).copy()
    assert stats.recomputed_tokens > 0 and a.owns_cache and not b.owns_cache
    ref = fresh_last_logits(default_model, a_ids + [nxt])
    np.testing.assert_allclose(logits, ref, atol=2e-3, rtol=1e-3)


def test_shared_prefix_is_reused_only_while_it_is_in_the_cache(default_model):
    tok = default_model.tokenizer
    base = tok.encode("One two three four five six seven")
    a, b = Session(default_model), Session(default_model)
    a.feed(base)
    stats = GenerationStats()
    b.feed(base + tok.encode(" eight", add_special_tokens=False), stats)
    assert stats.cached_tokens == len(base)          # b starts where a's tokens are still valid
    default_model.kv_owner = None                     # e.g. after a direct model.logits() call
    stats = GenerationStats()
    a.feed(base, stats)
    assert stats.cached_tokens == 0


def test_chat_after_interleaved_generate_matches_a_fresh_run(default_model):
    chat = Chat(default_model, system="You are a helpful assistant.", temperature=0.0)
    "".join(chat.send("Name a colour.", max_tokens=8))
    greedy(default_model, "An unrelated prompt about trains", 6)      # overwrites the cache
    second = "".join(chat.send("And a fruit?", max_tokens=8))
    tok = default_model.tokenizer
    ids = tok.encode(tok.apply_chat_template(chat.messages[:-1], add_generation_prompt=True),
                     add_special_tokens=False)
    assert chat.last_stats.prompt_tokens + chat.last_stats.cached_tokens == len(ids)
    fresh = Chat(default_model, system="You are a helpful assistant.", temperature=0.0)
    fresh.messages = [dict(m) for m in chat.messages[:-2]]
    assert "".join(fresh.send("And a fruit?", max_tokens=8)) == second
    assert int(np.argmax(fresh_last_logits(default_model, ids))) == tok.encode(second, add_special_tokens=False)[0]


def test_interleaved_generators_equal_their_solo_runs(default_model):
    p1, p2 = "The quick brown fox", "Water boils at"
    solo1, solo2 = greedy(default_model, p1, 6), greedy(default_model, p2, 6)
    g1 = default_model.generate(p1, max_tokens=6, temperature=0.0)
    g2 = default_model.generate(p2, max_tokens=6, temperature=0.0)
    out1, out2 = [], []
    for _ in range(20):
        for g, out in ((g1, out1), (g2, out2)):
            piece = next(g, None)
            if piece is not None:
                out.append(piece)
    assert "".join(out1) == solo1 and "".join(out2) == solo2


def test_threads_on_one_model_equal_sequential_runs(default_model):
    # greedy: a session that lost the cache re-runs its tokens as one batched prefill, whose
    # logits differ from the step-by-step ones by float rounding (~3e-3), enough to flip a
    # seeded draw that lies near a boundary; the server runs whole requests one at a time
    prompts = ["Once upon a time", "The weather today"]
    seq = [greedy(default_model, p, 10) for p in prompts]
    out = [None, None]

    def run(i):
        out[i] = greedy(default_model, prompts[i], 10)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert out == seq


def test_abandoned_generator_blocks_nobody(default_model):
    g = default_model.generate("Counting: 1, 2, 3,", max_tokens=8, temperature=0.0)
    next(g)                                  # started, then left unconsumed
    done = []
    t = threading.Thread(target=lambda: done.append(greedy(default_model, "Hello", 4)))
    t.start()
    t.join(timeout=60)
    assert done, "a second thread could not generate while a generator was abandoned"
    rest = "".join(g)                        # the stale generator still finishes correctly
    assert isinstance(rest, str)


# ------------------------------------------------------------- API fixes
def test_stop_string_is_one_string(default_model):
    full = greedy(default_model, "The capital of France is", 16)
    # a stop string whose first letter occurs earlier in the text: split into letters it would cut there
    k = next(k for k in range(2, len(full) - 3) if full[k] in full[:k] and full[k:k + 3].strip() == full[k:k + 3])
    stop = full[k:k + 3]
    first = full.find(stop)
    assert greedy(default_model, "The capital of France is", 16, stop=stop) == full[:first]
    assert greedy(default_model, "The capital of France is", 16, stop=[stop]) == full[:first]
    with pytest.raises(InvalidArgumentError):
        default_model.generate("x", stop=3)


def test_repeat_penalty_is_repetition_penalty(default_model):
    a = greedy(default_model, "la la la la la", 6, repeat_penalty=1.5)
    b = greedy(default_model, "la la la la la", 6, repetition_penalty=1.5)
    assert a == b
    with pytest.raises(InvalidArgumentError):
        default_model.generate("x", repeat_penalty=1.2, repetition_penalty=1.3)
    with pytest.raises(InvalidArgumentError):
        default_model.generate("x", temperature="hot")


def test_chat_records_a_partial_answer(default_model):
    chat = Chat(default_model, temperature=0.0)
    pieces = chat.send("Tell me a long story about a dragon.", max_tokens=64)
    read = [next(pieces), next(pieces)]
    pieces.close()
    assert [m["role"] for m in chat.messages] == ["user", "assistant"]
    assert chat.messages[-1]["content"] == "".join(read)
    "".join(chat.send("Thanks!", max_tokens=4))
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "user", "assistant"]


def test_chat_rejects_bad_sampling_at_once(default_model):
    with pytest.raises(InvalidArgumentError):
        Chat(default_model, top_p=5.0)
    with pytest.raises(TypeError):
        Chat(default_model, temprature=0.5)


def test_chat_turn_that_does_not_fit_leaves_history_alone(default_model):
    chat = Chat(default_model, temperature=0.0)
    with pytest.raises(ContextFullError):
        "".join(chat.send("word " * (default_model.context + 5), max_tokens=4))
    assert chat.messages == []


# ------------------------------------------------------------- penalties
def test_frequency_and_presence_penalties_follow_openai_formula():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(50).astype(np.float32)
    s = Sampler(50, SamplingParams(frequency_penalty=0.7, presence_penalty=0.4))
    history = [3, 3, 3, 9, 17, 9]
    for t in history:
        s.accept(t)
    counts = np.bincount(history, minlength=50)
    expected = logits - counts * 0.7 - (counts > 0) * 0.4
    assert s.sample(logits) == int(np.argmax(expected))
    # make the penalised favourite lose to the runner-up exactly as the formula says
    x = np.zeros(50, np.float32)
    x[3], x[5] = 3.0, 1.0
    s = Sampler(50, SamplingParams(frequency_penalty=0.5, presence_penalty=0.0))
    for _ in range(3):
        s.accept(3)                # 3 - 1.5 = 1.5 > 1
    assert s.sample(x) == 3
    s.accept(3)                    # 3 - 2.0 = 1.0: a tie, the first index wins
    s.accept(3)                    # 3 - 2.5 < 1
    assert s.sample(x) == 5
    with pytest.raises(InvalidArgumentError):
        SamplingParams(presence_penalty=3.0)


# ------------------------------------------------------- OpenAI-shaped API
def test_create_completion_dict_and_stream(default_model):
    r = default_model.create_completion("1, 2, 3,", max_tokens=6, temperature=0)
    assert r["object"] == "text_completion" and r["choices"][0]["text"].startswith(" 4, 5")
    assert r["usage"]["completion_tokens"] == 6 and r["choices"][0]["finish_reason"] == "length"
    chunks = list(default_model.create_completion("1, 2, 3,", max_tokens=6, temperature=0, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == r["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_create_chat_completion_matches_chat(default_model):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    # each from an empty cache: a reused prefix would put decode-computed positions where the
    # other ran prefill, and on quantized weights the two round activations differently
    default_model.kv_owner = None
    r = default_model.create_chat_completion(msgs, max_tokens=10, temperature=0)
    default_model.kv_owner = None
    ref = "".join(Chat(default_model, temperature=0.0).send(msgs[0]["content"], max_tokens=10))
    default_model.kv_owner = None
    assert r["choices"][0]["message"] == {"role": "assistant", "content": ref}
    chunks = list(cyllm.completions.create_chat_completion(default_model, msgs, max_tokens=10, temperature=0,
                                                           stream=True))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == ref


@pytest.mark.parametrize("kw", [dict(temperature="0.5"), dict(max_tokens=-1), dict(seed=1.5),
                                dict(stop=[1]), dict(stop=["x"] * 65), dict(logit_bias={"5": 101}), dict(whatever=1),
                                dict(messages_extra=1), dict(top_k=-2)])
def test_create_chat_completion_rejects_bad_arguments(default_model, kw):
    with pytest.raises(CyllmError):
        default_model.create_chat_completion([{"role": "user", "content": "hi"}], **kw)


@pytest.mark.parametrize("key", ["temperature", "top_k", "seed", "max_tokens", "logprobs", "model", "stop",
                                 "frobnicate"])
def test_a_huge_bad_value_makes_a_short_error_line(default_model, key):
    """A refused value is shown shortened: an 8 MB string in a request made an 8 MB error
    line (and server response)."""
    with pytest.raises(CyllmError) as e:
        default_model.create_chat_completion([{"role": "user", "content": "hi"}], **{key: {"x" * (8 << 20): 1}})
    assert len(str(e.value)) < 300 and "\n" not in str(e.value), str(e.value)[:300]


def test_cancel_stops_generation(default_model):
    stats = GenerationStats()
    calls = []

    def cancel():
        calls.append(1)
        return len(calls) > 5

    chunks = list(default_model.create_completion("1, 2, 3,", max_tokens=100, temperature=0, stream=True,
                                                  stats=stats, cancel=cancel))
    assert stats.stop_reason == "cancelled" and stats.generated_tokens <= 6
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)


# ------------------------------------------- structured output, HF tokenizer
def test_json_schema_on_a_hugging_face_tokenizer(tmp_path):
    """llguidance over a tokenizer.json model (the default model covers GGUF): a random
    tiny model still writes JSON that validates, because the grammar decides."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    import json

    from tinymodels import make_tiny_model

    tiny = cyllm.load(make_tiny_model(tmp_path, "llama_tied", seed=2), backend="numpy")
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["colour", "n"], "additionalProperties": False}
    for seed in (1, 2):
        r = tiny.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=40, seed=seed,
                                        temperature=1.0, response_format={
                                            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        assert r["choices"][0]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(r["choices"][0]["message"]["content"]), schema)
    with pytest.raises(InvalidArgumentError):
        tiny.create_completion("x", response_format={"type": "json_schema", "json_schema": {"schema": 5}})
    # the engine's multi-line message (a regex it cannot compile) comes back as one line
    backref = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(a)\\1"}}, "required": ["a"]}
    with pytest.raises(InvalidArgumentError) as e:
        tiny.create_completion("x", max_tokens=2, response_format={"type": "json_schema",
                                                                   "json_schema": {"schema": backref}})
    assert "\n" not in str(e.value) and "backreference" in str(e.value)


def test_echo_offsets_and_cancel_on_a_model_with_bos(family_material):
    """echo on a model whose tokenizer adds a BOS (Llama 3.2's tiny one): the echoed text is the
    prompt as given, the BOS sits at offset 0 and every other token's text starts at its
    text_offset; echo null is the default; a cancelled scoring pass returns nothing."""
    llm = cyllm.load(family_material.hf_dir("llama32"), backend="numpy")
    tok = llm.tokenizer
    prompt = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(prompt)
    assert ids[0] == tok.bos_id
    r = llm.create_completion(prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    c = r["choices"][0]
    lp = c["logprobs"]
    assert c["text"] == prompt and c["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 0
    assert len(lp["tokens"]) == len(ids) and lp["text_offset"][0] == 0
    for t, off in zip(ids[1:], lp["text_offset"][1:]):
        assert prompt[off:].startswith(tok.decode([t]).lstrip() if off == 0 else tok.decode([t]))
    assert llm.create_completion(prompt, max_tokens=2, echo=None)["choices"][0]["text"] != prompt
    assert collect(create_completion(llm, prompt, max_tokens=0, echo=True, logprobs=1, stream=True,
                                     cancel=lambda: True)) == {}
    # the stats a server logs: the scoring passes ran the prompt once, whatever n
    from cyllm.generate import GenerationStats
    st = GenerationStats()
    create_completion(llm, prompt, max_tokens=0, echo=True, logprobs=0, n=2, stats=st)
    assert (st.prompt_tokens, st.cached_tokens) == (len(ids), 0)
    # a special token the prompt spells out takes its length in the echoed text (the added BOS none)
    spelled = "The fox<|eot_id|> ran."
    ids = tok.encode(spelled)
    assert tok.token_to_id("<|eot_id|>") in ids
    lp = llm.create_completion(spelled, max_tokens=0, echo=True, logprobs=0)["choices"][0]["logprobs"]
    for name, off in zip(lp["tokens"][1:], lp["text_offset"][1:]):
        assert spelled[off:].startswith(name.lstrip() if off == 0 else name), (name, off)
    assert lp["text_offset"][-1] == len(spelled) - len(lp["tokens"][-1])
