"""Run cyllm's command line on many inputs in one process (for tests/test_fuzz.py; not a test module).

    python tests/fuzz_worker.py CASES.json RESULTS.jsonl SECONDS

CASES.json holds a list of argv lists. For each case the worker writes a
``{"start": i}`` line to RESULTS.jsonl, runs ``cyllm.tools.cli.main(argv)`` exactly as
the ``cyllm`` console script does, with stdout and stderr sent to files, then
writes ``{"i", "code", "stderr", "seconds"}``; ``code`` is the exit status, or
"timeout" (the case ran past SECONDS), or "exception" (something escaped
``main``: then ``stderr`` holds the traceback). The parent sets the resource
limits (address space) and an overall timeout; when the worker dies of a
signal, the last "start" line names the case that killed it.

One process for a batch costs one interpreter start instead of one per case.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import tempfile
import time
import traceback


class _CaseTimeout(BaseException):     # not an Exception: cyllm's handlers must not swallow it
    pass


def _alarm(signum, frame):
    raise _CaseTimeout()


def run_case(argv: list[str], seconds: float, scratch: str) -> dict:
    from cyllm.tools.cli import main

    out_path, err_path = os.path.join(scratch, "out"), os.path.join(scratch, "err")
    saved = sys.stdout, sys.stderr
    t0 = time.monotonic()
    with open(out_path, "w", encoding="utf-8") as out, open(err_path, "w", encoding="utf-8") as err:
        sys.stdout, sys.stderr = out, err
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            code = main(list(argv))
            code = 0 if code is None else code
        except SystemExit as e:          # argparse, or a command that exits
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except _CaseTimeout:
            code = "timeout"
        except BaseException:            # noqa: BLE001 - exactly what the fuzz test looks for
            code = "exception"
            err.write(traceback.format_exc())
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            sys.stdout, sys.stderr = saved
    with open(err_path, encoding="utf-8", errors="replace") as f:
        stderr = f.read(20000)
    return {"code": code, "stderr": stderr, "seconds": round(time.monotonic() - t0, 3)}


def main() -> int:
    cases_path, results_path, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    with open(cases_path, encoding="utf-8") as f:
        cases = json.load(f)
    signal.signal(signal.SIGALRM, _alarm)
    if os.environ.get("FUZZ_TEMPLATE_SECONDS"):
        # a shorter render deadline keeps runaway-template cases fast; the bound itself is the same code
        import cyllm.template_sandbox
        cyllm.template_sandbox.MAX_SECONDS = float(os.environ["FUZZ_TEMPLATE_SECONDS"])
    with open(results_path, "a", encoding="utf-8") as res, tempfile.TemporaryDirectory() as scratch:
        for i, argv in enumerate(cases):
            res.write(json.dumps({"start": i}) + "\n")
            res.flush()
            r = run_case(argv, seconds, scratch)
            r["i"] = i
            res.write(json.dumps(r) + "\n")
            res.flush()
            gc.collect()                 # drop the last model's arrays and maps before the next
    return 0


if __name__ == "__main__":
    sys.exit(main())
