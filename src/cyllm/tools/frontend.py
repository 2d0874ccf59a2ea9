"""What the command-line front ends share (the one-shot commands in cli.py and the
chat loop in repl.py): loading the model the flags name, the chat-template flag,
the sampling flags, and writing results to stdout."""

from __future__ import annotations

import sys

from ..errors import CyllmError, InvalidArgumentError
from ..hub import model_path
from ..oneline import one_line


def warn(msg: str) -> None:
    print(f"cyllm: warning: {one_line(msg)}", file=sys.stderr)


def sampling_kwargs(a) -> dict:
    return dict(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                repetition_penalty=a.repeat_penalty, seed=a.seed)


def load_model(a):
    import cyllm
    model = cyllm.load(model_path(a.model), backend=a.backend, threads=a.threads, context=a.context,
                       threads_batch=getattr(a, "threads_batch", None), quantize=getattr(a, "quantize", None))
    trained = model.config.max_seq_len
    if a.context and a.context > trained:
        warn(f"--context {a.context} is larger than the {trained} tokens the model was trained on; "
             "text beyond that is usually garbage")
    return model


def use_chat_template(model, spec: str | None) -> str | None:
    """Apply ``--chat-template`` (None or "": the model's own); returns a turn-end stop string or None."""
    tok = model.tokenizer
    if tok is None:
        raise InvalidArgumentError("this model has no tokenizer, so no chat template can be used")
    if spec:
        from ..chat_templates import resolve_chat_template
        t = resolve_chat_template(spec)
        tok.set_chat_template(t.source)
        return t.end
    if not tok.chat_template:
        raise InvalidArgumentError("this model has no chat template; name one with --chat-template "
                                   "chatml|llama3|gemma|phi3 or a jinja file")
    return None


class OutputError(CyllmError):
    """Standard output cannot take the results (a full disk, a device error)."""


def write_out(text: str) -> None:
    """Results to stdout, at once (streaming); a failing stdout is one clear line, not a traceback."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        raise OutputError(f"cannot write to standard output: {e.strerror or e}") from None
