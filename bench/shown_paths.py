"""Command lines as the results files show them: no paths of the machine that ran them.

A results file keeps the command that reproduces its numbers, but a path into the home
directory or a scratch folder of the machine that ran it means nothing elsewhere. Absolute
paths under the home directory become `~/...`; other absolute paths become their file
name (the results file says how each file was made)."""

from __future__ import annotations

import os
import re
import shlex

_ABS = re.compile(r"(?<![\w.~])/[^\s,'\"`]+")


def shown(text: str) -> str:
    """`text` with every absolute path replaced as the module docstring says."""
    home = os.path.expanduser("~").rstrip("/")

    def one(m: re.Match) -> str:
        p = m.group(0)
        if home and home != "/" and (p == home or p.startswith(home + "/")):
            return "~" + p[len(home):]
        return os.path.basename(p.rstrip("/")) or p
    return _ABS.sub(one, text)


def shown_argv(script: str, argv: list[str]) -> str:
    """`python SCRIPT ARGS...` quoted for a shell, with shown() paths."""
    return shown("python " + " ".join([script] + [shlex.quote(a) for a in argv]))
