"""`qllama tokenize MODEL [TEXT]`: the token ids of a text, as llama.cpp's llama-tokenize prints them.

Each line is `id -> 'piece'`; `--ids` prints only the list of ids. BOS is added when the model
asks for it (`--no-bos` never adds it); `--parse-special` matches control tokens such as
<|eot_id|> written in the text. Without TEXT (or with "-") the text is read from stdin.
Works on vocab-only GGUF files and never imports numba.
"""

from __future__ import annotations

import sys

import click

from ..tokenizer import load_tokenizer
from .model_ref import ModelRef


@click.command("tokenize")
@click.argument("model", type=ModelRef(dir_okay=False))
@click.argument("text", required=False)
@click.option("-p", "--prompt", "prompt_opt", metavar="TEXT", help="The text (llama-tokenize's spelling of TEXT).")
@click.option("-f", "--file", "text_file", type=click.Path(dir_okay=False), help="Read the text from a file.")
@click.option("--ids", "ids_only", is_flag=True, help="Print only the list of token ids.")
@click.option("--no-bos", is_flag=True, help="Never add the BOS token.")
@click.option("--parse-special", is_flag=True, help="Match special tokens (e.g. <|eot_id|>) in the text.")
def command(model: str, text: str | None, prompt_opt: str | None, text_file: str | None, ids_only: bool, no_bos: bool,
            parse_special: bool) -> None:
    """Print the token ids of TEXT (or -p TEXT, -f FILE, stdin) for MODEL's tokenizer."""
    from .options import read_text_file

    if sum(x is not None for x in (text, prompt_opt, text_file)) > 1:
        raise click.UsageError("give the text once: as TEXT, with -p TEXT or with -f FILE")
    text = text if text is not None else prompt_opt
    if text_file is not None and text_file != "-":
        text = read_text_file(text_file)
    tok = load_tokenizer(model)
    if text is None or text == "-":
        text = sys.stdin.buffer.read().decode("utf-8", "replace")
    ids = tok.encode(text, add_bos=not no_bos, parse_special=parse_special)
    if ids_only:
        click.echo("[" + ", ".join(map(str, ids)) + "]")
        return
    lines = [f"{i:6d} -> {_quote(tok.piece(i))}" for i in ids]
    if lines:
        click.echo("\n".join(lines))


def _quote(piece: str) -> str:
    # repr-like quoting so that newlines, tabs and spaces stay visible on one line
    shown = "".join(c if c.isprintable() or c == " " else c.encode("unicode_escape").decode("ascii") for c in piece)
    return "'" + shown + "'"
