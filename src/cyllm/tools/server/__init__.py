"""`cyllm serve`: an OpenAI-compatible HTTP server over cyllm.completions.

app.py builds the ASGI app (FastAPI on Starlette, served by uvicorn), worker.py
runs the requests one at a time in arrival order on one thread, cli.py holds
the `serve` subcommand. Importing this package needs nothing beyond cyllm;
the server itself needs the `server` extra (pip install "cyllm[server]").
"""
