"""Tool calls in OpenAI's shape over each model family's own call syntax (llama.cpp's
common/chat.cpp is the map), and reasoning kept apart from the answer.

Formats, picked from the chat template's source as llama.cpp does:

    hermes   Qwen 2.5/3, Hermes:   <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
    llama3   Llama 3.x:            {"name": ..., "parameters": {...}}  (or after <|python_tag|>)
    mistral  Mistral Nemo/Small:   [TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}]
    phi4     Phi-4-mini:           functools[{"name": ..., "arguments": {...}}]
    harmony  gpt-oss:              <|channel|>commentary to=functions.NAME ...<|message|>{...}<|call|>
             (parsed, not constrained; its analysis channel is the reasoning)
    generic  templates without tool support (llama-server's fallback): the tools are described in
             the system message and the whole answer is JSON, {"tool_calls": [...]} or
             {"response": "..."}, always constrained to that schema.

With `tool_choice` "required" or a named function, decoding is constrained to a valid call
(`call_grammar`: the family's syntax around each function's JSON schema, through llguidance);
with "auto" a native format is a lazy grammar (free text until the family's trigger, then only a
valid call: `lazy_grammar`), the generic one stays constrained. `ChatPost` splits a reply (whole or streamed) into reasoning, content and calls.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from .schemas import bad_request

FORMATS = ("hermes", "llama3", "mistral", "phi4", "generic")


# -- requests -------------------------------------------------------------------------------------

@dataclass
class ToolRequest:
    tools: list[dict]  # OpenAI's [{"type": "function", "function": {name, description, parameters}}]
    choice: str = "auto"  # "auto" | "none" | "required" | "named"
    name: str | None = None  # the function, when choice is "named"
    parallel: bool = True

    @property
    def functions(self) -> list[dict]:
        return [t["function"] for t in self.tools]

    def chosen(self) -> list[dict]:
        return [f for f in self.functions if self.choice != "named" or f["name"] == self.name]


def parse_tools(body: dict) -> ToolRequest | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat request (400s name the field)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise bad_request(f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -", "tools")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    names = [t["function"]["name"] for t in out]
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    req = ToolRequest(out, parallel=parallel)
    if choice is None or choice in ("auto", "none", "required"):
        req.choice = choice or "auto"
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools "
                              f"({', '.join(names)})", "tool_choice")
        req.choice, req.name = "named", name
    else:
        raise bad_request("'tool_choice' must be 'auto', 'none', 'required' or "
                          "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    return req


# -- formats ---------------------------------------------------------------------------------------

def detect_format(template_source: str | None) -> str:
    """The family's call syntax from its chat template's source (generic when it has none)."""
    src = template_source or ""
    if "tools" not in src and "tool_calls" not in src:
        return "generic"
    if "<|channel|>" in src:
        return "harmony"  # gpt-oss: calls are commentary messages to=functions.NAME (parsed, not constrained)
    if "<tool_call>" in src:
        return "hermes"
    if "[TOOL_CALLS]" in src:
        return "mistral"
    if "functools[" in src:
        return "phi4"
    if "<|python_tag|>" in src or ("ipython" in src and "parameters" in src):
        return "llama3"
    return "generic"


GENERIC_PROMPT = (
    "You can call these tools (JSON schemas of their arguments):\n{tools}\n\n"
    "Respond in JSON only: {{\"tool_calls\": [{{\"name\": <tool name>, \"arguments\": <arguments object>}}]}} "
    "to call tools, or {{\"response\": <your answer>}} to answer the user."
)


def prepare_messages(messages: list[dict], fmt: str, req: ToolRequest | None) -> list[dict]:
    """Messages as the template wants them: assistant `tool_calls` with arguments as objects (HF
    templates write them with `tojson`); for the generic format, the tools in the system message,
    calls as the JSON the model writes and tool results as user messages."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for c in calls:
                fn = dict(c.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args) if args.strip() else {}
                    except ValueError:
                        pass
                fixed.append({**c, "function": fn, "name": fn.get("name"), "arguments": fn.get("arguments")})
            m["tool_calls"] = fixed
            if fmt == "generic":
                m = {"role": "assistant", "content": json.dumps(
                    {"tool_calls": [{"name": c["name"], "arguments": c["arguments"]} for c in fixed]}, ensure_ascii=False)}
        if m.get("role") == "tool" and fmt == "generic":
            m = {"role": "user", "content": json.dumps({"tool_response": {"tool": m.get("name") or m.get("tool_call_id"),
                                                                         "response": m.get("content")}}, ensure_ascii=False)}
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    if fmt == "generic" and req is not None:
        desc = "\n".join(json.dumps({"name": f["name"], "description": f.get("description", ""),
                                     "parameters": f["parameters"]}, ensure_ascii=False) for f in req.chosen())
        text = GENERIC_PROMPT.format(tools=desc)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": (out[0].get("content") or "") + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _call_schema(f: dict, args_key: str = "arguments", with_id: bool = False) -> dict:
    props = {"name": {"const": f["name"]}, args_key: f["parameters"]}
    required = ["name", args_key]
    if with_id:
        props["id"] = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}
        required.append("id")
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _one_of(schemas: list[dict]) -> dict:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _lark_lit(text: str, tokenizer) -> str:
    """A literal in llguidance's Lark: a control token by id (it has no spelling), else a string."""
    if tokenizer is not None:
        tid = tokenizer.token_id(text)
        if tid is not None and tokenizer.is_control(tid):
            return f"<[{tid}]>"
    return json.dumps(text)


def call_grammar(fmt: str, req: ToolRequest, tokenizer=None) -> tuple[str, Any] | None:
    """(kind, spec) constraining the answer to valid calls, or None when decoding stays free:
    "required" / a named function in every format; "auto" in the generic one (a call or a response)."""
    if req.choice == "none" or fmt == "harmony":
        return None
    fns = req.chosen()
    constrained = req.choice in ("required", "named")
    if fmt == "generic":
        calls = {"type": "array", "items": _one_of([_call_schema(f) for f in fns]), "minItems": 1}
        if not req.parallel:
            calls["maxItems"] = 1
        call_obj = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
                    "additionalProperties": False}
        if constrained:
            return "json_schema", call_obj
        answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                  "additionalProperties": False}
        return "json_schema", {"anyOf": [call_obj, answer]}
    if not constrained:
        return lazy_grammar(fmt, req, tokenizer)
    if fmt == "llama3":
        return "json_schema", _one_of([_call_schema(f, "parameters") for f in fns])
    from ..generation.constrained import JSON_DEFAULTS

    # in Lark, %json takes the whitespace options in the schema (bounded, as for response_format)
    one = json.dumps({**_one_of([_call_schema(f, with_id=(fmt == "mistral")) for f in fns]), "x-guidance": JSON_DEFAULTS})
    many = "+" if req.parallel else ""
    if fmt == "hermes":
        lark = f'start: call{many}\ncall: "<tool_call>\\n" %json {one} "\\n</tool_call>" "\\n"?\n'
        return "lark", lark
    if fmt in ("mistral", "phi4"):
        items = {"type": "array", "items": json.loads(one), "minItems": 1, "x-guidance": JSON_DEFAULTS}
        if not req.parallel:
            items["maxItems"] = 1
        head = _lark_lit("[TOOL_CALLS]", tokenizer) if fmt == "mistral" else json.dumps("functools")
        return "lark", f"start: {head} %json {json.dumps(items)}\n"
    return None


def lazy_grammar(fmt: str, req: ToolRequest, tokenizer=None) -> tuple[str, Any] | None:
    """"auto" in a native format, as llama.cpp's lazy grammars: free text, but from the family's
    trigger on, only valid calls. One llguidance Lark grammar: free text is a lexeme that never
    contains the trigger; the text up to and including the trigger is another lexeme, so the two
    split where the trigger appears (Hermes); formats whose calls open the answer (Llama 3 JSON,
    Mistral, Phi-4-mini) take either free text not starting like a call, or the calls."""
    from ..generation.constrained import JSON_DEFAULTS

    fns = req.chosen()
    one = json.dumps({**_one_of([_call_schema(f, "parameters" if fmt == "llama3" else "arguments",
                                              with_id=(fmt == "mistral")) for f in fns]), "x-guidance": JSON_DEFAULTS})
    if fmt == "hermes":
        more = '\nmore: "\\n<tool_call>\\n" call "\\n</tool_call>"' if req.parallel else ""
        return "lark", (f'start: PLAIN | PRE call "\\n</tool_call>"{" more*" if req.parallel else ""}\n'
                        f"call: %json {one}{more}\n"
                        "PLAIN: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/\n"
                        "PRE: /(?s:.*<tool_call>\\n)/ & ~/(?s:.*<tool_call>.*<tool_call>.*)/\n")
    if fmt == "llama3":
        return "lark", f"start: PLAIN | call\ncall: %json {one}\nPLAIN: /(?s:[^{{ \\t\\n].*)?/\n"
    if fmt in ("mistral", "phi4"):
        items = {"type": "array", "items": json.loads(one), "minItems": 1, "x-guidance": JSON_DEFAULTS}
        if not req.parallel:
            items["maxItems"] = 1
        if fmt == "mistral":
            head = _lark_lit("[TOOL_CALLS]", tokenizer)
            plain = "/(?s:[^\\[ \\t\\n].*)?/" if not head.startswith("<[") else "/(?s:.*)/"
        else:
            head, plain = json.dumps("functools"), "/(?s:.*)/ & ~/(?s:functools.*)/"
        return "lark", f"start: PLAIN | {head} calls\ncalls: %json {json.dumps(items)}\nPLAIN: {plain}\n"
    return None


# -- replies ---------------------------------------------------------------------------------------

def new_call_id(fmt: str | None = None) -> str:
    """A call id: Mistral's templates want 9 letters and digits, others take OpenAI's call_... form."""
    if fmt == "mistral":
        alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
        return "".join(secrets.choice(alphabet) for _ in range(9))
    return "call_" + secrets.token_hex(12)


def _as_call(obj: Any, args_keys=("arguments", "parameters")) -> dict | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):
        obj = {**obj["function"], "id": obj.get("id")}
    name = obj.get("name")
    if not isinstance(name, str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return {"id": obj.get("id") if isinstance(obj.get("id"), str) and obj.get("id") else new_call_id(),
            "type": "function",
            "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}


def _builtin_call(text: str) -> dict | None:
    """Llama 3.1's built-in tool call after <|python_tag|>, `brave_search.call(query="...")`, as
    an OpenAI call (llama.cpp's common/chat.cpp reads it the same way); None if it is not one."""
    import ast

    m = re.fullmatch(r"([A-Za-z_]\w*)\.call\((.*)\)\s*;?", text.strip(), re.S)
    if m is None:
        return None
    try:
        call = ast.parse(f"f({m.group(2)})", mode="eval").body
        if not isinstance(call, ast.Call) or call.args:
            return None
        args = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg is not None}
    except (SyntaxError, ValueError):
        return None
    return _as_call({"name": m.group(1), "arguments": args})


def _json_values(text: str) -> list[Any] | None:
    """Every JSON value in text, one after another (separated by whitespace or ';'), or None."""
    dec = json.JSONDecoder()
    out, i, n = [], 0, len(text)
    while True:
        while i < n and text[i] in " \t\r\n;":
            i += 1
        if i >= n:
            return out
        try:
            v, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(v)


def parse_calls(fmt: str, text: str) -> tuple[str, list[dict]]:
    """(content, tool calls) of a whole reply in the family's syntax; text that does not parse as
    calls stays content, as llama-server leaves it."""
    if fmt == "hermes":
        calls, rest, pos = [], [], 0
        for m in re.finditer(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.S):
            vals = _json_values(m.group(1))
            parsed = [c for c in (_as_call(v) for v in vals or []) if c]
            if not parsed:
                continue
            rest.append(text[pos:m.start()])
            pos = m.end()
            calls += parsed
        rest.append(text[pos:])
        return "".join(rest).strip() if calls else text, calls
    if fmt == "generic":
        vals = _json_values(text.strip())
        if vals is None and re.match(r'\s*\{\s*"response"\s*:\s*"', text):  # cut by max_tokens: the text so far
            for end in ('"}', '\\"}', '}'):
                vals = _json_values(text.strip() + end)
                if vals is not None:
                    break
        if vals and len(vals) == 1 and isinstance(vals[0], dict):
            v = vals[0]
            if "response" in v and isinstance(v["response"], str):
                return v["response"], []
            items = v.get("tool_calls") or ([v["tool_call"]] if "tool_call" in v else [])
            calls = [c for c in (_as_call(x) for x in items if isinstance(items, list)) if c]
            if calls:
                return "", calls
        return text, []
    body = text.strip()
    head, found = "", None
    for marker in ("<|python_tag|>", "[TOOL_CALLS]", "functools"):
        i = body.find(marker)
        if i >= 0 and (marker != "functools" or body[i + len(marker):].lstrip().startswith("[")):
            head, body, found = body[:i].strip(), body[i + len(marker):].strip(), marker
            break
    else:
        if not body.startswith(("{", "[")):
            return text, []
    if found == "<|python_tag|>":
        builtin = _builtin_call(body)  # Llama 3.1's built-in tools: name.call(key=value, ...)
        if builtin is not None:
            return head, [builtin]
    vals = _json_values(body)
    if not vals:
        return text, []
    items: list = []
    for v in vals:
        items.extend(v if isinstance(v, list) else [v])
    calls = [_as_call(x) for x in items]
    if not calls or any(c is None for c in calls):
        return text, []
    return head, calls  # type: ignore[return-value]


TRIGGERS = {"hermes": ["<tool_call>"], "mistral": ["[TOOL_CALLS]"], "phi4": ["functools["],
            "llama3": ["<|python_tag|>"], "generic": []}
START_TRIGGERS = {"llama3": ["{"], "mistral": ["[{"], "phi4": [], "hermes": [], "generic": []}


def _held(text: str, stops) -> int:
    from ..generation.text import held_back

    return held_back(text, stops)


_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def _json_end(text: str, start: int) -> int:
    """The index just past the JSON object or array that starts at text[start], or -1 while it is
    not complete (strings and escapes respected)."""
    if start >= len(text) or text[start] not in "{[":
        return -1
    depth, i, n, in_str = 0, start, len(text), False
    while i < n:
        ch = text[i]
        if in_str:
            if ch == "\\":
                i += 1
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


_RESPONSE = re.compile(r'\s*\{\s*"response"\s*:\s*"')


def _json_string_prefix(body: str) -> str:
    """The decoded text of a JSON string's body as far as it is known: up to the closing quote,
    and short of an escape sequence still arriving."""
    i, n = 0, len(body)
    while i < n:
        ch = body[i]
        if ch == '"':
            break
        if ch == "\\":
            need = 6 if body[i + 1:i + 2] == "u" else 2
            if i + need > n:
                break
            i += need
            continue
        i += 1
    try:
        return json.loads('"' + body[:i] + '"')
    except ValueError:
        return ""


_HARMONY_HEAD = re.compile(r"<\|channel\|>(\w+)([^<]*)(?:<\|constrain\|>[^<]*)?<\|message\|>")
_HARMONY_OTHER = re.compile(r"<\|(?:end|call|return)\|>|<\|start\|>[^<]*(?=<\|)")


@dataclass
class ChatPost:
    """Splits a chat reply into reasoning, content and tool calls, as the text comes.

    reasoning: `<think>...</think>` becomes reasoning_content (thinking_open: the prompt already
    opened it, as DeepSeek-R1's template does); tools: the format when the request has tools
    (the text from a call's trigger on is held and parsed at the end; the generic format holds
    the whole reply, which is JSON).
    """

    reasoning: bool = True
    thinking_open: bool = False
    fmt: str | None = None
    harmony: bool = False  # gpt-oss's channels: analysis -> reasoning, final -> content, functions.* -> calls
    _buf: str = ""  # text not yet sorted
    _channel: str | None = None  # harmony: the channel of the current message
    _recipient: str = ""  # harmony: its recipient (to=functions.NAME for a call)
    _hcalls: list = field(default_factory=list)  # harmony: [name, arguments text]
    _in_think: bool = False
    _after_think: bool = False
    _started: bool = False  # a non-space character was seen
    _content: str = ""  # the content so far (for the tool parser)
    _sent: int = 0  # content characters sent
    _capture: int = -1  # where a call starts in _content (-1: none yet)
    _resp_text: str = ""  # generic format: the response string decoded so far (sent)
    _resp_sent: int = 0
    _streamed: list = field(default_factory=list)  # calls sent as they came: {"id", "name", "sent" (argument chars)}
    reasoning_text: list[str] = field(default_factory=list)

    def __post_init__(self):
        self._in_think = self.reasoning and self.thinking_open

    def open_thinking(self) -> None:
        """The prompt ends inside <think>: the reply starts as reasoning."""
        self.thinking_open = self._in_think = self._started = True

    def feed(self, text: str) -> list[dict]:
        """Deltas ({"reasoning_content": ...} / {"content": ...}) that can go out now."""
        if self.harmony:
            return self._harmony(text)
        out: list[dict] = []
        self._buf += text
        while self._buf:
            if self._in_think:
                i = self._buf.find("</think>")
                if i < 0:
                    keep = _held(self._buf, ["</think>"])
                    part, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                    if part:
                        out.append({"reasoning_content": part})
                        self.reasoning_text.append(part)
                    break
                if i:
                    out.append({"reasoning_content": self._buf[:i]})
                    self.reasoning_text.append(self._buf[:i])
                self._buf = self._buf[i + len("</think>"):]
                self._in_think = False
                self._after_think = True
                continue
            if self.reasoning and not self._started:
                s = self._buf.lstrip()
                if not s:
                    break
                if "<think>".startswith(s) and len(s) < len("<think>"):
                    break  # may still become <think>
                if s.startswith("<think>"):
                    self._buf = s[len("<think>"):]
                    self._in_think = True
                    self._started = True
                    continue
            self._started = True
            part, self._buf = self._buf, ""
            if self._after_think:  # the blank lines after </think> are neither
                part = part.lstrip("\n")
                self._after_think = not part
            out += self._content_deltas(part)
        return out

    def _content_deltas(self, part: str) -> list[dict]:
        self._content += part
        if self.fmt is None:
            self._sent = len(self._content)
            return [{"content": part}] if part else []
        if self.fmt == "generic":
            return self._generic_response() + self._call_deltas()
        if self._capture >= 0:
            return self._call_deltas()
        c = self._content
        s = c.lstrip()
        if not s:
            return []
        starts = START_TRIGGERS.get(self.fmt, [])
        if self._sent == 0 and any(t.startswith(s) and len(s) < len(t) for t in starts):
            return []  # could still open a call
        if self._sent == 0 and any(s.startswith(t) for t in starts):
            self._capture = len(c) - len(s)
            return self._call_deltas()
        triggers = TRIGGERS.get(self.fmt, [])
        hits = [i for i in (c.find(t, self._sent) for t in triggers) if i >= 0]
        if hits:
            self._capture = min(hits)
            end = self._capture
        else:
            end = len(c) - _held(c, triggers)
        delta = c[self._sent:end]
        self._sent = max(self._sent, end)
        return ([{"content": delta}] if delta else []) + (self._call_deltas() if self._capture >= 0 else [])

    def _call_region(self) -> str | None:
        """The text holding the calls (from the trigger on), or None while there is none."""
        if self.fmt == "generic":
            s = self._content.lstrip()
            return s if re.match(r'\{\s*"tool_calls?"', s) else None
        return self._content[self._capture:] if self._capture >= 0 else None

    def _call_deltas(self, final: bool = False) -> list[dict]:
        """OpenAI's streamed calls: a call's id and name as soon as its name is known, then its
        arguments as they come (the model's JSON text). Calls whose JSON puts "name" first (every
        constrained call does); the others are sent whole at the end."""
        region = self._call_region()
        if region is None:
            return []
        out = []
        for k, m in enumerate(_CALL_HEAD.finditer(region)):
            if k >= len(self._streamed):
                try:
                    name = json.loads('"' + m.group(1) + '"')
                except ValueError:
                    break
                self._streamed.append({"id": new_call_id(self.fmt), "name": name, "sent": 0})
                out.append({"tool_calls": [{"index": k, "id": self._streamed[k]["id"], "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})
            end = _json_end(region, m.end())
            args = region[m.end():end] if end >= 0 else region[m.end():]
            new = args[self._streamed[k]["sent"]:]
            if new:
                self._streamed[k]["sent"] += len(new)
                out.append({"tool_calls": [{"index": k, "function": {"arguments": new}}]})
        return out

    def _harmony(self, text: str, final: bool = False) -> list[dict]:
        """gpt-oss: <|channel|>NAME[ to=RECIPIENT][<|constrain|>json]<|message|>TEXT(<|end|>|<|call|>)
        messages, each after <|start|>assistant; text before any header is content."""
        out: list[dict] = []
        if not self.reasoning:  # reasoning_format none: the text as generated, markers included
            return [{"content": text}] if text else []
        self._buf += text

        def emit(part: str) -> None:
            if not part:
                return
            if self._recipient.startswith("functions."):
                self._hcalls[-1][1] += part
            elif self._channel == "analysis":
                out.append({"reasoning_content": part})
                self.reasoning_text.append(part)
            else:  # final, commentary to the user, or text before any header
                out.append({"content": part})

        while self._buf:
            i = self._buf.find("<|")
            if i < 0:
                keep = 1 if self._buf.endswith("<") and not final else 0  # may open a marker
                emit(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            emit(self._buf[:i])
            self._buf = self._buf[i:]
            m = _HARMONY_HEAD.match(self._buf)
            if m:
                to = re.search(r"to=([^\s<]+)", m.group(2))
                self._channel, self._recipient = m.group(1), to.group(1) if to else ""
                if self._recipient.startswith("functions."):
                    self._hcalls.append([self._recipient[len("functions."):], ""])
                self._buf = self._buf[m.end():]
                continue
            m = _HARMONY_OTHER.match(self._buf)
            if m:
                if m.group(0) in ("<|end|>", "<|call|>", "<|return|>"):
                    self._channel, self._recipient = None, ""
                self._buf = self._buf[m.end():]
                continue
            if not final and len(self._buf) < 256:
                break  # a marker still arriving
            emit(self._buf[:2])  # not a marker: text
            self._buf = self._buf[2:]
        return out

    def finish(self) -> tuple[list[dict], list[dict]]:
        """(the last deltas, the tool calls) at the end of the reply."""
        if self.harmony:
            out = self._harmony("", final=True)
            calls = [c for c in (_as_call({"name": n, "arguments": a.strip() or "{}"}) for n, a in self._hcalls) if c]
            return out, calls
        out: list[dict] = []
        if self._buf:
            if self._in_think:
                out.append({"reasoning_content": self._buf})
                self.reasoning_text.append(self._buf)
            else:
                self._started = True
                self._content += self._buf
            self._buf = ""
        if self.fmt is None:
            rest = self._content[self._sent:]
            self._sent = len(self._content)
            return out + ([{"content": rest}] if rest else []), []
        start = self._capture if self._capture >= 0 else (0 if self.fmt == "generic" else len(self._content))
        if self.fmt == "generic":
            start = self._sent
        tail = self._content[start:]
        content, calls = parse_calls(self.fmt, tail) if tail.strip() else (tail, [])
        if self.fmt == "generic" and not calls:
            if self._resp_sent:  # the response was streamed: only what is left of it
                content = content[self._resp_sent:] if content.startswith(self._resp_text) else ""
        if content:
            out.append({"content": content})
        out += self._call_deltas(final=True)
        streamed = len(self._streamed)
        for k, call in enumerate(calls):
            if k < streamed:  # sent as it came: the reply keeps the id the client has
                call["id"] = self._streamed[k]["id"]
            else:
                out.append({"tool_calls": [{"index": k, **call}]})
        return out, calls

    def _generic_response(self) -> list[dict]:
        """The generic format's {"response": "..."}, streamed as its string decodes."""
        m = _RESPONSE.match(self._content)
        if not m:
            return []
        text = _json_string_prefix(self._content[m.end():])
        new = text[len(self._resp_text):] if text.startswith(self._resp_text) else ""
        self._resp_text = text
        self._resp_sent = len(text)
        return [{"content": new}] if new else []

    def message(self, text: str) -> tuple[str | None, str | None, list[dict]]:
        """A whole reply: (reasoning_content or None, content, tool calls)."""
        deltas = self.feed(text)
        last, calls = self.finish()
        content = "".join(d.get("content", "") for d in deltas + last)
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas + last)
        return (reasoning or None), content, calls
