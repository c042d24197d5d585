"""Batch jobs in OpenAI's Batch format (what vLLM's `run_batch` reads and writes), run in-process
through `qllama serve`'s own HTTP app and continuous-batching scheduler.

Input, one JSON object a line:

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

Output, one line per custom_id, in the order the requests finish:

    {"id": "batch_req_...", "custom_id": "q1",
     "response": {"status_code": 200, "request_id": "req_...", "body": {...}}, "error": null}

The body is what `qllama serve` answers to that request: each request is an ASGI call into the
server's Starlette app (`qllama.server.app.create_app`), so validation, tokenization, chat
templates and the response objects are the server's own, with no socket in between. A request
the server answers with an error keeps that answer (status and `{"error": ...}` body) and also
gets `error: {"code", "message"}`; a malformed line (not JSON, no custom_id, a method or url the
server does not answer, `stream`) gets a 400 in the same shape; a custom_id found on several
lines gets one such error line and none of them runs.

Up to `in_flight` requests are in the scheduler at once; its worker loop runs on the calling
thread (the model's thread: see `qllama serve`), the app on an event loop in another thread.

Resume: results are appended to the output file, flushed and fsynced line by line as they
finish. Re-running the same job reads the file first, repairs a partial last line (a crash in
the middle of a write) and skips every custom_id it already holds; a malformed line without a
custom_id is remembered by its line number (`error.line`).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from .errors import QllamaError

URLS = ("/v1/chat/completions", "/v1/completions")


# -- input -----------------------------------------------------------------------------------------


@dataclass
class BatchRequest:
    """One input line: a request to run, or (error set) one to answer with a 400 error line."""

    line: int  # 1-based line number in the input file
    custom_id: str | None
    url: str | None = None
    body: dict | None = None
    error: str | None = None

    def record(self) -> dict:
        """A plain dict (Ray Data rows, pickling)."""
        return {"line": self.line, "custom_id": self.custom_id, "url": self.url,
                "body": json.dumps(self.body) if self.body is not None else None, "error": self.error}

    @classmethod
    def from_record(cls, r: dict) -> "BatchRequest":
        body = r.get("body")
        return cls(int(r["line"]), r.get("custom_id"), r.get("url"), json.loads(body) if body else None,
                   r.get("error"))


def parse_line(n: int, text: str) -> BatchRequest:
    """Line n of a Batch input file (not blank)."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        return BatchRequest(n, None, error=f"line {n}: not valid JSON: {e}")
    if not isinstance(obj, dict):
        return BatchRequest(n, None, error=f"line {n}: a request must be a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return BatchRequest(n, None, error=f"line {n}: 'custom_id' must be a non-empty string")
    method, url, body = obj.get("method"), obj.get("url"), obj.get("body")
    if method != "POST":
        return BatchRequest(n, cid, error=f"line {n}: 'method' must be \"POST\", got {json.dumps(method)}")
    if url not in URLS:
        return BatchRequest(n, cid, error=f"line {n}: 'url' must be one of {', '.join(URLS)}; got {json.dumps(url)}")
    if not isinstance(body, dict):
        return BatchRequest(n, cid, error=f"line {n}: 'body' must be a JSON object")
    if body.get("stream"):
        return BatchRequest(n, cid, error=f"line {n}: 'stream' is not supported in a batch")
    return BatchRequest(n, cid, url, body)


def parse_input(lines: Iterable[str]) -> list[BatchRequest]:
    """Every non-blank line; a custom_id on several lines becomes one error request (at its first line)."""
    reqs = [parse_line(n, text) for n, text in enumerate(lines, start=1) if text.strip()]
    where: dict[str, list[int]] = {}
    for r in reqs:
        if r.custom_id is not None:
            where.setdefault(r.custom_id, []).append(r.line)
    out, reported = [], set()
    for r in reqs:
        lines_of = where.get(r.custom_id, []) if r.custom_id is not None else []
        if len(lines_of) > 1:
            if r.custom_id in reported:
                continue
            reported.add(r.custom_id)
            r = BatchRequest(r.line, r.custom_id, error=(
                f"custom_id {json.dumps(r.custom_id)} is on lines {', '.join(map(str, lines_of))}: "
                f"custom_ids must be unique (none of them was run)"))
        out.append(r)
    return out


def read_input(path: str) -> list[BatchRequest]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse_input(f.read().split("\n"))
    except IsADirectoryError:
        raise QllamaError(f"{path}: is a directory, not a Batch input file") from None


# -- output ----------------------------------------------------------------------------------------


def _ids() -> tuple[str, str]:
    return "batch_req_" + secrets.token_hex(12), "req_" + secrets.token_hex(12)


def result_line(custom_id: str | None, status: int, body, line: int | None = None) -> dict:
    """An output line: the server's answer (status, body); a non-200 answer also fills `error`."""
    rid, req_id = _ids()
    error = None
    if status != 200:
        err = body.get("error") if isinstance(body, dict) else None
        err = err if isinstance(err, dict) else {}
        error = {"code": err.get("type") or "server_error", "message": err.get("message") or str(body)}
        if custom_id is None and line is not None:
            error["line"] = line  # a line without a custom_id: how a re-run knows it was answered
    return {"id": rid, "custom_id": custom_id,
            "response": {"status_code": status, "request_id": req_id, "body": body}, "error": error}


def invalid_line(req: BatchRequest) -> dict:
    """The error line of a malformed input line: a 400 in the server's error shape."""
    from .server.schemas import bad_request

    return result_line(req.custom_id, 400, bad_request(req.error).body(), line=req.line)


class ResultsFile:
    """The output file, appended to line by line (flush + fsync), with what it already holds.

    Opening repairs a partial last line (a crash mid-write): the bytes after the last newline are
    dropped unless they are a whole result. `done_ids` / `done_lines` say what a re-run skips.
    """

    def __init__(self, path: str, *, fsync: bool = True):
        self.path = path
        self.fsync = fsync
        self.done_ids: set[str] = set()
        self.done_lines: set[int] = set()
        self.repaired = 0  # bytes of a partial last line that were dropped
        self._lock = threading.Lock()
        self.closed = False
        self._read_existing()
        self._f = open(path, "a", encoding="utf-8")

    def _read_existing(self) -> None:
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return
        except IsADirectoryError:
            raise QllamaError(f"{self.path}: is a directory, not a results file") from None
        end = data.rfind(b"\n") + 1
        complete, tail = data[:end], data[end:]
        for i, raw in enumerate(complete.split(b"\n")[:-1], start=1):
            if not raw.strip():
                continue
            try:
                self._note(json.loads(raw))
            except (ValueError, QllamaError):
                raise QllamaError(f"{self.path}: line {i} is not a result line of a Batch output file "
                                  f"(choose another -o, or remove it)") from None
        if not tail.strip():
            if tail:
                self._truncate(end)
            return
        try:
            self._note(json.loads(tail))  # a whole last result without its newline: keep it, end it
        except (ValueError, QllamaError):
            self.repaired = len(tail)  # a partial line (a crash mid-write): dropped
            self._truncate(end)
            return
        with open(self.path, "ab") as f:
            f.write(b"\n")

    def _truncate(self, size: int) -> None:
        with open(self.path, "r+b") as f:
            f.truncate(size)
            os.fsync(f.fileno())

    def _note(self, obj) -> None:
        if not isinstance(obj, dict) or "custom_id" not in obj:
            raise QllamaError("not a result line")
        cid = obj["custom_id"]
        if isinstance(cid, str):
            self.done_ids.add(cid)
        else:
            line = (obj.get("error") or {}).get("line") if isinstance(obj.get("error"), dict) else None
            if isinstance(line, int):
                self.done_lines.add(line)

    def is_done(self, req: BatchRequest) -> bool:
        if req.custom_id is not None:
            return req.custom_id in self.done_ids
        return req.line in self.done_lines

    def write(self, obj: dict) -> bool:
        """Append one result (durably); False once closed (results after a Ctrl-C are dropped)."""
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"
        with self._lock:
            if self.closed:
                return False
            self._f.write(text)
            self._f.flush()
            if self.fsync:
                os.fsync(self._f.fileno())
            cid = obj.get("custom_id")
            if isinstance(cid, str):
                self.done_ids.add(cid)
            return True

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                self._f.close()


# -- the engine: the server's app and scheduler, called in-process ---------------------------------


async def asgi_post(app, path: str, body: bytes) -> tuple[int, bytes]:
    """POST body to path of an ASGI app, in-process: (status, response body)."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
             "headers": [(b"host", b"qllama-batch"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    received = False

    async def receive():
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the "client" never goes away (cancelled with the call)

    status, chunks = 500, []

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    try:
        await app(scope, receive, send)
    except Exception as e:  # noqa: BLE001 - Starlette re-raises after answering a 500
        if not chunks:
            from .server.schemas import ApiError

            return 500, json.dumps(ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error").body()).encode()
    return status, b"".join(chunks)


@dataclass
class Stats:
    done: int = 0
    ok: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    t0: float = field(default_factory=time.monotonic)
    t_first: float | None = None  # when the first result came (a Ray job: after its replicas started)

    def add(self, line: dict) -> None:
        if self.t_first is None:
            self.t_first = time.monotonic()
        self.done += 1
        resp = line.get("response") or {}
        if resp.get("status_code") == 200:
            self.ok += 1
            usage = (resp.get("body") or {}).get("usage") or {}
            self.prompt_tokens += int(usage.get("prompt_tokens") or 0)
            self.completion_tokens += int(usage.get("completion_tokens") or 0)
        else:
            self.errors += 1


class BatchEngine:
    """One model behind `qllama serve`'s app and scheduler, answering Batch requests in-process."""

    def __init__(self, llm, *, model_name: str = "qllama", parallel: int = 4, chunk: int = 128,
                 chat_template: str | None = None, in_flight: int | None = None):
        from .server.app import ServerState, create_app
        from .server.engine import model_forward
        from .server.scheduler import Scheduler

        self.llm = llm
        self.parallel = parallel
        self.in_flight = in_flight or 2 * parallel  # slots busy + the next prompts already tokenized
        forward, new_cache, self.batched = model_forward(llm)
        self.scheduler = Scheduler(forward, new_cache, llm.tokenizer, llm.n_ctx, n_parallel=parallel,
                                   max_queue=self.in_flight, chunk=chunk)
        self.app = create_app(ServerState(llm, self.scheduler, model_name, chat_template=chat_template))

    async def answer(self, req: BatchRequest) -> dict:
        """The output line of one request (run through the app, or an error line if malformed)."""
        if req.error is not None:
            return invalid_line(req)
        status, raw = await asgi_post(self.app, req.url, json.dumps(req.body).encode())
        try:
            body = json.loads(raw)
        except ValueError:
            body = raw.decode("utf-8", "replace")
        return result_line(req.custom_id, status, body)

    def run(self, requests: list[BatchRequest], on_result: Callable[[BatchRequest, dict], None]) -> None:
        """Answer every request, calling on_result(request, line) as each finishes (from the event
        loop's thread). The scheduler runs on the calling thread; returns when all are answered.
        A KeyboardInterrupt stops at once (requests in flight are dropped) and is re-raised."""
        if not requests:
            return
        finished = threading.Event()
        failure: list[BaseException] = []
        loop = asyncio.new_event_loop()
        main_task: list[asyncio.Task] = []

        async def main():
            sem = asyncio.Semaphore(self.in_flight)

            async def one(req):
                try:
                    line = await self.answer(req)
                    on_result(req, line)
                finally:
                    sem.release()

            tasks = []
            for req in requests:
                await sem.acquire()
                tasks.append(asyncio.ensure_future(one(req)))
            await asyncio.gather(*tasks)

        def loop_thread():
            asyncio.set_event_loop(loop)
            try:
                task = loop.create_task(main())
                main_task.append(task)
                loop.run_until_complete(task)
            except asyncio.CancelledError:
                pass
            except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
                failure.append(e)
            finally:
                finished.set()
                with self.scheduler._cond:
                    self.scheduler._cond.notify_all()

        thread = threading.Thread(target=loop_thread, name="qllama-batch-loop", daemon=True)
        thread.start()
        try:
            self._drive(finished)
        except BaseException:
            if main_task:
                loop.call_soon_threadsafe(main_task[0].cancel)
            for slot in self.scheduler.slots:
                if slot.run is not None:
                    slot.run.job.cancel()
            thread.join(timeout=5)
            raise
        thread.join()
        loop.close()
        if failure:
            raise failure[0]

    def _drive(self, finished: threading.Event) -> None:
        """The scheduler's worker loop on this thread, until `finished` (as Scheduler._loop, which
        runs until the server closes)."""
        s = self.scheduler
        while not finished.is_set():
            try:
                worked = s.step()
            except Exception as e:  # noqa: BLE001 - as Scheduler._loop: the running jobs fail, the loop goes on
                s._fail_running(f"internal error: {type(e).__name__}: {e}")
                worked = True
            if not worked:
                with s._cond:
                    if not s._queue and not finished.is_set():
                        s._cond.wait(timeout=0.05)


# -- progress --------------------------------------------------------------------------------------


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    """`[#####.....] 12/40 requests  35.1 tokens/s  ETA 0:42` on stderr, redrawn in place (a
    terminal only), at most `hz` times a second."""

    def __init__(self, total: int, enabled: bool, stream=None, hz: float = 4.0, width: int = 24):
        self.total, self.enabled, self.stream, self.width = total, enabled, stream or sys.stderr, width
        self.period = 1.0 / hz
        self._last = 0.0
        self._drawn = False

    def update(self, stats: Stats, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self.period:
            return
        self._last = now
        elapsed = max(now - stats.t0, 1e-9)
        frac = stats.done / self.total if self.total else 1.0
        bar = "#" * int(frac * self.width) + "." * (self.width - int(frac * self.width))
        eta = "?" if not stats.done else _clock((self.total - stats.done) * elapsed / stats.done)
        self.stream.write(f"\r[{bar}] {stats.done}/{self.total} requests  "
                          f"{stats.completion_tokens / elapsed:.1f} tokens/s  ETA {eta} \x1b[K")
        self.stream.flush()
        self._drawn = True

    def clear(self) -> None:
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False


# -- the job -----------------------------------------------------------------------------------------


@dataclass
class JobPlan:
    """What a run does: the requests still to answer, and what the output already holds."""

    todo: list[BatchRequest]
    total: int
    skipped: int


def plan(requests: list[BatchRequest], results: ResultsFile) -> JobPlan:
    todo = [r for r in requests if not results.is_done(r)]
    return JobPlan(todo, len(requests), len(requests) - len(todo))


def summary(stats: Stats, plan_: JobPlan, output: str) -> str:
    elapsed = time.monotonic() - stats.t0
    rate = stats.done / elapsed if elapsed > 0 else 0.0
    text = (f"{stats.done} requests in {elapsed:.1f} s ({rate:.2f} requests/s, "
            f"{stats.completion_tokens / elapsed if elapsed > 0 else 0.0:.1f} generated tokens/s): "
            f"{stats.ok} ok, {stats.errors} errors")
    if stats.t_first is not None and stats.done > 1 and stats.t_first - stats.t0 > 0.2 * elapsed:
        text += f"; the first result came after {stats.t_first - stats.t0:.1f} s"  # Ray's start, a long prompt
    if plan_.skipped:
        text += f"; {plan_.skipped} already in {output} were skipped"
    return text + f"; results in {output}"


def run_job(engine_run: Callable[[list[BatchRequest], Callable[[BatchRequest, dict], None]], None],
            requests: list[BatchRequest], results: ResultsFile, *, progress: bool,
            echo: Callable[[str], None]) -> Stats:
    """Run `requests` minus those already in `results` with engine_run(todo, on_result), writing
    each result as it comes; a progress bar when asked, and the summary at the end (also after a
    Ctrl-C, which is re-raised)."""
    p = plan(requests, results)
    if p.skipped:
        echo(f"{p.skipped} of {p.total} requests are already in {results.path}: skipped")
    stats = Stats()
    bar = Progress(len(p.todo), progress)
    lock = threading.Lock()

    def on_result(req: BatchRequest, line: dict) -> None:
        if results.write(line):
            with lock:
                stats.add(line)
                bar.update(stats, force=stats.done == len(p.todo))

    bar.update(stats, force=True)
    try:
        engine_run(p.todo, on_result)
    except BaseException as e:
        results.close()  # from now on nothing is written: every finished line is on disk
        bar.clear()
        why = "interrupted" if isinstance(e, KeyboardInterrupt) else "stopped"
        echo(f"{why}: {summary(stats, p, results.path)}; run the same command again to continue")
        raise
    results.close()
    bar.clear()
    echo(summary(stats, p, results.path))
    return stats
