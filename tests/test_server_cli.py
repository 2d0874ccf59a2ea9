"""`cyllm serve` as a user runs it: a subprocess on a free port, its errors, its log lines."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")


def cyllm(*args, **kw):
    return subprocess.run([sys.executable, "-m", "cyllm", *args], capture_output=True, text=True,
                          timeout=120, **kw)


def one_error_line(r):
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cyllm: error:"), r.stderr
    return lines[0]


def test_bad_port_and_taken_port_are_one_line_errors():
    assert "port" in one_error_line(cyllm("serve", "--port", "70000"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        line = one_error_line(cyllm("serve", "--port", str(s.getsockname()[1])))
        assert "cannot listen" in line


def test_missing_server_extra_says_what_to_install():
    code = ("import sys; sys.modules['fastapi'] = None; from cyllm.tools.cli import main; "
            "sys.exit(main(['serve']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert 'pip install "cyllm[server]"' in one_error_line(r)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_answers_openai_requests_and_logs_one_line_each(default_model_file):
    port = free_port()
    env = dict(os.environ, CYLLM_API_KEY="k")
    p = subprocess.Popen([sys.executable, "-m", "cyllm", "serve", "-m", str(default_model_file), "--port",
                          str(port), "-c", "512"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = p.stderr.readline()
        assert f"http://127.0.0.1:{port}/v1" in line and "API key required" in line, line
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert time.time() < deadline
                time.sleep(0.1)
        headers = {"authorization": "Bearer k"}
        r = httpx.post(url + "/v1/chat/completions", headers=headers, timeout=120, json={
            "model": "x", "messages": [{"role": "user", "content": "What is the capital of Japan?"}],
            "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200 and "Tokyo" in r.json()["choices"][0]["message"]["content"]
        assert r.json()["model"] == default_model_file.name
        assert httpx.post(url + "/v1/completions", content=b"{", headers=headers).status_code == 400
        assert httpx.get(url + "/v1/models").status_code == 401
    finally:
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
    logged = [ln for ln in err.splitlines() if " ms" in ln and ("POST" in ln or "GET" in ln)]
    assert any("POST /v1/chat/completions 200" in ln and "generated" in ln and "tok/s" in ln and "ttft" in ln
               for ln in logged), err
    assert any("POST /v1/completions 400" in ln for ln in logged), err
    assert any("GET /v1/models 401" in ln for ln in logged), err
    assert "Traceback" not in err
