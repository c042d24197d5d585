"""`qllama bench MODEL`: prompt-processing and generation speed, like llama-bench."""

from __future__ import annotations

import json

import click

from .model_ref import ModelRef
from .options import kv_cache_options


def _int_list(ctx, param, values) -> list[int]:
    """Repeatable options that also take comma lists: `-t 1 -t 2` or `-t 1,2`."""
    out: list[int] = []
    for v in values:
        for part in str(v).split(","):
            part = part.strip()
            if not part:
                continue
            try:
                n = int(part)
            except ValueError:
                raise click.BadParameter(f"{part!r} is not an integer") from None
            if n < 0 or (param.name == "threads" and n < 1):
                raise click.BadParameter(f"{n} is out of range")
            out.append(n)
    return out


@click.command("bench")
@click.argument("model", type=ModelRef(dir_okay=False))
@click.option("-p", "--n-prompt", default=512, show_default=True, type=click.IntRange(min=0),
              help="Prompt tokens for the pp test (0: skip).")
@click.option("-n", "--n-gen", default=128, show_default=True, type=click.IntRange(min=0),
              help="Generated tokens for the tg test (0: skip).")
@click.option("-t", "--threads", multiple=True, callback=_int_list,
              help="Threads; repeatable or a comma list (default: physical cores).")
@click.option("-r", "--reps", default=5, show_default=True, type=click.IntRange(min=1), help="Repetitions of each test.")
@click.option("-d", "--depth", "depths", multiple=True, callback=_int_list,
              help="Also measure tg after DEPTH tokens are in the cache; repeatable or a comma list.")
@click.option("-b", "--batch-size", default=512, show_default=True, type=click.IntRange(min=1),
              help="Prompt tokens per forward batch.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of the table.")
@click.option("--profile", is_flag=True,
              help="Also time every kernel call of decode steps by kind, and the Python overhead (printed after the table).")
@click.option("--profile-steps", default=32, show_default=True, type=click.IntRange(min=1), help="Decode steps profiled.")
@click.option("--profile-depth", default=128, show_default=True, type=click.IntRange(min=0),
              help="Cached tokens before the profiled steps.")
@click.option("--no-fuse", is_flag=True,
              help="One-token steps without the fused kernels (one call per matrix), to compare before/after.")
@kv_cache_options
@click.option("-q", "--quiet", is_flag=True, help="No progress lines on stderr.")
def command(model, n_prompt, n_gen, threads, reps, depths, batch_size, as_json, profile, profile_steps, profile_depth,
            no_fuse, type_k, type_v, quiet):
    """Measure pp (prompt tokens/s) and tg (generated tokens/s) of MODEL.

    Each figure is the mean ± sd of REPS repetitions after an untimed warm-up; the Numba
    compile / cache-load time of the warm-up is reported separately. Progress goes to stderr.
    """
    from ..bench.profile import format_profile, profile_decode
    from ..bench.runner import format_table, run_bench

    err = (lambda msg: None) if quiet else (lambda msg: click.echo(msg, err=True))  # noqa: E731
    depths = sorted({0, *depths})
    _say_if_compiling(model, threads, err)
    doc = run_bench(model, n_prompt=n_prompt, n_gen=n_gen, threads=threads, reps=reps, depths=depths,
                    batch_size=batch_size, progress=err, type_k=type_k, type_v=type_v, fused=not no_fuse)
    prof = None
    if profile:
        err(f"profiling {profile_steps} decode steps at depth {profile_depth}...")
        n_thr = doc["n_threads"][-1] if doc["n_threads"] else None
        prof = profile_decode(model, steps=profile_steps, depth=profile_depth, n_threads=n_thr, batch_size=batch_size,
                              type_k=type_k, type_v=type_v, fused=not no_fuse)
    if as_json:
        if prof is not None:
            doc = {**doc, "profile": prof.as_dict()}
        click.echo(json.dumps(doc))
    else:
        click.echo(format_table(doc))
        if prof is not None:
            click.echo("")
            click.echo(format_profile(prof))


def _say_if_compiling(model: str, threads: list[int], err) -> None:
    """The first run's notice (as `run` prints it): bench's own warm-up then compiles, timed apart."""
    from ..gguf.reader import GGUFFile
    from ..qtensor import physical_cores
    from ..runtime.warmup import is_warm, kernel_types

    with GGUFFile(model) as g:
        types = kernel_types(g)
    n_threads = max(threads) if threads else physical_cores()
    if not is_warm(types, n_threads):
        err(f"compiling kernels for {', '.join(types)} (first run only)...")
