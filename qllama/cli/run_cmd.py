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
from .options import read_prompt, sampling_options, session_options
from .prompt_format import chat_template_option, describe, no_template_error

DEFAULT_N_PREDICT = 256  # tokens when -n is not given (capped by the room left in the context)


@click.command("run")
@click.argument("model", type=ModelRef(dir_okay=False))
@click.argument("prompt", required=False)
@click.option("-p", "--prompt", "prompt_opt", metavar="TEXT", help="The prompt (llama.cpp's spelling of PROMPT).")
@click.option("-f", "--file", "prompt_file", type=click.Path(dir_okay=False), help="Read the prompt from a file ('-' = stdin).")
@click.option("-n", "--max-tokens", "--n-predict", "max_tokens", default=None, type=click.IntRange(min=-1),
              show_default=f"{DEFAULT_N_PREDICT}, or the room left in the context",
              help="Tokens to generate at most (-1: until the end of the text or a full context).")
@sampling_options
@session_options
@click.option("--stop", multiple=True, help="Stop when this text appears (repeatable); it is not printed.")
@click.option("-r", "--reverse-prompt", multiple=True, metavar="TEXT",
              help="llama.cpp's reverse prompt (repeatable): a stop string; with -i, the text stops there (it is shown) "
                   "and control returns to you.")
@click.option("-cnv/-no-cnv", "--conversation/--no-conversation", "conversation", default=None,
              help="Conversation mode (the interactive chat; PROMPT, if given, is the first message) or never "
                   "(plain completion, as --raw). Default: chat on a terminal without a prompt, else one answer.")
@click.option("-i", "--interactive", is_flag=True,
              help="Interactive completion (for base models): the text continues, then you type more of it; "
                   "Ctrl-C stops the text, Ctrl-D exits.")
@click.option("--lookup", type=click.IntRange(min=0), default=0, metavar="N",
              help="Prompt-lookup decoding: draft up to N tokens per forward from n-gram matches in the prompt "
                   "and output (same greedy output, same sampling distribution; faster when copying). 0 = off.")
@click.option("--json-schema", "json_schema", metavar="FILE|JSON",
              help="Constrain the output to this JSON schema (a file, or the schema inline); needs llguidance.")
@click.option("--grammar", "grammar_file", type=click.Path(dir_okay=False), metavar="FILE",
              help="Constrain the output to this grammar (llama.cpp's GBNF, or Lark); needs llguidance.")
@click.option("--hide-reasoning", is_flag=True,
              help="Do not show a thinking model's <think>...</think> reasoning (on a terminal it is shown dimmed).")
@click.option("--no-bos", is_flag=True, help="Do not add the BOS token.")
@click.option("--raw", is_flag=True, help="Completion mode: never wrap the prompt in the chat template.")
@click.option("-sys", "--system", "--system-prompt", "system_prompt", help="System message (chat-template mode; ignored with --raw).")
@chat_template_option
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON document at the end (text, tokens, finish reason, timings) instead of streaming.")
@click.option("--check-tensors", is_flag=True,
              help="Scan every tensor for NaN and Inf before running (as llama.cpp's flag); exit 1 if any.")
@click.option("-v", "--verbose", is_flag=True, help="Print load details and the chosen prompt format on stderr.")
@click.pass_context
def command(ctx, model, prompt, prompt_opt, prompt_file, max_tokens, temp, top_k, top_p, min_p, repeat_penalty,
            repeat_last_n, presence_penalty, frequency_penalty, logit_bias, ignore_eos, seed, ctx_size, threads, batch_size, type_k, type_v, stop, reverse_prompt, conversation, interactive, lookup, json_schema, grammar_file, hide_reasoning, no_bos, raw, system_prompt, chat_template,
            as_json, check_tensors, verbose):
    """Generate text from MODEL, streaming it to stdout.

    The prompt comes from PROMPT (or -p), -f FILE, or standard input; with none of them on a
    terminal, the interactive chat starts. Timings go to stderr.
    """
    if prompt is not None and prompt_opt is not None:
        raise click.UsageError("give the prompt either as PROMPT or with -p, not both")
    if prompt is None:
        prompt = prompt_opt
    if interactive and (conversation or as_json):
        raise click.UsageError("-i (interactive completion) goes with neither -cnv nor --json")
    if conversation and not as_json:  # llama-cli -cnv: the prompt, if any, is the first message
        first = read_prompt(prompt, prompt_file) if prompt is not None or prompt_file is not None else None
        return _chat_instead(ctx, first)
    if (prompt is None and prompt_file is None and sys.stdin.isatty() and not as_json and not interactive
            and conversation is None):
        return _chat_instead(ctx)
    if conversation is False:  # -no-cnv: the prompt as it is, no chat template
        raw = True
    stop = list(stop) + list(reverse_prompt)
    if interactive:
        text = read_prompt(prompt, prompt_file) if prompt is not None or prompt_file is not None else ""
        raw = True
    else:
        text = read_prompt(prompt, prompt_file)
    err = lambda msg: click.echo(msg, err=True)  # noqa: E731
    if raw and system_prompt:
        # llama-cli also ignores its system prompt outside chat mode; we say so instead of failing
        err("warning: --system is ignored with --raw (raw completion uses no chat template)")
        system_prompt = None

    from ..api import load
    from .warm import warm_up

    constrain = {}
    if json_schema is not None or grammar_file is not None:  # read before the model loads: errors come first
        from ..generation.constrained import read_spec

        if json_schema is not None and grammar_file is not None:
            raise click.UsageError("give --json-schema or --grammar, not both")
        if json_schema is not None:
            constrain["json_schema"] = read_spec(json_schema, "json schema")
        else:
            constrain["grammar"] = read_spec(grammar_file, "grammar")

    llm = load(model, n_ctx=ctx_size or None, n_threads=threads, batch_size=batch_size, type_k=type_k, type_v=type_v,
               warmup_next=True)
    if verbose:
        err(f"loaded {llm!r} in {llm.load_s:.2f} s, {llm.n_threads} threads")
    bad = [t for t in logit_bias if t >= llm.n_vocab]
    if bad:
        raise click.BadParameter(f"token id {bad[0]} is out of range [0, {llm.n_vocab})", param_hint="'--logit-bias'")
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
    from .terminal import PromptProgress, quiet_input

    llm.session.progress = PromptProgress()  # a long prompt shows its progress on a terminal
    sampling = dict(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                    repeat_last_n=repeat_last_n, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                    logit_bias=logit_bias, ignore_eos=ignore_eos, seed=seed)
    if interactive:
        return _interactive(llm, ids if text else ids[:len(llm.tokenize("", add_bos=not no_bos))], max_tokens,
                            sampling, list(reverse_prompt), stop, lookup, verbose)
    # without -n, llama.cpp generates until the context is full and stops quietly; qllama's default
    # is DEFAULT_N_PREDICT tokens, and a full context before that is as quiet (the demo's 256 tokens)
    quiet_full = max_tokens is None or max_tokens < 0
    if max_tokens is None:
        max_tokens = DEFAULT_N_PREDICT
    elif max_tokens < 0:
        max_tokens = llm.n_ctx
    chunks = llm.stream(ids, max_tokens=max_tokens, stop=stop, lookup=lookup, **sampling, **constrain)
    out = sys.stdout
    from .reasoning_view import ReasoningView, opens_thinking

    view = ReasoningView(out, hide=hide_reasoning, thinking_open=opens_thinking(llm.tokenizer, ids))
    reason = None
    texts: list[str] = []
    tokens: list[int] = []
    try:
        with quiet_input():  # keys typed meanwhile are not echoed into the text
            for chunk in chunks:
                texts.append(chunk.text)
                tokens.extend(chunk.token_ids)
                if chunk.text and not as_json:
                    view.write(chunk.text)  # reasoning dimmed on a terminal, or hidden
                reason = chunk.finish_reason or reason
    except KeyboardInterrupt:
        reason = "interrupted"
    finally:
        if not as_json:
            view.finish()
            out.write("\n")
            out.flush()
    if as_json:
        t = llm.last_timings
        doc = {"model": model, "prompt_tokens": len(ids), "text": "".join(texts), "tokens": tokens,
               "finish_reason": reason, "timings": {**dataclasses.asdict(t), "prompt_tps": t.prompt_tps, "gen_tps": t.gen_tps}}
        out.write(json.dumps(doc, ensure_ascii=False) + "\n")
        out.flush()
    if reason == "context" and not quiet_full:  # -n N asked for more than the context holds
        err(f"stopped: the context is full ({llm.n_ctx} tokens; raise -c/--ctx-size)")
    elif reason == "interrupted":
        err("stopped: interrupted")
    elif verbose:
        err(f"stopped: {reason}")
    if not as_json or verbose:
        err(llm.last_timings.report())
    if reason == "interrupted":
        sys.exit(130)  # as llama-cli after Ctrl-C: the timings, then status 130


def _chat_instead(ctx: click.Context, first: str | None = None):
    """`run MODEL` on a terminal without a prompt, or with -cnv: the chat command, with the options
    given here (`first`: the first message, sent before any input is read)."""
    from . import chat_cmd

    chat = chat_cmd.command
    names = {p.name for p in chat.params}
    given = {name: value for name, value in ctx.params.items()
             if name in names and (name == "model" or ctx.get_parameter_source(name) != click.core.ParameterSource.DEFAULT)}
    stops = list(ctx.params.get("stop") or ()) + list(ctx.params.get("reverse_prompt") or ())
    if stops:
        given["reverse_prompt"] = tuple(stops)
    if first is not None:
        given["first_message"] = first
    return ctx.invoke(chat, **given)


def _interactive(llm, ids: list[int], max_tokens: int | None, sampling: dict, reverse: list[str], stop: list[str],
                 lookup: int, verbose: bool) -> None:
    """llama-cli -i: interactive completion. The text (the prompt, if any) continues until an
    end of text, -n tokens, a reverse prompt (shown; -r) or Ctrl-C; then a line typed (or read
    from stdin) joins the text, and it continues. An empty line lets it go on. Ctrl-D (end of
    input) or a full context ends the session. The KV cache keeps the text between turns."""
    from .chat_cmd import stream_lines, terminal_lines
    from .terminal import quiet_input

    out, tty = sys.stdout, sys.stdin.isatty()
    err = lambda msg: click.echo(msg, err=True)  # noqa: E731
    context = list(ids)
    stops = [s for s in stop if s not in reverse]  # --stop still ends the text unseen; -r is shown

    def generate() -> str | None:
        room = llm.n_ctx - len(context)
        if room <= 0:
            return "context"
        n = room + 1 if max_tokens is None or max_tokens < 0 else min(max_tokens, room + 1)
        chunks = llm.stream(context, max_tokens=n, stop=stops, lookup=lookup, **sampling)
        shown, reason = "", None
        try:
            with quiet_input():
                for chunk in chunks:
                    context.extend(chunk.token_ids)
                    reason = chunk.finish_reason or reason
                    if chunk.text:
                        out.write(chunk.text)
                        out.flush()
                        shown += chunk.text
                        start = len(shown) - len(chunk.text)
                        if any(r and r in shown[max(0, start - len(r) + 1):] for r in reverse):
                            reason = "reverse prompt"
                            break
        except KeyboardInterrupt:
            reason = "interrupted"
            out.write("\n")
        finally:
            chunks.close()
        if verbose:
            err(f"[stopped: {reason}]")
        return reason

    if tty:
        err("[interactive completion: type to add to the text (an empty line lets it go on); Ctrl-C stops the "
            "text, Ctrl-D exits]")
    bos = llm.tokenizer.bos_id
    reason = generate() if any(t != bos for t in context) else None
    if reason != "context":
        lines = terminal_lines(prompt="", more="") if tty else stream_lines(sys.stdin)
        for line in lines:
            if line:
                context.extend(llm.tokenize(line + "\n", add_bos=False))
            if len(context) >= llm.n_ctx:
                reason = "context"
                break
            reason = generate()
            if reason == "context":
                break
    if reason == "context":
        err(f"[the context of {llm.n_ctx} tokens is full (raise -c/--ctx-size)]")
    out.write("\n")
    out.flush()
    if verbose and llm.last_timings is not None:
        err(llm.last_timings.report())
