"""`qllama run MODEL [PROMPT]`: stream a continuation (or, on instruct models, a chat reply).

Without a prompt on a terminal it starts the interactive chat (as `ollama run` does); from a
pipe it reads the prompt from stdin. `--json` prints one JSON document at the end instead of
streaming. Ctrl-C stops generation, prints the timings and exits with status 130 (llama-cli's
manners).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import click

from ..chat import NoChatTemplateError
from .model_ref import ModelRef
from .options import kv_cache_options, read_prompt, sampling_options
from .prompt_format import chat_template_option, describe, no_template_error


@click.command("run")
@click.argument("model", type=ModelRef(dir_okay=False))
@click.argument("prompt", required=False)
@click.option("-p", "--prompt", "prompt_opt", metavar="TEXT", help="The prompt (llama.cpp's spelling of PROMPT).")
@click.option("-f", "--file", "prompt_file", type=click.Path(dir_okay=False), help="Read the prompt from a file ('-' = stdin).")
@click.option("-n", "--max-tokens", "--n-predict", "max_tokens", default=256, show_default=True, type=click.IntRange(min=0),
              help="Tokens to generate at most.")
@sampling_options
@click.option("-c", "--ctx-size", type=click.IntRange(min=0), default=0, help="Context size (0 = min(model's, 4096)).")
@click.option("-t", "--threads", type=click.IntRange(min=1), help="Threads (default: physical cores).")
@click.option("-b", "--batch-size", type=click.IntRange(min=1), default=512, show_default=True, help="Prompt tokens per prefill batch.")
@kv_cache_options
@click.option("--stop", multiple=True, help="Stop when this text appears (repeatable); it is not printed.")
@click.option("--lookup", type=click.IntRange(min=0), default=0, metavar="N",
              help="Prompt-lookup decoding: draft up to N tokens per forward from n-gram matches in the prompt "
                   "and output (same greedy output, same sampling distribution; faster when copying). 0 = off.")
@click.option("--no-bos", is_flag=True, help="Do not add the BOS token.")
@click.option("--raw", is_flag=True, help="Completion mode: never wrap the prompt in the chat template.")
@click.option("--system", "--system-prompt", "system_prompt", help="System message (chat-template mode; ignored with --raw).")
@chat_template_option
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON document at the end (text, tokens, finish reason, timings) instead of streaming.")
@click.option("--check-tensors", is_flag=True,
              help="Scan every tensor for NaN and Inf before running (as llama.cpp's flag); exit 1 if any.")
@click.option("-v", "--verbose", is_flag=True, help="Print load details and the chosen prompt format on stderr.")
@click.pass_context
def command(ctx, model, prompt, prompt_opt, prompt_file, max_tokens, temp, top_k, top_p, min_p, repeat_penalty,
            repeat_last_n, seed, ctx_size, threads, batch_size, type_k, type_v, stop, lookup, no_bos, raw, system_prompt, chat_template,
            as_json, check_tensors, verbose):
    """Generate text from MODEL, streaming it to stdout.

    The prompt comes from PROMPT (or -p), -f FILE, or standard input; with none of them on a
    terminal, the interactive chat starts. Timings go to stderr.
    """
    if prompt is not None and prompt_opt is not None:
        raise click.UsageError("give the prompt either as PROMPT or with -p, not both")
    if prompt is None:
        prompt = prompt_opt
    if prompt is None and prompt_file is None and sys.stdin.isatty() and not as_json:
        return _chat_instead(ctx)
    text = read_prompt(prompt, prompt_file)
    err = lambda msg: click.echo(msg, err=True)  # noqa: E731
    if raw and system_prompt:
        # llama-cli also ignores its system prompt outside chat mode; we say so instead of failing
        err("warning: --system is ignored with --raw (raw completion uses no chat template)")
        system_prompt = None

    from ..api import load
    from .warm import warm_up

    llm = load(model, n_ctx=ctx_size or None, n_threads=threads, batch_size=batch_size, type_k=type_k, type_v=type_v,
               warmup_next=True)
    if verbose:
        err(f"loaded {llm!r} in {llm.load_s:.2f} s, {llm.n_threads} threads")
    if check_tensors:
        from .check_report import run_check

        if not run_check(llm.gguf, quiet_ok=not verbose):
            ctx.exit(1)
    try:
        ids, mode = llm.prepare_prompt(text, raw=raw, system=system_prompt, add_bos=not no_bos,
                                       chat_template=chat_template)
    except NoChatTemplateError as e:  # the library names no options: add the one that fixes it
        raise no_template_error(e, llm.metadata) from None
    if verbose:
        err(f"prompt format: {describe(mode, llm.metadata)}; {len(ids)} prompt tokens")
    warm_up(llm)  # before the timed part: a first-run compile is not the prompt's speed

    chunks = llm.stream(ids, max_tokens=max_tokens, temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                        repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed, stop=list(stop),
                        lookup=lookup)
    out = sys.stdout
    reason = None
    texts: list[str] = []
    tokens: list[int] = []
    try:
        for chunk in chunks:
            texts.append(chunk.text)
            tokens.extend(chunk.token_ids)
            if chunk.text and not as_json:
                out.write(chunk.text)
                out.flush()
            reason = chunk.finish_reason or reason
    except KeyboardInterrupt:
        reason = "interrupted"
    finally:
        if not as_json:
            out.write("\n")
            out.flush()
    if as_json:
        t = llm.last_timings
        doc = {"model": model, "prompt_tokens": len(ids), "text": "".join(texts), "tokens": tokens,
               "finish_reason": reason, "timings": {**dataclasses.asdict(t), "prompt_tps": t.prompt_tps, "gen_tps": t.gen_tps}}
        out.write(json.dumps(doc, ensure_ascii=False) + "\n")
        out.flush()
    if reason == "context":
        err(f"stopped: the context is full ({llm.n_ctx} tokens; raise -c/--ctx-size)")
    elif reason == "interrupted":
        err("stopped: interrupted")
    elif verbose:
        err(f"stopped: {reason}")
    if not as_json or verbose:
        err(llm.last_timings.report())
    if reason == "interrupted":
        sys.exit(130)  # as llama-cli after Ctrl-C: the timings, then status 130


def _chat_instead(ctx: click.Context):
    """`run MODEL` on a terminal without a prompt: the chat command, with the options given here."""
    from . import chat_cmd

    chat = chat_cmd.command
    names = {p.name for p in chat.params}
    given = {name: value for name, value in ctx.params.items()
             if name in names and (name == "model" or ctx.get_parameter_source(name) != click.core.ParameterSource.DEFAULT)}
    return ctx.invoke(chat, **given)
