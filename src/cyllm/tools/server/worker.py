"""One thread runs the generations, one request at a time, in arrival order.

The model has one KV cache, so requests take turns (FIFO queue). A job hands
its chunks to the event loop through an asyncio queue; the event loop sets
the job's cancel flag when the client goes away, and the generation loop
polls it before every forward pass, so a dropped client frees the model
within one token (or one prefill step).
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


class Job:
    """One request's generation: ``start(cancel)`` returns an iterator of chunks (called on the worker)."""

    def __init__(self, start, loop: asyncio.AbstractEventLoop):
        self.start = start
        self.loop = loop
        self.items: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.stats = GenerationStats()
        self.t_arrival = time.perf_counter()
        self.t_started: float | None = None     # when the worker picked it up

    def post(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:        # the event loop is gone (server shutting down)
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
        self._thread = threading.Thread(target=self._loop, name="cyllm-generate", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job.t_started = time.perf_counter()
            if job.cancelled.is_set():          # the client left while waiting in the queue
                job.post(DONE)
                continue
            try:
                chunks = job.start(job.cancelled.is_set)
                try:
                    for chunk in chunks:
                        job.post(chunk)
                        if job.cancelled.is_set():
                            break
                finally:
                    chunks.close()
            except CyllmError as e:
                job.post(e)
            except Exception as e:   # noqa: BLE001 -- a failed request must not end the server
                log.exception("generation failed")
                job.post(e)
            job.post(DONE)
