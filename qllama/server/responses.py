"""OpenAI response objects (and llama.cpp's `timings` extra) built from scheduler events.

Shapes follow OpenAI's API: `chat.completion` / `chat.completion.chunk` and `text_completion`
(also its streamed chunks), `usage` with `prompt_tokens_details.cached_tokens`, and, with
stream_options.include_usage, a last chunk whose `choices` is empty. Chat logprobs use the
`{"content": [{token, logprob, bytes, top_logprobs}]}` form; completion logprobs the legacy
`{tokens, token_logprobs, top_logprobs, text_offset}` form the `openai` client types.
"""

from __future__ import annotations

import json
import secrets
import time

from .scheduler import Usage
from .logprobs import TokenLogprob

FINGERPRINT = "qllama"


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


def sse(obj: dict) -> bytes:
    """One server-sent event carrying a JSON object."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def usage_json(u: Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def timings_json(u: Usage) -> dict:
    """llama.cpp's `timings` object: prompt = tokens evaluated (cache excluded), predicted = sampled."""
    n_prompt = u.prompt_tokens - u.cached_tokens

    def rate(n: int, ms: float) -> float:
        return 1000.0 * n / ms if ms > 0 else 0.0

    return {
        "cache_n": u.cached_tokens,
        "prompt_n": n_prompt,
        "prompt_ms": round(u.prompt_ms, 3),
        "prompt_per_second": round(rate(n_prompt, u.prompt_ms), 3),
        "predicted_n": u.completion_tokens,
        "predicted_ms": round(u.predicted_ms, 3),
        "predicted_per_second": round(rate(u.completion_tokens - 1, u.predicted_ms), 3),
    }


def chat_logprobs(lps: list[TokenLogprob]) -> dict:
    def entry(text: str, b: bytes, lp: float) -> dict:
        return {"token": text, "logprob": lp, "bytes": list(b)}

    content = []
    for t in lps:
        e = entry(t.text, t.bytes, t.logprob)
        e["top_logprobs"] = [entry(text, b, lp) for _, text, b, lp in t.top]
        content.append(e)
    return {"content": content, "refusal": None}


def completion_logprobs(lps: list[TokenLogprob], offset: int) -> dict:
    """Legacy completion logprobs; `offset` is where the first token's text starts in the completion."""
    offsets = []
    for t in lps:
        offsets.append(offset)
        offset += len(t.text)
    return {
        "tokens": [t.text for t in lps],
        "token_logprobs": [t.logprob for t in lps],
        "top_logprobs": [{text: lp for _, text, _, lp in t.top} for t in lps],
        "text_offset": offsets,
    }


class ResponseBuilder:
    """Builds the chunks and the final object of one request (chat or text completion)."""

    def __init__(self, kind: str, model: str, want_logprobs: bool, post=None):
        self.kind = kind  # "chat" | "completion"
        self.model = model
        self.want_logprobs = want_logprobs
        self.post = post  # a tools.ChatPost: reasoning and tool calls apart from the content (chat only)
        self.calls_made = False
        self.id = new_id(kind)
        self.created = int(time.time())
        self.text_len = 0  # characters sent so far (completion logprobs' text_offset)

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": FINGERPRINT}

    def _logprobs(self, lps: list[TokenLogprob]):
        if not self.want_logprobs:
            return None
        if self.kind == "chat":
            return chat_logprobs(lps)
        return completion_logprobs(lps, self.text_len)

    # -- streaming ----------------------------------------------------------------------------

    def first_chunk(self) -> dict | None:
        """Chat streams open with the assistant role, as OpenAI's do."""
        if self.kind != "chat":
            return None
        return self._chunk({"role": "assistant", "content": ""}, None, None)

    def text_chunk(self, text: str, lps: list[TokenLogprob]) -> dict:
        delta = {"content": text} if self.kind == "chat" else text
        out = self._chunk(delta, None, self._logprobs(lps))
        self.text_len += len(text)
        return out

    def text_chunks(self, text: str, lps: list[TokenLogprob]) -> list[dict]:
        """The chunks for new text: one, or with a ChatPost, one per delta it lets out now
        (reasoning_content / content; text that may open a tool call is held)."""
        if self.post is None:
            return [self.text_chunk(text, lps)]
        deltas = self.post.feed(text)
        if not deltas and lps and self.want_logprobs:  # text held back (or none, at a stop string): the logprobs go now
            deltas = [{"content": ""}]
        return [self._chunk(d, None, self._logprobs(lps) if k == 0 else None) for k, d in enumerate(deltas)]

    def closing_chunks(self) -> list[dict]:
        """With a ChatPost: what it held back, and the rest of the tool calls (`delta.tool_calls`: a
        call's id and name first, then its arguments as they came; calls it could not follow are
        sent whole)."""
        if self.post is None:
            return []
        deltas, calls = self.post.finish()  # with the calls not streamed yet as tool_calls deltas
        self.calls_made = bool(calls)
        return [self._chunk(d, None, None) for d in deltas]

    def final_chunk(self, finish_reason: str, usage: Usage) -> dict:
        if self.calls_made:
            finish_reason = "tool_calls"
        out = self._chunk({} if self.kind == "chat" else "", finish_reason, None)
        out["timings"] = timings_json(usage)
        return out

    def usage_chunk(self, usage: Usage) -> dict:
        out = self._base("chat.completion.chunk" if self.kind == "chat" else "text_completion")
        out["choices"] = []
        out["usage"] = usage_json(usage)
        return out

    def _chunk(self, delta, finish_reason, logprobs) -> dict:
        if self.kind == "chat":
            out = self._base("chat.completion.chunk")
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            out = self._base("text_completion")
            choice = {"index": 0, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        out["choices"] = [choice]
        return out

    # -- whole response -----------------------------------------------------------------------

    def complete(self, text: str, lps: list[TokenLogprob], finish_reason: str, usage: Usage) -> dict:
        if self.kind == "chat":
            out = self._base("chat.completion")
            message = {"role": "assistant", "content": text}
            if self.post is not None:
                reasoning, content, calls = self.post.message(text)
                message["content"] = content if content or not calls else None
                if reasoning is not None:
                    message["reasoning_content"] = reasoning
                if calls:
                    message["tool_calls"] = calls
                    finish_reason = "tool_calls"
            choice = {"index": 0, "message": message,
                      "logprobs": self._logprobs(lps), "finish_reason": finish_reason}
        else:
            out = self._base("text_completion")
            choice = {"index": 0, "text": text, "logprobs": self._logprobs(lps), "finish_reason": finish_reason}
        out["choices"] = [choice]
        out["usage"] = usage_json(usage)
        out["timings"] = timings_json(usage)
        return out
