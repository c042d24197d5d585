"""MODEL arguments that take a model reference: a path, `demo`, `org/repo[:QUANT]`, `org/repo/file.gguf`, `hf://...`.

`ModelRef` is a click type: a local path is checked exactly as `click.Path` checks it (so the
errors stay those of a path); a hub reference is resolved through `qllama.hub.refs`, downloading
the file into the Hugging Face cache with a progress bar on stderr when it is not cached.
"""

from __future__ import annotations

import time

import click

from ..hub import refs as hub


class ModelRef(click.ParamType):
    name = "model"

    def __init__(self, dir_okay: bool = True):
        self._path = click.Path(dir_okay=dir_okay)

    def get_metavar(self, param, ctx=None):  # noqa: D102 - click API
        return "MODEL"

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return self._path.convert(value, param, ctx)
        kind, target = hub.parse(value)
        if kind == "local":
            return self._path.convert(target, param, ctx)
        if kind == "demo":
            return target
        return fetch_model(target).path


def fetch_model(ref: "hub.HubRef", refresh: bool = False) -> "hub.CachedModel":
    """hub.fetch with the CLI's manners: progress on stderr, one line after a download, Ctrl-C as one line."""
    t0 = time.perf_counter()
    try:
        model = hub.fetch(ref, refresh=refresh)
    except KeyboardInterrupt:
        click.echo("", err=True)
        click.echo(f"error: download of {ref} interrupted; the partial file is kept in the cache and the next "
                   "`qllama pull` (or run) resumes it", err=True)
        raise SystemExit(130) from None
    if model.downloaded:
        n = len(model.paths)
        shards = f", {n} files" if n > 1 else ""
        click.echo(f"downloaded {model.ref} ({model.size / 1e6:.1f} MB{shards}) in {time.perf_counter() - t0:.1f} s",
                   err=True)
    return model
