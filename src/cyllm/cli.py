"""`cyllm generate|chat|info|bench|tune|perplexity|convert|quantize`.

Every user error ends as one line on stderr (``cyllm: error: ...``) and exit
status 2; results go to stdout, progress and statistics to stderr.
"""

from __future__ import annotations

import argparse
import os
import sys

from .errors import CyllmError, InvalidArgumentError


class _Parser(argparse.ArgumentParser):
    def error(self, message):          # one line, exit 2 (argparse would print the usage too)
        self.exit(2, f"cyllm: error: {message} (see `{self.prog} --help`)\n")


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def _pos_int(text: str) -> int:
    value = _nonneg_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError("expected a number > 0, got 0")
    return value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", help="Hugging Face model directory or GGUF file "
                   "(default: $CYLLM_MODEL or SmolLM2-135M-Instruct, fetched on first use)")
    p.add_argument("--backend", default="cpu", help="cpu (default), cuda or numpy (slow reference)")
    p.add_argument("-t", "--threads", help="kernel threads (default: OMP_NUM_THREADS, tuned value, "
                   "or the number of physical cores)")
    p.add_argument("--threads-batch", help="threads for prompt processing (default: as --threads, "
                   "or the tuned value)")
    p.add_argument("-c", "--context", type=_pos_int, help="context window in tokens (default: the "
                   "model's, at most 4096)")
    p.add_argument("--quantize", metavar="TYPE", help="quantize float weights in memory at load: "
                   "q8_0, q4_0 or q4_k (llama.cpp's Q4_K_M recipe)")


def _add_sampling_args(p: argparse.ArgumentParser, default_temp: float) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("-n", "--max-tokens", type=_nonneg_int, default=128, help="tokens to generate (default 128)")
    g.add_argument("--temp", "--temperature", dest="temperature", type=float, default=default_temp,
                   help=f"0 = greedy (default {default_temp})")
    g.add_argument("--top-k", type=_nonneg_int, default=40, help="0 = off (default 40)")
    g.add_argument("--top-p", type=float, default=0.95, help="1 = off (default 0.95)")
    g.add_argument("--min-p", type=float, default=0.05, help="0 = off (default 0.05)")
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="1 = off (default 1.0)")
    g.add_argument("--seed", type=int, help="random seed: the same seed gives the same output")
    g.add_argument("--stop", action="append", default=[], help="stop when this text appears (repeatable)")
    g.add_argument("--no-stats", action="store_true", help="do not print the statistics line")


def _sampling_kwargs(a) -> dict:
    return dict(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                repetition_penalty=a.repeat_penalty, seed=a.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cyllm", description="Fast local LLM inference (Cython + OpenMP, optional CUDA).")
    parser.add_argument("--version", action="version", version=f"cyllm {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    g = sub.add_parser("generate", help="continue a prompt")
    _add_model_args(g)
    src = g.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", help="the prompt text ('-' reads it from stdin)")
    src.add_argument("-f", "--file", help="read the prompt from this file")
    g.add_argument("--chat-template", action="store_true",
                   help="wrap the prompt as a user message with the model's chat template")
    _add_sampling_args(g, default_temp=0.8)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="talk with the model (reads lines from stdin when it is not a terminal)")
    _add_model_args(c)
    c.add_argument("-s", "--system", help="system prompt")
    _add_sampling_args(c, default_temp=0.8)
    c.set_defaults(func=cmd_chat, max_tokens=512)

    i = sub.add_parser("info", help="version, CPU features, kernel variant, threads")
    i.set_defaults(func=cmd_info)

    pp = sub.add_parser("perplexity", help="perplexity of a text file (llama.cpp's method)")
    _add_model_args(pp)
    pp.add_argument("-f", "--file", required=True, help="text file")
    pp.set_defaults(func=cmd_perplexity)

    cv = sub.add_parser("convert", help="convert a GGUF file to a Hugging Face directory")
    cv.add_argument("gguf", help="input .gguf file")
    cv.add_argument("out_dir", help="output directory")
    cv.add_argument("--force", action="store_true", help="write into a non-empty directory")
    cv.set_defaults(func=cmd_convert)

    try:
        from .bench import add_bench_parser, add_tune_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub, _add_model_args)
        add_tune_parser(sub, _add_model_args)
    from .quantize import add_quantize_parser
    add_quantize_parser(sub)
    return parser


def _version() -> str:
    from . import __version__
    return __version__


def _load(a):
    import cyllm
    return cyllm.load(a.model, backend=a.backend, threads=a.threads, context=a.context,
                      threads_batch=getattr(a, "threads_batch", None), quantize=getattr(a, "quantize", None))


def _print_stats(stats, quiet: bool) -> None:
    if stats is None:
        return
    if stats.stop_reason == "context":
        print("cyllm: notice: the context window is full; generation stopped "
              "(use a larger --context)", file=sys.stderr)
    if not quiet:
        print(stats.line(), file=sys.stderr)


def cmd_generate(a) -> int:
    if a.file:
        try:
            with open(a.file, encoding="utf-8") as f:
                prompt = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidArgumentError(f"cannot read prompt file {a.file}: {e}") from None
    elif a.prompt == "-" or (a.prompt is None and not sys.stdin.isatty()):
        prompt = sys.stdin.read()
    elif a.prompt is not None:
        prompt = a.prompt
    else:
        raise InvalidArgumentError("no prompt: pass -p TEXT, -f FILE, or pipe text on stdin")
    model = _load(a)
    add_special = True
    if a.chat_template:
        prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        add_special = False
    for piece in model.generate(prompt, max_tokens=a.max_tokens, stop=a.stop,
                                add_special_tokens=add_special, **_sampling_kwargs(a)):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    _print_stats(getattr(model, "last_stats", None), a.no_stats)
    return 0


def cmd_chat(a) -> int:
    from .generate import Chat

    model = _load(a)
    chat = Chat(model, system=a.system, **_sampling_kwargs(a))
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"cyllm chat with {model.config.name or 'the model'} -- Ctrl-D to quit", file=sys.stderr)
    while True:
        if interactive:
            try:
                line = input("> ")
            except EOFError:
                print(file=sys.stderr)
                return 0
        else:
            line = sys.stdin.readline()
            if not line:
                return 0
        line = line.rstrip("\n")
        if not line.strip():
            continue
        for piece in chat.send(line, max_tokens=a.max_tokens, stop=a.stop):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        _print_stats(chat.last_stats, a.no_stats)
        if chat.last_stats.stop_reason == "context":
            return 0


def cmd_info(a) -> int:
    import platform

    import numpy as np

    from .threads import logical_cpus, physical_cores, resolve_threads

    print(f"cyllm {_version()} (Python {platform.python_version()}, numpy {np.__version__})")
    print(f"cpu: {_cpu_model()} ({physical_cores()} physical cores, {logical_cpus()} logical CPUs)")
    try:
        from .backends.cpu import kernel_info
        info = kernel_info()
        print(f"cpu features: {', '.join(info['cpu_features']) or 'none detected'}")
        print(f"kernel variant: {info['variant']}"
              + ("  (forced by CYLLM_KERNELS)" if os.environ.get("CYLLM_KERNELS") else ""))
        print(f"openmp: {'yes' if info['openmp'] else 'no (single-threaded build)'}")
        for fmt, how in info.get("formats", {}).items():
            print(f"weights {fmt}: {how}")
        if "quant_error" in info:
            print(f"quantized kernels: unavailable ({info['quant_error']})")
    except CyllmError as e:
        print(f"cpu backend: unavailable ({e})")
    except ImportError as e:
        print(f"cpu backend: unavailable ({e})")
    src = "OMP_NUM_THREADS" if os.environ.get("OMP_NUM_THREADS") else "physical cores"
    print(f"threads: {resolve_threads(None)} (from {src}; a saved tuning below applies per model size)")
    try:
        from .tuning import describe_saved_tuning
        for line in describe_saved_tuning():
            print(line)
    except ImportError:
        pass
    from .default_model import default_model_path
    path = default_model_path(download=False)
    print(f"default model: {path}" + ("" if path.exists() else " (fetched on first use)"))
    print(f"cuda: {_cuda_status()}")
    return 0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def _cuda_status() -> str:
    try:
        import cupy
    except ImportError:
        return "not available (cupy is not installed: pip install cyllm[cuda])"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 -- any driver error means "no usable GPU"
        return f"not available ({str(e).splitlines()[0]})"
    if n == 0:
        return "not available (no GPU found)"
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    return f"available ({n} GPU(s), {name.decode() if isinstance(name, bytes) else name})"


def cmd_perplexity(a) -> int:
    from .perplexity import format_ppl, perplexity

    try:
        with open(a.file, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgumentError(f"cannot read text file {a.file}: {e}") from None
    ctx = a.context or 512
    a.context = max(ctx, 1)
    model = _load(a)
    ppl, err = perplexity(model, text, ctx)
    print(format_ppl(ppl, err))
    return 0


def cmd_convert(a) -> int:
    from .convert import convert_gguf_to_hf

    out = convert_gguf_to_hf(a.gguf, a.out_dir, overwrite=a.force)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.func(args) or 0
    except CyllmError as e:
        print(f"cyllm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ncyllm: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (e.g. `| head`); exit quietly
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0


if __name__ == "__main__":
    sys.exit(main())
