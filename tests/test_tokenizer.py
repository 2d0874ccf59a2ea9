"""Tokenizer: parity with transformers' AutoTokenizer, chat templates, streaming."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from cyllm.errors import InvalidArgumentError, TokenizerError
from cyllm.tokenizer import Tokenizer

from tinymodels import CHAT_TEMPLATE, make_tiny_model, make_tokenizer, write_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    " leading space and  double  spaces",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber",                     # accented, in the corpus
    "\u00c5ngstr\u00f6m \u0152uvre \u0127\u0101\u0142",                # accented, unseen
    "Emoji \U0001f600\U0001f680 \U0001f980 \U0001f469\u200d\U0001f4bb \U0001f44d\U0001f3fd!",
    "\u4f60\u597d\uff0c\u4e16\u754c \u65e5\u672c\u8a9e \ud55c\uad6d\uc5b4 \u0645\u0631\u062d\u0628\u0627",
    "\u03a9\u03bc\u03ad\u03b3\u03b1 \u2603 \u221e \u00bd",
    "line one\nline two\n\n\ttabbed",
    "<s>special</s> tokens in text",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "  Hi there \u00e9\u00e8 \U0001f600  "},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "\u4f60\u597d?"},
]


@pytest.fixture(scope="module", params=["bytelevel", "sentencepiece"])
def tok_dir(request, tmp_path_factory):
    # a complete tiny model directory: the tokenizer is read as the loader reads it
    return make_tiny_model(tmp_path_factory.mktemp("tok"), "llama_tied", tokenizer=request.param)


@pytest.fixture(scope="module")
def pair(tok_dir):
    return Tokenizer.from_hf_dir(tok_dir), transformers.AutoTokenizer.from_pretrained(tok_dir)


def test_encode_matches_transformers(pair):
    ours, ref = pair
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == \
                ref.encode(text, add_special_tokens=special), (text, special)


def test_long_text_matches_transformers_and_lets_other_threads_run(pair):
    """Texts past _LONG_TEXT go through encode_batch, which releases the GIL: the same ids as
    transformers, and a thread beside the encode keeps running (a server's other requests)."""
    import threading
    import time

    from cyllm import tokenizer as T
    ours, ref = pair
    base = " ".join(TEXTS[:-1])
    text = base * (T._LONG_TEXT // len(base) + 1)
    assert len(text) >= T._LONG_TEXT
    for special in (True, False):
        assert ours.encode(text, add_special_tokens=special) == ref.encode(text, add_special_tokens=special)
    big = text * 40
    ticks, done = [], threading.Event()

    def ticker():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.002)

    th = threading.Thread(target=ticker)
    th.start()
    t0 = time.perf_counter()
    ours.encode(big)
    spent = time.perf_counter() - t0
    done.set()
    th.join()
    during = [t for t in ticks if t0 < t < t0 + spent]
    assert spent < 0.05 or len(during) >= 0.2 * spent / 0.002, (spent, len(during))


def test_lone_surrogate_is_one_clear_error(pair):
    ours, _ = pair
    with pytest.raises(InvalidArgumentError, match="not valid Unicode: a lone surrogate U[+]D800 at character 3"):
        ours.encode("abc\ud800def")


def test_decode_matches_transformers(pair):
    ours, ref = pair
    for text in TEXTS:
        ids = ours.encode(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == \
                ref.decode(ids, skip_special_tokens=skip), (text, skip)


def test_roundtrip_and_specials(pair):
    ours, _ = pair
    assert ours.bos_id == 1 and ours.eos_ids == {2} and ours.is_eos(2) and not ours.is_eos(1)
    assert ours.bos_token == "<s>" and ours.eos_token == "</s>"
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids[0] == ours.bos_id
        assert ours.decode(ids, skip_special_tokens=True).strip() == \
            text.replace("<s>", "").replace("</s>", "").strip()


def test_chat_template_matches_transformers(pair):
    ours, ref = pair
    for gen in (True, False):
        for msgs in (MESSAGES, MESSAGES[1:2]):
            want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == want


def test_chat_template_raise_exception(pair):
    ours, _ = pair
    with pytest.raises(TokenizerError, match="unknown role: robot"):
        ours.apply_chat_template([{"role": "robot", "content": "x"}])
    with pytest.raises(InvalidArgumentError):
        ours.apply_chat_template([{"content": "no role"}])


def _stream(tok, ids, skip=False):
    sd = tok.stream_decoder(skip_special_tokens=skip)
    parts = [sd.add(i) for i in ids]
    return parts, sd.flush()


def test_stream_decoder_reproduces_decode(pair):
    ours, _ = pair
    text = " ".join(TEXTS)
    for t in TEXTS + [text]:
        ids = ours.encode(t) + [2] + ours.encode(t, add_special_tokens=False)
        for skip in (False, True):
            parts, tail = _stream(ours, ids, skip)
            assert "".join(parts) + tail == ours.decode(ids, skip_special_tokens=skip), t
            # valid text never shows a replacement char mid-stream
            assert not any("\ufffd" in p for p in parts), parts
            assert tail == ""


def test_stream_decoder_emits_promptly(pair):
    ours, _ = pair
    ids = ours.encode("hello world, the quick brown fox", add_special_tokens=False)
    parts, _ = _stream(ours, ids)
    # ASCII text: after every token, all of its text is out (nothing held back)
    for k in range(1, len(ids) + 1):
        assert "".join(parts[:k]) == ours.decode(ids[:k]), k


def test_stream_decoder_random_ids(pair):
    ours, _ = pair
    vocab = ours._tok.get_vocab()
    byte_ids = {i for t, i in vocab.items() if t.startswith("<0x")}
    plain = [i for i in range(ours.vocab_size) if i not in byte_ids]
    enc = {ch: [ours.token_to_id(f"<0x{b:02X}>") for b in ch.encode()] for ch in "\U0001f980\u03a9\u00e9\u4e2d"}
    rng = random.Random(0)
    for trial in range(300):
        ids = []
        for _ in range(rng.randrange(1, 30)):
            if byte_ids and rng.random() < 0.3:
                ids += enc[rng.choice(list(enc))]       # valid byte-fallback runs
            else:
                ids.append(rng.choice(plain))          # anything else, specials included
        for skip in (False, True):
            parts, tail = _stream(ours, ids, skip)
            assert "".join(parts) + tail == ours.decode(ids, skip_special_tokens=skip), ids


def test_stream_decoder_split_utf8_bytes(pair):
    """A character split over several tokens is held back until it is complete."""
    ours, _ = pair
    ids = ours.encode("\U0001f980\U0001f980 \u0152", add_special_tokens=False)
    parts, tail = _stream(ours, ids)
    assert "".join(parts) + tail == "\U0001f980\U0001f980 \u0152"
    assert len(ids) > 3 and any(p == "" for p in parts)   # something was held back


def test_token_bytes_rebuild_the_text(pair):
    """Each token's bytes, joined, are the UTF-8 of transformers' decode of the ids (with the
    space marker decode strips at a text's start); an emoji's tokens are parts of a character."""
    ours, ref = pair
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        joined = b"".join(ours.token_bytes(i) for i in ids)
        want = ref.decode(ids).encode("utf-8")
        assert joined in (want, b" " + want), (text, joined, want)
    ids = ours.encode("\U0001f980\U0001f980", add_special_tokens=False)
    parts = [ours.token_bytes(i) for i in ids]
    assert b"".join(parts).strip() == "\U0001f980\U0001f980".encode()
    bad = 0
    for p in parts:
        try:
            p.decode("utf-8")
        except UnicodeDecodeError:
            bad += 1
    assert bad, f"no token holds part of a character ({parts}): the test would prove nothing"
    assert ours.token_bytes(2) == ref.convert_ids_to_tokens(2).encode()       # an added token: its content
    with pytest.raises(InvalidArgumentError):
        ours.token_bytes(ours.vocab_size)


def test_bad_ids(pair):
    ours, _ = pair
    with pytest.raises(InvalidArgumentError):
        ours.decode([ours.vocab_size])
    with pytest.raises(InvalidArgumentError):
        ours.decode([-1])
    with pytest.raises(InvalidArgumentError):
        ours.stream_decoder().add(10**9)
    with pytest.raises(InvalidArgumentError):
        ours.encode(b"bytes")


# ------------------------------------------------------------ files / variants
@pytest.fixture
def tok_files(tmp_path):
    d = tmp_path / "tok"
    d.mkdir()
    write_tokenizer(d, make_tokenizer("bytelevel"))
    return d


def _edit_config(d, **changes):
    p = d / "tokenizer_config.json"
    cfg = json.loads(p.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    p.write_text(json.dumps(cfg))


def test_file_padding_and_truncation_ignored(tok_files):
    """A tokenizer.json's padding and truncation (batch settings) do not reach a prompt: it
    encodes whole and unpadded, as transformers' encode does, even with a padding length
    that would take gigabytes."""
    p = tok_files / "tokenizer.json"
    spec = json.loads(p.read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0}
    spec["padding"] = {"strategy": {"Fixed": 100_000_000}, "direction": "Right", "pad_to_multiple_of": None,
                       "pad_id": 0, "pad_type_id": 0, "pad_token": "<pad>"}
    p.write_text(json.dumps(spec))
    ours = Tokenizer.from_hf_dir(tok_files)
    spec.pop("padding")                  # transformers would pad to the fixed length on its own load
    p.write_text(json.dumps(spec))
    ref = transformers.AutoTokenizer.from_pretrained(tok_files)
    for text in TEXTS:
        want = ref.encode(text, add_special_tokens=True)
        assert ours.encode(text, add_special_tokens=True) == want, text
    assert len(ours.encode(TEXTS[1])) > 2


def test_no_tokenizer_json_is_none(tmp_path):
    assert Tokenizer.from_hf_dir(tmp_path) is None


def test_garbage_tokenizer_json(tok_files):
    (tok_files / "tokenizer.json").write_text('{"version": "1.0", "model": 42}')
    with pytest.raises(TokenizerError, match="cannot load tokenizer"):
        Tokenizer.from_hf_dir(tok_files)


def test_bad_tokenizer_config(tok_files):
    (tok_files / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(TokenizerError, match="tokenizer_config.json is not valid JSON"):
        Tokenizer.from_hf_dir(tok_files)


def test_no_chat_template(tok_files):
    _edit_config(tok_files, chat_template=None)
    tok = Tokenizer.from_hf_dir(tok_files)
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)


def test_chat_template_list_and_file(tok_files):
    _edit_config(tok_files, chat_template=[{"name": "tool_use", "template": "TOOLS"},
                                           {"name": "default", "template": "D{{ messages|length }}"}])
    assert Tokenizer.from_hf_dir(tok_files).apply_chat_template(MESSAGES) == "D4"
    # chat_template.jinja wins over tokenizer_config.json, as in transformers
    (tok_files / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    tok = Tokenizer.from_hf_dir(tok_files)
    ref = transformers.AutoTokenizer.from_pretrained(tok_files)
    assert tok.apply_chat_template(MESSAGES) == \
        ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


def test_template_helpers(tok_files):
    tmpl = ("{{ strftime_now('%Y') | length }}|{{ messages[0] | tojson }}|"
            "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}"
            "{% generation %}G{% endgeneration %}")
    _edit_config(tok_files, chat_template=tmpl)
    out = Tokenizer.from_hf_dir(tok_files).apply_chat_template(MESSAGES[1:])
    assert out == '4|{"role": "user", "content": "  Hi there \u00e9\u00e8 \U0001f600  "}|userG'


def test_template_compile_error_and_sandbox(tok_files):
    _edit_config(tok_files, chat_template="{% for %}")
    with pytest.raises(TokenizerError, match="does not compile"):
        Tokenizer.from_hf_dir(tok_files).apply_chat_template(MESSAGES)
    _edit_config(tok_files, chat_template="{{ messages.append(1) }}")
    with pytest.raises(TokenizerError):
        Tokenizer.from_hf_dir(tok_files).apply_chat_template(MESSAGES)


def test_special_tokens_as_dicts_and_ids_from_config(tok_files):
    _edit_config(tok_files, bos_token={"content": "<s>"}, eos_token=None)
    (tok_files / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    tok = Tokenizer.from_hf_dir(tok_files)
    assert tok.bos_id == 1 and tok.eos_ids == {2, 5}
    assert tok.eos_token == "</s>"          # spelled from the first eos id


def test_explicit_add_bos(tok_files):
    base = Tokenizer.from_hf_dir(tok_files)
    raw = base.backend
    plain = raw.encode("hi there", add_special_tokens=False).ids
    on = Tokenizer(raw, bos_id=1, eos_ids=[2], add_bos=True)
    off = Tokenizer(raw, bos_id=1, eos_ids=[2], add_bos=False)
    assert on.encode("hi there") == [1] + plain
    assert on.encode("<s>hi there")[0] == 1 and on.encode("<s>hi there")[1] != 1
    assert on.encode("hi there", add_special_tokens=False) == plain
    assert off.encode("hi there") == plain


def test_copy_of_model_dir_tokenizer(tok_dir, tmp_path):
    # the directory written by make_tiny_model loads through the full loader too
    from cyllm.loading import load_path
    d = tmp_path / "m"
    shutil.copytree(tok_dir, d)
    config, _, tok = load_path(d)
    assert tok.vocab_size == config.vocab_size
