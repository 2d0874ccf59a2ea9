"""`cyllm serve`: argument definitions and the run function (cli.py only registers them)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ...errors import InvalidArgumentError

INSTALL_HINT = "`cyllm serve` needs the server extra: pip install \"cyllm[server]\""


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is in [0, 65535], got {value}")
    return value


def add_serve_parser(sub, add_model_args) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)")
    add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=_port, default=8080, help="port (default 8080)")
    s.add_argument("--api-key", help="require `Authorization: Bearer KEY` (default: $CYLLM_API_KEY, else no key)")
    s.add_argument("--alias", help="model name shown in /v1/models and in responses (default: the file name)")
    s.add_argument("--cache-ram", type=int, default=1024, metavar="MIB",
                   help="host memory for the KV caches of recent conversations, MiB (default 1024; 0 = off)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="info logs one line per request (default)")
    s.set_defaults(func=cmd_serve)


def cmd_serve(a) -> int:
    import os

    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise InvalidArgumentError(INSTALL_HINT) from None
    from ... import load
    from .app import create_app

    api_key = a.api_key if a.api_key is not None else (os.environ.get("CYLLM_API_KEY") or None)
    if api_key is not None and not api_key.strip():
        raise InvalidArgumentError("--api-key is empty")
    sock = listen(a.host, a.port)        # a taken port fails before the model loads
    try:
        llm = load(a.model, backend=a.backend, threads=a.threads, context=a.context,
                   threads_batch=getattr(a, "threads_batch", None))
    except BaseException:
        sock.close()
        raise
    if a.alias:
        name = a.alias
    else:
        from ...default_model import default_model_path
        name = Path(a.model).name if a.model else default_model_path(download=False).name
    if a.cache_ram < 0:
        raise InvalidArgumentError(f"--cache-ram must be >= 0, got {a.cache_ram}")
    app = create_app(llm, name, api_key, cache_bytes=a.cache_ram << 20)
    logging.basicConfig(level=getattr(logging, a.log_level.upper()), format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    port = sock.getsockname()[1]
    print(f"cyllm: serving {name} on http://{a.host}:{port}/v1 (context {llm.context} tokens"
          f"{', API key required' if api_key else ''}) -- Ctrl-C to stop", file=sys.stderr, flush=True)
    serve(app, sock)
    return 0


def listen(host: str, port: int):
    """A listening socket, bound before uvicorn starts so a taken port is one clear error."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        raise InvalidArgumentError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def server_for(app, sock):
    """A uvicorn server for ``app`` on an already bound socket (run it with .run(sockets=[sock])).

    When its shutdown begins (a signal, or ``should_exit``) it first calls ``app.cancel_all()``
    where the app has one: uvicorn would otherwise wait for the running requests up to its
    graceful timeout and then cancel their tasks, which gives their clients a bare 500 or a
    cut stream and logs a traceback, while the generation runs on.
    """
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            getattr(app, "cancel_all", lambda: None)()
            await super().shutdown(sockets)

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=3)
    return Server(config)


def serve(app, sock) -> None:
    server_for(app, sock).run(sockets=[sock])
