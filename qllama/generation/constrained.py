"""Constrained decoding: a grammar decides which tokens may come next, through llguidance.

llguidance (guidance-ai, MIT; used by llama.cpp, vLLM and SGLang) compiles JSON schemas,
Lark grammars, regular expressions and llama.cpp's GBNF, and computes a bitmask over the
model's own vocabulary, given as bytes, for each step. Nothing here is a grammar engine:

- `llg_tokenizer(tokenizer)`: the vocabulary as llguidance sees it, built once per tokenizer
  (every token's bytes; control tokens as b"\\xff" + their text, so that no grammar can produce
  them as text; the end-of-generation ids as llguidance's EOS set).
- `compile_grammar(kind, text)`: one of "json_schema", "json_object", "regex", "lark", "gbnf"
  to llguidance's grammar, checked against the vocabulary (a `GrammarError` says why not).
- `Constraint(tokenizer, grammar)`: one matcher; `mask(logits)` sets the disallowed ids to
  -inf (in place) before the sampler chain, `advance(token)` moves past a sampled token.
  A `ConstrainedSampler` does both around the sampler chain, so every token source goes
  through it: plain decoding, prompt lookup (each draft row is masked after the
  previous accepted token, so a draft the grammar forbids is never taken) and the server's slots
  (one Constraint per request).

JSON schemas compile with bounded whitespace (", " and ": " separators, no free whitespace):
a small model given free whitespace may write newlines forever; a schema's own "x-guidance"
options override this. An optional dependency: `pip install 'qllama[structured]'`.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ..errors import QllamaError
from .sampling import Sampler

JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf")


class GrammarError(QllamaError):
    """A grammar or schema that cannot be compiled, or a constraint that cannot go on."""


def available() -> bool:
    """Whether llguidance can be imported (constrained decoding is possible)."""
    try:
        _llguidance()
        return True
    except GrammarError:
        return False


def _llguidance():
    try:
        import llguidance  # noqa: F401
        import llguidance.numpy  # noqa: F401
    except ImportError:
        raise GrammarError("constrained decoding needs llguidance: pip install 'qllama[structured]' "
                           "(or pip install llguidance)") from None
    return llguidance


class _VocabWrapper:
    """The tokenizer protocol llguidance's `TokenizerWrapper` reads: token bytes, ids, encode."""

    def __init__(self, tokenizer, tokens: list[bytes]):
        self._tok = tokenizer
        self.tokens = tokens
        eog = sorted(tokenizer.eog_ids)
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else (eog[0] if eog else 0)
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = [i for i, t in enumerate(tokens) if t[:1] == b"\xff"]

    def __call__(self, text):
        if isinstance(text, bytes):  # llguidance probes whether bytes are taken: they are not
            raise TypeError("str only")
        spm = getattr(self._tok, "_spm", None)
        if spm is not None:  # as the bytes come, without SentencePiece's dummy-prefix space
            return spm.encode(text.replace(" ", "\u2581"))
        return self._tok.encode(text, add_bos=False)


def llg_tokenizer(tokenizer):
    """llguidance's LLTokenizer for a qllama Tokenizer, built once and kept on it."""
    cached = getattr(tokenizer, "_llg_tokenizer", None)
    if cached is not None:
        return cached
    llg = _llguidance()
    tokens = []
    for i in range(tokenizer.n_vocab):
        b = tokenizer.token_bytes(i)
        if not b and (tokenizer.is_control(i) or i in tokenizer.eog_ids):
            b = b"\xff" + tokenizer.token_bytes(i, special=True)  # llguidance's mark of a special token
        tokens.append(b)
    eog = sorted(tokenizer.eog_ids) or None
    lltok = llg.LLTokenizer(llg.TokenizerWrapper(_VocabWrapper(tokenizer, tokens)), n_vocab=tokenizer.n_vocab,
                            eos_token=eog)
    tokenizer._llg_tokenizer = lltok
    return lltok


def compile_grammar(kind: str, spec: Any, tokenizer=None) -> str:
    """llguidance's grammar for `spec` of one of KINDS: a JSON schema (dict or JSON text), None for
    "json_object" (any object) or a schema, a regex, a Lark or a GBNF text. With a tokenizer, the
    grammar is also checked against its vocabulary. Raises GrammarError with the reason."""
    llg = _llguidance()
    from llguidance import LLMatcher

    try:
        if kind in ("json_schema", "json_object"):
            if kind == "json_object" and spec is None:
                spec = {"type": "object"}
            if isinstance(spec, str):
                try:
                    spec = json.loads(spec)
                except ValueError as e:
                    raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(spec, dict):
                raise GrammarError("a JSON schema must be a JSON object")
            grammar = LLMatcher.grammar_from_json_schema(bound_integers(spec), defaults=JSON_DEFAULTS)
        elif kind in ("regex", "lark", "gbnf"):
            if not isinstance(spec, str) or not spec.strip():
                raise GrammarError(f"the {kind} grammar must be a non-empty string")
            grammar = llg.grammar_from(kind, spec)
        else:
            raise GrammarError(f"unknown grammar kind {kind!r} (one of {', '.join(KINDS)})")
    except ValueError as e:
        raise GrammarError(f"the {kind.replace('_', ' ')} cannot be compiled: {e}") from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(
        grammar, llg_tokenizer(tokenizer) if tokenizer is not None else None)
    if is_error:
        raise GrammarError(f"the {kind.replace('_', ' ')} cannot be compiled: {_first_line(messages[0])}")
    return grammar


INT_DIGITS = 16  # an integer without bounds gets at most this many digits, as llama.cpp's schema grammars


def bound_integers(schema: Any) -> Any:
    """A copy of `schema` in which every integer without a minimum or maximum gets +-(10^16 - 1),
    as llama.cpp's JSON-schema grammars allow 16 digits: a small model can otherwise write digits
    until max_tokens and leave invalid JSON."""
    if isinstance(schema, list):
        return [bound_integers(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bound_integers(v) for k, v in schema.items()}
    if out.get("type") == "integer" and "enum" not in out and "const" not in out:
        big = 10 ** INT_DIGITS - 1
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -big
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = big
    return out


def _first_line(msg: str, limit: int = 400) -> str:
    s = " ".join(str(msg).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


class Constraint:
    """One grammar's state while generating: which tokens may come next.

    `mask(logits)` writes -inf into the disallowed entries (in place; ids beyond the vocabulary
    the grammar knows are disallowed too); `advance(token)` moves past a chosen token. A state in
    which no token is allowed, or a token the grammar refuses, raises GrammarError.
    """

    def __init__(self, tokenizer, grammar: str):
        llg = _llguidance()
        self.lltok = llg_tokenizer(tokenizer)
        self.matcher = llg.LLMatcher(self.lltok, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar cannot be used: {_first_line(self.matcher.get_error())}")
        self._fill = llg.numpy.fill_next_token_bitmask
        self._bitmask = llg.numpy.allocate_token_bitmask(1, self.lltok.vocab_size)
        self.n_tokens = 0  # tokens advanced past

    @classmethod
    def from_spec(cls, tokenizer, kind: str, spec: Any) -> "Constraint":
        return cls(tokenizer, compile_grammar(kind, spec, tokenizer))

    def allowed(self, n: int) -> np.ndarray:
        """(n,) bool: the ids allowed next."""
        self._fill(self.matcher, self._bitmask)
        if self.matcher.is_error():
            raise GrammarError(f"constrained decoding failed: {_first_line(self.matcher.get_error())}")
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        out = np.zeros(n, dtype=bool)
        m = min(n, bits.shape[0])
        out[:m] = bits[:m]
        return out

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """Set disallowed ids of logits (n_vocab,) to -inf, in place; returns logits."""
        ok = self.allowed(logits.shape[0])
        if not ok.any():
            raise GrammarError("the grammar allows no token here (it matches nothing the vocabulary can spell)")
        logits[~ok] = -np.inf
        return logits

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise GrammarError(f"the grammar refused token {int(token)}: {_first_line(self.matcher.get_error())}")
        self.n_tokens += 1

    def check_start(self) -> None:
        """Raise GrammarError if no token at all can start the output (a grammar matching nothing)."""
        ok = self.allowed(self.lltok.vocab_size)
        eos = set(self.lltok.eos_tokens) if hasattr(self.lltok, "eos_tokens") else {self.lltok.eos_token}
        if not ok.any() or (all(int(i) in eos for i in np.flatnonzero(ok)) and not self.matcher.is_accepting()):
            raise GrammarError("the grammar matches nothing the vocabulary can spell")

    @property
    def done(self) -> bool:
        """Only an end of generation can follow (the grammar is complete)."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()


def response_format_grammar(rf: Any) -> tuple[str, Any] | None:
    """OpenAI's `response_format` as (kind, spec) for `compile_grammar`, or None for plain text.

    {"type": "text"}; {"type": "json_object"} (llama-server: an optional "schema" in it);
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}} (the schema is enforced
    whether `strict` or not, as llama-server does). Raises GrammarError for another shape."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise GrammarError("'response_format' must be an object")
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        schema = rf.get("schema")
        return ("json_object", schema)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise GrammarError("'response_format.json_schema' must be an object with a 'schema'")
        schema = js.get("schema", rf.get("schema"))
        if schema is None:
            schema = {"type": "object"}
        if not isinstance(schema, dict):
            raise GrammarError("'response_format.json_schema.schema' must be an object")
        return ("json_schema", schema)
    raise GrammarError(f"unknown response_format type {kind!r} (text, json_object or json_schema)")


def constraint_for(tokenizer, *, response_format: Any = None, grammar: str | None = None,
                   json_schema: Any = None, regex: str | None = None) -> Constraint | None:
    """The Constraint asked for by the API's options (at most one of them), or None."""
    given = [(k, v) for k, v in (("response_format", response_format), ("grammar", grammar),
                                 ("json_schema", json_schema), ("regex", regex)) if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise GrammarError(f"give one of response_format, grammar, json_schema and regex, not {' and '.join(k for k, _ in given)}")
    key, value = given[0]
    if key == "response_format":
        spec = response_format_grammar(value)
        if spec is None:
            return None
        kind, value = spec
    else:
        kind = {"grammar": "gbnf", "json_schema": "json_schema", "regex": "regex"}[key]
    c = Constraint.from_spec(tokenizer, kind, value)
    c.check_start()
    return c



class ConstrainedSampler(Sampler):
    """A Sampler whose distribution is masked by a Constraint before the chain runs.

    Tokens accepted before the first draw are the prompt (the repeat penalty's history); every
    token accepted after it is output and advances the constraint. Every token source (plain
    decoding, prompt lookup's draft rows, the server's slots) samples through `distribution` and
    records through `accept`, so each obeys the grammar; a lookup draft the grammar forbids has
    probability 0 in its row and is refused like any other.
    """

    def __init__(self, params, constraint: Constraint):
        super().__init__(params)
        self.constraint = constraint
        self._drawing = False  # True from the first draw on

    def distribution(self, logits):
        self._drawing = True
        masked = self.constraint.mask(np.array(logits, dtype=np.float32))
        return super().distribution(masked)

    def accept(self, token: int) -> None:
        super().accept(token)
        if self._drawing:
            self.constraint.advance(token)


def constrained_sampler(params, constraint: "Constraint | None") -> Sampler:
    """A Sampler for `params` whose choices obey `constraint` (None: a plain Sampler)."""
    return Sampler(params) if constraint is None else ConstrainedSampler(params, constraint)


def read_spec(value: str, what: str) -> str:
    """A command-line grammar argument: the text itself when it looks inline (a JSON schema that
    starts with "{"), else the file it names. Raises GrammarError if the file cannot be read."""
    if what == "json schema" and value.lstrip().startswith("{"):
        return value
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise GrammarError(f"cannot read the {what} file {value}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise GrammarError(f"the {what} file {value} is not UTF-8 text") from None
