"""Terminal manners shared by `run`, `chat` and `perplexity`.

- `quiet_input()`: while an answer streams, keys typed at the terminal are not echoed into it
  (the terminal's ECHO is off; what was typed stays in the input queue, so the next prompt
  receives it as type-ahead). The terminal's settings are restored afterwards, also after
  Ctrl-C or an error.
- `PromptProgress`: a long prompt (at least `min_tokens`) shows "prompt: done/total tokens,
  N tokens/s" on stderr, redrawn in place, only when stderr is a terminal; the line is erased
  when the prompt is done, so the answer starts on a clean line.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Iterator, TextIO

PROGRESS_MIN_TOKENS = 256  # prompts shorter than this evaluate in about a second: no progress line


@contextlib.contextmanager
def quiet_input(stream: TextIO | None = None) -> Iterator[None]:
    """Turn the terminal's echo off on `stream` (default: stdin) for the block; nothing when it
    is not a terminal (a pipe, a file, a test) or termios is missing (Windows)."""
    stream = sys.stdin if stream is None else stream
    try:
        import termios

        fd = stream.fileno()
        if not stream.isatty():
            raise OSError
        saved = termios.tcgetattr(fd)
    except (ImportError, OSError, ValueError, AttributeError):
        yield
        return
    quiet = list(saved)
    quiet[3] = quiet[3] & ~termios.ECHO  # lflag: no echo; canonical mode and Ctrl-C (ISIG) unchanged
    try:
        termios.tcsetattr(fd, termios.TCSANOW, quiet)
    except termios.error:
        yield
        return
    try:
        yield
    finally:
        try:
            termios.tcsetattr(fd, termios.TCSANOW, saved)
        except termios.error:
            pass


class PromptProgress:
    """A `progress(done, total)` callback for `Session.progress` (qllama.generation.session)."""

    def __init__(self, stream: TextIO | None = None, min_tokens: int = PROGRESS_MIN_TOKENS):
        self.stream = sys.stderr if stream is None else stream
        try:
            self.enabled = self.stream.isatty()
        except (AttributeError, ValueError):
            self.enabled = False
        self.min_tokens = min_tokens
        self.t0: float | None = None
        self.width = 0

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total < self.min_tokens:
            return
        now = time.perf_counter()
        if done == 0 or self.t0 is None:
            self.t0 = now
            line = f"prompt: 0/{total} tokens"
        else:
            rate = done / (now - self.t0) if now > self.t0 else 0.0
            line = f"prompt: {done}/{total} tokens, {rate:.1f} tokens/s"
        if done >= total:  # erase the line: the answer starts where it was
            self.stream.write("\r" + " " * max(self.width, len(line)) + "\r")
            self.t0, self.width = None, 0
        else:
            self.stream.write("\r" + line.ljust(self.width))
            self.width = len(line)
        self.stream.flush()
