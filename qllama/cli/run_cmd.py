"""`qllama run MODEL [PROMPT]`: stream a continuation (or, on instruct models, a chat reply)."""

from __future__ import annotations

import sys

import click

from .options import sampling_options, read_prompt


@click.command("run")
@click.argument("model", type=click.Path(dir_okay=False))
@click.argument("prompt", required=False)
@click.option("-f", "--file", "prompt_file", type=click.Path(dir_okay=False), help="Read the prompt from a file ('-' = stdin).")
@click.option("-n", "--max-tokens", default=256, show_default=True, type=click.IntRange(min=0), help="Tokens to generate at most.")
@sampling_options
@click.option("-c", "--ctx-size", type=click.IntRange(min=0), default=0, help="Context size (0 = min(model's, 4096)).")
@click.option("-t", "--threads", type=click.IntRange(min=1), help="Threads (default: physical cores).")
@click.option("-b", "--batch-size", type=click.IntRange(min=1), default=512, show_default=True, help="Prompt tokens per prefill batch.")
@click.option("--stop", multiple=True, help="Stop when this text appears (repeatable); it is not printed.")
@click.option("--no-bos", is_flag=True, help="Do not add the BOS token.")
@click.option("--raw", is_flag=True, help="Completion mode: never wrap the prompt in the chat template.")
@click.option("--system", "system_prompt", help="System message (chat-template mode).")
@click.option("--chat-template", "chat_template_file", type=click.Path(exists=True, dir_okay=False), help="Use this Jinja chat template file.")
@click.option("-v", "--verbose", is_flag=True, help="Print load details and the chosen prompt format on stderr.")
def command(model, prompt, prompt_file, max_tokens, temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed,
            ctx_size, threads, batch_size, stop, no_bos, raw, system_prompt, chat_template_file, verbose):
    """Generate text from MODEL, streaming it to stdout.

    The prompt comes from PROMPT, -f FILE, or standard input. Timings go to stderr.
    """
    from ..api import load

    text = read_prompt(prompt, prompt_file)
    llm = load(model, n_ctx=ctx_size or None, n_threads=threads, batch_size=batch_size)
    err = lambda msg: click.echo(msg, err=True)  # noqa: E731
    if verbose:
        err(f"loaded {llm!r} in {llm.load_s:.2f} s, {llm.n_threads} threads")

    ids, mode = llm.prepare_prompt(text, raw=raw, system=system_prompt, add_bos=not no_bos,
                                   chat_template_file=chat_template_file)
    if verbose:
        err(f"prompt format: {mode}; {len(ids)} prompt tokens")
    chunks = llm.stream(ids, max_tokens=max_tokens, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                        repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed, stop=list(stop))
    out = sys.stdout
    reason = None
    try:
        for chunk in chunks:
            if chunk.text:
                out.write(chunk.text)
                out.flush()
            reason = chunk.finish_reason or reason
    except KeyboardInterrupt:
        reason = "interrupted"
    finally:
        out.write("\n")
        out.flush()
    if reason == "context":
        err(f"stopped: the context is full ({llm.n_ctx} tokens; raise -c/--ctx-size)")
    elif reason == "interrupted":
        err("stopped: interrupted")
    elif verbose:
        err(f"stopped: {reason}")
    err(llm.last_timings.report())
