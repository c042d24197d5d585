"""`qllama list`: the models qllama can run without a download (the demo and the cached GGUF models)."""

from __future__ import annotations

import json
import os

import click

from ..hub import refs as hub


@click.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def command(as_json: bool) -> None:
    """List the cached GGUF models: reference, quant, size and path."""
    from ..hub.cache import list_models, partial_downloads

    rows = [dict(ref=m.ref, quant=m.quant, size=m.size, path=m.path, complete=m.complete) for m in list_models()]
    try:
        demo = hub.demo_path()
        rows.insert(0, dict(ref=hub.DEMO, quant=hub.quant_tag(demo), size=os.path.getsize(demo), path=demo, complete=True))
    except hub.HubError:
        pass
    if as_json:
        click.echo(json.dumps({"cache": hub.cache_dir(), "models": rows}, indent=1))
        return
    table = [("REFERENCE", "QUANT", "SIZE", "PATH")] + [
        (r["ref"], r["quant"] or "-", f"{r['size'] / 1e6:.1f} MB" + ("" if r["complete"] else " (incomplete)"), r["path"])
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    for row in table:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[3])
    for repo, _, size in partial_downloads():
        click.echo(f"partial download of {repo}: {size / 1e6:.1f} MB (`qllama pull` resumes it)", err=True)
