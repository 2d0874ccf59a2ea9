"""Drive a command in a pseudo-terminal, as a person at a terminal would (not a test module).

``PtyProcess([...])`` starts the command as a session leader with the pty as its
controlling terminal, so Ctrl-C (``\\x03``) is turned into SIGINT by the
terminal's line discipline, exactly as at a real keyboard. ``expect(text)``
reads output until ``text`` appears; ``send`` writes in small pieces while
draining output, so a long paste cannot deadlock on a full pty buffer.
"""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

CTRL_C = b"\x03"
CTRL_D = b"\x04"
PASTE_START = b"\x1b[200~"        # bracketed paste, as a terminal sends it to readline
PASTE_END = b"\x1b[201~"


class PtyProcess:
    def __init__(self, argv, env=None, cols=200, rows=50):
        import fcntl
        import struct
        import termios
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

        def child_setup():
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        full_env = dict(os.environ)
        full_env.update({"TERM": "xterm", "PYTHONUNBUFFERED": "1"})
        full_env.update(env or {})
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=full_env,
                                     preexec_fn=child_setup, close_fds=True)
        os.close(slave)
        self.fd = master
        os.set_blocking(master, False)
        self.buf = b""            # everything read so far
        self.pos = 0              # expect() searches from here

    def _read(self, timeout: float) -> bool:
        r, _, _ = select.select([self.fd], [], [], timeout)
        if not r:
            return False
        try:
            data = os.read(self.fd, 65536)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:           # EIO: the child closed the terminal
            return False
        if not data:
            return False
        self.buf += data
        return True

    def expect(self, pattern: str | bytes, timeout: float = 120.0) -> bytes:
        """Read until ``pattern`` (a regex) appears after the last match; return the text up to it."""
        if isinstance(pattern, str):
            pattern = pattern.encode()
        rx = re.compile(pattern)
        end = time.monotonic() + timeout
        while True:
            m = rx.search(self.buf, self.pos)
            if m:
                chunk = self.buf[self.pos:m.end()]
                self.pos = m.end()
                return chunk
            left = end - time.monotonic()
            if left <= 0 or (not self._read(min(left, 0.5)) and self.proc.poll() is not None
                             and not self._read(0.1)):
                raise TimeoutError(f"{pattern!r} did not appear; output so far:\n"
                                   + self.buf[-3000:].decode("utf-8", "replace"))

    def send(self, data: bytes | str, chunk: int = 256) -> None:
        if isinstance(data, str):
            data = data.encode()
        for i in range(0, len(data), chunk):
            piece = data[i:i + chunk]
            while piece:
                try:
                    n = os.write(self.fd, piece)
                    piece = piece[n:]
                except BlockingIOError:
                    pass
                self._read(0.001)

    def wait(self, timeout: float = 60.0) -> int:
        end = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < end:
            self._read(0.2)
        while self._read(0.05):
            pass
        if self.proc.poll() is None:
            self.kill()
            raise TimeoutError("the process did not exit; output:\n" + self.text()[-3000:])
        return self.proc.returncode

    def text(self) -> str:
        return self.buf.decode("utf-8", "replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.wait()

    def close(self) -> None:
        self.kill()
        try:
            os.close(self.fd)
        except OSError:
            pass


def cyllm_argv(*args) -> list[str]:
    return [sys.executable, "-m", "cyllm", *map(str, args)]
