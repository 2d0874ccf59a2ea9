"""`cyllm serve` as a user runs it: a subprocess on a free port, its errors, its log lines."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
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


def serve(model_file, *args, env=None):
    """`cyllm serve` on a free port: (the process, its base URL, its first stderr line), once
    /health answers. The caller stops the process."""
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "cyllm", "serve", "-m", str(model_file), "--port", str(port), *args],
                         stderr=subprocess.PIPE, text=True, env=env)
    line = p.stderr.readline()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return p, url, line
        except httpx.TransportError:
            assert time.time() < deadline and p.poll() is None, line
            time.sleep(0.1)


def test_serve_answers_openai_requests_and_logs_one_line_each(default_model_file):
    p, url, line = serve(default_model_file, "-c", "512", env=dict(os.environ, CYLLM_API_KEY="k"))
    try:
        assert f"{url}/v1" in line and "API key required" in line, line
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


# a JSON string of at least 6000 characters: the grammar allows no end before the context is full,
# so the first generation is still running when the signal comes, however fast the machine
LONG_STORY = {"messages": [{"role": "user", "content": "Tell a very long story."}], "max_tokens": 4000,
              "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
                  "name": "story", "schema": {"type": "string", "minLength": 6000}}}}


def plain_request(url, answers):
    r = httpx.post(url + "/v1/chat/completions", json=LONG_STORY, timeout=60)
    answers.append((r.status_code, r.json()))


def streamed_request(url, answers, started: threading.Event):
    """Appends the SSE data lines of one streamed request; ``started`` is set at its first content."""
    with httpx.stream("POST", url + "/v1/chat/completions", json=dict(LONG_STORY, stream=True), timeout=60) as r:
        lines = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if '"content":"' in line and '"content":""' not in line:
                    started.set()
        answers.append(lines)


@pytest.mark.parametrize("stream, sig", [(False, signal.SIGTERM), (True, signal.SIGTERM), (False, signal.SIGINT)],
                         ids=["plain-SIGTERM", "streamed-SIGTERM", "plain-SIGINT"])
def test_shutdown_ends_running_and_queued_requests_at_once(default_model_file, stream, sig):
    """A signal while one generation runs and another waits: both clients get OpenAI's error
    (plain: a 503 error object; streamed: an error event, then the stream ends without [DONE]),
    the process exits well within uvicorn's 3 s graceful timeout, and the log has no traceback."""
    p, url, _ = serve(default_model_file, "-c", "2048")      # room for ~2000 tokens: far longer than the test
    answers, started, clients = [], threading.Event(), []
    try:
        for _ in range(2):          # the first one runs, the second waits in the queue
            target, args = (streamed_request, (url, answers, started)) if stream else (plain_request, (url, answers))
            clients.append(threading.Thread(target=target, args=args, daemon=True))
            clients[-1].start()
        if stream:
            assert started.wait(30), "no token came"
        else:
            time.sleep(1.5)         # the requests arrive; the first one is generating
        t0 = time.perf_counter()
        p.send_signal(sig)
        _, err = p.communicate(timeout=30)
        exit_s = time.perf_counter() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    for c in clients:
        c.join(timeout=10)
    assert exit_s < 2.0, (exit_s, err)
    assert "Traceback" not in err and "Exception in ASGI application" not in err, err
    assert len(answers) == 2, (answers, err)
    errors = [shutdown_error(answer, stream) for answer in answers]
    assert all(e["message"] == "the server is shutting down" and e["type"] == "server_error" for e in errors), errors
    logged = [line for line in err.splitlines() if "POST /v1/chat/completions" in line]
    assert len(logged) == 2 and all(line.endswith("| server shutting down") for line in logged), err
    assert all((" 200 " if stream else " 503 ") in line for line in logged), err


def shutdown_error(answer, stream: bool) -> dict:
    """The error object that ended one client's answer."""
    if not stream:
        status, body = answer
        assert status == 503, answer
        return body["error"]
    assert "[DONE]" not in answer, answer[-3:]
    assert all("error" not in json.loads(line) for line in answer[:-1]), answer[-3:]
    return json.loads(answer[-1])["error"]
