"""Request validation for the OpenAI-compatible endpoints: JSON bodies -> plain dataclasses.

Unknown fields are ignored (clients send many we do not use); a known field of the wrong type
or out of range is an `ApiError` (HTTP 400) naming the field in `param`. Defaults follow
llama.cpp's server: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, repeat_penalty 1.0,
repeat_last_n 64, and no max_tokens limit (generation ends at an end-of-generation token or
when the context is full).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import QllamaError
from ..generation.sampling import SamplingParams

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_STOP_STRINGS = 16
ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's message roles


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

    `type` names follow llama.cpp's server (invalid_request_error, authentication_error,
    not_found_error, server_error, unavailable_error, exceed_context_size_error); `code` is
    the HTTP status, as llama.cpp sends it. `extra` fields join the error object.
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None, **extra: Any):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.headers = headers or {}
        self.extra = extra

    def body(self) -> dict:
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.status}
        err.update(self.extra)
        return {"error": err}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


@dataclass
class GenParams:
    """What to generate for one request (after validation)."""

    max_tokens: int | None = None  # None: until end of generation or a full context
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: off; else the number of top alternatives per token (0..20)
    stream: bool = False
    include_usage: bool = False
    grammar: tuple[str, Any] | None = None  # (kind, spec) for qllama.generation.constrained.compile_grammar
    grammar_param: str | None = None  # the request field it came from (errors name it)
    constraint: Any = None  # the compiled Constraint (set by the app); each request gets its own matcher
    special: bool = False  # control tokens show in the text (the chat parser reads tool-call and channel markers)


@dataclass
class CompletionRequest:
    prompt: str | list[int]
    params: GenParams


@dataclass
class ChatRequest:
    messages: list[dict]
    params: GenParams


# -- field readers ------------------------------------------------------------------------------

_MISSING = object()


def _number(body: dict, key: str, default, *, integer: bool = False, lo=None, hi=None, lo_open: bool = False):
    """body[key] as int/float within [lo, hi]; null or absent -> default. bool is not a number."""
    v = body.get(key, _MISSING)
    if v is _MISSING or v is None:
        return default
    if integer and isinstance(v, float) and v.is_integer():
        v = int(v)  # 100.0 is 100, as JSON libraries that know no integers write it
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        kind = "an integer" if integer else "a number"
        raise bad_request(f"'{key}' must be {kind}, got {type(v).__name__ if v is not None else 'null'}", key)
    if isinstance(v, float) and v != v:
        raise bad_request(f"'{key}' must be a number, got NaN", key)
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise bad_request(f"'{key}' must be {'>' if lo_open else '>='} {lo}, got {v}", key)
    if hi is not None and v > hi:
        raise bad_request(f"'{key}' must be <= {hi}, got {v}", key)
    return v


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, None)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{key}' must be a boolean", key)
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    if len(v) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' holds at most {MAX_STOP_STRINGS} strings, got {len(v)}", "stop")
    return [s for s in v if s]


MAX_LOGIT_BIAS = 100.0  # OpenAI's range is [-100, 100]


def _logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's `logit_bias`: {"token id": bias in [-100, 100]}; also llama-server's list form
    [[id, bias], ...], where a bias of false bans the token (-inf). Ids are checked against the
    vocabulary by the app (`check_token_ids`)."""
    v = body.get("logit_bias")
    if v is None:
        return {}
    if isinstance(v, dict):
        items = list(v.items())
    elif isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 for p in v):
        items = [(p[0], p[1]) for p in v]
    else:
        raise bad_request("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    out: dict[int, float] = {}
    for key, bias in items:
        tok = key if isinstance(key, int) and not isinstance(key, bool) else None
        if isinstance(key, str) and key.strip().isdigit():
            tok = int(key)
        if tok is None:
            raise bad_request(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias")
        if bias is False:
            out[tok] = float("-inf")
            continue
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or bias != bias:
            raise bad_request(f"'logit_bias' of token {tok} must be a number, got {bias!r}", "logit_bias")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise bad_request(f"'logit_bias' of token {tok} must be in [-100, 100], got {bias}", "logit_bias")
        out[tok] = float(bias)
    return out


def check_token_ids(params: "GenParams", n_vocab: int) -> None:
    """A 400 when `logit_bias` names a token the vocabulary does not have."""
    bad = [t for t, _ in params.sampling.logit_bias if not 0 <= t < n_vocab]
    if bad:
        raise bad_request(f"'logit_bias': token id {bad[0]} is out of range [0, {n_vocab})", "logit_bias")


def _common(body: dict) -> GenParams:
    """Fields shared by /v1/completions and /v1/chat/completions."""
    n = _number(body, "n", 1, integer=True)
    if n != 1:
        raise bad_request(f"only n = 1 is supported, got {n}", "n")
    max_tokens = _number(body, "max_tokens", None, integer=True, lo=-1)
    mct = _number(body, "max_completion_tokens", None, integer=True, lo=-1)
    if mct is not None:  # the newer name wins, as in OpenAI's API
        max_tokens = mct
    if max_tokens == -1:  # llama.cpp's "no limit"
        max_tokens = None
    seed = _number(body, "seed", None, integer=True)
    sampling = SamplingParams(
        temperature=float(_number(body, "temperature", 0.8, lo=0.0)),
        top_k=_number(body, "top_k", 40, integer=True),
        top_p=float(_number(body, "top_p", 0.95, lo=0.0, hi=1.0)),
        min_p=float(_number(body, "min_p", 0.05, lo=0.0, hi=1.0)),
        repeat_penalty=float(_number(body, "repeat_penalty", 1.0, lo=0.0, lo_open=True)),
        repeat_last_n=_number(body, "repeat_last_n", 64, integer=True, lo=-1),
        seed=None if seed is None else seed % (1 << 64),  # numpy wants a non-negative seed
        presence_penalty=float(_number(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0)),  # OpenAI's range
        frequency_penalty=float(_number(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0)),
        logit_bias=_logit_bias(body),
        ignore_eos=_bool(body, "ignore_eos", False),  # llama-server's
    )
    try:
        sampling.validate()
    except QllamaError as e:
        raise bad_request(str(e)) from None
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    include_usage = _bool(opts or {}, "include_usage", False)
    params = GenParams(max_tokens=max_tokens, sampling=sampling, stop=_stop(body), stream=stream,
                       include_usage=include_usage)
    params.grammar, params.grammar_param = _grammar(body)
    return params


def _grammar(body: dict) -> tuple[tuple[str, Any] | None, str | None]:
    """At most one of `response_format` (OpenAI), `json_schema` and `grammar` (llama.cpp's
    server: a JSON schema, a GBNF text) as (kind, spec), and the field it came from."""
    given = [k for k in ("response_format", "json_schema", "grammar") if body.get(k) not in (None, "")]
    if not given:
        return None, None
    if len(given) > 1:
        raise bad_request(f"give one of {', '.join(given)}, not several", given[1])
    key = given[0]
    v = body[key]
    if key == "grammar":
        if not isinstance(v, str):
            raise bad_request("'grammar' must be a string (GBNF or Lark)", key)
        return ("gbnf", v), key
    if key == "json_schema":
        if not isinstance(v, dict):
            raise bad_request("'json_schema' must be an object", key)
        return ("json_schema", v), key
    from ..generation.constrained import GrammarError, response_format_grammar

    try:
        return response_format_grammar(v), key
    except GrammarError as e:
        raise bad_request(str(e), key) from None


def parse_completion(body: Any) -> CompletionRequest:
    """A /v1/completions body: `prompt` is a string, a list of token ids, or a one-element list of either."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    params = _common(body)
    prompt = body.get("prompt", _MISSING)
    if prompt is _MISSING or prompt is None:
        raise bad_request("'prompt' is required", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, list):
        if (prompt and all(isinstance(p, str) for p in prompt)) or any(isinstance(p, list) for p in prompt):
            raise bad_request("only one prompt per request is supported", "prompt")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise bad_request("'prompt' must be a string or a list of token ids", "prompt")
    elif not isinstance(prompt, str):
        raise bad_request("'prompt' must be a string or a list of token ids", "prompt")
    if _bool(body, "echo", False):
        raise bad_request("'echo' is not supported", "echo")
    for key in ("best_of", "suffix"):
        if body.get(key) not in (None, 1, ""):
            raise bad_request(f"'{key}' is not supported", key)
    logprobs = _number(body, "logprobs", None, integer=True, lo=0, hi=MAX_TOP_LOGPROBS)
    params.logprobs = logprobs
    return CompletionRequest(prompt, params)


def parse_chat(body: Any) -> ChatRequest:
    """A /v1/chat/completions body: messages with string content (or lists of text parts)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    params = _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string 'role'", "messages")
        if m["role"] not in ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m['role']!r}", "messages")
        if m["role"] in ("system", "developer", "user") and "content" not in m:
            raise bad_request(f"messages[{i}] ({m['role']}) has no 'content'", "messages")
        msg = {"role": m["role"], "content": _content(m.get("content"), i)}
        for key in ("tool_calls", "tool_call_id", "name", "reasoning_content"):  # tool turns, as the template wants them
            if m.get(key) is not None:
                msg[key] = m[key]
        if msg.get("tool_calls") is not None and not isinstance(msg["tool_calls"], list):
            raise bad_request(f"messages[{i}].tool_calls must be a list", "messages")
        out.append(msg)
    if _bool(body, "logprobs", False):
        params.logprobs = _number(body, "top_logprobs", 0, integer=True, lo=0, hi=MAX_TOP_LOGPROBS)
    elif body.get("top_logprobs") is not None:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    return ChatRequest(out, params)


def _content(content: Any, i: int) -> str:
    """A message's content as text: a string, null, or a list of {"type": "text", "text": ...} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content: only text parts are supported", "messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")
