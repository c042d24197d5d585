"""Generated token ids -> text chunks, for every front end (the API, the CLI, the server).

A multi-byte character is never split (the tokenizer's streaming decoder holds back incomplete
UTF-8), and text that may be the start of a stop string waits until it is known not to be one.
Each token may carry a payload (its id, or its log-probabilities on the server); a chunk goes
out with the payloads of every token fed since the previous chunk.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence


def held_back(text: str, stops: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return hold


class TextOutput:
    """Token ids -> text chunks with stop strings (see the module docstring)."""

    def __init__(self, tokenizer, stops: Sequence[str], special: bool = False):
        # the ids continue the prompt: keep the first one's leading space, as llama.cpp prints it;
        # special: control tokens are text too (a tool-call or channel marker the server parses)
        self.decoder = tokenizer.stream_decoder(special=special, continuation=True)
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.pending_items: list[Any] = []

    def feed(self, token: int, item: Any = None) -> tuple[str, list[Any], bool]:
        """Add one token (and its payload, if not None): (text that can go out now, the payloads
        that go with it, whether a stop string appeared; then the text ends before it)."""
        self.pending += self.decoder.feed(token)
        if item is not None:
            self.pending_items.append(item)
        if self.stops:
            hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
            if hits:
                text, self.pending = self.pending[: min(hits)], ""
                items, self.pending_items = self.pending_items, []
                return text, items, True
        return self.take(len(self.pending) - held_back(self.pending, self.stops)) + (False,)

    def take(self, n: int) -> tuple[str, list[Any]]:
        """The first n pending characters, with the payloads of every token fed so far (when n > 0)."""
        text, self.pending = self.pending[:n], self.pending[n:]
        items: list[Any] = []
        if n > 0:
            items, self.pending_items = self.pending_items, []
        return text, items

    def finish(self) -> tuple[str, list[Any]]:
        """The rest of the text (at an end of generation or the length limit)."""
        self.pending += self.decoder.flush()
        text, items = self.pending, self.pending_items
        self.pending, self.pending_items = "", []
        return text, items
