"""The Python API: `qllama.load(path)` gives a `Model` that tokenizes, evaluates and generates."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np

from .errors import QllamaError
from .generation.sampling import Sampler, SamplingParams, sampling_params
from .generation.session import Chunk, Session, Timings, stream_generate
from .gguf.reader import GGUFFile
from .models import build_model, read_args
from .qtensor import PROMPT_MIN_TOKENS, resolve_threads
from .tokenizer import Tokenizer

if TYPE_CHECKING:  # imported where used: the chat package is not needed to load a model
    from .chat import ChatTemplate, PromptFormat


def load(
    path: str | os.PathLike,
    *,
    n_ctx: int | None = None,
    n_threads: int | None = None,
    batch_size: int = 512,
    type_k: str | int | None = None,
    type_v: str | int | None = None,
    warmup_next: bool = False,
) -> "Model":
    """Open a GGUF model: maps the file, checks every tensor, builds the tokenizer and KV cache.

    n_ctx defaults to min(the model's context length, 4096); n_threads to the physical cores.
    type_k / type_v: the KV cache's key and value type, "f16" (the default, as llama.cpp's),
    "f32" (twice the memory) or a quantized type as llama.cpp's: "q8_0", "q4_0", "q4_1", "q5_0",
    "q5_1", "iq4_nl" (head size a multiple of 32); llama-cpp-python's ggml type ids (1 F16, 0 F32,
    8 Q8_0, 2 Q4_0, ...) work too.
    warmup_next: `warmup()` comes next; on a first run its compile workers then start up while
    the model loads (they exit by themselves if no warm-up comes).
    `path` may also be a model reference (`demo`, `org/repo[:QUANT]`, `org/repo/file.gguf`,
    `hf://...`): see `qllama.hub.refs`; it is downloaded into the Hugging Face cache if needed.
    """
    from .hub.refs import resolve

    return Model(resolve(path), n_ctx=n_ctx, n_threads=n_threads, batch_size=batch_size, type_k=type_k, type_v=type_v,
                 warmup_next=warmup_next)


class Model:
    """A loaded Llama-family model. Create it with `qllama.load`.

    Attributes: `metadata` (the GGUF key/values), `args` (ModelArgs), `tokenizer`, `n_ctx`,
    `n_vocab`, `last_timings` (Timings of the latest generation).
    """

    def __init__(self, path, *, n_ctx: int | None = None, n_threads: int | None = None, batch_size: int = 512,
                 type_k: str | int | None = None, type_v: str | int | None = None, warmup_next: bool = False):
        from .models.kvcache import kv_type

        t0 = time.perf_counter()
        self.kv_types = (kv_type(type_k), kv_type(type_v))  # checked before the file is opened
        self.path = os.fspath(path)
        self.gguf = GGUFFile(self.path)
        self.metadata: dict[str, Any] = self.gguf.metadata
        self.args = read_args(self.metadata)  # one error line for an unsupported architecture
        if n_ctx is None or n_ctx == 0:
            n_ctx = self.args.default_n_ctx()
        if n_ctx < 1:
            raise QllamaError(f"context size must be >= 1, got {n_ctx}")
        if n_threads is not None and n_threads < 1:
            raise QllamaError(f"thread count must be >= 1, got {n_threads}")
        from .runtime.memory import check_context

        check_context(self.args, n_ctx, batch_size, kv_types=self.kv_types)  # before anything n_ctx-sized is allocated
        self.n_threads = resolve_threads(n_threads)  # None: the physical cores
        from .runtime import compile_pool

        if warmup_next and compile_pool.default_workers() > 0 and not self.kernels_cached():
            compile_pool.prestart()  # the first run's compile workers start up while the model loads
        try:
            self.tokenizer = Tokenizer.from_gguf(self.gguf)
            self._model = build_model(self.gguf, self.args, n_ctx, batch_size)  # checks every tensor
        except BaseException:
            compile_pool.stop_prestarted()
            raise
        self._model.kv_types = self.kv_types
        self._model.n_threads = self.n_threads  # every forward round's count unless its caller names one
        self.weights = self._model.weights
        self.session = Session(self._model, batch_size=batch_size, adapt_threads=n_threads is None)  # default: adaptive decode threads
        self.load_s = time.perf_counter() - t0
        self.compile_s = 0.0  # seconds of the latest warmup()
        self.last_timings: Timings | None = None

    # -- properties --------------------------------------------------------------------------

    @property
    def n_ctx(self) -> int:
        """Context window (KV cache positions)."""
        return self._model.n_ctx

    @property
    def n_vocab(self) -> int:
        return self.args.n_vocab

    @property
    def forward_model(self):
        """The forward-pass object (`forward(ids, cache)`, `new_cache()`), e.g. for benchmarks."""
        return self._model

    # -- kernels ---------------------------------------------------------------------------

    def kernel_types(self) -> list[str]:
        """Type names of the model's matrices, e.g. ["q4_K", "q6_K"]: what its kernels are compiled for."""
        from .runtime.warmup import kernel_types

        return kernel_types(self.gguf)

    def kernels_cached(self) -> bool:
        """Whether the kernel cache already holds this model's kernels (then warmup() only loads them)."""
        from .runtime.warmup import is_warm

        return is_warm(self.kernel_types(), self.n_threads)

    def warmup(self) -> float:
        """Call every kernel of the forward pass once on a scratch cache: Numba compiles them (first
        run) or loads them from its disk cache. Returns the seconds it took; later timings then
        measure the model alone, and this is reported apart (`Timings.compile_s`)."""
        from .kernels.jit import CacheDirError, check_cache_dir
        from .runtime.warmup import mark_warm, warm_up

        try:
            check_cache_dir()
        except CacheDirError as exc:
            raise QllamaError(str(exc)) from None
        self.compile_s = warm_up(self._model)
        mark_warm(self.kernel_types(), self.n_threads)
        return self.compile_s

    # -- tokens ------------------------------------------------------------------------------

    def tokenize(self, text: str, add_bos: bool = True, parse_special: bool = False) -> list[int]:
        """Text to token ids. BOS is prepended when add_bos and the model's tokenizer adds one."""
        return self.tokenizer.encode(text, add_bos=add_bos and self.tokenizer.add_bos, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Token ids to text."""
        return self.tokenizer.decode(list(ids))

    # -- evaluation --------------------------------------------------------------------------

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits at every position of `ids`, float32 (len(ids), n_vocab), from an empty cache.

        Uses a cache of its own, so a generation in progress is not disturbed. The tokens are
        evaluated as a prompt (`forward(prompt=...)`: as llama.cpp evaluates a prompt or a
        perplexity chunk).
        """
        ids = [int(i) for i in ids]
        if not ids:
            raise QllamaError("logits() needs at least one token")
        if len(ids) > self.n_ctx:
            raise QllamaError(f"{len(ids)} tokens do not fit in the context of {self.n_ctx}")
        cache = self._model.new_cache()
        out = np.empty((len(ids), self.n_vocab), dtype=np.float32)
        bs, prompt = self.session.batch_size, len(ids) >= PROMPT_MIN_TOKENS
        for start in range(0, len(ids), bs):
            out[start : start + bs] = self._model.forward(ids[start : start + bs], cache, all_logits=True, prompt=prompt)
        return out

    # -- inside the forward pass: named points (qllama.models.points) ----------------------

    @property
    def hooks(self):
        """Hooks at the named points of every forward pass (logits, generate, stream, chat):
        `h = model.hooks.add("blk.5.ffn_out", fn)`, `fn(name, array, layer)` may return a
        replacement array; `h.remove()`. Point names and shapes: `qllama.models.points`."""
        from .models.points import Hooks, probe_of

        return Hooks(probe_of(self._model))

    def trace(self, capture: str | Sequence[str] = "*"):
        """Capture points while the block runs: `with model.trace(capture=["blk.*.resid"]) as t:
        model.logits(ids)`, then `t["blk.3.resid"]` (forward calls concatenated along tokens,
        `t.calls(name)` one array per call). Capturing attn_scores/attn_probs runs that layer's
        attention through NumPy (slower)."""
        from .models.points import Trace, probe_of

        return Trace(probe_of(self._model), capture)

    def logit_lens(self, prompt: str | Sequence[int], top_k: int = 5, position: int = -1):
        """For the embedding and each block, the top_k tokens the residual stream at `position`
        would predict through the final norm and output matrix (`qllama.lens.LensResult`)."""
        from .lens import logit_lens

        return logit_lens(self, prompt, top_k=top_k, position=position)

    # -- generation --------------------------------------------------------------------------

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 256,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] | str = (),
        add_bos: bool = True,
        parse_special: bool = False,
        lookup: int = 0,
        response_format: dict | None = None,
        grammar: str | None = None,
        json_schema: dict | str | None = None,
        **sampling_fields,
    ) -> Iterator[Chunk]:
        """Generate the continuation of `prompt` (text, or token ids as given) as `Chunk`s (text,
        token ids; a finish_reason on the last one). The one generation call: `generate`,
        `complete` and `chat` are thin over it.

        Sampling is one value, `sampling=SamplingParams(...)` (llama.cpp's defaults), or its fields
        as keywords (`temperature=0`, `top_k`, `top_p`, `min_p`, `repeat_penalty`, `repeat_last_n`,
        `presence_penalty`, `frequency_penalty`, `logit_bias`, `ignore_eos`, `seed`), which override
        the value's. temperature 0 is greedy; seed None is random. `stop`
        strings end generation and are not included; BOS is added when `add_bos` and the model asks
        for it; `parse_special` reads control tokens written in the prompt text. `lookup` N > 0
        drafts up to N tokens per forward from n-gram matches in the prompt and output
        (prompt-lookup decoding, `qllama.generation.lookup`): greedy output is unchanged, sampling
        keeps its distribution; faster when the output copies from the prompt. Timings are in
        `last_timings` afterwards.

        Constrained decoding (`pip install 'qllama[structured]'`, llguidance): `response_format`
        as OpenAI's ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema":
        ...}}), `json_schema` (a dict or JSON text) or `grammar` (llama.cpp's GBNF, or Lark): only
        tokens the grammar allows are sampled (`qllama.generation.constrained`); lookup drafts
        are checked against it. A grammar that cannot be compiled raises `GrammarError`.
        """
        if isinstance(prompt, str):
            ids = self.tokenize(prompt, add_bos=add_bos, parse_special=parse_special)
        else:
            ids = [int(i) for i in prompt]
        if max_tokens < 0:
            raise QllamaError(f"max_tokens must be >= 0, got {max_tokens}")
        if lookup < 0:
            raise QllamaError(f"lookup must be >= 0 draft tokens, got {lookup}")
        if isinstance(stop, str):
            stop = [stop]
        params = sampling_params(sampling, **sampling_fields)
        if response_format is None and grammar is None and json_schema is None:
            sampler = Sampler(params)
        else:
            from .generation.constrained import constrained_sampler, constraint_for

            constraint = constraint_for(self.tokenizer, response_format=response_format, grammar=grammar,
                                        json_schema=json_schema)
            sampler = constrained_sampler(params, constraint)
        timings = Timings(load_s=self.load_s, compile_s=self.compile_s)
        self.last_timings = timings
        return stream_generate(self.session, self.tokenizer, ids, sampler, max_tokens, stop, timings, lookup=lookup)

    def generate(self, prompt: str | Sequence[int], **options) -> Iterator[str]:
        """The text chunks of `stream(prompt, **options)`."""
        for chunk in self.stream(prompt, **options):
            if chunk.text:
                yield chunk.text

    def complete(self, prompt: str | Sequence[int], **options) -> str:
        """The whole continuation of `prompt` as one string (the options of `stream`)."""
        return "".join(self.generate(prompt, **options))

    # -- chat ------------------------------------------------------------------------------

    def _special_text(self, token_id: int | None) -> str:
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        if token_id is None or tokens is None or not 0 <= token_id < len(tokens):
            return ""
        return tokens[token_id]

    def chat_template(self, spec: str | os.PathLike | None = None) -> "ChatTemplate | None":
        """The chat template for this model, or None (then prompts are plain completion).

        `spec` asks for one: a built-in name ("llama-3", "chatml", "gemma", "phi-3", ... see
        `qllama.chat.BUILTIN_TEMPLATES`) or a Jinja file. Without it, the GGUF's own
        `tokenizer.chat_template`, and None when the file has none: no format is guessed from
        the vocabulary or the name, as in llama.cpp.
        """
        from .chat import ChatTemplate

        key = (isinstance(spec, str), os.fspath(spec)) if spec is not None else None  # a Path is always a file
        cached = getattr(self, "_chat_templates", {})
        if key not in cached:
            cached[key] = ChatTemplate.from_spec(spec) if spec is not None else ChatTemplate.from_metadata(self.metadata)
            self._chat_templates = cached
        return cached[key]

    def _require_chat_template(self, spec: str | os.PathLike | None, what: str = "chat") -> "ChatTemplate":
        from .chat import NoChatTemplateError

        template = self.chat_template(spec)
        if template is None:
            raise NoChatTemplateError(what)
        return template

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True, *,
                            chat_template: str | os.PathLike | None = None, tools: list | None = None,
                            template_vars: dict | None = None) -> str:
        """Render messages ([{"role": ..., "content": ...}]) with the chat template (see `chat_template`);
        `tools` (OpenAI's function list) goes to the template as its `tools` variable, `template_vars`
        as more variables (e.g. Qwen3's `enable_thinking`)."""
        return self._require_chat_template(chat_template).render(
            list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self._special_text(self.tokenizer.bos_id),
            eos_token=self._special_text(self.tokenizer.eos_id),
            tools=tools,
            **{k: v for k, v in (template_vars or {}).items()
               if k not in ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools")},
        )

    def chat_tokens(self, messages: Sequence[dict], *, chat_template: str | os.PathLike | None = None,
                    add_bos: bool = True, tools: list | None = None, template_vars: dict | None = None) -> list[int]:
        """Token ids of a rendered conversation: special tokens parsed, BOS exactly once."""
        from .chat import strip_leading_bos

        text = self.apply_chat_template(messages, chat_template=chat_template, tools=tools, template_vars=template_vars)
        text, had_bos = strip_leading_bos(text, self._special_text(self.tokenizer.bos_id))
        bos = add_bos and (self.tokenizer.add_bos or had_bos) and self.tokenizer.bos_id is not None
        ids = self.tokenizer.encode(text, add_bos=False, parse_special=True)
        return ([self.tokenizer.bos_id] if bos else []) + ids

    def chat_prompt_ids(self, messages: Sequence[dict], *, chat_template: str | os.PathLike | None = None) -> list[int]:
        """The ids `chat` evaluates for `messages`: `chat_tokens`, except that earlier answers the KV
        cache holds keep the model's own tokens (same text; see `qllama.chat.prompt_ids`)."""
        from .chat import prompt_ids

        ids = self.chat_tokens(messages, chat_template=chat_template)
        return prompt_ids(ids, self.session.tokens, self.tokenizer.token_bytes)

    def prepare_prompt(self, prompt: str, *, raw: bool = False, system: str | None = None, add_bos: bool = True,
                       chat_template: str | os.PathLike | None = None) -> "tuple[list[int], PromptFormat]":
        """Prompt ids for a one-shot prompt: one user message (after `system`) in the chat template
        when there is one and not `raw`, else plain completion. Returns (ids, the format and why)."""
        from .chat import NoChatTemplateError, PromptFormat

        if raw:
            fmt = PromptFormat(None, "raw")
        else:
            template = self.chat_template(chat_template)
            fmt = PromptFormat(template, "none" if template is None else "gguf" if chat_template is None else "requested")
        if not fmt.chat:
            if system and raw:
                raise QllamaError("a system prompt needs the chat template, and raw completion uses none")
            if system:
                raise NoChatTemplateError("a system prompt")
            return self.tokenize(prompt, add_bos=add_bos), fmt
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return self.chat_tokens(messages, chat_template=chat_template, add_bos=add_bos), fmt

    def chat(self, messages: Sequence[dict], *, chat_template: str | os.PathLike | None = None,
             **options) -> Iterator[str]:
        """Stream the assistant's reply to a conversation as text chunks (the options of `stream`).

        The KV cache is reused across calls: only the tokens after the longest common prefix
        with the previous call are evaluated, and the model's own tokens of earlier answers are
        kept (`chat_prompt_ids`), as `qllama chat` does.
        """
        ids = self.chat_prompt_ids(messages, chat_template=chat_template)
        return self.generate(ids, **options)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of one sequence's KV cache at n_ctx, for the cache types `kv_types` (type_k, type_v)."""
        from .runtime.memory import kv_cache_bytes

        return kv_cache_bytes(self.args, self.n_ctx, self._model.batch, self.kv_types)

    def __repr__(self) -> str:
        a = self.args
        tk, tv = self.kv_types
        kv = f"{self.kv_cache_bytes / 2**20:.2f} MiB KV cache ({tk}" + ("" if tk == tv else f" K, {tv} V") + ")"
        return (f"<qllama.Model {os.path.basename(self.path)}: {a.arch}, {a.n_layer} layers, n_embd {a.n_embd}, "
                f"n_ctx {self.n_ctx}, {kv}>")


__all__ = ["load", "Model"]
