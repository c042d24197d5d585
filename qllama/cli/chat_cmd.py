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
(plus a few tokens at the boundary of the last answer) is evaluated. When the conversation
outgrows the context, the oldest user/assistant turns are dropped (the system prompt is kept).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator, TextIO

import click

from ..errors import QllamaError
from .model_ref import ModelRef
from .options import sampling_options

HELP = """commands:
  /reset          forget the conversation (the system prompt is kept)
  /system [TEXT]  set the system prompt (no TEXT: remove it)
  /save FILE      write the conversation to FILE as JSON
  /load FILE      replace the conversation with the one in FILE
  /exit           quit (also /quit or Ctrl-D)
  /help           this text
Ctrl-C stops the answer being generated. End a line with \\ to continue the message on the next line."""

ROLES = ("system", "user", "assistant")


@dataclass
class Conversation:
    """A system prompt and the user/assistant turns after it."""

    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self) -> list[dict[str, str]]:
        """The messages to render: the system prompt (if any), then the turns."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def drop_oldest_turn(self) -> int:
        """Remove the oldest user message and the replies after it, never the last (pending) message.

        Returns how many messages were removed (0 when only the pending message is left).
        """
        if len(self.turns) < 2:
            return 0
        n = 1
        while n < len(self.turns) - 1 and self.turns[n]["role"] != "user":
            n += 1
        del self.turns[:n]
        return n

    def to_json(self) -> str:
        return json.dumps(self.messages(), ensure_ascii=False, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "the file") -> "Conversation":
        """Parse a list of {"role", "content"} messages (or {"messages": [...]})."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise QllamaError(f"{source} is not JSON: {e.msg} at line {e.lineno}") from None
        if isinstance(data, dict):
            data = data.get("messages")
        if not isinstance(data, list):
            raise QllamaError(f"{source} must hold a list of messages (or {{\"messages\": [...]}})")
        conv = cls()
        for i, m in enumerate(data):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise QllamaError(f"{source}: message {i} must be {{\"role\": system|user|assistant, \"content\": text}}")
            if m["role"] == "system":
                if i != 0:
                    raise QllamaError(f"{source}: message {i}: a system message may only come first")
                conv.system = m["content"]
            else:
                conv.turns.append({"role": m["role"], "content": m["content"]})
        return conv


class ChatSession:
    """The chat loop's state and actions, independent of where lines come from.

    `llm` is a loaded `qllama.Model`; `sampling` holds the keyword arguments of `Model.stream`
    (temperature, top_k, ...); `max_tokens` < 0 means "until end of turn or a full context".
    """

    def __init__(self, llm, *, system: str | None = None, chat_template_file: str | None = None,
                 max_tokens: int = -1, sampling: dict[str, Any] | None = None, verbose: bool = False,
                 out: TextIO | None = None, err: TextIO | None = None):
        self.llm = llm
        self.conv = Conversation(system=system or None)
        self.chat_template_file = chat_template_file
        self.max_tokens = max_tokens
        self.sampling = dict(sampling or {})
        self.verbose = verbose
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        template = llm.chat_template(chat_template_file)
        if template is None:
            raise QllamaError("the model has no chat template and none is built in for its family: "
                              "give one with --chat-template FILE (a Jinja file)")
        self.template_name = template.name
        # render once now, so that a template that cannot handle this conversation fails at start
        llm.apply_chat_template(self.conv.messages() + [{"role": "user", "content": "hi"}],
                                chat_template_file=chat_template_file)

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
            self.llm.apply_chat_template(self.conv.messages() + [{"role": "user", "content": "hi"}],
                                         chat_template_file=self.chat_template_file)
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
    def fit(self) -> list[int] | None:
        """Token ids of the conversation, after dropping the oldest turns if it outgrows the context.

        Room is kept for the answer: min(max_tokens, n_ctx / 2) positions; when the rest does not
        hold the conversation, the oldest turns go until it fills at most half of it. Returns None (and
        removes the pending message) when even the system prompt and that message do not fit.
        """
        n_ctx = self.llm.n_ctx
        answer_room = n_ctx // 2 if self.max_tokens < 0 else min(self.max_tokens, n_ctx // 2)
        budget = max(n_ctx - answer_room, 1)
        ids = self.prompt_ids()
        if len(ids) <= budget:
            return ids
        alone = Conversation(self.conv.system, self.conv.turns[-1:]).messages()
        n_alone = len(self.llm.chat_tokens(alone, self.chat_template_file))
        if n_alone >= n_ctx:  # not even one position left for the answer: drop nothing, refuse
            self.conv.turns.pop()
            what = "the system prompt and this message" if self.conv.system else "this message"
            self.error(f"{what} take {n_alone} tokens, which do not fit in the context of {n_ctx} "
                       "(raise -c/--ctx-size or shorten it)")
            return None
        # Dropped turns change every position after the system prompt, so all of it is evaluated
        # again; dropping down to half the budget (as llama.cpp's context shift discards half)
        # lets the next turns reuse the cache instead of paying that on every turn.
        dropped = 0
        while len(ids) > budget // 2:
            n = self.conv.drop_oldest_turn()
            if n == 0:
                break
            dropped += n
            ids = self.prompt_ids()
        if dropped:
            kept = " (the system prompt is kept)" if self.conv.system else ""
            self.notice(f"the conversation outgrew the context of {n_ctx} tokens: "
                        f"dropped the {dropped} oldest messages{kept}")
        return ids

    def prompt_ids(self) -> list[int]:
        """Token ids of the conversation, keeping the tokens the model generated when possible.

        The canonical ids are the rendered conversation tokenized afresh (as `Model.chat` does);
        the KV cache then keeps their longest common prefix with the cached tokens. But an
        answer, re-tokenized, may split differently from the tokens that were sampled (a random
        or unusual model samples non-canonical splits), and the cache would lose everything after
        the difference. Tokenization restarts at every control token (<|eot_id|>, </s>, ...), so
        both sequences are runs of text tokens between the same control tokens: where the cached
        runs spell the same bytes as the canonical ones, the cached tokens are kept and the
        canonical ids continue from the next control token. Same text, only the model's own
        split of its answers (as llama.cpp's interactive mode keeps them).
        """
        ids = self.llm.chat_tokens(self.conv.messages(), self.chat_template_file)
        held = list(self.llm.session.tokens)
        common = 0
        for a, b in zip(held, ids):
            if a != b:
                break
            common += 1
        if common == len(held):
            return ids
        k, j = self._aligned_prefix(held, ids)
        return held[:k] + ids[j:] if k > common else ids

    def _aligned_prefix(self, held: list[int], ids: list[int]) -> tuple[int, int]:
        """The largest (k, j) with held[:k] the same text as ids[:j] and ids[j] a control token (or j == len(ids))."""
        tok = self.llm.tokenizer

        def run_end(seq: list[int], i: int) -> int:  # end of the text run starting at i
            while i < len(seq) and tok.token_bytes(seq[i]) != b"":
                i += 1
            return i

        def text(seq: list[int], a: int, b: int) -> bytes:
            return b"".join(tok.token_bytes(t) for t in seq[a:b])

        best = (0, 0)
        i = j = 0
        while i < len(held) and j < len(ids):
            i2, j2 = run_end(held, i), run_end(ids, j)
            if text(held, i, i2) != text(ids, j, j2):
                break
            best = (i2, j2)  # ids[j2:] starts at a control token (or is empty): tokenization restarts there
            if i2 == len(held) or j2 == len(ids) or held[i2] != ids[j2]:
                break
            i, j = i2 + 1, j2 + 1  # the same control token
            best = (i, j)
        return best

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
            for chunk in chunks:
                if chunk.text:
                    parts.append(chunk.text)
                    self.out.write(chunk.text)
                    self.out.flush()
                reason = chunk.finish_reason or reason
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
@click.option("-n", "--max-tokens", default=-1, show_default=True, type=click.IntRange(min=-1),
              help="Tokens per answer at most (-1: until the end of the turn or a full context).")
@sampling_options
@click.option("-c", "--ctx-size", type=click.IntRange(min=0), default=0, help="Context size (0 = min(model's, 4096)).")
@click.option("-t", "--threads", type=click.IntRange(min=1), help="Threads (default: physical cores).")
@click.option("-b", "--batch-size", type=click.IntRange(min=1), default=512, show_default=True, help="Prompt tokens per prefill batch.")
@click.option("--system", "system_prompt", help="System prompt (also settable in the session with /system).")
@click.option("--chat-template", "chat_template_file", type=click.Path(exists=True, dir_okay=False),
              help="Use this Jinja chat template file instead of the model's.")
@click.option("-v", "--verbose", is_flag=True, help="Print load details and, after each answer, tokens evaluated/reused and speed (stderr).")
def command(model, max_tokens, temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed,
            ctx_size, threads, batch_size, system_prompt, chat_template_file, verbose):
    """Chat with MODEL: type a message, read the streamed answer; the conversation is kept.

    Commands: /reset, /system [TEXT], /save FILE, /load FILE (JSON list of {role, content}),
    /help, /exit. Ctrl-C stops an answer, Ctrl-D exits. Answers go to stdout, notices to
    stderr. With stdin not a terminal, each input line is one message.
    The same --seed is used for every answer.
    """
    from ..api import load

    llm = load(model, n_ctx=ctx_size or None, n_threads=threads, batch_size=batch_size)
    sampling = dict(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                    repeat_last_n=repeat_last_n, seed=seed)
    chat = ChatSession(llm, system=system_prompt, chat_template_file=chat_template_file, max_tokens=max_tokens,
                       sampling=sampling, verbose=verbose)
    interactive = sys.stdin.isatty()
    if verbose:
        chat.notice(f"loaded {llm!r} in {llm.load_s:.2f} s, {llm.n_threads} threads; chat template {chat.template_name}")
    if interactive:
        chat.notice(f"chatting with {llm.path} ({chat.template_name}); /help for commands, "
                    "Ctrl-C stops an answer, Ctrl-D exits")
    lines = terminal_lines() if interactive else stream_lines(sys.stdin)
    for line in lines:
        if not chat.handle(line):
            break
