"""Chat on the real default model: the answer, the KV cache reused across turns, piped stdin."""

import subprocess
import sys

import numpy as np

from cyllm.generate import Chat, Session


def test_capital_of_japan_names_tokyo(default_model):
    chat = Chat(default_model, temperature=0.0)
    answer = "".join(chat.send("What is the capital of Japan?", max_tokens=32))
    assert "Tokyo" in answer


def test_second_turn_reuses_the_cache_and_matches_a_fresh_run(default_model):
    chat = Chat(default_model, system="You are a helpful assistant.", temperature=0.0)
    "".join(chat.send("Name a colour.", max_tokens=12))
    second = "".join(chat.send("And a fruit?", max_tokens=12))
    stats = chat.last_stats
    assert stats.cached_tokens > 0
    # only the new turn went through prefill, not the whole conversation
    rendered = default_model.tokenizer.apply_chat_template(chat.messages[:-1], add_generation_prompt=True)
    full = default_model.tokenizer.encode(rendered, add_special_tokens=False)
    assert stats.prompt_tokens + stats.cached_tokens == len(full)
    assert stats.prompt_tokens < len(full) // 2
    # the answer equals a from-scratch evaluation of the same conversation
    fresh = Session(default_model)
    logits = fresh.feed(full).copy()
    ids = default_model.tokenizer.encode(second, add_special_tokens=False)
    assert int(np.argmax(logits)) == ids[0]


def test_cli_chat_reads_piped_stdin(default_model_file):
    r = subprocess.run([sys.executable, "-m", "cyllm", "chat", "-m", str(default_model_file), "-n", "24",
                        "--temp", "0", "--no-stats"],
                       input="What is the capital of Japan?\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Tokyo" in r.stdout
