"""The argument parser of the CLI: one-line errors, typo suggestions, llama.cpp's habits.

argparse's own error prints the usage and a message that can span lines; this
parser prints one line ``cyllm: error: ...`` with a "did you mean" for an
unknown option or command (difflib), never accepts abbreviations
(``allow_abbrev=False``), and answers llama.cpp flags that have no plain
equivalent (``-ngl``, ``-hf``) with what to use instead.
"""

from __future__ import annotations

import argparse
import difflib
import re

from ..oneline import one_line

EXIT_USAGE = 2


# llama.cpp flags whose cyllm equivalent is not a plain alias: a one-line pointer instead
_LLAMA_CPP_HINTS = {
    "-ngl": "cyllm does not split a model between CPU and GPU layers: `--backend cuda` runs all "
            "of it on the GPU (like llama.cpp's -ngl 99)",
    "-hf": "name a Hugging Face model with -m: `-m org/repo` or `-m org/repo-GGUF:Q4_K_M`",
    "-cnv": "for a conversation use `cyllm chat`",
}
for _alias, _key in (("--n-gpu-layers", "-ngl"), ("--gpu-layers", "-ngl"), ("--hf-repo", "-hf"),
                     ("-hfr", "-hf"), ("--conversation", "-cnv")):
    _LLAMA_CPP_HINTS[_alias] = _LLAMA_CPP_HINTS[_key]
# options whose next word is a value, not a flag (so `-p -ngl` is a prompt)
_TAKES_TEXT = {"-p", "--prompt", "-s", "--system", "-sys", "--system-prompt", "--stop", "-r",
               "--reverse-prompt", "-f", "--file", "-m", "--model"}


def llama_cpp_flag(argv: list[str]) -> str | None:
    prev = None
    for tok in argv:
        if tok == "--":
            return None
        if prev not in _TAKES_TEXT:
            name = tok.split("=", 1)[0]
            if name in _LLAMA_CPP_HINTS:
                return f"{name} is a llama.cpp option; {_LLAMA_CPP_HINTS[name]}"
            if re.fullmatch(r"-ngl\d+", tok):
                return f"-ngl is a llama.cpp option; {_LLAMA_CPP_HINTS['-ngl']}"
        prev = tok
    return None


def suggest(word: str, candidates) -> str:
    match = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""


class Parser(argparse.ArgumentParser):
    """One-line errors with a suggestion for typos; no silent abbreviations."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.commands: dict[str, argparse.ArgumentParser] = {}

    def parse_args(self, args=None, namespace=None):
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            sub = self.commands.get(getattr(ns, "command", None))
            (sub or self).error(self._unrecognized(extras, sub))
        return ns

    def _unrecognized(self, extras: list[str], sub) -> str:
        msg = f"unrecognized arguments: {' '.join(extras)}"
        parser = sub or self
        flag = next((x for x in extras if x.startswith("-") and len(x) > 1), None)
        if flag is not None:
            name = flag.split("=", 1)[0]
            options = [o for act in parser._actions for o in act.option_strings if o.startswith("--")]
            return msg + suggest(name, options)
        if sub is not None and sub.prog.endswith(" generate"):
            return msg + " (pass the prompt with -p TEXT)"
        return msg

    def error(self, message):
        m = re.match(r"argument (\S+): invalid choice: '(.*?)' \(choose from (.*)\)$", message)
        if m:
            choices = re.findall(r"'([^']*)'", m.group(3))
            what = "command" if m.group(1) == "COMMAND" else f"choice for {m.group(1)}"
            message = f"unknown {what} {m.group(2)!r}{suggest(m.group(2), choices)}"
        self.exit(EXIT_USAGE, f"cyllm: error: {one_line(message)} (see `{self.prog} --help`)\n")


def nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {one_line(text, 40)!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def pos_int(text: str) -> int:
    value = nonneg_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError("expected a number > 0, got 0")
    return value
