"""Options and input handling shared by several commands."""

from __future__ import annotations

import sys

import click

from ..errors import QllamaError


def sampling_options(f):
    """--temp, --top-k, --top-p, --min-p, --repeat-penalty, --repeat-last-n, --seed (llama.cpp's defaults)."""
    opts = [
        click.option("--temp", default=0.8, show_default=True, type=float, help="Temperature; 0 = greedy."),
        click.option("--top-k", default=40, show_default=True, type=int, help="Top-k (<= 0: off)."),
        click.option("--top-p", default=0.95, show_default=True, type=click.FloatRange(0.0, 1.0), help="Top-p (1.0: off)."),
        click.option("--min-p", default=0.05, show_default=True, type=click.FloatRange(0.0, 1.0), help="Min-p (0.0: off)."),
        click.option("--repeat-penalty", default=1.0, show_default=True, type=click.FloatRange(min=0.0, min_open=True),
                     help="Penalty for recently seen tokens (1.0: off)."),
        click.option("--repeat-last-n", default=64, show_default=True, type=click.IntRange(min=-1),
                     help="Window of the repeat penalty (0: off, -1: whole context)."),
        click.option("--seed", type=int, default=None, help="Random seed (default: random)."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt from the argument, a file ('-' = stdin), or stdin when neither is given."""
    if prompt is not None and prompt_file is not None:
        raise click.UsageError("give the prompt either as an argument or with -f, not both")
    if prompt is not None:
        return prompt
    if prompt_file is not None and prompt_file != "-":
        try:
            with open(prompt_file, encoding="utf-8") as f:
                return f.read()
        except UnicodeDecodeError:
            raise QllamaError(f"{prompt_file}: not UTF-8 text") from None
    if prompt_file is None and sys.stdin.isatty():
        raise click.UsageError("no prompt: give PROMPT, -f FILE, or pipe text on stdin")
    return sys.stdin.read()
