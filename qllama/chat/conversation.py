"""A conversation's history, and the token ids a model evaluates for it, reusing its KV cache.

Every caller that chats (`qllama chat`, `Model.chat`, a server) renders the whole conversation
each turn and hands the ids to the model, whose KV cache keeps the longest common prefix with
what it already holds. Two things make that prefix long:

- `prompt_ids` keeps the model's own tokens of earlier answers. An answer, re-tokenized, may
  split differently from the tokens that were sampled (a random or unusual model samples
  non-canonical splits), and the cache would lose everything after the first difference.
- `fit` drops the oldest turns when the conversation outgrows the context, and drops down to
  half of it, so that the next turns reuse the cache instead of paying for a shift each turn.

Nothing here prints or knows about the model class: the callers pass what it needs (a function
from messages to ids, the cached tokens, the bytes of a token).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from qllama.errors import QllamaError

ROLES = ("system", "user", "assistant")

#: messages -> token ids of the rendered conversation (with the generation prompt).
Encode = Callable[[list[dict]], list[int]]
#: token id -> its bytes as text; b"" for a control token (<|eot_id|>, </s>, ...).
TokenBytes = Callable[[int], bytes]


class ConversationTooLongError(QllamaError):
    """Even the system prompt and the newest message do not fit in the context."""


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


def prompt_ids(ids: list[int], held: Sequence[int], token_bytes: TokenBytes) -> list[int]:
    """The ids to evaluate for a conversation whose canonical ids are `ids`, given the cached `held`.

    `ids` is the rendered conversation tokenized afresh; the cache then keeps its longest common
    prefix with `held`. Where held tokens spell the same bytes as the start of `ids` (see
    `aligned_prefix`), they are kept and `ids` continues from the matching point: the same
    text, only the model's own split of its answers (as llama.cpp's interactive mode keeps
    them). With nothing to gain, `ids` is returned unchanged.
    """
    common = 0
    for a, b in zip(held, ids):
        if a != b:
            break
        common += 1
    if common == len(held):
        return ids
    k, j = aligned_prefix(held, ids, token_bytes)
    return list(held[:k]) + ids[j:] if k > common else ids


def aligned_prefix(held: Sequence[int], ids: Sequence[int], token_bytes: TokenBytes) -> tuple[int, int]:
    """The largest (k, j) with held[:k] spelling the same bytes as ids[:j], found run by run.

    Runs between the same control tokens that spell the same bytes are taken whole. In the first
    run that differs (an answer whose bytes were not valid UTF-8 comes back as U+FFFD; an
    answer cut short), the alignment stops at the last token boundary the two share before the
    first differing byte: ids[j:] then spells the rest of the text, whatever held's split was.
    """

    def run_end(seq: Sequence[int], i: int) -> int:  # end of the text run starting at i
        while i < len(seq) and token_bytes(seq[i]) != b"":
            i += 1
        return i

    def text(seq: Sequence[int], a: int, b: int) -> bytes:
        return b"".join(token_bytes(t) for t in seq[a:b])

    best = (0, 0)
    i = j = 0
    while i < len(held) and j < len(ids):
        i2, j2 = run_end(held, i), run_end(ids, j)
        if text(held, i, i2) != text(ids, j, j2):
            return max(best, _shared_boundary(held, i, i2, ids, j, j2, token_bytes))
        best = (i2, j2)  # ids[j2:] starts at a control token (or is empty)
        if i2 == len(held) or j2 == len(ids) or held[i2] != ids[j2]:
            break
        i, j = i2 + 1, j2 + 1  # the same control token
        best = (i, j)
    return best


def _shared_boundary(held: Sequence[int], i: int, i_end: int, ids: Sequence[int], j: int, j_end: int,
                     token_bytes: TokenBytes) -> tuple[int, int]:
    """The furthest (k, m), i <= k <= i_end and j <= m <= j_end, where held[i:k] and ids[j:m] spell the
    same bytes (a token boundary of both inside two runs that differ somewhere)."""
    a, b = bytearray(), bytearray()  # the bytes of held[i:k] and of ids[j:m]
    k, m = i, j
    same = 0  # a[:same] == b[:same], checked
    best = (i, j)
    while True:
        n = min(len(a), len(b))
        if a[same:n] != b[same:n]:
            return best
        same = n
        if len(a) == len(b):
            best = (k, m)
        if len(a) <= len(b):
            if k == i_end:
                return best
            a += token_bytes(held[k])
            k += 1
        else:
            if m == j_end:
                return best
            b += token_bytes(ids[m])
            m += 1


def answer_room(n_ctx: int, max_tokens: int) -> int:
    """Positions kept free for the answer: min(max_tokens, n_ctx / 2); max_tokens < 0 means n_ctx / 2."""
    return n_ctx // 2 if max_tokens < 0 else min(max_tokens, n_ctx // 2)


def fit(conv: Conversation, encode: Encode, n_ctx: int, max_tokens: int) -> tuple[list[int], int]:
    """Token ids of the conversation, after dropping its oldest turns if it outgrows the context.

    `encode` gives the ids to evaluate for some messages (for reuse: the canonical ids passed
    through `prompt_ids`). Room is kept for the answer (`answer_room`); when the rest does not
    hold the conversation, the oldest turns go until it fills at most half of it. Returns
    (ids, number of messages dropped). Raises `ConversationTooLongError`, changing nothing, when
    even the system prompt and the newest message leave no position for an answer.
    """
    budget = max(n_ctx - answer_room(n_ctx, max_tokens), 1)
    ids = encode(conv.messages())
    if len(ids) <= budget:
        return ids, 0
    n_alone = len(encode(Conversation(conv.system, conv.turns[-1:]).messages()))
    if n_alone >= n_ctx:  # not even one position left for the answer: drop nothing, refuse
        what = "the system prompt and the newest message take" if conv.system else "the newest message takes"
        raise ConversationTooLongError(f"{what} {n_alone} tokens, which do not fit in the context of {n_ctx}")
    # Dropped turns change every position after the system prompt, so all of it is evaluated
    # again; dropping down to half the budget (as llama.cpp's context shift discards half)
    # lets the next turns reuse the cache instead of paying that on every turn.
    dropped = 0
    while len(ids) > budget // 2:
        n = conv.drop_oldest_turn()
        if n == 0:
            break
        dropped += n
        ids = encode(conv.messages())
    return ids, dropped
