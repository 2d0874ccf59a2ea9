"""`cyllm generate|chat|info|models|bench|tune|perplexity|convert|quantize`.

Every user error ends as one line on stderr (``cyllm: error: ...``) and exit
status 2; a bug ends as one line ``cyllm: internal error: ...`` and exit status
3 (CYLLM_DEBUG=1 prints the traceback). Results go to stdout, progress and
statistics to stderr. Messages are made single-line and printable here, so the
content of a file (a path with a newline, a template's exception text) cannot
forge extra lines.
"""

from __future__ import annotations

import argparse
import os
import sys

from .argparsing import EXIT_USAGE, Parser, llama_cpp_flag, nonneg_int, pos_int
from ..errors import CyllmError, InvalidArgumentError
from ..hub import model_path
from ..oneline import one_line
from .frontend import OutputError, load_model, sampling_kwargs, use_chat_template, write_out
from .textinput import (check_text_arg, read_stdin_text, read_text_file, strip_one_newline,
                        stdin_is_tty as _stdin_is_tty)

MAX_TEXT_BYTES = 64 << 20        # perplexity texts (wikitext-103's test set is 1.3 MB)
EXIT_INTERNAL = 3


def _add_model_args(p: argparse.ArgumentParser, threads_batch: bool = True, context_help: str | None = None) -> None:
    p.add_argument("-m", "--model", help="a GGUF file, a Hugging Face model directory, or a Hugging Face "
                   "name: org/repo, org/repo-GGUF:Q4_K_M (default: $CYLLM_MODEL, else SmolLM2-135M-Instruct, "
                   "fetched on first use)")
    p.add_argument("--backend", default="cpu", help="cpu (default), cuda or numpy (slow reference)")
    p.add_argument("-t", "--threads", help="kernel threads (default: OMP_NUM_THREADS, tuned value, "
                   "or the number of physical cores)")
    if threads_batch:
        p.add_argument("-tb", "--threads-batch", help="threads for prompt processing (default: as "
                       "--threads, or the tuned value)")
    p.add_argument("-c", "--context", "--ctx-size", dest="context", type=pos_int,
                   help=context_help or "context window in tokens (default: the model's, at most 4096)")
    p.add_argument("--quantize", metavar="TYPE", help="quantize float weights in memory at load: "
                   "q8_0, q4_0 or q4_k (llama.cpp's Q4_K_M recipe)")


def _add_bench_model_args(p: argparse.ArgumentParser) -> None:
    # bench and tune set both phases' threads themselves: no --threads-batch to ignore
    _add_model_args(p, threads_batch=False)


def _add_sampling_args(p: argparse.ArgumentParser, default_temp: float, default_n: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("-n", "--max-tokens", "--n-predict", dest="max_tokens", type=nonneg_int,
                   default=default_n, help=f"tokens to generate (default {default_n})")
    g.add_argument("--temp", "--temperature", dest="temperature", type=float, default=default_temp,
                   help=f"0 = greedy (default {default_temp})")
    g.add_argument("--top-k", type=nonneg_int, default=40, help="0 = off (default 40)")
    g.add_argument("--top-p", type=float, default=0.95, help="1 = off (default 0.95)")
    g.add_argument("--min-p", type=float, default=0.05, help="0 = off (default 0.05)")
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="1 = off (default 1.0)")
    g.add_argument("--seed", type=int, help="random seed: the same seed gives the same output")
    g.add_argument("--stop", "-r", "--reverse-prompt", dest="stop", action="append", default=[],
                   help="stop when this text appears (repeatable)")
    g.add_argument("--no-stats", action="store_true", help="do not print the statistics")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="cyllm", description="Fast local LLM inference (Cython + OpenMP, optional CUDA).")
    parser.add_argument("--version", action="version", version=f"cyllm {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    g = sub.add_parser("generate", help="continue a prompt")
    _add_model_args(g)
    src = g.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="the prompt text ('-' reads it from stdin)")
    src.add_argument("-f", "--file", help="read the prompt from this file")
    g.add_argument("--chat-template", nargs="?", const="", metavar="NAME|FILE",
                   help="wrap the prompt as a user message with the model's chat template, or with a "
                   "built-in one (chatml, llama3, gemma, phi3) or a jinja file")
    g.add_argument("--context-shift", action="store_true",
                   help="when the context is full, drop the oldest half of the text (after --keep "
                   "tokens) and go on instead of stopping")
    g.add_argument("--keep", type=int, default=0, metavar="N",
                   help="with --context-shift: prompt tokens never dropped, besides BOS (-1 = the whole prompt)")
    _add_sampling_args(g, default_temp=0.8, default_n=128)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="talk with the model (reads lines from stdin when it is not a terminal)",
                       description="An interactive chat: /help lists the commands; Ctrl-C stops an answer, "
                       "Ctrl-D or /exit leaves. When stdin is not a terminal, each line is a message.")
    _add_model_args(c)
    c.add_argument("-s", "--system", "-sys", "--system-prompt", dest="system", help="system prompt")
    c.add_argument("--chat-template", metavar="NAME|FILE",
                   help="for a model without a chat template: chatml, llama3, gemma, phi3, or a jinja file")
    c.add_argument("-v", "--verbose", action="store_true",
                   help="statistics after every answer (default: once, at the end)")
    _add_sampling_args(c, default_temp=0.8, default_n=512)
    c.set_defaults(func=cmd_chat)

    i = sub.add_parser("info", help="this machine (version, CPU features, kernels, threads), or with -m a model",
                       description="Without -m: version, CPU features, kernel variant, threads, default model, "
                       "CUDA. With -m: what the model file is, read from its headers without loading it.")
    i.add_argument("-m", "--model", help="describe this model (GGUF file, Hugging Face directory or name)")
    i.set_defaults(func=cmd_info)

    ms = sub.add_parser("models", help="list the models in the Hugging Face cache (names for -m)")
    ms.set_defaults(func=cmd_models)

    pp = sub.add_parser("perplexity", help="perplexity of a text file (llama.cpp's method)")
    _add_model_args(pp, context_help="tokens per chunk (default 512, as llama-perplexity)")
    pp.add_argument("-f", "--file", required=True, help="text file")
    pp.add_argument("--no-progress", action="store_true", help="no progress bar (it is drawn only on a terminal)")
    pp.set_defaults(func=cmd_perplexity)

    cv = sub.add_parser("convert", help="convert a GGUF file to a Hugging Face directory")
    cv.add_argument("gguf", help="input .gguf file")
    cv.add_argument("out_dir", help="output directory")
    cv.add_argument("--force", action="store_true", help="write into a non-empty directory")
    cv.set_defaults(func=cmd_convert)

    from .server.cli import add_serve_parser
    add_serve_parser(sub, _add_model_args)

    try:
        from .bench import add_bench_parser
        from .tuning import add_tune_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub, _add_bench_model_args)
        add_tune_parser(sub, _add_bench_model_args)
    from .quantize import add_quantize_parser
    add_quantize_parser(sub)
    parser.commands = dict(sub.choices)
    return parser


def _version() -> str:
    from .. import __version__
    return __version__


# -- commands ----------------------------------------------------------------------------
def _print_stats(stats, quiet: bool, shift_hint: bool = False) -> None:
    if stats is None:
        return
    if stats.stop_reason == "context":
        print("cyllm: notice: the context window is full; generation stopped (use a larger --context"
              + (" or --context-shift)" if shift_hint else ")"), file=sys.stderr)
    if not quiet:
        print(stats.line(), file=sys.stderr)


def _read_prompt(a) -> str:
    if a.file:
        return strip_one_newline(read_text_file(a.file, "prompt file"))
    if a.prompt == "-" or (a.prompt is None and not _stdin_is_tty() and sys.stdin is not None):
        return strip_one_newline(read_stdin_text())
    if a.prompt is not None:
        return check_text_arg(a.prompt, "the prompt (-p)")
    raise InvalidArgumentError("no prompt: pass -p TEXT, -f FILE, or pipe text on stdin")


def cmd_generate(a) -> int:
    prompt = _read_prompt(a)
    stop = [check_text_arg(s, "a --stop text") for s in a.stop]
    model = load_model(a)
    add_special = True
    if a.chat_template is not None:
        end = use_chat_template(model, a.chat_template)
        if end and end not in stop:
            stop.append(end)
        prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        add_special = False
    if a.context_shift:
        pieces = _generate_shifting(model, prompt, add_special, stop, a)
    else:
        pieces = model.generate(prompt, max_tokens=a.max_tokens, stop=stop,
                                add_special_tokens=add_special, **sampling_kwargs(a))
    for piece in pieces:
        write_out(piece)
    write_out("\n")
    _print_stats(getattr(model, "last_stats", None), a.no_stats, shift_hint=not a.context_shift)
    return 0


def _generate_shifting(model, prompt: str, add_special: bool, stop: list[str], a):
    from ..context_shift import generate_shifting
    from ..errors import ContextFullError, TokenizerError
    from ..sampling import SamplingParams

    if model.tokenizer is None:
        raise TokenizerError("this model has no tokenizer (no tokenizer.json)")
    params = SamplingParams(temperature=float(a.temperature), top_k=a.top_k, top_p=float(a.top_p),
                            min_p=float(a.min_p), repetition_penalty=float(a.repeat_penalty), seed=a.seed)
    ids = model.tokenizer.encode(prompt, add_special_tokens=add_special)
    if not ids:
        raise InvalidArgumentError("the prompt is empty (it encodes to no tokens)")
    if len(ids) > model.context:
        raise ContextFullError(f"the prompt has {len(ids)} tokens but the context window holds "
                               f"{model.context} (use a larger --context or a shorter prompt)")
    if a.keep < -1:
        raise InvalidArgumentError(f"--keep must be a count of tokens >= 0, or -1 (the whole prompt), got {a.keep}")
    bos = 1 if model.tokenizer.bos_id is not None and ids[0] == model.tokenizer.bos_id else 0
    keep = len(ids) if a.keep < 0 else min(len(ids), bos + a.keep)

    def notice(n):
        print(f"\ncyllm: notice: context full: dropped {n} tokens after the first {keep}", file=sys.stderr)

    return generate_shifting(model, ids, a.max_tokens, params, stop, keep, notice)


def cmd_chat(a) -> int:
    from .repl import run_chat
    return run_chat(a)


def cmd_info(a) -> int:
    if a.model is not None:
        from .modelinfo import describe_model
        for line in describe_model(model_path(a.model)):
            print(one_line(line))
        return 0
    import platform

    import numpy as np

    from ..threads import logical_cpus, physical_cores, resolve_threads

    print(f"cyllm {_version()} (Python {platform.python_version()}, numpy {np.__version__})")
    print(f"cpu: {_cpu_model()} ({physical_cores()} physical cores, {logical_cpus()} logical CPUs)")
    try:
        from ..backends.cpu import kernel_info
        info = kernel_info()
        print(f"cpu features: {', '.join(info['cpu_features']) or 'none detected'}")
        print(f"kernel variant: {info['variant']}"
              + ("  (forced by CYLLM_KERNELS)" if os.environ.get("CYLLM_KERNELS") else ""))
        print(f"openmp: {'yes' if info['openmp'] else 'no (single-threaded build)'}")
        for fmt, how in info.get("formats", {}).items():
            print(f"weights {fmt}: {how}")
        if "quant_error" in info:
            print(f"quantized kernels: unavailable ({one_line(info['quant_error'])})")
    except (CyllmError, ImportError) as e:
        print(f"cpu backend: unavailable ({one_line(e)})")
    src = "OMP_NUM_THREADS" if os.environ.get("OMP_NUM_THREADS") else "physical cores"
    try:
        print(f"threads: {resolve_threads(None)} (from {src}; a saved tuning below applies per model size)")
    except CyllmError as e:
        print(f"threads: {one_line(e)}")
    try:
        from ..saved_tuning import describe_saved_tuning
        for line in describe_saved_tuning():
            print(one_line(line))
    except ImportError:
        pass
    from ..default_model import describe_default_model
    print(one_line(describe_default_model()))
    print(f"cuda: {_cuda_status()}")
    return 0


def cmd_models(a) -> int:
    from ..default_model import default_model_path
    from ..hub import cache_dir, cached_models
    from .modelinfo import fmt_bytes

    models = cached_models()
    print(f"Hugging Face cache: {cache_dir()}")
    if not models:
        print("  no models that cyllm can load (`cyllm generate -m org/repo` or "
              "`-m org/repo-GGUF:Q4_K_M` downloads one)")
    width = max((len(m.name) for m in models), default=0)
    for m in models:
        print(f"  {one_line(m.name):<{width}}  {fmt_bytes(m.size):>11}  {m.kind}")
    try:
        path = default_model_path(download=False)
    except CyllmError as e:
        print(f"default model: {one_line(e)}")
    else:
        state = "" if path.exists() else " (not fetched yet)"
        print(f"default model (no -m): {one_line(path)}{state}")
    return 0


def _cpu_model() -> str:
    from ..hostinfo import cpu_model_name
    return cpu_model_name()


from ..errors import CUDA_INSTALL_HINT  # noqa: E402  (the engine's hint; the CLI repeats it)


def _cuda_status() -> str:
    try:
        import cupy
    except ImportError:
        return f"not available (cupy is not installed; {CUDA_INSTALL_HINT})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 -- any driver error means "no usable GPU"
        return f"not available ({one_line(str(e).splitlines()[0] if str(e) else type(e).__name__)})"
    if n == 0:
        return "not available (no GPU found)"
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    return f"available ({n} GPU(s), {name.decode() if isinstance(name, bytes) else name})"


def cmd_perplexity(a) -> int:
    from .perplexity import format_ppl, perplexity

    text = read_text_file(a.file, "text file", MAX_TEXT_BYTES)
    ctx = a.context or 512
    a.context = max(ctx, 1)
    model = load_model(a)
    ppl, err = perplexity(model, text, ctx, progress=not a.no_progress)
    print(format_ppl(ppl, err))
    return 0


def cmd_convert(a) -> int:
    from .convert import convert_gguf_to_hf

    out = convert_gguf_to_hf(a.gguf, a.out_dir, overwrite=a.force)
    print(f"wrote {out}", file=sys.stderr)
    return 0


# -- the entry point ---------------------------------------------------------------------
def _silence_stdout() -> None:
    """Point fd 1 at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, AttributeError, ValueError):
        pass


def _run(argv) -> int:
    if argv is None:
        argv = sys.argv[1:]
    hint = llama_cpp_flag(list(argv))
    if hint:
        print(f"cyllm: error: {one_line(hint)}", file=sys.stderr)
        return EXIT_USAGE
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if sys.stdout is None:
        raise InvalidArgumentError("standard output is closed: there is nowhere to write the results")
    return args.func(args) or 0


def main(argv=None) -> int:
    if sys.stderr is None:                        # started with stderr closed
        sys.stderr = open(os.devnull, "w")
    try:
        return _run(argv)
    except CyllmError as e:
        if isinstance(e, OutputError):
            _silence_stdout()                     # the interpreter's last flush would fail again
        print(f"cyllm: error: {one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\ncyllm: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _silence_stdout()                         # the reader went away (`| head`): exit quietly
        return 0
    except OSError as e:
        # the environment, not a bug: a full disk (stdout to /dev/full), a read-only directory...
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        if e.errno is not None and getattr(e, "filename", None) is None:
            _silence_stdout()
        print(f"cyllm: error: {one_line(e.strerror or e)}{one_line(where)}", file=sys.stderr)
        return EXIT_USAGE
    except MemoryError:
        # the machine's limit, not a bug: inputs that could ask for memory beyond their size are
        # bounded where they are read
        print("cyllm: error: out of memory (this needs more memory than the process may have)", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 -- the last line of defence: a bug in cyllm
        if os.environ.get("CYLLM_DEBUG", "") not in ("", "0"):
            import traceback
            traceback.print_exc()
        text = str(e)
        print(f"cyllm: internal error: {type(e).__name__}" + (f": {one_line(text, 300)}" if text else "")
              + " -- this is a bug in cyllm; please report it with the command line "
              "(CYLLM_DEBUG=1 shows the traceback)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
