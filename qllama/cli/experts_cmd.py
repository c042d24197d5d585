"""`qllama experts MODEL TEXT`: which experts a mixture-of-experts model routes a text to.

Per layer: the most chosen experts with their token counts and share of the layer's picks, and
how many experts no token chose. `--png FILE` draws the (layer x expert) counts as a heat map
(matplotlib, the `qllama[plot]` extra); `--json` prints `qllama.experts.ExpertUsage.as_dict`.
"""

from __future__ import annotations

import json

import click

from .options import load_text, text_analysis_options


@click.command("experts")
@click.option("-k", "--top", "top", default=5, show_default=True, type=click.IntRange(min=1, max=64),
              help="Experts shown per layer.")
@click.option("--png", "png", type=click.Path(dir_okay=False), help="Also write the counts as a heat map (needs matplotlib).")
@text_analysis_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of the table.")
def command(model, text, top, png, no_bos, threads, as_json):
    """Count, per layer of MODEL, the experts its router picks for the tokens of TEXT."""
    from ..experts import expert_usage

    llm, ids = load_text(model, text, no_bos, threads)
    usage = expert_usage(llm, ids)
    if png:
        usage.save_png(png)
    if as_json:
        click.echo(json.dumps(usage.as_dict()))
        return
    n_expert = usage.counts.shape[1]
    click.echo(f"{usage.n_tokens} tokens, {usage.n_used} of {n_expert} experts each, per layer:")
    click.echo("")
    click.echo("| layer | " + " | ".join(f"top {i + 1}" for i in range(top)) + " | unused |")
    click.echo("| ---: |" + " --- |" * top + " ---: |")
    for il in range(usage.counts.shape[0]):
        cells = [f"#{e} {c} ({share:.0%})" for e, c, share in usage.top(il, top)]
        click.echo(f"| {il} | " + " | ".join(cells) + f" | {len(usage.unused(il))} |")
