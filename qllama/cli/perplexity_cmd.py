"""`qllama perplexity MODEL FILE`: perplexity with llama-perplexity's chunking."""

from __future__ import annotations

import json
import sys

import click

from .model_ref import ModelRef
from .options import kv_cache_options


@click.command("perplexity")
@click.argument("model", type=ModelRef(dir_okay=False))
@click.argument("file", type=click.Path(dir_okay=False), required=False)
@click.option("-f", "--file", "file_opt", type=click.Path(dir_okay=False), help="The text file (llama-perplexity's spelling of FILE).")
@click.option("-c", "--ctx-size", default=512, show_default=True, type=click.IntRange(min=4), help="Tokens per chunk.")
@click.option("--chunks", default=0, type=click.IntRange(min=0), help="Score only the first K chunks (0 = all).")
@click.option("-t", "--threads", type=click.IntRange(min=1), help="Threads (default: physical cores).")
@kv_cache_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
def command(model, file, file_opt, ctx_size, chunks, threads, type_k, type_v, as_json):
    """Perplexity of MODEL on the text in FILE (lower is better).

    Progress is drawn on stderr when it is a terminal."""
    from ..api import load
    from ..generation.perplexity import perplexity
    from .options import read_text_file
    from .warm import warm_up

    if (file is None) == (file_opt is None):
        raise click.UsageError("give the text file once: as FILE or with -f FILE")
    file = file if file is not None else file_opt
    text = read_text_file(file)
    llm = load(model, n_ctx=ctx_size, n_threads=threads, batch_size=ctx_size, type_k=type_k, type_v=type_v,
               warmup_next=True)
    warm_up(llm)
    tty = sys.stderr.isatty()
    import time

    t0 = time.perf_counter()

    def progress(i: int, n: int, ppl: float) -> None:
        if tty:  # a line redrawn in place; a pipe or a log file gets only the result
            done = i * ctx_size
            rate = done / (time.perf_counter() - t0)
            click.echo(f"\r[{i}/{n}] perplexity {ppl:.4f} ({done}/{n * ctx_size} tokens, {rate:.1f} tokens/s)",
                       err=True, nl=(i == n))

    res = perplexity(llm, text, n_ctx=ctx_size, chunks=chunks, progress=progress)
    if as_json:
        json.dump({"model": model, "file": file, "ppl": res.ppl, "n_ctx": res.n_ctx, "chunks": res.chunks,
                   "scored_tokens": res.scored_tokens, "mean_nll": res.nll, "chunk_ppls": res.chunk_ppls},
                  sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        click.echo(f"perplexity: {res.ppl:.4f} ({res.chunks} chunks of {res.n_ctx} tokens, {res.scored_tokens} scored tokens)")
