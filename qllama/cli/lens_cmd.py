"""`qllama lens MODEL TEXT`: the logit lens, what each layer's residual stream would predict.

For the embedding and after every block, the residual stream at one position (the last token
by default) goes through the model's final RMSNorm, output matrix and final softcap; the table
shows the top tokens with their probabilities. `--json` prints `qllama.lens.LensResult.as_dict`.
"""

from __future__ import annotations

import json

import click

from .options import load_text, text_analysis_options


@click.command("lens")
@click.option("-k", "--top-k", default=5, show_default=True, type=click.IntRange(min=1, max=100),
              help="Tokens shown per layer.")
@click.option("--position", default=-1, show_default=True, type=int,
              help="Token position read (negative: from the end).")
@text_analysis_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of the table.")
def command(model, text, top_k, position, no_bos, threads, as_json):
    """Show, for each layer of MODEL, the top tokens its residual stream predicts for TEXT."""
    from ..lens import logit_lens

    llm, ids = load_text(model, text, no_bos, threads)
    res = logit_lens(llm, ids, top_k=top_k, position=position)
    if as_json:
        click.echo(json.dumps(res.as_dict(), ensure_ascii=False))
        return
    shown = "".join(res.tokens[: res.position + 1])
    click.echo(f"logit lens at position {res.position} (after {_show(res.tokens[res.position])}), "
               f"text so far: {_show(shown[-60:])}")
    click.echo("")
    click.echo("| layer | " + " | ".join(f"top {i + 1}" for i in range(top_k)) + " |")
    click.echo("| ---: |" + " --- |" * top_k)
    for r in res.rows:
        cells = [f"{_show(p)} {pr:.2f}" for p, pr in zip(r.pieces, r.probs)]
        cells += [""] * (top_k - len(cells))
        click.echo(f"| {r.layer} | " + " | ".join(cells) + " |")


def _show(piece: str) -> str:
    """A token piece quoted on one line (newlines and tabs escaped, `|` kept out of the table)."""
    s = "".join(c if c.isprintable() or c == " " else c.encode("unicode_escape").decode("ascii") for c in piece)
    return "'" + s.replace("|", "\\|") + "'"
