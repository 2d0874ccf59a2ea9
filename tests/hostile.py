"""Running cyllm's command line on hostile input under limits, and judging the outcome
(for tests/test_fuzz.py and tests/test_hardening*.py; not a test module).

The promise checked: every run ends with exit status 0, or with exit status 2
and exactly one line ``cyllm: error: ...`` on stderr (one-line warnings may
precede it); never a traceback, a signal, more than ``seconds`` or more than
``mem_mb`` of address space.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MEM_MB = 2048          # the tiny models run in ~1 GB of address space
CASE_SECONDS = 30      # chat templates stop at 5 s; loading a tiny model takes well under 1 s


def _limits(mem_mb: int):
    def apply():
        limit = mem_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")     # many short runs side by side: no oversubscription
    env.pop("CYLLM_DEBUG", None)
    return env


def problem(code, stderr: str) -> str | None:
    """What breaks the promise in one run's outcome, or None."""
    if code == "timeout":
        return "ran past its time limit"
    if code == "exception":
        return "an exception escaped cyllm.tools.cli.main"
    if isinstance(code, int) and code < 0:
        return f"killed by signal {-code}"
    if "Traceback (most recent call last)" in stderr:
        return "printed a traceback"
    lines = [l for l in stderr.splitlines() if l.strip() and not l.startswith("cyllm: warning:")]
    if code == 0:
        return None
    if code != 2:
        return f"exit status {code}"
    errors = [l for l in lines if l.startswith("cyllm: error:")]
    if len(errors) != 1 or len([l for l in lines if not _is_stats(l)]) != 1:
        return "exit status 2 without exactly one 'cyllm: error:' line"
    return None


def _is_stats(line: str) -> bool:
    return line.startswith("prompt:") or line.startswith("cyllm chat")


def run_cli(argv: list[str], mem_mb: int = MEM_MB, seconds: float = CASE_SECONDS, stdin: str = ""):
    """One ``python -m cyllm ARGV`` under an address-space limit; (exit code or "timeout", stderr)."""
    try:
        r = subprocess.run([sys.executable, "-m", "cyllm", *argv], input=stdin, capture_output=True,
                           text=True, errors="replace", timeout=seconds, preexec_fn=_limits(mem_mb),
                           env=_env())
    except subprocess.TimeoutExpired as e:
        err = e.stderr or ""
        return "timeout", err.decode("utf-8", "replace") if isinstance(err, bytes) else err
    return r.returncode, r.stderr


def run_batch(cases: list[list[str]], workdir: Path, mem_mb: int = MEM_MB,
              case_seconds: float = CASE_SECONDS, template_seconds: float | None = None) -> list[dict]:
    """Every argv of ``cases`` through tests/fuzz_worker.py (one process, restarted after a case
    that kills it); one result dict per case, in order. ``template_seconds``: the chat-template
    render deadline in the worker (default: cyllm's own)."""
    env = _env()
    if template_seconds is not None:
        env["FUZZ_TEMPLATE_SECONDS"] = str(template_seconds)
    results: dict[int, dict] = {}
    start = 0
    while start < len(cases):
        batch = cases[start:]
        cases_file, results_file = workdir / f"cases{start}.json", workdir / f"results{start}.jsonl"
        cases_file.write_text(json.dumps(batch), encoding="utf-8")
        overall = case_seconds * len(batch) + 60
        try:
            proc = subprocess.run([sys.executable, str(HERE / "fuzz_worker.py"), str(cases_file),
                                   str(results_file), str(case_seconds)], capture_output=True, text=True,
                                  errors="replace", timeout=overall, preexec_fn=_limits(mem_mb), env=env)
            code, tail = proc.returncode, proc.stderr[-2000:]
        except subprocess.TimeoutExpired:
            code, tail = "timeout", ""
        started = None
        for line in results_file.read_text(encoding="utf-8").splitlines() if results_file.exists() else []:
            rec = json.loads(line)
            if "start" in rec:
                started = rec["start"]
            else:
                results[start + rec["i"]] = rec
                started = None
        if started is None:          # the batch ran to its end
            break
        # the worker died inside case `started`: record it and go on after it
        died = code if code == "timeout" or (isinstance(code, int) and code < 0) else "exception"
        results[start + started] = {"code": died, "stderr": f"the worker died (status {code}): {tail}"}
        start += started + 1
    return [results.get(i, {"code": "exception", "stderr": "no result"}) for i in range(len(cases))]
