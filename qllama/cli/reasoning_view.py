"""Reasoning on the terminal: a thinking model's `<think>...</think>` (Qwen3, DeepSeek-R1
distills) shown dimmed on a terminal, or hidden (`--hide-reasoning`). Piped output keeps the
model's text as it is unless hidden. The split is the server's (`qllama.server.tools.ChatPost`)."""

from __future__ import annotations

DIM, RESET = "\x1b[2m", "\x1b[0m"


class ReasoningView:
    def __init__(self, out, *, hide: bool = False, thinking_open: bool = False):
        from ..server.tools import ChatPost

        self.out = out
        self.hide = hide
        self.dim = bool(getattr(out, "isatty", lambda: False)())
        self.post = ChatPost(reasoning=True)
        if thinking_open:
            self.post.open_thinking()
        self.passthrough = not hide and not self.dim

    def write(self, text: str) -> None:
        if self.passthrough:
            self.out.write(text)
        else:
            for d in self.post.feed(text):
                self._emit(d)
        self.out.flush()

    def finish(self) -> None:
        if not self.passthrough:
            for d in self.post.finish()[0]:
                self._emit(d)
            self.out.flush()

    def _emit(self, delta: dict) -> None:
        if "reasoning_content" in delta:
            if not self.hide:
                self.out.write(DIM + delta["reasoning_content"] + RESET)
        else:
            self.out.write(delta.get("content", ""))


def opens_thinking(tokenizer, ids) -> bool:
    """Whether the prompt ends inside <think> (the template opened it, as DeepSeek-R1's does)."""
    return bool(ids) and tokenizer.decode(list(ids[-4:]), special=True).rstrip().endswith("<think>")
