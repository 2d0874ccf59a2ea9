"""`cyllm chat` as a REPL: at a real (pseudo-)terminal with the default model, and piped.

The pty tests type, paste and press Ctrl-C the way a person does: the terminal's line
discipline turns \\x03 into SIGINT for the chat process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from cyllm.errors import InvalidArgumentError
from cyllm.tools.repl import ChatRepl, read_conversation
from ptyrun import CTRL_C, PASTE_END, PASTE_START, PtyProcess, cyllm_argv
from tinymodels import make_tiny_model

pytestmark = pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")

PROMPT = rb"\x1b\[\?2004h> "         # readline re-enables bracketed paste before each prompt
# one thread, passive waiting: these tests measure behaviour, and the CI machine is shared
QUIET_CPU = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive"}


@pytest.fixture
def chat_env(tmp_path):
    return {"XDG_STATE_HOME": str(tmp_path / "state"), "CYLLM_DEBUG": "1", **QUIET_CPU}


def start(model_file, env, *extra):
    p = PtyProcess(cyllm_argv("chat", "-m", model_file, "--temp", "0", *extra), env=env)
    p.expect(rb"/help lists the commands")
    p.expect(PROMPT)
    return p


def ctrl_c_at_prompt(p):
    # Python's readline checks for signals only when its select() is interrupted: a SIGINT
    # landing between the prompt being drawn and select() is seen at the next key. A person
    # is never that fast; the test waits as long as one.
    time.sleep(0.5)
    p.send(CTRL_C)


def saved(p, path):
    p.send(f"/save {path}\r")
    p.expect(rb"saved \d+ messages")
    p.expect(PROMPT)
    return json.loads(path.read_text())["messages"]


def test_ctrl_c_stops_the_answer_and_the_chat_goes_on(default_model_file, chat_env, tmp_path):
    p = start(default_model_file, chat_env, "-n", "400")
    try:
        p.send("Write a very long story about a dragon who learns to cook.\r")
        p.expect(rb"cook\.\r\n")                   # the echo of the line
        p.expect(rb"\w+\W+\w+\W+\w+")               # the answer is streaming
        p.send(CTRL_C)
        p.expect(rb"answer stopped")
        p.expect(PROMPT)
        msgs = saved(p, tmp_path / "a.json")
        assert [m["role"] for m in msgs] == ["user", "assistant"]
        assert msgs[1]["content"].strip()           # what was said stays in the conversation
        p.send("What is the capital of France?\r")
        p.expect(rb"France\?\r\n")
        p.expect(PROMPT)
        msgs = saved(p, tmp_path / "b.json")
        assert [m["role"] for m in msgs] == ["user", "assistant"] * 2 and msgs[3]["content"].strip()
        p.send("/exit\r")
        assert p.wait() == 0
        out = p.text()
        assert "Traceback" not in out
        # statistics once, at the end (no --verbose): no per-answer line
        assert out.count("chat: 2 answers") == 1
        assert not any(ln.lstrip("\r").startswith("prompt:") for ln in out.splitlines())
        assert (tmp_path / "state" / "cyllm" / "chat_history").is_file()
    finally:
        p.close()


def test_ctrl_c_clears_a_typed_line_and_twice_leaves(default_model_file, chat_env):
    p = start(default_model_file, chat_env, "-n", "8")
    try:
        p.send("half a thought")
        ctrl_c_at_prompt(p)
        p.expect(rb"Ctrl-C again or Ctrl-D to leave")
        p.expect(PROMPT)
        ctrl_c_at_prompt(p)
        assert p.wait() == 0
        assert "Traceback" not in p.text()
    finally:
        p.close()


def test_ctrl_c_at_an_empty_prompt_leaves(default_model_file, chat_env):
    p = start(default_model_file, chat_env, "-n", "8")
    try:
        ctrl_c_at_prompt(p)
        assert p.wait() == 0
    finally:
        p.close()


def test_a_long_paste_arrives_whole(default_model, default_model_file, chat_env, tmp_path):
    para = ("The river ran past the old mill, where children once played among the wheels "
            "and the miller sang songs about the harvest.")
    text = "Summarize these notes:\n" + "\n".join(f"{i}. {para}" for i in range(58))
    assert len(text) > 7000                       # the paste: 7,215 characters
    p = start(default_model_file, chat_env, "-n", "1", "--verbose", "-c", "2048")
    try:
        # a terminal sends a paste between bracketed-paste markers, newlines as CR
        p.send(PASTE_START + text.replace("\n", "\r").encode() + PASTE_END + b"\r", chunk=512)
        stats = p.expect(rb"prompt: (\d+) tokens[^\n]*\n", timeout=300)
        n_prompt = int(stats.rsplit(b"prompt: ", 1)[1].split()[0])
        p.expect(PROMPT)
        msgs = saved(p, tmp_path / "c.json")
        assert msgs[0] == {"role": "user", "content": text}
        tok = default_model.tokenizer
        want = len(tok.encode(tok.apply_chat_template(msgs[:1], add_generation_prompt=True),
                              add_special_tokens=False))
        assert n_prompt == want > 1600
        p.send("/exit\r")
        assert p.wait() == 0
    finally:
        p.close()


# -- piped: every line a message, same commands -----------------------------------------------
def piped(model_file, lines, *extra, timeout=600):
    return subprocess.run([sys.executable, "-m", "cyllm", "chat", "-m", str(model_file), "--temp", "0", *extra],
                          input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONIOENCODING": "utf-8", **QUIET_CPU})


def test_commands_when_piped(default_model_file, tmp_path):
    f, g = tmp_path / "f.json", tmp_path / "g.json"
    r = piped(default_model_file, ["/system You are a pirate.", "/system", "What is the capital of France?",
                                   f"/save {f}", "/clear", f"/save {g}", "/bogus", "/help",
                                   "/exit", "never sent"], "-n", "16")
    assert r.returncode == 0, r.stderr
    msgs = json.loads(f.read_text())["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant"]
    assert msgs[0]["content"] == "You are a pirate."
    assert json.loads(g.read_text())["messages"] == [msgs[0]]           # /clear keeps the system prompt
    assert "system prompt: You are a pirate." in r.stderr
    assert "unknown command /bogus" in r.stderr
    assert "/clear, /reset" in r.stderr                                  # /help
    assert "chat: 1 answer |" in r.stderr                                  # "never sent" was not
    assert r.stdout.count("\n") == 1                                       # stdout holds only the answer


def test_load_continues_a_saved_conversation(default_model_file, tmp_path):
    conv = tmp_path / "conv.json"
    conv.write_text(json.dumps({"messages": [
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": "Hello Ada!"}]}))
    bad = tmp_path / "bad.json"
    bad.write_text('[{"role": "wizard", "content": 1}]')
    out = tmp_path / "out.json"
    r = piped(default_model_file, [f"/load {bad}", f"/load {conv}", "What is my name?", f"/save {out}"],
              "-n", "12")
    assert r.returncode == 0, r.stderr
    assert "message 1 is not" in r.stderr and "loaded 2 messages" in r.stderr
    msgs = json.loads(out.read_text())["messages"]
    assert [m["content"] for m in msgs[:3]] == ["My name is Ada.", "Hello Ada!", "What is my name?"]


def test_statistics_once_or_every_answer(default_model_file):
    quiet = piped(default_model_file, ["Hi", "Bye"], "-n", "4")
    assert quiet.returncode == 0
    lines = quiet.stderr.splitlines()
    assert [ln for ln in lines if ln.startswith("chat: ")] == [lines[-1]] and "2 answers" in lines[-1]
    assert not [ln for ln in lines if ln.startswith("prompt:")]
    verbose = piped(default_model_file, ["Hi", "Bye"], "-n", "4", "--verbose")
    assert len([ln for ln in verbose.stderr.splitlines() if ln.startswith("prompt:")]) == 2
    none = piped(default_model_file, ["Hi"], "-n", "4", "--no-stats")
    assert none.stderr == ""


def test_a_full_context_drops_the_oldest_turns(default_model_file, tmp_path):
    out = tmp_path / "o.json"
    questions = ["Tell me about the sea.", "Tell me about the mountains.", "Tell me about the sky.",
                 "Tell me about forests.", "Tell me about rivers."]
    r = piped(default_model_file, questions + [f"/save {out}"], "-n", "48", "-c", "160",
              "-s", "You are a helpful assistant.")
    assert r.returncode == 0, r.stderr
    assert "context full: dropped the 2 oldest messages (the system prompt stays)" in r.stderr
    assert "chat: 5 answers" in r.stderr
    msgs = json.loads(out.read_text())["messages"]
    assert msgs[0] == {"role": "system", "content": "You are a helpful assistant."}
    assert msgs[-2]["content"] == questions[-1] and len(msgs) < 1 + 2 * len(questions)


# -- the parts, on a tiny model --------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    import cyllm
    return cyllm.load(make_tiny_model(tmp_path_factory.mktemp("repl"), "llama_tied"), backend="numpy",
                      context=64)


def test_fit_keeps_the_system_prompt_and_drops_whole_turns(tiny_model):
    from cyllm.generate import Chat
    chat = Chat(tiny_model, system="sys")
    repl = ChatRepl(tiny_model, chat, max_tokens=8, stop=[], verbose=False, quiet=True, interactive=False)
    msgs = [{"role": "system", "content": "sys"}]
    for i in range(6):
        msgs += [{"role": "user", "content": f"question {i} " * 3}, {"role": "assistant", "content": f"answer {i}"}]
    msgs.append({"role": "user", "content": "last"})
    kept, dropped, n = repl.fit(msgs)
    assert kept[0] == msgs[0] and kept[-1] == msgs[-1]
    assert dropped % 2 == 0 and dropped > 0 and kept[1:] == msgs[1 + dropped:]
    assert n == repl.count(kept) <= tiny_model.context - repl.reserve()
    assert kept[1]["role"] == "user"                     # turns go whole: no orphan answer first
    assert repl.count(msgs[:1] + msgs[dropped - 1:]) > tiny_model.context - repl.reserve()   # minimal drop


def _fit_turn_by_turn(repl, messages):
    """The reference: drop the oldest turn and count again, until it fits."""
    msgs = list(messages)
    limit = repl.model.context - repl.reserve()
    dropped, n = 0, repl.count(msgs)
    while n > limit:
        first = 1 if msgs and msgs[0]["role"] == "system" else 0
        if first >= len(msgs) - 1:
            break
        del msgs[first]
        dropped += 1
        if first < len(msgs) - 1 and msgs[first]["role"] == "assistant":
            del msgs[first]
            dropped += 1
        n = repl.count(msgs)
    return msgs, dropped, n


def test_fit_bisects_to_what_dropping_turn_by_turn_gives(tiny_model):
    """fit finds the drops by bisection: the same messages as dropping one turn at a time and
    counting again, on conversations of every shape (system prompt or none, answers missing or
    doubled, a last message too long to fit alone), in a few renders of the template where a
    loaded conversation of 3000 messages took one render per turn (minutes)."""
    import random

    from cyllm.generate import Chat
    repl = ChatRepl(tiny_model, Chat(tiny_model), max_tokens=8, stop=[], verbose=False, quiet=True,
                    interactive=False)
    rng = random.Random(0)
    for case in range(40):
        msgs = [{"role": "system", "content": "sys " * rng.randint(0, 6)}] if case % 2 else []
        for _ in range(rng.randint(0, 12)):
            msgs.append({"role": rng.choice(["user", "user", "assistant"]), "content": "w " * rng.randint(0, 12)})
        msgs.append({"role": "user", "content": "last " * (40 if case % 7 == 0 else rng.randint(1, 4))})
        assert repl.fit(msgs) == _fit_turn_by_turn(repl, msgs), case
    long = [{"role": "system", "content": "s"}]
    for i in range(1500):
        long += [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
    long.append({"role": "user", "content": "last"})
    calls = []
    count = repl.count
    repl.count = lambda m: calls.append(len(m)) or count(m)
    kept, dropped, n = repl.fit(long)
    assert kept[0] == long[0] and kept[-1] == long[-1] and kept[1:] == long[1 + dropped:] and dropped % 2 == 0
    assert n <= tiny_model.context - repl.reserve() < count(long[:1] + long[dropped - 1:])
    assert len(calls) <= 14, len(calls)          # 1 + log2(1501) + 1


def test_read_conversation_checks_what_it_loads(tmp_path):
    f = tmp_path / "c.json"
    cases = {
        "[1, 2]": "message 1 is not",
        '{"messages": {"a": 1}}': "expected a list",
        '[{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]': "must come first",
        "[" * 100000: "not a conversation",
    }
    for text, needle in cases.items():
        f.write_text(text)
        with pytest.raises(InvalidArgumentError, match=needle):
            read_conversation(f)
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        read_conversation(tmp_path / "missing.json")
    f.write_text('[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]')
    assert read_conversation(f) == [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
