"""`qllama attention MODEL TEXT --layer L [--head H]`: an attention map of one layer.

The weights (`blk.L.attn_probs`, see qllama.models.points) of each query token (rows) over the
tokens it attends to (columns), drawn with shade blocks in the terminal: one head, or the mean
over the heads. `--png FILE` draws the same map with matplotlib (the optional `qllama[plot]`).
"""

from __future__ import annotations

import click

from .options import text_analysis_options, text_ids

SHADES = " ░▒▓█"
LEVELS = (0.05, 0.25, 0.5, 0.75)  # a weight below LEVELS[0] is blank, then one shade per step


@click.command("attention")
@click.option("-l", "--layer", required=True, type=click.IntRange(min=0), help="Block whose attention is shown.")
@click.option("--head", type=click.IntRange(min=0), help="Query head (default: the mean over the heads).")
@click.option("--last", default=48, show_default=True, type=click.IntRange(min=1),
              help="Show only the last N tokens (rows and columns) in the terminal.")
@click.option("--png", "png", type=click.Path(dir_okay=False), help="Also write the map as a picture (needs matplotlib).")
@text_analysis_options
def command(model, text, layer, head, last, png, no_bos, threads):
    """Draw the attention weights of block LAYER of MODEL over TEXT."""
    from ..api import load
    from ..errors import QllamaError
    from ..lens import attention_map

    plt = None
    if png:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise QllamaError("--png needs matplotlib: pip install 'qllama[plot]'") from None
    llm = load(model, n_threads=threads)
    n_head = llm.args.n_head
    if head is not None and head >= n_head:
        raise click.BadParameter(f"{head} is not a head of this model (0..{n_head - 1})", param_hint="--head")
    if layer >= llm.args.n_layer:
        raise click.BadParameter(f"{layer} is not a block of this model (0..{llm.args.n_layer - 1})",
                                 param_hint="--layer")
    ids = text_ids(llm, text, no_bos)
    pieces, probs = attention_map(llm, ids, layer)  # (H, T, T)
    grid = probs[head] if head is not None else probs.mean(axis=0)  # (T, T)
    what = f"head {head}" if head is not None else f"mean of {n_head} heads"
    click.echo("\n".join(render(pieces, grid, last, f"block {layer}, {what}")))
    if plt is not None:
        save_png(plt, pieces, grid, png, f"block {layer}, {what}")
        click.echo(f"wrote {png}")


def _label(piece: str, width: int = 12) -> str:
    s = "".join(c if c.isprintable() and c != "\n" else "·" for c in piece)
    return (s if len(s) <= width else s[: width - 1] + "…").ljust(width)


def render(pieces: list[str], grid, last: int, title: str) -> list[str]:
    """Terminal lines: a header, one row per query token (its index, label and shades), a legend."""
    n = len(pieces)
    lo = max(0, n - last)
    lines = [f"attention, {title} (rows: query tokens, columns: the tokens they attend to"
             + (f"; last {n - lo} of {n}" if lo else "") + ")"]
    cols = range(lo, n)
    lines.append(" " * 19 + "".join(str(j % 10) * 2 for j in cols))
    for i in range(lo, n):
        cells = "".join(SHADES[sum(float(grid[i, j]) >= v for v in LEVELS)] * 2 for j in cols)
        lines.append(f"{i:5d} {_label(pieces[i])} |{cells}|")
    lines.append(f"shades: blank < {LEVELS[0]} <= '{SHADES[1]}' < {LEVELS[1]} <= '{SHADES[2]}' < {LEVELS[2]} <= "
                 f"'{SHADES[3]}' < {LEVELS[3]} <= '{SHADES[4]}'; columns numbered by token index (last digit)")
    return lines


def save_png(plt, pieces: list[str], grid, path: str, title: str) -> None:
    n = len(pieces)
    size = max(4.0, min(24.0, 0.28 * n + 2))
    fig, ax = plt.subplots(figsize=(size, size))
    im = ax.imshow(grid, cmap="viridis", vmin=0.0, vmax=1.0)
    labels = [repr(p)[1:-1] for p in pieces]
    ax.set_xticks(range(n), labels, rotation=90, fontsize=7)
    ax.set_yticks(range(n), labels, fontsize=7)
    ax.set_xlabel("key token")
    ax.set_ylabel("query token")
    ax.set_title(f"attention, {title}")
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
