"""The kernel warm-up as the commands show it: a line on stderr before a first-run compile, a
spinner while it lasts (on a terminal only), and its time reported apart from the model's speed."""

from __future__ import annotations

import sys
import threading
import time

import click


class Spinner:
    """`with Spinner("compiling"):` draws `| compiling... 3 s` on stderr after `delay` seconds,
    redrawn in place, and erases it at the end. Does nothing when disabled (e.g. not a terminal)."""

    FRAMES = "|/-\\"

    def __init__(self, label: str, enabled: bool, delay: float = 1.0, period: float = 0.2):
        self.label, self.enabled, self.delay, self.period = label, enabled, delay, period
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._drawn = False

    def _run(self) -> None:
        t0 = time.monotonic()
        if self._stop.wait(self.delay):
            return
        i = 0
        while not self._stop.is_set():
            sys.stderr.write(f"\r{self.FRAMES[i % 4]} {self.label}... {time.monotonic() - t0:.0f} s ")
            sys.stderr.flush()
            self._drawn = True
            i += 1
            self._stop.wait(self.period)

    def __enter__(self) -> "Spinner":
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="qllama-spinner", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            if self._drawn:
                sys.stderr.write("\r\x1b[K")  # erase the spinner line
                sys.stderr.flush()


def warm_up(llm, *, quiet: bool = False) -> float:
    """Warm up `llm`'s kernels (Model.warmup), telling the user when this is a first-run compile.

    Returns the seconds spent. A Ctrl-C that Numba's compile swallowed is raised again here.
    """
    from . import reraise_lost_interrupt, sigint_count

    cold = not llm.kernels_cached()
    say = cold and not quiet
    if say:
        click.echo(f"compiling kernels for {', '.join(llm.kernel_types())} (first run only)...", err=True)
    before = sigint_count()
    with Spinner("compiling", enabled=say and sys.stderr.isatty()):
        seconds = llm.warmup()
    reraise_lost_interrupt(since=before)  # a Ctrl-C that the compile swallowed still stops us
    if say:
        click.echo(f"kernels compiled in {seconds:.1f} s", err=True)
    return seconds
