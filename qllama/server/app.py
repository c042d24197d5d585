"""The OpenAI-compatible HTTP app (Starlette): routes, API key, body limit, errors, SSE.

    GET  /health                  {"status": "ok", slots}             (no key needed)
    GET  /v1/models               the one model served                 (no key needed, as llama.cpp)
    POST /v1/completions          prompt -> text_completion (stream: SSE chunks, then data: [DONE])
    POST /v1/chat/completions     messages -> chat.completion, through the model's chat template

Every error is {"error": {"message", "type", "param", "code"}} with the HTTP status as code.
Handlers only validate, tokenize and queue; the model runs in the scheduler's worker thread,
and events come back through an asyncio queue (all events of a step with one wake-up of the
event loop). Long prompts are tokenized (and chat templates rendered) in a worker thread, so
they do not hold up the streams being served. A client that goes away cancels its job.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import weakref

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import QllamaError
from .responses import SSE_DONE, ResponseBuilder, sse
from .scheduler import Event, Job, QueueFull, ShuttingDown
from .schemas import ApiError, GenParams, bad_request, check_token_ids, parse_chat, parse_completion

MAX_BODY = 1 << 20  # bytes of a request body
OFF_LOOP_BYTES = 16 << 10  # a body this large is tokenized in a worker thread, not on the event loop
RETRY_AFTER_S = 1


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class ServerState:
    """What the handlers share: the model, the scheduler, the served name and the key."""

    def __init__(self, llm, scheduler, model_name: str, api_key: str | None = None, max_body: int = MAX_BODY,
                 chat_template: str | None = None):
        self.llm = llm
        self.chat_template = chat_template  # a built-in name or a file; None: the GGUF's own
        self.scheduler = scheduler
        self.model_name = model_name
        self.api_key = api_key
        self.max_body = max_body
        self.created = int(time.time())


def create_app(state: ServerState) -> Starlette:
    """The Starlette application serving `state`."""

    def check_key(request: Request) -> None:
        if state.api_key is None:
            return
        given = request.headers.get("authorization") or request.headers.get("x-api-key") or ""
        if given.startswith("Bearer "):
            given = given[len("Bearer "):]
        if not hmac.compare_digest(given.encode(), state.api_key.encode()):
            raise ApiError(401, "Invalid API Key", "authentication_error")

    async def health(request: Request) -> Response:
        s = state.scheduler
        busy = s.n_busy
        return JSONResponse({"status": "ok", "slots_idle": len(s.slots) - busy, "slots_processing": busy,
                             "requests_waiting": s.n_waiting})

    async def models(request: Request) -> Response:
        llm = state.llm
        meta = {"n_ctx": llm.n_ctx, "n_ctx_train": llm.args.n_ctx_train if hasattr(llm.args, "n_ctx_train") else None,
                "n_vocab": llm.n_vocab, "n_parallel": len(state.scheduler.slots)}
        return JSONResponse({"object": "list", "data": [
            {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "qllama", "meta": meta}]})

    async def completions(request: Request) -> Response:
        check_key(request)
        body, size = await read_json(request, state.max_body)
        req = parse_completion(body)
        if isinstance(req.prompt, str):  # add_bos, parse_special: as llama.cpp's server
            ids = await off_loop(size, state.llm.tokenize, req.prompt, add_bos=True, parse_special=True)
        else:
            ids = [int(t) for t in req.prompt]
            bad = [t for t in ids if not 0 <= t < state.llm.n_vocab]
            if bad:
                raise bad_request(f"token id {bad[0]} is out of range [0, {state.llm.n_vocab})", "prompt")
        return await run_job(request, ids, req.params, ResponseBuilder("completion", state.model_name,
                                                                       req.params.logprobs is not None))

    async def chat(request: Request) -> Response:
        check_key(request)
        body, size = await read_json(request, state.max_body)
        req = parse_chat(body)
        llm = state.llm
        template = llm.chat_template(state.chat_template)
        if template is None:
            raise bad_request("this model has no chat template: use /v1/completions", "messages")
        post = chat_post(body, req, template, llm.tokenizer)  # tools and reasoning (qllama.server.tools)
        try:
            ids = await off_loop(size, llm.chat_tokens, post.messages, chat_template=state.chat_template,
                                 tools=post.template_tools, template_vars=post.template_vars)
        except QllamaError as e:  # the template refused the conversation (raise_exception...)
            raise bad_request(f"chat template: {e}", "messages") from None
        if post.reasoning and llm.tokenizer.decode(ids[-4:], special=True).rstrip().endswith("<think>"):
            post.open_thinking()  # the template opened the reasoning (DeepSeek-R1, Qwen3 forced thinking)
        return await run_job(request, ids, req.params, ResponseBuilder("chat", state.model_name,
                                                                       req.params.logprobs is not None, post=post))

    async def run_job(request: Request, ids: list[int], params: GenParams, rb: ResponseBuilder) -> Response:
        stream = await start_job(ids, params)
        if params.stream:
            return SSEResponse(stream, rb, params.include_usage)
        return await collect(request, stream, rb)

    async def start_job(ids: list[int], params: GenParams) -> "JobStream":
        """Check a job and queue it on the scheduler: its events come through the JobStream
        (also used by the ollama routes, qllama.server.ollama); an ApiError when it cannot run."""
        n_ctx = state.llm.n_ctx
        check_token_ids(params, state.llm.n_vocab)
        if params.grammar is not None and params.constraint is None:
            params.constraint = await run_in_threadpool(build_constraint, state.llm.tokenizer, params)
        if not ids:
            raise bad_request("the prompt is empty (no tokens)", "prompt")
        if len(ids) >= n_ctx:
            raise ApiError(400, f"the prompt has {len(ids)} tokens but the context holds {n_ctx} "
                           f"(it needs room for at least one more)", "exceed_context_size_error",
                           n_prompt_tokens=len(ids), n_ctx=n_ctx)
        stream = JobStream(asyncio.get_running_loop())
        job = Job(ids, params, stream.emit)
        stream.job = job
        try:
            state.scheduler.submit(job)
        except QueueFull as e:
            raise ApiError(503, f"all slots are busy and {e}; retry later", "unavailable_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ShuttingDown as e:
            raise ApiError(503, str(e), "unavailable_error") from None
        return stream

    async def collect(request: Request, stream: "JobStream", rb: ResponseBuilder) -> Response:
        """A whole (non-streamed) answer; a client that disconnects meanwhile cancels the job."""
        watcher = asyncio.create_task(stream.watch_disconnect(request.receive))
        texts, lps = [], []
        try:
            async for ev in stream.events():
                if ev.kind == "error":
                    err = ApiError(ev.status, ev.message, "unavailable_error" if ev.status == 503 else "server_error")
                    return error_response(err)
                texts.append(ev.text)
                lps.extend(ev.logprobs)
                if ev.kind == "done":
                    return JSONResponse(rb.complete("".join(texts), lps, ev.finish_reason, ev.usage))
            return Response(status_code=499)  # the client is gone: nobody reads this
        finally:
            watcher.cancel()
            stream.cancel()

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        detail = getattr(exc, "detail", "") or "not found"
        return error_response(ApiError(status, f"{detail}: {request.method} {request.url.path}", kind))

    async def api_error(request: Request, exc: Exception) -> Response:
        return error_response(exc)  # type: ignore[arg-type]

    async def server_error(request: Request, exc: Exception) -> Response:
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))

    async def chat_page(request: Request) -> Response:
        """The chat page (static/index.html: one file, no build step, nothing from the network)."""
        return Response(_chat_page_html(), media_type="text/html; charset=utf-8",
                        headers={"cache-control": "no-cache"})

    routes = [
        Route("/", chat_page, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/chat/completions", chat, methods=["POST"]),
    ]
    from .ollama import extra_routes  # ollama's /api/*, llama-server's /tokenize, /detokenize, /metrics

    routes += extra_routes(state, start_job=start_job, read_json=read_json, check_key=check_key)
    handlers = {ApiError: api_error, HTTPException: not_found, Exception: server_error}
    return Starlette(routes=routes, exception_handlers=handlers)


def _chat_page_html() -> bytes:
    from importlib.resources import files

    return (files("qllama.server") / "static" / "index.html").read_bytes()


def chat_post(body: dict, req, template, tokenizer):
    """The request's tools (OpenAI's tools / tool_choice / parallel_tool_calls) and reasoning
    option (llama-server's reasoning_format: "none" keeps <think> inline) as a ChatPost that also
    carries the messages and tools to render; a forced call constrains decoding (unless the request
    has its own response_format or grammar)."""
    from .tools import ChatPost, call_grammar, detect_format, parse_tools, prepare_messages

    rf = body.get("reasoning_format")
    if rf is not None and rf not in ("none", "auto", "deepseek", "deepseek-legacy"):
        raise bad_request("'reasoning_format' must be 'none', 'auto' or 'deepseek'", "reasoning_format")
    kwargs = body.get("chat_template_kwargs")  # llama-server's: more template variables, e.g. enable_thinking
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    treq = parse_tools(body)
    if treq is not None and treq.choice == "none":
        treq = None
    fmt = detect_format(template.source) if treq is not None else None
    harmony = "<|channel|>" in (template.source or "")  # gpt-oss: analysis / final channels
    post = ChatPost(reasoning=rf != "none", fmt=fmt, harmony=harmony)
    # the parser reads markers that are control tokens: gpt-oss's channels, <|python_tag|>, [TOOL_CALLS]
    req.params.special = harmony or fmt in ("llama3", "mistral")
    post.messages = prepare_messages(req.messages, fmt or "", treq) if treq is not None else req.messages
    post.template_tools = treq.tools if treq is not None and fmt != "generic" else None
    post.template_vars = kwargs
    from ..generation.constrained import available

    if treq is not None and req.params.grammar is None and available():  # without llguidance: parsed, not constrained
        req.params.grammar = call_grammar(fmt, treq, tokenizer)
        req.params.grammar_param = "tools"
    return post


def build_constraint(tokenizer, params: GenParams):
    """The request's grammar compiled against the vocabulary (a matcher of its own), or a 400
    naming the field: a schema or grammar llguidance cannot compile, or one matching nothing."""
    from ..generation.constrained import Constraint, GrammarError

    kind, spec = params.grammar
    try:
        c = Constraint.from_spec(tokenizer, kind, spec)
        c.check_start()
        return c
    except GrammarError as e:
        raise bad_request(str(e), params.grammar_param) from None


async def off_loop(size: int, fn, *args, **kwargs):
    """fn(*args, **kwargs) for a request of `size` bytes: in a worker thread when it is large, so
    that streams keep being served meanwhile; small ones run here (a thread hop costs two GIL
    hand-overs with the model's thread, more than tokenizing a short prompt)."""
    if size >= OFF_LOOP_BYTES:
        return await run_in_threadpool(fn, *args, **kwargs)
    return fn(*args, **kwargs)


async def read_json(request: Request, limit: int):
    """(the body as JSON, its size in bytes); over `limit` bytes: 413 (checked on Content-Length
    and while reading)."""
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > limit:
        raise ApiError(413, f"the request body has {int(size)} bytes; the limit is {limit}")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"the request body is over the limit of {limit} bytes")
    try:
        return json.loads(body), len(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"invalid JSON in the request body: {e}") from None


_CLOSED = Event("closed")  # the client went away


class Mailbox:
    """Events from the worker thread to one event loop, delivered in batches.

    Each `call_soon_threadsafe` wakes the loop, which then competes with the worker for the
    GIL; the events of one step (one per busy slot) are emitted within microseconds, so the
    first schedules a delivery and the others join it: one wake-up per step, not per stream.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, Event]] = []

    def post(self, queue: asyncio.Queue, event: Event) -> None:
        """Called by the worker thread; raises RuntimeError once the loop is closed."""
        with self._lock:
            self._pending.append((queue, event))
            if len(self._pending) > 1:
                return  # a delivery is already scheduled
            try:
                self.loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:
                self._pending.clear()
                raise

    def _deliver(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        for queue, event in batch:
            queue.put_nowait(event)


_MAILBOXES: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Mailbox]" = weakref.WeakKeyDictionary()


def mailbox(loop: asyncio.AbstractEventLoop) -> Mailbox:
    """The Mailbox of `loop` (one per loop, made on first use from that loop)."""
    box = _MAILBOXES.get(loop)
    if box is None:
        box = _MAILBOXES[loop] = Mailbox(loop)
    return box


class JobStream:
    """Events of one job, handed from the worker thread to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.box = mailbox(loop)
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.job: Job | None = None

    def emit(self, event: Event) -> None:
        """Called by the worker thread; raises RuntimeError once the loop is closed."""
        self.box.post(self.queue, event)

    def cancel(self) -> None:
        if self.job is not None:
            self.job.cancel()
        self.queue.put_nowait(_CLOSED)

    async def events(self):
        """Events up to and including "done" or "error"; stops early when cancelled."""
        while True:
            ev = await self.queue.get()
            if ev is _CLOSED:
                return
            yield ev
            if ev.kind in ("done", "error"):
                return

    async def watch_disconnect(self, receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.cancel()
                return


class SSEResponse:
    """An ASGI response streaming a job as server-sent events (OpenAI's chunk objects).

    Ends with `data: [DONE]`; an error mid-stream is sent as `data: {"error": {...}}` and
    ends the stream. A disconnect (noticed while waiting or while sending) cancels the job.
    """

    def __init__(self, stream: JobStream, rb: ResponseBuilder, include_usage: bool):
        self.stream = stream
        self.rb = rb
        self.include_usage = include_usage

    async def __call__(self, scope, receive, send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]
        watcher = asyncio.create_task(self.stream.watch_disconnect(receive))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for data in self._chunks():
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away while we were sending
            pass
        finally:
            watcher.cancel()
            self.stream.cancel()

    async def _chunks(self):
        rb = self.rb
        first = rb.first_chunk()
        if first is not None:
            yield sse(first)
        async for ev in self.stream.events():
            if ev.kind == "error":
                kind = "unavailable_error" if ev.status == 503 else "server_error"
                yield sse(ApiError(ev.status, ev.message, kind).body())
                return
            if ev.text or ev.logprobs:
                for chunk in rb.text_chunks(ev.text, ev.logprobs):
                    yield sse(chunk)
            if ev.kind == "done":
                for chunk in rb.closing_chunks():
                    yield sse(chunk)
                yield sse(rb.final_chunk(ev.finish_reason, ev.usage))
                if self.include_usage:
                    yield sse(rb.usage_chunk(ev.usage))
                yield SSE_DONE
                return
