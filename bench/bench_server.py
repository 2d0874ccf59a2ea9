"""Serving speed: time to first token and tokens/s for 1, 4 and 8 concurrent clients,
the prompt-cache saving on a 10-turn conversation, and the cost of the HTTP layer.

    python bench/bench_server.py                       # default model, cyllm only
    python bench/bench_server.py -m model.gguf --llama-cpp-python   # + llama-cpp-python's server

Each server runs as its own process (`cyllm serve`, `python -m llama_cpp.server`)
on a free port of 127.0.0.1 with the same GGUF, context and thread count, and
is driven by the same streaming HTTP client (httpx): TTFT is request sent ->
first content chunk; decode tok/s is (tokens - 1) / (last chunk - first
chunk) per client; aggregate tok/s is every client's tokens / wall time.
The HTTP overhead alternates one request over HTTP with the same request
through cyllm's Python API (create_chat_completion) in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

PROMPTS = ["Write a long story about a dragon who learns to bake bread.",
           "Explain in detail how a steam engine works.",
           "Describe a walk through a busy market in a large city.",
           "Write a long letter to a friend about your summer holiday.",
           "Tell the history of the bicycle in many paragraphs.",
           "Describe the life of a lighthouse keeper on a stormy island.",
           "Explain how bread, cheese and wine are made, step by step.",
           "Write a detailed guide to planting a vegetable garden."]
TURNS = ["Hi! I am planning a trip to Italy.", "Which cities should I visit first?",
         "How many days in Rome?", "What food should I try there?", "And in Florence?",
         "Is the train between them fast?", "What about Venice?", "Any tips for museums?",
         "What should I pack?", "Thanks, summarise the plan in three lines."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name, argv, port, env=None):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=env)
        self._log: list[str] = []
        threading.Thread(target=lambda: self._log.extend(self.proc.stderr), daemon=True).start()
        deadline = time.time() + 300
        while True:
            if self.proc.poll() is not None:
                time.sleep(0.2)
                raise RuntimeError(f"{name} exited: {''.join(self._log)[-2000:]}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"{name} did not start")
            time.sleep(0.2)

    def stop(self):
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def stream_chat(url, messages, max_tokens, seed) -> dict:
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0.8, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    chunks, text, usage = 0, [], None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            c = json.loads(line[6:])
            usage = c.get("usage") or usage
            for ch in c.get("choices", []):
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    chunks += 1
                    text.append(piece)
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else chunks
    return {"ttft": (first or end) - t0, "tokens": n, "decode_s": (last - first) if first else 0.0,
            "chunks": chunks, "end": end, "start": t0, "text": "".join(text), "usage": usage}


def concurrency(url, n_clients, max_tokens, rounds) -> dict:
    results = []
    wall = 0.0
    failed = 0
    for r in range(rounds):
        out = [None] * n_clients

        def one(i):
            msgs = [{"role": "user", "content": PROMPTS[(i + r) % len(PROMPTS)]}]
            try:
                out[i] = stream_chat(url, msgs, max_tokens, seed=100 * r + i)
            except httpx.HTTPError as e:          # counted as failed, not fatal to the run
                print(f"request failed: {e!r}", file=sys.stderr)

        ts = [threading.Thread(target=one, args=(i,)) for i in range(n_clients)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        wall += time.perf_counter() - t0
        failed += sum(x is None for x in out)
        results += [x for x in out if x is not None]
    if not results:
        return {"clients": n_clients, "requests": 0, "failed": failed, "ttft_ms_median": 0.0, "ttft_ms_max": 0.0,
                "decode_tps_per_client": 0.0, "aggregate_tps": 0.0, "tokens": 0}
    per_client = [(x["chunks"] - 1) / x["decode_s"] for x in results if x["decode_s"] > 0]
    return {"clients": n_clients, "requests": len(results), "failed": failed,
            "ttft_ms_median": 1000 * statistics.median(x["ttft"] for x in results),
            "ttft_ms_max": 1000 * max(x["ttft"] for x in results),
            "decode_tps_per_client": statistics.median(per_client) if per_client else 0.0,
            "aggregate_tps": sum(x["tokens"] for x in results) / wall,
            "tokens": sum(x["tokens"] for x in results)}


def conversation(url, turns, max_tokens, reuse=True) -> dict:
    """A conversation that sends its whole history each turn. reuse=False puts a new
    number at the very start of every turn's prompt, so that no prefix can be reused:
    the TTFT of a server without a prompt cache."""
    system = "You are a helpful travel assistant."
    messages = [{"role": "system", "content": system}]
    rows = []
    for i, text in enumerate(TURNS[:turns]):
        messages.append({"role": "user", "content": text})
        if not reuse:
            messages[0] = {"role": "system", "content": f"{1000 + i}. {system}"}
        x = stream_chat(url, messages, max_tokens, seed=i)
        messages.append({"role": "assistant", "content": x["text"]})
        u = x["usage"] or {}
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
        rows.append({"turn": i + 1, "prompt_tokens": u.get("prompt_tokens"), "cached_tokens": cached,
                     "ttft_ms": 1000 * x["ttft"]})
    return {"turns": rows,
            "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in rows),
            "cached_tokens": sum(r["cached_tokens"] or 0 for r in rows) if rows[0]["cached_tokens"] is not None
            else None,
            "ttft_ms_total": sum(r["ttft_ms"] for r in rows)}


def overhead(url, model_path, threads, context, max_tokens, pairs) -> dict:
    """One client over HTTP against the same request through the Python API in this process,
    alternating (HTTP, API) pairs so that a change of machine load hits both alike."""
    import cyllm
    llm = cyllm.load(model_path, threads=threads, context=context)
    http, api = [], []
    for i in range(pairs):
        msgs = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        x = stream_chat(url, msgs, max_tokens, seed=i)
        http.append((x["ttft"], (x["chunks"] - 1) / x["decode_s"]))
        t0 = time.perf_counter()
        first = last = None
        n = 0
        for c in llm.create_chat_completion(msgs, max_tokens=max_tokens, temperature=0.8, seed=i, stream=True):
            if c["choices"] and c["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
                n += 1
        api.append((first - t0, (n - 1) / (last - first)))

    def med(rows, k):
        return statistics.median(r[k] for r in rows)
    return {"pairs": pairs, "http_ttft_ms": 1000 * med(http, 0), "api_ttft_ms": 1000 * med(api, 0),
            "http_tps": med(http, 1), "api_tps": med(api, 1),
            "ttft_added_ms": 1000 * statistics.median(h[0] - a[0] for h, a in zip(http, api)),
            "tps_change": statistics.median(h[1] / a[1] - 1 for h, a in zip(http, api))}


def bench_server(server: Server, args) -> dict:
    stream_chat(server.url, [{"role": "user", "content": "Hello"}], 8, 0)          # warm-up
    out = {"name": server.name, "concurrency": [], "conversation": None}
    for n in args.clients:
        out["concurrency"].append(concurrency(server.url, n, args.max_tokens, args.rounds))
        print(f"{server.name}: {out['concurrency'][-1]}", file=sys.stderr)
    out["conversation"] = conversation(server.url, args.turns, args.turn_tokens)
    print(f"{server.name}: conversation {out['conversation']}", file=sys.stderr)
    out["no_reuse"] = conversation(server.url, args.turns, args.turn_tokens, reuse=False)
    print(f"{server.name}: conversation without reuse {out['no_reuse']}", file=sys.stderr)
    return out


def markdown(results, inproc, args, cmd) -> str:
    from cyllm.hostinfo import cpu_description
    lines = [f"Command: `{cmd}`", "",
             f"Machine: {cpu_description()}, {os.cpu_count()} logical CPUs; threads {args.threads or 'default'}; "
             f"model {os.path.basename(args.model)}; context {args.context}; {args.max_tokens} tokens per "
             f"request, temperature 0.8, {args.rounds} round(s) per row", "",
             "| server | clients | TTFT median (ms) | TTFT max (ms) | decode tok/s per client | aggregate tok/s "
             "| failed requests |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        for c in r["concurrency"]:
            lines.append(f"| {r['name']} | {c['clients']} | {c['ttft_ms_median']:.0f} | {c['ttft_ms_max']:.0f} | "
                         f"{c['decode_tps_per_client']:.1f} | {c['aggregate_tps']:.1f} | {c['failed']} |")
    if inproc:
        o = inproc
        lines += ["", f"HTTP layer, {o['pairs']} alternating pairs of one request over HTTP and the same request "
                      f"through the Python API (medians): TTFT {o['http_ttft_ms']:.0f} vs {o['api_ttft_ms']:.0f} ms "
                      f"(added {o['ttft_added_ms']:+.0f} ms), decode {o['http_tps']:.1f} vs {o['api_tps']:.1f} tok/s "
                      f"({100 * o['tps_change']:+.1f}%)"]
    lines += ["", f"{args.turns}-turn conversation ({args.turn_tokens} tokens per answer), whole history sent "
                  "each turn; \"no reuse\" changes the first characters of every turn's prompt:", "",
              "| server | prompt tokens sent | cached (reused) | TTFT sum (ms) | TTFT sum, no reuse (ms) |",
              "|---|---|---|---|---|"]
    for r in results:
        c = r["conversation"]
        cached = "n/a" if c["cached_tokens"] is None else f"{c['cached_tokens']} " \
            f"({100 * c['cached_tokens'] / max(1, c['prompt_tokens']):.0f}%)"
        sent = c["prompt_tokens"] if c["cached_tokens"] is not None else "n/a (no usage in its stream)"
        lines.append(f"| {r['name']} | {sent} | {cached} | {c['ttft_ms_total']:.0f} | "
                     f"{r['no_reuse']['ttft_ms_total']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", help="GGUF file (default: cyllm's default model)")
    p.add_argument("-t", "--threads", type=int, help="threads for both servers (default: cyllm's choice)")
    p.add_argument("-c", "--context", type=int, default=2048)
    p.add_argument("--clients", default="1,4,8")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--turn-tokens", type=int, default=24)
    p.add_argument("--llama-cpp-python", action="store_true",
                   help="also run llama-cpp-python's server (needs llama_cpp importable, with its [server] extra)")
    p.add_argument("--no-cyllm", action="store_true", help="skip cyllm's server (e.g. to rerun only the peer)")
    p.add_argument("--no-in-process", action="store_true", help="skip the HTTP-overhead pairs")
    p.add_argument("--pairs", type=int, default=6, help="HTTP / Python API request pairs for the overhead")
    p.add_argument("--out", help="append the markdown table to this file")
    args = p.parse_args()
    args.clients = [int(x) for x in args.clients.split(",")]
    if args.model is None:
        from cyllm.default_model import default_model_path
        args.model = str(default_model_path())
    threads = [] if args.threads is None else ["-t", str(args.threads)]
    results = []
    port = free_port()
    inproc = None
    if not args.no_cyllm:
        s = Server("cyllm", [sys.executable, "-m", "cyllm", "serve", "-m", args.model, "--port", str(port),
                             "-c", str(args.context), *threads], port)
        try:
            results.append(bench_server(s, args))
            if not args.no_in_process:
                inproc = overhead(s.url, args.model, args.threads, args.context, args.max_tokens, args.pairs)
                print(f"overhead: {inproc}", file=sys.stderr)
        finally:
            s.stop()
    if args.llama_cpp_python:
        port = free_port()
        n_threads = args.threads or os.cpu_count()
        s = Server("llama-cpp-python", [sys.executable, "-m", "llama_cpp.server", "--model", args.model,
                                        "--port", str(port), "--n_ctx", str(args.context),
                                        "--n_threads", str(n_threads), "--n_threads_batch", str(n_threads),
                                        # queue concurrent requests as cyllm does (its default cuts off the
                                        # running stream when a new request arrives)
                                        "--interrupt_requests", "False"], port)
        try:
            results.append(bench_server(s, args))
        finally:
            s.stop()
    cmd = "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    md = markdown(results, inproc, args, cmd)
    print(md)
    if args.out:
        with open(args.out, "a") as f:
            f.write(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
