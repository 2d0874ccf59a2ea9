"""Hostile chat templates: a template that raises, overflows, recurses or
runs for minutes is one TokenizerError line, from a Hugging Face directory, a chat_template.jinja
file or a GGUF's metadata; rendering is bounded in time and in output size; and real template
features still render exactly as transformers renders them.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

import cyllm.template_sandbox as sandbox
import gguf_raw as G
from cyllm.tools.cli import main
from cyllm.errors import TokenizerError
from cyllm.tokenizer import _compile_template
from tinymodels import make_tiny_model

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Caf\u00e9 \u4f60\u597d?"}]


@pytest.fixture
def fast_deadline(monkeypatch):
    monkeypatch.setattr(sandbox, "MAX_SECONDS", 0.5)


def render(source: str, **kw) -> str:
    return _compile_template(source).render(messages=MESSAGES, add_generation_prompt=True,
                                             bos_token="<s>", eos_token="</s>", **kw)


def refused(source: str, *needles, seconds: float = 4.0) -> str:
    t0 = time.monotonic()
    with pytest.raises(TokenizerError) as e:
        render(source)
    msg = str(e.value)
    assert "\n" not in msg and msg.isprintable(), repr(msg)
    for n in needles:
        assert n.lower() in msg.lower(), (n, msg)
    assert time.monotonic() - t0 < seconds, f"{time.monotonic() - t0:.1f} s for {source[:60]!r}"
    return msg


HOSTILE = {
    # name: (template, words the message holds)
    "divides by zero": ("{{ 1/0 }}", ["ZeroDivisionError"]),
    "range of a million": ("{% for i in range(10**6) %}x{% endfor %}", ["range"]),
    "nested loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     ["longer than"]),
    "loops over a long string": ("{% for c in 'x' * 100000 %}{% for d in 'y' * 100000 %}{% endfor %}{% endfor %}",
                                 ["longer than"]),
    "lipsum": ("{{ lipsum(10**7) }}", ["lipsum"]),
    "string repetition": ("{{ 'x' * 10**10 }}", ["repeats"]),
    "list repetition": ("{{ [0] * 10**9 }}", ["repeats"]),
    "huge power": ("{{ 10 ** 100000 }}", ["bits"]),
    "squaring in a loop": ("{% set ns = namespace(v=3) %}{% for i in range(40) %}{% set ns.v = ns.v * ns.v %}"
                           "{% endfor %}{{ ns.v }}", ["bits"]),
    "doubling a string with ~": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
                                 "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}", ["characters"]),
    "doubling a string with +": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
                                 "{% set ns.s = ns.s + ns.s %}{% endfor %}", ["items"]),
    "printf width": ("{{ '%999999999d' % 1 }}", ["width"]),
    "printf star width": ("{{ '%*d' % (10**9, 1) }}", ["width"]),
    "format width": ("{{ '{:>999999999}'.format(1) }}", ["width"]),
    "format nested width": ("{{ '{:>{}}'.format(1, 10**9) }}", ["nest"]),
    "format filter width": ("{{ '%999999999s' | format('x') }}", ["width"]),
    "center filter": ("{{ 'x' | center(10**9) }}", ["center"]),
    "ljust method": ("{{ 'x'.ljust(10**9) }}", ["ljust"]),
    "expandtabs": ("{{ ('\t' * 60000).expandtabs(60000) }}", ["expandtabs"]),
    "replace growth": ("{{ ('x' * 60000) | replace('', 'y' * 60000) }}", ["replace"]),
    "join growth": ("{{ range(100000) | join('y' * 60000) }}", ["join"]),
    "indent growth": ("{{ ('\n' * 100000) | indent(60000) }}", ["indent"]),
    "batch fill": ("{{ [1] | batch(10**9, 'x') | list }}", ["batch"]),
    "tojson indent": ("{{ messages | tojson(indent=10**9) }}", ["indent"]),
    "macro recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", ["recursed"]),
    "recursive loop": ("{% for x in [[1]] recursive %}{{ loop([x]) }}{% endfor %}", ["recursed"]),
    "output of 100 GB": ("{% set big = 'x' * 1000000 %}{% for i in range(100000) %}{{ big }}{% endfor %}",
                         ["output"]),
    "block capture": ("{% set big = 'x' * 1000000 %}{% set y %}{% for i in range(100000) %}{{ big }}{% endfor %}"
                      "{% endset %}{{ y }}", ["output"]),
    "unsafe attribute": ("{{ ''.__class__.__mro__ }}", ["unsafe"]),
    "undefined": ("{{ nothing.here }}", ["undefined"]),
    "include": ("{% include 'x' %}", ["render"]),
    "syntax error": ("{% for %}", ["compile"]),
    "parenthesis bomb": ("{{ " + "(" * 100000 + "1" + ")" * 100000 + " }}", ["compile"]),
    "too long": ("x" * (sandbox.MAX_TEMPLATE_CHARS + 1), ["characters"]),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_template_is_one_line(name, fast_deadline):
    source, needles = HOSTILE[name]
    refused(source, *needles)


def test_deadline_is_the_default_bound():
    """Without the test's short deadline a runaway template stops at MAX_SECONDS."""
    t0 = time.monotonic()
    refused("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "longer than", seconds=sandbox.MAX_SECONDS + 3)
    assert time.monotonic() - t0 >= sandbox.MAX_SECONDS * 0.9


def test_template_text_cannot_forge_lines():
    msg = refused("{{ raise_exception('first line\nsecond line\r\x1b[31m') }}", "chat template error")
    assert "first line\\nsecond line" in msg and "\\x1b[31m" in msg
    msg = refused("{{ messages[0].content.foo() }}")
    assert "\n" not in msg


def test_render_is_reentrant_and_leaves_no_deadline_behind(fast_deadline):
    refused("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "longer than")
    assert getattr(sandbox._state, "deadline", None) is None
    assert render("{{ messages | length }}") == "4"


# ---------------------------------------------------------------- real features render as transformers does

FEATURES = (
    "{{ bos_token }}{% set ns = namespace(sys='') %}"
    "{% for m in messages %}{% if m.role == 'system' %}{% set ns.sys = ns.sys ~ m.content %}{% endif %}{% endfor %}"
    "{% if ns.sys %}[SYS {{ '%-12s|' % ns.sys }}]{% endif %}"
    "{% for m in messages if m.role != 'system' %}"
    "{{ '<%s %d/%d>' % (m.role, loop.index, loop.length) }}{{ m.content | trim | replace('!', '.') }}"
    "{% if loop.last %}{{ ' (last)' }}{% endif %}{{ eos_token if m.role == 'assistant' else '' }}\n"
    "{% endfor %}"
    "{{ messages | map(attribute='role') | join(', ') }}|{{ '{:>6}'.format('ok') }}|"
    "{{ messages[:1] | tojson(indent=2) }}|{{ (messages | length) ** 2 }}|{{ 'ab' * 3 }}|{{ [1, 2] + [3] }}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_features_render_as_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    d = make_tiny_model(tmp_path, "llama_tied")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = FEATURES
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ref = transformers.AutoTokenizer.from_pretrained(d).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)
    from cyllm.tokenizer import Tokenizer
    ours = Tokenizer.from_hf_dir(d).apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert ours == ref


# ---------------------------------------------------------------- every source of templates

def _cli(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def _one_line_cli_error(code, err, *needles):
    lines = [l for l in err.splitlines() if l.strip() and not l.startswith("cyllm: warning:")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("cyllm: error:"), err
    for n in needles:
        assert n in lines[0], (n, err)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tpl"), "llama_mqa_odd")


@pytest.mark.parametrize("where", ["tokenizer_config", "jinja_file"])
def test_template_from_hf_directory(tiny, tmp_path, capsys, where, fast_deadline):
    d = tmp_path / "m"
    shutil.copytree(tiny, d)
    bad = "{% for m in messages %}{{ m.content }}{% endfor %}{{ 1/0 }}"
    if where == "tokenizer_config":
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg["chat_template"] = bad
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    else:
        (d / "chat_template.jinja").write_text(bad)
    _one_line_cli_error(*_cli(capsys, "generate", "-m", d, "-p", "hi", "-n", "1", "--chat-template"),
                        "ZeroDivisionError")


def test_template_from_gguf_metadata(tmp_path, capsys, fast_deadline):
    from test_gguf import write_tiny_gguf
    p = tmp_path / "t.gguf"
    write_tiny_gguf(p)
    g = G.RawGGUF.parse(p.read_bytes())
    g.set("tokenizer.chat_template", G.STRING,
          "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    p.write_bytes(g.to_bytes())
    t0 = time.monotonic()
    _one_line_cli_error(*_cli(capsys, "generate", "-m", p, "-p", "hi", "-n", "1", "--chat-template"),
                        "longer than")
    assert time.monotonic() - t0 < 10


def test_template_file_size_bound(tiny, tmp_path):
    from cyllm.tokenizer import read_template_file
    f = tmp_path / "big.jinja"
    f.write_text("x" * (sandbox.MAX_TEMPLATE_CHARS + 10))
    with pytest.raises(TokenizerError, match="beyond any real one"):
        read_template_file(f)


def test_template_from_the_command_line(tiny, tmp_path, capsys, fast_deadline):
    f = tmp_path / "evil.jinja"
    for source, needle in (("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                            "longer than"),
                           ("{{ raise_exception('line one\nline two') }}", "line one\\nline two"),
                           ("{{ 'x' * 10**10 }}", "repeats")):
        f.write_text(source)
        _one_line_cli_error(*_cli(capsys, "generate", "-m", tiny, "-p", "hi", "-n", "1", "--chat-template", f),
                            needle)
