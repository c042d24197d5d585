"""Shared test helpers: the repo root on sys.path (for `tools.*`) and the ../shared folder."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Callable

import pytest

# A shell starts background jobs (`cmd &`, nohup) with SIGINT ignored, and children inherit an
# ignored signal: the Ctrl-C tests' qllama processes would then never see their SIGINT. A handler
# (unlike SIG_IGN) is reset to the default in a child, so restore Python's own.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def shared_path(*parts: str) -> Path:
    """A path under ../shared, or skip the test (a fresh clone has no ../shared)."""
    p = SHARED.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"{p} is absent (the read-only ../shared folder is not beside this checkout)")
    return p


@pytest.fixture
def float_path():
    """Run a test on the float kernels, restoring the int8-activation setting afterwards."""
    from qllama.qtensor import int8_activations, set_int8_activations

    was_on = bool(int8_activations())
    set_int8_activations(False)
    yield
    set_int8_activations(was_on)


@pytest.fixture
def int8_mode():
    """`set_int8_activations`, with the setting restored after the test."""
    from qllama.qtensor import int8_activations, set_int8_activations

    was_on = bool(int8_activations())
    yield set_int8_activations
    set_int8_activations(was_on)


def synthetic_models(tmp_path_factory, cases: dict) -> "Callable[[str], str]":
    """name -> path of a synthetic model file for `cases[name]` (a tools.make_model spec), written
    on first use into one temporary folder (a module-scoped fixture's getter)."""
    from tools.make_model import write_model

    root = tmp_path_factory.mktemp("models")
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            path = root / f"{name}.gguf"
            write_model(path, cases[name])
            made[name] = str(path)
        return made[name]

    return get
