"""Messages on one printable line, whatever text they quote (a path, a file's content).

Used by every message cyllm prints about input it did not write itself, so a
newline or a terminal escape in a file name or a template's exception cannot
forge extra lines or repaint the terminal.
"""

from __future__ import annotations


def one_line(text, limit: int = 2000) -> str:
    """``text`` as one printable line: newlines, tabs and other control or format
    characters (bidi overrides, line separators) are shown escaped."""
    out = []
    for ch in str(text):
        if ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append(" ")
        elif not ch.isprintable():
            o = ord(ch)
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")
        else:
            out.append(ch)
    s = "".join(out)
    return s if len(s) <= limit else s[:limit] + "..."
