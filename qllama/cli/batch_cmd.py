"""`qllama batch MODEL -i requests.jsonl -o results.jsonl`: an OpenAI Batch file through the
server's continuous batching, on this machine or (`--ray ADDRESS --replicas N`) on a Ray cluster.

Needs Starlette (the server extra: the requests run through `qllama serve`'s own app) and, for
`--ray`, the ray extra. See `qllama.batch` for the formats and the resume rule.
"""

from __future__ import annotations

import os
import sys

import click

from ..errors import QllamaError
from .model_ref import ModelRef
from .options import kv_cache_options

SERVER_HINT = "pip install 'qllama[server]'"
RAY_HINT = "pip install 'qllama[ray]'"


@click.command("batch")
@click.argument("model", metavar="MODEL")
@click.option("-i", "--input", "input_path", required=True, type=click.Path(dir_okay=False),
              help="Requests, one JSON object a line (OpenAI's Batch input format).")
@click.option("-o", "--output", "output_path", required=True, type=click.Path(dir_okay=False),
              help="Results, appended line by line; the custom_ids it already holds are skipped (resume).")
@click.option("-np", "--parallel", default=8, show_default=True, type=click.IntRange(1, 64),
              help="Requests decoded together (slots) in each model.")
@click.option("-c", "--ctx-size", type=click.IntRange(min=0), default=0,
              help="Context size of each slot (0 = min(model's, 4096)).")
@click.option("-t", "--threads", type=click.IntRange(min=1), help="Threads (default: physical cores; with --ray: "
              "the CPUs of each replica).")
@click.option("-b", "--batch-size", default=128, show_default=True, type=click.IntRange(min=1),
              help="Prompt tokens evaluated per step, for all new requests together (chunked prefill).")
@click.option("--alias", help="Model name in the responses (default: the file name, as qllama serve).")
@click.option("--chat-template", "chat_template", metavar="NAME|FILE",
              help="Chat format of /v1/chat/completions requests: a built-in name or a Jinja file (default: the GGUF's own).")
@kv_cache_options
@click.option("--ray", "ray_address", metavar="ADDRESS",
              help="Run on a Ray cluster (ray.init address: HOST:PORT, ray://HOST:PORT, auto; `local`: a "
                   "local Ray on 127.0.0.1). Needs the ray extra.")
@click.option("--replicas", default=1, show_default=True, type=click.IntRange(min=1),
              help="With --ray: model replicas (Ray Data actors), one model each.")
@click.option("--cpus-per-replica", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --ray: CPUs Ray reserves for each replica (and its threads).")
@click.option("--rows-per-call", default=16, show_default=True, type=click.IntRange(min=1),
              help="With --ray: requests handed to an actor at a time (Ray Data's batch_size); results are "
                   "written as each such group finishes.")
@click.option("--no-progress", is_flag=True, help="No progress bar (it is drawn only on a terminal anyway).")
@click.pass_context
def command(ctx, model, input_path, output_path, parallel, ctx_size, threads, batch_size, alias, chat_template,
            type_k, type_v, ray_address, replicas, cpus_per_replica, rows_per_call, no_progress):
    """Run an OpenAI Batch file (-i) against MODEL, writing OpenAI Batch results (-o).

    Each line is answered exactly as `qllama serve MODEL` answers that request. Interrupted
    (Ctrl-C, a crash), the same command continues where it stopped.
    """
    from .. import batch

    err = lambda msg: click.echo(msg, err=True)  # noqa: E731
    try:
        import starlette  # noqa: F401
    except ImportError:
        raise QllamaError(f"qllama batch needs the server extra: {SERVER_HINT}") from None
    if ray_address:
        from ..integrations import ray as ray_integration  # (before Ray itself: it sets Ray's loopback switch)

        try:
            import ray  # noqa: F401
            import ray.data  # noqa: F401
        except ImportError:
            raise QllamaError(f"--ray needs Ray: {RAY_HINT}") from None
    elif replicas != 1:
        raise click.UsageError("--replicas needs --ray ADDRESS (one machine runs one model: raise --parallel)")
    if os.path.exists(output_path) and os.path.exists(input_path) and os.path.samefile(input_path, output_path):
        raise QllamaError("the output file is the input file")
    ref = model  # as given: with --ray, each replica resolves it on its own node (a Hub reference: its cache)
    model = ModelRef(dir_okay=False).convert(model, None, ctx)  # checked (and a Hub file fetched) here too
    if ray_address and hub_kind(ref) == "local":
        ref = os.path.abspath(model)  # the same path must exist on every node
    requests = batch.read_input(input_path)
    results = batch.ResultsFile(output_path)
    if results.repaired:
        err(f"{output_path}: dropped a partial last line ({results.repaired} bytes) left by an interrupted run")
    name = alias or os.path.basename(model)
    show = not no_progress and sys.stderr.isatty()

    if ray_address:
        def engine_run(todo, on_result):
            ray_integration.run_on_ray(todo, on_result, address=ray_address, model=ref, model_name=name, replicas=replicas,
                       cpus_per_replica=cpus_per_replica, n_threads=threads, parallel=parallel, n_ctx=ctx_size or None,
                       chunk=batch_size, chat_template=chat_template, type_k=type_k, type_v=type_v,
                       rows_per_call=rows_per_call, echo=err)

        batch.run_job(engine_run, requests, results, progress=show, echo=err)
        return

    todo = batch.plan(requests, results).todo
    if not todo:
        results.close()
        err(f"nothing to do: all {len(requests)} requests are already in {output_path}")
        return
    from ..api import load
    from .warm import warm_up

    llm = load(model, n_ctx=ctx_size or None, n_threads=threads, type_k=type_k, type_v=type_v, warmup_next=True)
    llm.chat_template(chat_template)  # a bad NAME or FILE fails here, before the job
    warm_up(llm)
    engine = batch.BatchEngine(llm, model_name=name, parallel=parallel, chunk=batch_size, chat_template=chat_template)
    err(f"loaded {llm!r}, {llm.n_threads} threads; {parallel} slots of {llm.n_ctx} tokens; "
        f"{len(todo)} requests to run")
    batch.run_job(engine.run, requests, results, progress=show, echo=err)


def hub_kind(ref: str) -> str:
    from ..hub import refs

    return refs.parse(ref)[0]
