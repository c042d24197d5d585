"""`qllama chat MODEL`: an interactive, multi-turn chat with an instruct model.

Where things go, as in a terminal chat UI:
- the answer streams to **stdout** as it is generated, followed by a newline;
- the input marker `> ` (and `. ` for a continued line) is shown by `input()` on the terminal
  (on stderr when stdout is redirected);
- notices (dropped turns, interruptions, `/save` results, `--verbose` timings) and in-session
  errors go to **stderr**, one line each, in brackets or starting with `error:`.

Without a terminal on stdin (a pipe or a file), every line is one user message (or command) and
no marker is shown, so `printf 'hi\\nbye\\n' | qllama chat M > answers.txt` writes one answer per
turn to answers.txt.

Each turn renders the whole conversation with the chat template and hands the token ids to the
model; the KV cache keeps the longest common prefix with the previous turn, so only the new turn
is evaluated. When the conversation outgrows the context, the oldest user/assistant turns are
dropped (the system prompt is kept). Both are library code (`qllama.chat.conversation`, shared
with `Model.chat`); this module reads lines, runs commands, prints, and handles Ctrl-C.
"""

from __future__ import annotations

import sys
from typing import Any, Iterator, TextIO

import click

from ..chat import Conversation, ConversationTooLongError, NoChatTemplateError, PromptFormat, fit
from ..errors import QllamaError
from .options import sampling_options, session_options
from .model_ref import ModelRef
from .prompt_format import chat_template_option, describe, no_template_error
from .terminal import PromptProgress, quiet_input

HELP = """commands:
  /reset          forget the conversation (the system prompt is kept)
  /system [TEXT]  set the system prompt (no TEXT: remove it)
  /save FILE      write the conversation to FILE as JSON
  /load FILE      replace the conversation with the one in FILE
  /exit           quit (also /quit or Ctrl-D)
  /help           this text
Ctrl-C stops the answer being generated. End a line with \\ to continue the message on the next line."""


class ChatSession:
    """The chat loop's I/O: one input line at a time, answers to `out`, notices and errors to `err`.

    The conversation is a `qllama.chat.Conversation`; which ids each turn evaluates (dropped
    turns, reused answer tokens) is the library's `fit` and `Model.chat_prompt_ids`.
    `llm` is a loaded `qllama.Model`; `chat_template` a built-in name or a file (None: the
    GGUF's); `sampling` holds the keyword arguments of `Model.stream` (temperature, top_k, ...);
    `max_tokens` < 0 means "until end of turn or a full context".
    """

    def __init__(self, llm, *, system: str | None = None, chat_template: str | None = None,
                 max_tokens: int = -1, sampling: dict[str, Any] | None = None, verbose: bool = False,
                 out: TextIO | None = None, err: TextIO | None = None):
        self.llm = llm
        self.conv = Conversation(system=system or None)
        self.chat_template = chat_template
        self.max_tokens = max_tokens
        self.sampling = dict(sampling or {})
        self.verbose = verbose
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        template = llm.chat_template(chat_template)
        if template is None:
            raise no_template_error(NoChatTemplateError("chat"), llm.metadata)
        self.template_name = template.name
        self.format = PromptFormat(template, "gguf" if chat_template is None else "requested")
        # render once now, so that a template that cannot handle this conversation fails at start
        self.check_renders()

    def check_renders(self) -> None:
        """Render the conversation plus a user message; raises the template's error."""
        self.llm.apply_chat_template(self.conv.messages() + [{"role": "user", "content": "hi"}],
                                     chat_template=self.chat_template)

    # -- output helpers ----------------------------------------------------------------------
    def notice(self, text: str) -> None:
        self.err.write(f"[{text}]\n")
        self.err.flush()

    def error(self, text: str) -> None:
        self.err.write(f"error: {text}\n")
        self.err.flush()

    # -- one input line -------------------------------------------------------------------------
    def handle(self, line: str) -> bool:
        """Act on one input (a message or a /command). Returns False when the session should end."""
        text = line.strip()
        if not text:
            return True
        if text.startswith("/") and not text.startswith("//"):
            return self.command(text)
        if text.startswith("//"):  # "//x" sends the message "/x"
            text = text[1:]
        self.ask(text)
        return True

    def command(self, text: str) -> bool:
        name, _, arg = text.partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit"):
            return False
        if name == "/help":
            self.err.write(HELP + "\n")
        elif name == "/reset":
            self.conv.turns.clear()
            self.notice("the conversation is cleared" + (" (the system prompt is kept)" if self.conv.system else ""))
        elif name == "/system":
            self.set_system(arg or None)
        elif name in ("/save", "/load"):
            if not arg:
                self.error(f"{name} needs a file name")
            elif name == "/save":
                self.save(arg)
            else:
                self.load(arg)
        else:
            self.error(f"unknown command {name} (/help lists them; start a message with // to send a leading /)")
        return True

    def set_system(self, system: str | None) -> None:
        old = self.conv.system
        self.conv.system = system
        try:  # a template may reject a system message: keep the old one then
            self.check_renders()
        except QllamaError as e:
            self.conv.system = old
            self.error(str(e))
            return
        self.notice("system prompt set" if system else "system prompt removed")

    def save(self, path: str) -> None:
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(self.conv.to_json())
        except OSError as e:
            self.error(f"cannot write {path}: {e.strerror or e}")
            return
        self.notice(f"saved {len(self.conv.messages())} messages to {path}")

    def load(self, path: str) -> None:
        try:
            with open(path, encoding="utf-8") as f:
                conv = Conversation.from_json(f.read(), path)
        except OSError as e:
            self.error(f"cannot read {path}: {e.strerror or e}")
            return
        except UnicodeDecodeError:
            self.error(f"{path} is not UTF-8 text")
            return
        except QllamaError as e:
            self.error(str(e))
            return
        self.conv = conv
        self.notice(f"loaded {len(conv.messages())} messages from {path}")

    # -- one turn -----------------------------------------------------------------------------
    def prompt_ids(self) -> list[int]:
        """The ids this turn evaluates for the conversation as it is (`Model.chat_prompt_ids`)."""
        return self.llm.chat_prompt_ids(self.conv.messages(), chat_template=self.chat_template)

    def fit(self) -> list[int] | None:
        """`qllama.chat.fit` with notices: the ids of the conversation, after dropping its oldest turns
        if it outgrows the context; None (and the pending message removed) when even it does not fit."""
        encode = lambda messages: self.llm.chat_prompt_ids(messages, chat_template=self.chat_template)  # noqa: E731
        n_ctx = self.llm.n_ctx
        try:
            ids, dropped = fit(self.conv, encode, n_ctx, self.max_tokens)
        except ConversationTooLongError as e:
            self.conv.turns.pop()
            self.error(f"{e} (raise -c/--ctx-size or shorten it)")
            return None
        if dropped:
            kept = " (the system prompt is kept)" if self.conv.system else ""
            self.notice(f"the conversation outgrew the context of {n_ctx} tokens: "
                        f"dropped the {dropped} oldest messages{kept}")
        return ids

    hide_reasoning = False  # --hide-reasoning: a thinking model's <think> text is not shown

    def ask(self, text: str) -> str | None:
        """Send one user message, stream the answer to `out`, record it. Returns the answer text.

        Ctrl-C (KeyboardInterrupt) stops the answer: what was shown is kept as the answer (with
        nothing shown, the question is forgotten too). An error is printed, not raised.
        """
        self.conv.turns.append({"role": "user", "content": text})
        parts: list[str] = []
        reason = None
        chunks = None
        try:
            ids = self.fit()
            if ids is None:
                return None
            max_tokens = self.llm.n_ctx if self.max_tokens < 0 else self.max_tokens
            chunks = self.llm.stream(ids, max_tokens=max_tokens, **self.sampling)
            from .reasoning_view import ReasoningView, opens_thinking

            view = ReasoningView(self.out, hide=self.hide_reasoning,
                                 thinking_open=opens_thinking(self.llm.tokenizer, ids))  # <think> dimmed or hidden
            with quiet_input():  # keys typed while the answer streams are not echoed into it
                for chunk in chunks:
                    if chunk.text:
                        parts.append(chunk.text)
                        view.write(chunk.text)
                    reason = chunk.finish_reason or reason
            view.finish()
        except KeyboardInterrupt:  # Ctrl-C: stop this answer, keep the session
            reason = "interrupted"
        except QllamaError as e:  # e.g. the template rejects the conversation
            reason = "error"
            if parts:
                self.out.write("\n")
            self.error(str(e))
        finally:
            if chunks is not None:
                chunks.close()
        answer = "".join(parts)
        if reason != "error":
            self.out.write("\n")
            self.out.flush()
        if reason == "interrupted":
            self.notice("interrupted")
        elif reason == "context":
            self.notice(f"the context of {self.llm.n_ctx} tokens is full: the answer is cut "
                        "(the oldest turns will be dropped next turn)")
        if answer or reason not in ("interrupted", "error"):
            self.conv.turns.append({"role": "assistant", "content": answer})
        elif self.conv.turns and self.conv.turns[-1] == {"role": "user", "content": text}:
            self.conv.turns.pop()  # nothing was answered: forget the question too
        if self.verbose and reason != "error":
            self.report(reason)
        return answer if reason != "error" else None

    def report(self, reason: str | None) -> None:
        t = self.llm.last_timings
        if t is None:
            return
        self.notice(f"prompt: {t.prompt_tokens} tokens evaluated, {t.cached_tokens} reused from the cache, "
                    f"{t.prompt_tps:.1f} tokens/s; answer: {t.gen_tokens} tokens, {t.gen_tps:.1f} tokens/s; "
                    f"stop: {reason}")


# -- input ---------------------------------------------------------------------------------------

def terminal_lines(prompt: str = "> ", more: str = ". ") -> Iterator[str]:
    """Messages typed at a terminal, with line editing (readline) when available.

    A line ending in a backslash continues on the next line. Ctrl-C at the prompt discards the
    line; Ctrl-D (end of file) ends the iteration.
    """
    try:
        import readline  # noqa: F401  (importing it gives input() line editing and history)
    except ImportError:
        pass
    to_stdout = sys.stdout.isatty()

    def read(marker: str) -> str:
        if to_stdout:
            return input(marker)
        sys.stderr.write(marker)
        sys.stderr.flush()
        return input()

    while True:
        try:
            lines = [read(prompt)]
            while lines[-1].endswith("\\"):
                lines[-1] = lines[-1][:-1]
                lines.append(read(more))
        except EOFError:
            sys.stderr.write("\n")
            return
        except KeyboardInterrupt:
            sys.stderr.write("\n")
            continue
        yield "\n".join(lines)


def stream_lines(stream: TextIO) -> Iterator[str]:
    """Messages read from a pipe or file: one per line (a trailing backslash continues it)."""
    parts: list[str] = []
    for raw in stream:
        line = raw.rstrip("\r\n")
        if line.endswith("\\"):
            parts.append(line[:-1])
            continue
        yield "\n".join(parts + [line])
        parts = []
    if parts:
        yield "\n".join(parts)


@click.command("chat")
@click.argument("model", type=ModelRef(dir_okay=False))
@click.option("-p", "--prompt", "first_message", metavar="TEXT",
              help="The first message, answered before any input is read (llama-cli -cnv -p).")
@click.option("-n", "--max-tokens", default=-1, show_default=True, type=click.IntRange(min=-1),
              help="Tokens per answer at most (-1: until the end of the turn or a full context).")
@sampling_options
@session_options
@click.option("-sys", "--system", "--system-prompt", "system_prompt",
              help="System prompt (also settable in the session with /system).")
@click.option("-r", "--reverse-prompt", multiple=True, metavar="TEXT",
              help="End an answer where this text appears (repeatable; not shown) and return control to you.")
@chat_template_option
@click.option("--hide-reasoning", is_flag=True,
              help="Do not show a thinking model's <think>...</think> reasoning (on a terminal it is shown dimmed).")
@click.option("-v", "--verbose", is_flag=True, help="Print load details and, after each answer, tokens evaluated/reused and speed (stderr).")
def command(model, first_message, max_tokens, temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n,
            presence_penalty, frequency_penalty, logit_bias, ignore_eos, seed, ctx_size, threads, batch_size, type_k,
            type_v, system_prompt, reverse_prompt, chat_template, hide_reasoning, verbose):
    """Chat with MODEL: type a message, read the streamed answer; the conversation is kept.

    Commands: /reset, /system [TEXT], /save FILE, /load FILE (JSON list of {role, content}),
    /help, /exit. Ctrl-C stops an answer, Ctrl-D exits. Answers go to stdout, notices to
    stderr. With stdin not a terminal, each input line is one message.
    The same --seed is used for every answer.
    """
    from ..api import load

    llm = load(model, n_ctx=ctx_size or None, n_threads=threads, batch_size=batch_size, type_k=type_k, type_v=type_v,
               warmup_next=True)
    bad = [t for t in logit_bias if t >= llm.n_vocab]
    if bad:
        raise click.BadParameter(f"token id {bad[0]} is out of range [0, {llm.n_vocab})", param_hint="'--logit-bias'")
    sampling = dict(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                    repeat_last_n=repeat_last_n, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                    logit_bias=logit_bias, ignore_eos=ignore_eos, seed=seed, stop=list(reverse_prompt))
    llm.session.progress = PromptProgress()  # a long conversation or pasted text shows its progress on a terminal
    chat = ChatSession(llm, system=system_prompt, chat_template=chat_template, max_tokens=max_tokens,
                       sampling=sampling, verbose=verbose)
    chat.hide_reasoning = hide_reasoning
    from .warm import warm_up

    warm_up(llm)  # a first-run compile says so here, instead of a long silent first answer
    interactive = sys.stdin.isatty()
    if verbose:
        chat.notice(f"loaded {llm!r} in {llm.load_s:.2f} s, {llm.n_threads} threads; "
                    f"prompt format: {describe(chat.format, llm.metadata)}")
    if interactive:
        chat.notice(f"chatting with {llm.path} ({chat.template_name}); /help for commands, "
                    "Ctrl-C stops an answer, Ctrl-D exits")
    if first_message is not None and not chat.handle(first_message):
        return
    lines = terminal_lines() if interactive else stream_lines(sys.stdin)
    for line in lines:
        if not chat.handle(line):
            break
