"""`qllama quantize IN OUT TYPE`: quantize a f32/f16/bf16 GGUF model like llama-quantize."""

from __future__ import annotations

import os
import sys
import time

import click


@click.command("quantize")
@click.argument("src", metavar="IN", type=click.Path(dir_okay=False))
@click.argument("dst", metavar="OUT", type=click.Path(dir_okay=False))
@click.argument("preset", metavar="TYPE")
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists (never IN).")
@click.option("--dry-run", is_flag=True, help="Only print the type each tensor would get.")
@click.option("--allow-requantize", is_flag=True,
              help="Accept an already quantized IN (dequantized, then quantized again: the errors add up).")
@click.option("--imatrix", "imatrix_path", metavar="FILE", type=click.Path(dir_okay=False),
              help="llama.cpp's importance matrix (llama-imatrix's GGUF, or its legacy .dat), applied as llama-quantize does.")
def command(src, dst, preset, force, dry_run, allow_requantize, imatrix_path):
    """Quantize the model IN to OUT with llama.cpp's TYPE mix.

    TYPE: Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0, IQ4_XS, IQ4_NL, IQ3_M, IQ3_S, Q3_K_M, Q2_K (also Q4_K_S,
    Q5_K_S, Q3_K_S, Q3_K_L, Q2_K_S, Q4_1, Q5_0, Q5_1, IQ3_XXS, IQ3_XS, IQ2_M, IQ2_S, IQ2_XS, IQ2_XXS,
    IQ1_M, IQ1_S, TQ2_0, TQ1_0, MXFP4_MOE, F16, BF16, F32).
    Q2_K_S and the IQ3_XXS .. IQ1_S presets need --imatrix. A quantized IN needs --allow-requantize,
    as in llama-quantize.
    """
    from ..errors import QllamaError
    from ..gguf.types import type_name
    from ..quantize import FLOAT_TYPES, RequantizeError, get_preset, plan_quantization, quantize_gguf
    from ..quantize.imatrix import read_imatrix
    from ..quantize.presets import NEEDS_IMATRIX, needs_imatrix_message

    p = get_preset(preset)  # unknown TYPE: error before touching any file
    if p.name in NEEDS_IMATRIX and not imatrix_path:
        raise QllamaError(needs_imatrix_message(p.name))
    imatrix = read_imatrix(imatrix_path) if imatrix_path else None
    try:
        plans = plan_quantization(src, p.name, allow_requantize=allow_requantize, has_imatrix=imatrix is not None)
    except RequantizeError as e:  # the library names no options: add the one that allows it
        raise QllamaError(f"{e}; or requantize anyway with --allow-requantize") from None
    requant = sorted({type_name(pl.src_type) for pl in plans if pl.src_type != pl.dst_type and pl.src_type not in FLOAT_TYPES})
    if requant:
        click.echo(f"warning: requantizing {', '.join(requant)} tensors to {p.name}: the quantization errors add up; "
                   "quantize from the f32/f16/bf16 model if you have it", err=True)
    if dry_run:
        for pl in plans:
            click.echo(f"{pl.name:40s} {str(list(pl.shape)):18s} {type_name(pl.src_type):>6s} -> {type_name(pl.dst_type)}")
        return

    t0 = time.perf_counter()
    state = {"bar": None, "done": 0}

    def progress(done: int, total: int, name: str) -> None:
        if state["bar"] is None:
            # click hides the bar (prints the label only) when stderr is not a terminal
            state["bar"] = click.progressbar(length=total, label=f"quantizing to {p.name}", file=sys.stderr,
                                             show_eta=True, item_show_func=lambda n: n)
            state["bar"].__enter__()
        state["bar"].update(done - state["done"], current_item=name)
        state["done"] = done

    try:
        quantize_gguf(src, dst, p.name, progress=progress, force=force, allow_requantize=allow_requantize, imatrix=imatrix)
    finally:
        if state["bar"] is not None:
            state["bar"].__exit__(None, None, None)
    mib_in = os.path.getsize(src) / 2**20
    mib_out = os.path.getsize(dst) / 2**20
    click.echo(f"wrote {dst}: {mib_in:.1f} MiB -> {mib_out:.1f} MiB ({p.name}) in {time.perf_counter() - t0:.1f} s", err=True)
