"""`qllama rm REF...`: delete cached models from the Hugging Face cache."""

from __future__ import annotations

import click

from ..hub import refs as hub


@click.command("rm")
@click.argument("refs", metavar="REF...", nargs=-1, required=True)
def command(refs: tuple[str, ...]) -> None:
    """Delete cached models: org/repo (all its GGUF files), org/repo:QUANT or org/repo/file.gguf.

    Only the cache is touched (never a local path); no network is used.
    """
    from ..hub.cache import remove

    for ref in refs:
        kind, target = hub.parse(ref if ref.startswith("hf://") or ref == hub.DEMO else f"hf://{ref}"
                                 if "/" in ref and not ref.startswith(("/", ".")) else ref)
        if kind == "demo":
            raise hub.HubError("demo is part of the qllama package and cannot be removed")
        if kind != "hub":
            raise click.UsageError(f"{ref} is not a cached model reference (see `qllama list`); rm never deletes local files")
        names, freed = remove(target)
        shown = names[0] + (f" and {len(names) - 1} more files" if len(names) > 1 else "")
        click.echo(f"removed {target.repo}: {shown} ({freed / 1e6:.1f} MB freed)")
