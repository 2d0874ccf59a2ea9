"""The ASGI app: OpenAI's /v1/chat/completions, /v1/completions, /v1/models, plus /health.

Request bodies are passed as keyword arguments to cyllm.completions (same
names as OpenAI's fields), which checks them all before anything runs; a
CyllmError becomes a 400 OpenAI error object. Every other failure is an
OpenAI error object too (401, 404, 405, 500): the server never dies on a
request. One log line per request (logger "cyllm.server").

Shutdown (Ctrl-C, SIGTERM): the server calls ``cancel_all`` on the app the
moment it begins, so generations stop within one token and their clients get
a 503 error object (streams: an error event, then the end of the stream)
instead of waiting for a graceful timeout that would cut them anyway.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ... import completions
from ...errors import ContextFullError, CyllmError, InvalidArgumentError
from ...jsonio import parse_json, short
from .worker import DONE, Job, ShuttingDown, Worker

log = logging.getLogger("cyllm.server")
RESERVED = ("llm", "stats", "cancel")          # keyword arguments of completions that a body cannot set
# a request body is read whole before it is parsed: far above any context's worth of text
# (a million tokens is ~4 MB), so only a body meant to exhaust memory is refused (413)
MAX_BODY_BYTES = 64 << 20
MAX_BODY_DEPTH = 256          # JSON nesting (json.loads recurses once per level)
# a body that stops arriving (a Content-Length larger than what is sent, a chunked body never
# ended) is answered 408 after this many seconds without a byte, instead of holding its
# connection for as long as the client keeps the socket open
BODY_IDLE_S = 30.0


def error_body(message: str, type_: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, code), status_code=status)


def _failure(e: Exception) -> tuple[int, dict]:
    """(HTTP status, OpenAI error body) for the exception that refused or ended a generation."""
    if isinstance(e, ShuttingDown):
        return 503, error_body(str(e), "server_error")
    if isinstance(e, CyllmError):
        return 400, error_body(str(e), code="context_length_exceeded" if isinstance(e, ContextFullError) else None)
    return 500, error_body(f"internal error: {type(e).__name__}: {e}", "server_error")


def _failure_response(e: Exception) -> JSONResponse:
    status, body = _failure(e)
    return JSONResponse(body, status_code=status)


def create_app(llm, model_name: str, api_key: str | None = None, cache_bytes: int = 1 << 30) -> FastAPI:
    """The server app for one loaded model; the generation thread starts with the app.

    ``cache_bytes``: host memory for the KV caches of recent conversations
    (prompt_cache.py); 0 keeps only the conversation in the model's own cache.
    """
    from .prompt_cache import PromptCache

    worker: Worker | None = None

    async def lifespan(app):
        nonlocal worker
        previous = getattr(llm, "prompt_cache", None)
        llm.prompt_cache = PromptCache(llm, cache_bytes) if cache_bytes > 0 else None
        worker = Worker()
        yield
        worker.close()
        llm.prompt_cache = previous

    app = FastAPI(title="cyllm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.model_name = model_name

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            msg = f"Invalid URL ({request.method} {request.url.path})"
        elif exc.status_code == 405:
            msg = f"Method {request.method} is not allowed for {request.url.path}"
        else:
            msg = str(exc.detail)
        return error_response(exc.status_code, msg)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        log.exception("request failed")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    # HEAD too on the read-only routes: load balancers and uptime checks probe with it
    read_only = dict(methods=["GET", "HEAD"])

    @app.api_route("/health", **read_only)
    async def health():
        return {"status": "ok"}

    def model_card():
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "cyllm"}

    @app.api_route("/v1/models", **read_only)
    @app.api_route("/models", **read_only)
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.api_route("/v1/models/{name:path}", **read_only)
    async def model(name: str):
        if name != model_name:
            return error_response(404, f"The model {short(name)} does not exist", code="model_not_found")
        return model_card()

    async def generation(request: Request, create, required: str):
        body = await _json_body(request)
        if isinstance(body, JSONResponse):
            return body
        if required not in body:
            return error_response(400, f"Missing required parameter: '{required}'")
        # null is the default (OpenAI's schema: "integer or null" and the like); max_tokens'
        # default on /v1/completions is 16, not None's "up to the context" of the Python API
        body = {k: v for k, v in body.items() if v is not None or k == required}
        bad = [k for k in body if k in RESERVED]
        if bad:
            return error_response(400, f"unsupported parameter: {short(bad[0])}")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            return error_response(400, f"stream must be true or false, got {short(stream)}")
        if not stream and body.get("stream_options") is not None:
            return error_response(400, "stream_options is only allowed when stream is true")
        name = body.pop("model", None)
        if name is not None and not isinstance(name, str):
            return error_response(400, f"model must be a string, got {short(name)}")
        body.update(stream=True, model=model_name)
        if not stream:
            body["stream_options"] = {"include_usage": True}
        job = Job(None, asyncio.get_running_loop())
        try:
            # checks, chat template, tokenization, grammar compilation: off the event loop
            chunks = await asyncio.to_thread(create, llm, stats=job.stats, cancel=job.cancelled.is_set, **body)
        except CyllmError as e:
            return _failure_response(e)
        except TypeError as e:         # a field given twice or in an impossible shape
            return error_response(400, f"invalid request: {e}")
        job.start = lambda cancel: chunks
        request.state.job = job          # for the log line
        worker.submit(job)
        if stream:
            return EventStream(job)
        return await _collect(request, job)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: Request):
        return await generation(request, completions.create_chat_completion, "messages")

    @app.post("/v1/completions")
    @app.post("/completions")
    async def text_completions(request: Request):
        return await generation(request, completions.create_completion, "prompt")

    def cancel_all() -> None:
        if worker is not None:
            worker.cancel_all()

    return Gate(app, api_key, cancel_all)


async def _json_body(request: Request):
    """The request's JSON object, or the OpenAI error response to send instead."""
    too_big = f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB"
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        return error_response(413, too_big)
    parts, size = [], 0
    stream = request.stream().__aiter__()          # chunked bodies declare no length
    try:
        while True:
            try:
                part = await asyncio.wait_for(stream.__anext__(), BODY_IDLE_S)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                return error_response(408, f"the request body stopped arriving (nothing for {BODY_IDLE_S:g} s)")
            size += len(part)
            if size > MAX_BODY_BYTES:
                return error_response(413, too_big)
            parts.append(part)
    except ClientDisconnect:
        # nobody will read this answer: it exists for the log line, which says why
        request.state.disconnected = True
        return error_response(400, "the client disconnected before sending the whole request body")
    # a large body takes a while to scan and parse: off the event loop, like the rest
    body, problem = await asyncio.to_thread(_parse_body, b"".join(parts))
    if problem is not None:
        return error_response(400, problem)
    if not isinstance(body, dict):
        return error_response(400, "the request body must be a JSON object")
    return body


def _parse_body(raw: bytes) -> tuple:
    """(the parsed body, None), or (None, the message saying why it cannot be parsed): jsonio's
    bounded parser (nesting, integer digits), so no body makes json.loads raise past us."""
    try:
        return parse_json(raw, "it", InvalidArgumentError, max_depth=MAX_BODY_DEPTH), None
    except CyllmError as e:
        return None, f"We could not parse the JSON body of your request: {e}"


async def _wait_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(request: Request, job: Job):
    """Gather a non-streamed answer, cancelling it if the client goes away first."""
    async def gather():
        return [item async for item in _items(job)]

    waiter = asyncio.ensure_future(gather())
    gone = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not waiter.done():
            job.cancelled.set()
            request.state.disconnected = True
            await waiter
    finally:
        gone.cancel()
        waiter.cancel()             # already done, unless this task is cancelled itself:
        job.cancelled.set()         # then the worker stops too (harmless after the end)
    items = waiter.result()
    if items and isinstance(items[-1], Exception):
        return _failure_response(items[-1])
    return JSONResponse(completions.collect(iter(items)))


async def _items(job: Job):
    """The job's chunks as they come; an exception ends the sequence (and is its last item)."""
    while True:
        item = await job.items.get()
        if item is DONE:
            return
        yield item
        if isinstance(item, Exception):
            return


class EventStream(Response):
    """A server-sent-events response that cancels its job the moment the client disconnects.

    (Starlette's StreamingResponse notices a disconnect only on some ASGI
    spec versions; this one always listens for it.)
    """

    def __init__(self, job: Job):        # no body or headers of Response's own: __call__ sends them
        self.job = job
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        job = self.job
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        gone.add_done_callback(lambda _: job.cancelled.set())
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            async for item in _items(job):
                if isinstance(item, Exception):
                    await send(_event(_failure(item)[1]))
                    break
                await send(_event(item))
            else:
                # the items ended without an error: the answer is complete unless the client left
                # (a job cancelled by the shutdown ends with an error instead)
                if not gone.done():
                    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:             # the connection broke while writing
            pass
        finally:
            if gone.done():
                scope.setdefault("state", {})["disconnected"] = True
            gone.cancel()
            job.cancelled.set()     # harmless after the end; stops the worker otherwise


def _event(obj) -> dict:
    data = b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    return {"type": "http.response.body", "body": data, "more_body": True}


class Gate:
    """Outermost ASGI layer: the API key check and one log line per request.

    ``cancel_all()`` stops every generation, queued or running (the server calls it when
    its shutdown begins).
    """

    def __init__(self, app, api_key: str | None, cancel_all=lambda: None):
        self.app = app
        self.api_key = api_key
        self.state = app.state
        self.cancel_all = cancel_all

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [0]

        async def send_logged(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.api_key is not None and scope["path"] != "/health" and not self._authorized(scope):
                await JSONResponse(error_body("Incorrect API key provided", code="invalid_api_key"),
                                   status_code=401)(scope, receive, send_logged)
            else:
                await self.app(scope, receive, send_logged)
        finally:
            log.info(_log_line(scope, status[0], time.perf_counter() - t0))

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(),
                                                                           self.api_key.encode("utf-8"))
        return False


def _log_line(scope, status: int, seconds: float) -> str:
    line = f"{scope.get('method', '?')} {scope.get('path', '?')} {status or '-'} {seconds * 1000:.0f} ms"
    state = scope.get("state") or {}
    job = state.get("job")
    if job is not None:
        s = job.stats
        line += (f" | prompt {s.prompt_tokens + s.cached_tokens} tokens ({s.cached_tokens} cached)"
                 f" | generated {s.generated_tokens} tokens, {s.decode_tps:.1f} tok/s"
                 f" | ttft {job.ttft_s * 1000:.0f} ms | {s.stop_reason or '-'}")
        if job.shutdown:
            line += " | server shutting down"
    if state.get("disconnected"):
        line += " | client disconnected"
    return line
