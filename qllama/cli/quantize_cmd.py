"""`qllama quantize IN OUT TYPE`: quantize a f32/f16/bf16 GGUF model like llama-quantize."""

from __future__ import annotations

import os
import time

import click


@click.command("quantize")
@click.argument("src", metavar="IN", type=click.Path(dir_okay=False))
@click.argument("dst", metavar="OUT", type=click.Path(dir_okay=False))
@click.argument("preset", metavar="TYPE")
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists (never IN).")
@click.option("--dry-run", is_flag=True, help="Only print the type each tensor would get.")
def command(src, dst, preset, force, dry_run):
    """Quantize the model IN to OUT with llama.cpp's TYPE mix.

    TYPE: Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0 (also Q4_K_S, Q5_K_S, Q4_1, Q5_0, Q5_1, F16, BF16, F32).
    No importance matrix is used, as llama-quantize without --imatrix.
    """
    from ..ggml_types import type_name
    from ..quantize import get_preset, plan_quantization, quantize_gguf

    p = get_preset(preset)  # unknown TYPE: error before touching any file
    if dry_run:
        for pl in plan_quantization(src, p.name):
            click.echo(f"{pl.name:40s} {str(list(pl.shape)):18s} {type_name(pl.src_type):>6s} -> {type_name(pl.dst_type)}")
        return

    t0 = time.perf_counter()
    state = {"bar": None, "done": 0}

    def progress(done: int, total: int, name: str) -> None:
        if state["bar"] is None:
            # click hides the bar (prints the label only) when stderr is not a terminal
            state["bar"] = click.progressbar(length=total, label=f"quantizing to {p.name}", file=click.get_text_stream("stderr"),
                                             show_eta=True, item_show_func=lambda n: n)
            state["bar"].__enter__()
        state["bar"].update(done - state["done"], current_item=name)
        state["done"] = done

    try:
        quantize_gguf(src, dst, p.name, progress=progress, force=force)
    finally:
        if state["bar"] is not None:
            state["bar"].__exit__(None, None, None)
    mib_in = os.path.getsize(src) / 2**20
    mib_out = os.path.getsize(dst) / 2**20
    click.echo(f"wrote {dst}: {mib_in:.1f} MiB -> {mib_out:.1f} MiB ({p.name}) in {time.perf_counter() - t0:.1f} s", err=True)
