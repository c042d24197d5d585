"""ollama's API beside OpenAI's, and llama-server's /tokenize, /detokenize and /metrics.

    GET  /api/version      {"version"}
    GET  /api/tags         the one model served, as ollama lists its models
    POST /api/show         its details, model_info (the GGUF's metadata, arrays left out), template
    GET  /api/ps           the loaded model (it stays loaded: keep_alive is accepted and changes nothing)
    POST /api/generate     prompt (+ system, through the chat template unless raw) -> NDJSON lines
    POST /api/chat         messages -> NDJSON lines
    POST /tokenize         {"content", "add_special", "with_pieces"} -> {"tokens"}      (llama-server)
    POST /detokenize       {"tokens"} -> {"content"}                                     (llama-server)
    GET  /metrics          Prometheus text format, llama-server's metric names

Generation runs as one more job on the scheduler the OpenAI routes use (the same slots, queue
and prefix reuse). Streams are ollama's newline-delimited JSON (`stream` defaults to true, as in
ollama); the last object has `done: true`, `done_reason` and the durations in nanoseconds.
`options` map to qllama's sampling: temperature, top_k, top_p, min_p, repeat_penalty,
repeat_last_n, seed, num_predict (-1 / -2: until the end or a full context), stop,
presence_penalty, frequency_penalty; other options (num_ctx, num_thread...) are ignored, as
ollama ignores the ones a runner does not use. Defaults are ollama's (top_p 0.9, min_p 0,
repeat_penalty 1.1). `format` ("json" or a JSON schema) constrains decoding as the OpenAI routes'
response_format does. Any model name is answered by the model served (as llama-server does).
Errors are ollama's {"error": "message"} with the HTTP status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import time
from datetime import datetime, timezone
from typing import Any, Awaitable, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import QllamaError
from ..generation.sampling import SamplingParams
from .schemas import ApiError, GenParams, bad_request, parse_chat

# ollama's defaults (api.DefaultOptions) where they differ from llama.cpp's
OLLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0, "repeat_penalty": 1.1,
                   "repeat_last_n": 64, "presence_penalty": 0.0, "frequency_penalty": 0.0}
OFF_LOOP_CHARS = 16 << 10  # longer prompts are tokenized in a worker thread


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def ollama_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _option(opts: dict, key: str, default, kind: type, lo=None, hi=None):
    v = opts.get(key, None)
    if v is None:
        return default
    if kind is int and isinstance(v, float) and v.is_integer():
        v = int(v)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or isinstance(v, int))
    if not ok or v != v:
        raise bad_request(f"option {key} must be {'an integer' if kind is int else 'a number'}, got {v!r}", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad_request(f"option {key} is out of range: {v}", key)
    return kind(v)


def gen_params(body: dict, stream_default: bool = True) -> GenParams:
    """ollama's `options` (and `stream`) -> the scheduler's GenParams."""
    opts = body.get("options") or {}
    if not isinstance(opts, dict):
        raise bad_request("options must be an object", "options")
    seed = _option(opts, "seed", -1, int)
    num_predict = _option(opts, "num_predict", -1, int, lo=-2)
    stop = opts.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request("option stop must be a list of strings", "stop")
    sampling = SamplingParams(
        temperature=_option(opts, "temperature", OLLAMA_DEFAULTS["temperature"], float, lo=0.0),
        top_k=_option(opts, "top_k", OLLAMA_DEFAULTS["top_k"], int),
        top_p=_option(opts, "top_p", OLLAMA_DEFAULTS["top_p"], float, lo=0.0, hi=1.0),
        min_p=_option(opts, "min_p", OLLAMA_DEFAULTS["min_p"], float, lo=0.0, hi=1.0),
        repeat_penalty=_option(opts, "repeat_penalty", OLLAMA_DEFAULTS["repeat_penalty"], float, lo=0.0),
        repeat_last_n=_option(opts, "repeat_last_n", OLLAMA_DEFAULTS["repeat_last_n"], int, lo=-1),
        presence_penalty=_option(opts, "presence_penalty", 0.0, float),
        frequency_penalty=_option(opts, "frequency_penalty", 0.0, float),
        seed=None if seed < 0 else seed,
    )
    if sampling.repeat_penalty == 0.0:  # ollama's 0 is "off"
        sampling = dataclasses.replace(sampling, repeat_penalty=1.0)
    try:
        sampling.validate()
    except QllamaError as e:
        raise bad_request(str(e)) from None
    stream = body.get("stream", stream_default)
    if stream is None:
        stream = stream_default
    if not isinstance(stream, bool):
        raise bad_request("stream must be a boolean", "stream")
    for key in ("images",):
        if body.get(key):
            raise bad_request(f"{key} are not supported by this model", key)
    params = GenParams(max_tokens=None if num_predict < 0 else num_predict, sampling=sampling,
                       stop=[s for s in stop if s], stream=stream)
    fmt = body.get("format")
    if fmt not in (None, ""):  # ollama's JSON mode ("json") or a JSON schema: constrained decoding
        if fmt == "json":
            params.grammar = ("json_object", None)
        elif isinstance(fmt, dict):
            params.grammar = ("json_schema", fmt)
        else:
            raise bad_request("format must be \"json\" or a JSON schema", "format")
        params.grammar_param = "format"
    return params


def model_details(llm) -> dict:
    from ..gguf.types import FILE_TYPES

    meta = llm.metadata
    arch = str(meta.get("general.architecture", ""))
    n_params = sum(t.n_elements for t in llm.gguf.tensors.values())
    size = f"{n_params / 1e9:.1f}B" if n_params >= 1e9 else f"{n_params / 1e6:.0f}M"
    ftype = meta.get("general.file_type")
    quant = FILE_TYPES.get(ftype, "").replace("MOSTLY_", "").replace("ALL_", "") if isinstance(ftype, int) else ""
    return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch] if arch else None,
            "parameter_size": size, "quantization_level": quant or "unknown"}


def extra_routes(state, *, start_job: Callable[..., Awaitable[Any]], read_json, check_key) -> list[Route]:
    """The routes of this module for the app of `state` (see app.create_app): `start_job(ids,
    params)` queues a job and returns its JobStream; `read_json(request, limit)` reads a body;
    `check_key(request)` raises a 401 ApiError without the server's key."""
    llm = state.llm

    def file_info() -> dict:
        try:
            st = os.stat(llm.path)
            size, mtime = st.st_size, st.st_mtime
        except OSError:
            size, mtime = 0, state.created
        digest = hashlib.sha256(f"{os.path.abspath(llm.path)}:{size}:{mtime}".encode()).hexdigest()
        modified = datetime.fromtimestamp(mtime, timezone.utc).isoformat().replace("+00:00", "Z")
        return {"name": state.model_name, "model": state.model_name, "modified_at": modified, "size": size,
                "digest": digest, "details": model_details(llm)}

    def guarded(handler):
        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as e:
                return ollama_error(e.status, e.message)
        return run

    async def body_of(request: Request) -> dict:
        check_key(request)
        body, _ = await read_json(request, state.max_body)
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        return body

    def need_model(body: dict) -> None:
        name = body.get("model") or body.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("model is required", "model")

    async def version(request: Request) -> Response:
        from .. import __version__

        return JSONResponse({"version": __version__})

    async def tags(request: Request) -> Response:
        return JSONResponse({"models": [file_info()]})

    async def ps(request: Request) -> Response:
        info = file_info()
        info.update({"expires_at": "2318-01-01T00:00:00Z", "size_vram": 0, "context_length": llm.n_ctx})
        return JSONResponse({"models": [info]})

    async def show(request: Request) -> Response:
        body = await body_of(request)
        need_model(body)
        meta = {}
        for k, v in llm.metadata.items():  # scalars only (ollama leaves the token lists out too)
            if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
                v = v.item()
            if isinstance(v, (str, int, float, bool)) and not k.startswith("tokenizer.chat"):
                meta[k] = v
        template = llm.chat_template(state.chat_template)
        caps = ["completion"]
        info = file_info()
        params = f"num_ctx {llm.n_ctx}"
        return JSONResponse({"license": str(llm.metadata.get("general.license", "")),
                             "modelfile": f"FROM {llm.path}\n{('PARAMETER ' + params)}\n", "parameters": params,
                             "template": template.source if template is not None else "",
                             "details": info["details"], "model_info": meta, "capabilities": caps,
                             "modified_at": info["modified_at"]})

    async def tokens_of(text: str, **kw) -> list[int]:
        if len(text) >= OFF_LOOP_CHARS:
            return await run_in_threadpool(llm.tokenize, text, **kw)
        return llm.tokenize(text, **kw)

    async def chat_ids(messages: list[dict]) -> list[int]:
        try:
            if len(json.dumps(messages)) >= OFF_LOOP_CHARS:
                return await run_in_threadpool(llm.chat_tokens, messages, chat_template=state.chat_template)
            return llm.chat_tokens(messages, chat_template=state.chat_template)
        except QllamaError as e:
            raise bad_request(f"chat template: {e}", "messages") from None

    async def generate(request: Request) -> Response:
        t0 = time.perf_counter()
        body = await body_of(request)
        need_model(body)
        params = gen_params(body)
        if body.get("suffix"):
            raise bad_request("this model does not support insert (suffix)", "suffix")
        prompt = body.get("prompt") or ""
        system = body.get("system") or ""
        if not isinstance(prompt, str) or not isinstance(system, str):
            raise bad_request("prompt and system must be strings", "prompt")
        context = body.get("context") or []
        if not isinstance(context, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in context):
            raise bad_request("context must be a list of token ids", "context")
        if not prompt and not context:  # ollama: an empty prompt only loads the model
            return JSONResponse({"model": body["model"], "created_at": now_iso(), "response": "", "done": True,
                                 "done_reason": "unload" if body.get("keep_alive") in (0, "0", "0s") else "load"})
        template = llm.chat_template(state.chat_template)
        if body.get("raw") or template is None:
            ids = await tokens_of(prompt, add_bos=not context, parse_special=True)
        else:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            ids = await chat_ids(messages)
        ids = [int(t) for t in context] + ids
        bad = [t for t in ids if not 0 <= t < llm.n_vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is out of range", "context")
        return await respond(request, body["model"], ids, params, t0, "generate")

    async def chat(request: Request) -> Response:
        t0 = time.perf_counter()
        body = await body_of(request)
        need_model(body)
        params = gen_params(body)
        messages = body.get("messages")
        if messages is None or messages == []:  # ollama: no messages only loads the model
            return JSONResponse({"model": body["model"], "created_at": now_iso(),
                                 "message": {"role": "assistant", "content": ""}, "done": True, "done_reason": "load"})
        if isinstance(messages, list) and any(isinstance(m, dict) and m.get("images") for m in messages):
            raise bad_request("images are not supported by this model", "messages")
        req = parse_chat({"messages": messages})  # OpenAI's checks: roles, content shapes
        if llm.chat_template(state.chat_template) is None:
            raise bad_request("this model has no chat template: use /api/generate with raw", "messages")
        ids = await chat_ids(req.messages)
        return await respond(request, body["model"], ids, params, t0, "chat")

    async def respond(request: Request, model: str, ids: list[int], params: GenParams, t0: float, kind: str) -> Response:
        stream = await start_job(ids, params)

        def piece(text: str) -> dict:
            out = {"model": model, "created_at": now_iso()}
            if kind == "chat":
                out["message"] = {"role": "assistant", "content": text}
            else:
                out["response"] = text
            out["done"] = False
            return out

        def final(ev, text: str = "") -> dict:
            u = ev.usage
            out = piece(text)
            out.update({"done": True, "done_reason": ev.finish_reason, "total_duration": int((time.perf_counter() - t0) * 1e9),
                        "load_duration": 0, "prompt_eval_count": u.prompt_tokens - u.cached_tokens,
                        "prompt_eval_duration": int(u.prompt_ms * 1e6), "eval_count": u.completion_tokens,
                        "eval_duration": int(u.predicted_ms * 1e6)})
            return out

        if params.stream:
            async def lines():
                parts: list[str] = []
                try:
                    async for ev in stream.events():
                        if ev.kind == "error":
                            yield (json.dumps({"error": ev.message}) + "\n").encode()
                            return
                        if ev.kind == "done":
                            doc = final(ev, ev.text)
                            if kind == "generate":
                                parts.append(ev.text)
                                doc["context"] = ids + llm.tokenize("".join(parts), add_bos=False)
                            yield (json.dumps(doc, ensure_ascii=False) + "\n").encode()
                            return
                        if ev.text:
                            parts.append(ev.text)
                            yield (json.dumps(piece(ev.text), ensure_ascii=False) + "\n").encode()
                finally:
                    stream.cancel()

            return StreamingResponse(lines(), media_type="application/x-ndjson")

        watcher = asyncio.create_task(stream.watch_disconnect(request.receive))
        parts: list[str] = []
        try:
            async for ev in stream.events():
                if ev.kind == "error":
                    return ollama_error(ev.status, ev.message)
                parts.append(ev.text)
                if ev.kind == "done":
                    doc = final(ev, "".join(parts))
                    if kind == "generate":
                        doc["context"] = ids + llm.tokenize("".join(parts), add_bos=False)
                    return JSONResponse(doc)
            return Response(status_code=499)
        finally:
            watcher.cancel()
            stream.cancel()

    async def tokenize(request: Request) -> Response:
        body = await body_of(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise bad_request("'content' must be a string", "content")
        add_special = body.get("add_special", False) is True
        ids = await tokens_of(content, add_bos=add_special, parse_special=body.get("parse_special", True) is not False)
        if body.get("with_pieces") is True:
            pieces = [{"id": t, "piece": llm.tokenizer.decode([t])} for t in ids]
            return JSONResponse({"tokens": pieces})
        return JSONResponse({"tokens": ids})

    async def detokenize(request: Request) -> Response:
        body = await body_of(request)
        toks = body.get("tokens", [])
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise bad_request("'tokens' must be a list of token ids", "tokens")
        bad = [t for t in toks if not 0 <= t < llm.n_vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is out of range [0, {llm.n_vocab})", "tokens")
        return JSONResponse({"content": llm.detokenize(toks)})

    async def metrics(request: Request) -> Response:
        check_key(request)
        s = state.scheduler
        t = s.totals
        rate = lambda n, sec: n / sec if sec > 0 else 0.0  # noqa: E731
        rows = [
            ("prompt_tokens_total", "counter", "Number of prompt tokens processed.", t["prompt_tokens"]),
            ("prompt_seconds_total", "counter", "Prompt process time.", t["prompt_seconds"]),
            ("tokens_predicted_total", "counter", "Number of generation tokens processed.", t["predicted_tokens"]),
            ("tokens_predicted_seconds_total", "counter", "Predict process time.", t["predicted_seconds"]),
            ("n_decode_total", "counter", "Total number of forward steps.", s.steps),
            ("n_busy_slots_per_decode", "counter", "Average number of busy slots per forward step.",
             rate(t["busy_slot_steps"], s.steps)),
            ("requests_total", "counter", "Requests finished.", t["requests"]),
            ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.",
             rate(t["prompt_tokens"], t["prompt_seconds"])),
            ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s.",
             rate(t["predicted_tokens"], t["predicted_seconds"])),
            ("requests_processing", "gauge", "Number of requests processing.", s.n_busy),
            ("requests_deferred", "gauge", "Number of requests deferred.", s.n_waiting),
        ]
        rows = [("llamacpp:" + name, *rest) for name, *rest in rows] + [  # qllama's own
            ("qllama:forward_seconds_total", "counter", "Wall time in the forward passes of the steps.", t["forward_seconds"]),
            ("qllama:step_seconds_total", "counter", "Wall time in whole steps (forward, sampling, detokenizing, events).",
             t["step_seconds"]),
        ]
        lines = []
        for name, kind, help_, value in rows:
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    g = guarded
    return [
        Route("/api/version", g(version), methods=["GET"]),
        Route("/api/tags", g(tags), methods=["GET"]),
        Route("/api/ps", g(ps), methods=["GET"]),
        Route("/api/show", g(show), methods=["POST"]),
        Route("/api/generate", g(generate), methods=["POST"]),
        Route("/api/chat", g(chat), methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
