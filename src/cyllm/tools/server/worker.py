"""One thread runs the generations, one request at a time, in arrival order.

The model has one KV cache, so requests take turns (FIFO queue). A job hands
its chunks to the event loop through an asyncio queue; the event loop sets
the job's cancel flag when the client goes away, and the generation loop
polls it before every forward pass, so a dropped client frees the model
within one token (or one prefill step).

When the server shuts down, ``cancel_all`` stops every queued and running job
the same way and marks it as stopped by the shutdown: its last item is then a
ShuttingDown error (a 503 for its client) instead of a cut answer.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time

from ...errors import CyllmError
from ...generate import GenerationStats

log = logging.getLogger("cyllm.server")
DONE = object()       # end-of-job marker in a job's queue


class ShuttingDown(Exception):
    """The last item of a job that the server's shutdown stopped before it was complete."""

    def __init__(self):
        super().__init__("the server is shutting down")


class Job:
    """One request's generation: ``start(cancel)`` returns an iterator of chunks (called on the worker),
    which polls ``cancel`` and, when it returns True, ends early with ``stats.stop_reason`` "cancelled"."""

    def __init__(self, start, loop: asyncio.AbstractEventLoop):
        self.start = start
        self.loop = loop
        self.items: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.shutdown = False                   # cancelled by the server's shutdown, not by its client
        self.stats = GenerationStats()
        self.t_arrival = time.perf_counter()
        self.t_started: float | None = None     # when the worker picked it up

    def post(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:        # the event loop is gone (server shutting down)
            self.cancelled.set()

    def stop_for_shutdown(self) -> None:
        self.shutdown = True        # before the flag: whoever sees the flag also sees why
        self.cancelled.set()

    @property
    def ttft_s(self) -> float:
        """Arrival to first token, queue wait included (what the client sees)."""
        if self.t_started is None or not self.stats.generated_tokens and not self.stats.ttft_s:
            return 0.0
        return self.t_started - self.t_arrival + self.stats.ttft_s


class Worker:
    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self._live: set[Job] = set()        # submitted and not finished: what cancel_all stops
        self._lock = threading.Lock()       # _live and _closing, shared with the generation thread
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="cyllm-generate", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            if not self._closing:
                self._live.add(job)
                self._jobs.put(job)
                return
        # the shutdown has begun (the generation thread may be gone): end the job here
        job.stop_for_shutdown()
        job.post(ShuttingDown())
        job.post(DONE)

    def cancel_all(self) -> None:
        """Stop every queued and running job, and any submitted later: the server is shutting down."""
        with self._lock:
            self._closing = True
            live = list(self._live)
        for job in live:
            job.stop_for_shutdown()

    def close(self) -> None:
        self.cancel_all()           # a running generation stops within one token instead of running on
        self._jobs.put(None)
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._run(job)
            with self._lock:
                self._live.discard(job)
            job.post(DONE)

    def _run(self, job: Job) -> None:
        """Post the job's chunks, or the error that ended it."""
        job.t_started = time.perf_counter()
        complete = False
        try:
            if not job.cancelled.is_set():          # the client left while waiting in the queue
                complete = _generate(job)
        except CyllmError as e:
            job.post(e)
            return
        except Exception as e:   # noqa: BLE001 -- a failed request must not end the server
            log.exception("generation failed")
            job.post(e)
            return
        if job.shutdown and not complete:
            job.post(ShuttingDown())


def _generate(job: Job) -> bool:
    """Post the job's chunks until they end or the job is cancelled; True if they all went out."""
    chunks = job.start(job.cancelled.is_set)
    try:
        for chunk in chunks:
            # checked before posting: a chunk that goes out belongs to an answer that may still
            # complete, so a cancel that comes after the last chunk does not cut the answer
            if job.cancelled.is_set():
                job.stats.stop_reason = "cancelled"     # the iterator, closed here, cannot say so
                return False
            job.post(chunk)
    finally:
        chunks.close()
    # the chunk iterator polls the flag too and, when it fires, ends without its final chunks
    return job.stats.stop_reason != "cancelled"
