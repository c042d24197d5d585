"""`qllama serve MODEL`: an OpenAI-compatible HTTP server with continuous batching.

Needs the optional extra: pip install 'qllama[server]' (Starlette + uvicorn).
"""

from __future__ import annotations

import os
import signal
import socket
import threading

import click

from ..errors import QllamaError
from .model_ref import ModelRef
from .options import kv_cache_options

EXTRA_HINT = "pip install 'qllama[server]'"


def security_warning(host: str, api_key: str | None) -> str | None:
    """A warning when the server listens beyond this machine without an API key."""
    loopback = host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")
    if loopback or api_key:
        return None
    return (f"warning: listening on {host} without --api-key: anyone who can reach this port "
            f"can use the model (set --api-key KEY or bind 127.0.0.1)")


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise QllamaError(f"cannot resolve host {host!r}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise QllamaError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


@click.command("serve")
@click.argument("model", type=ModelRef(dir_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535), help="Port (0: any free port).")
@click.option("-c", "--ctx-size", type=click.IntRange(min=0), default=0,
              help="Context size of each slot (0 = min(model's, 4096)).")
@click.option("-t", "--threads", type=click.IntRange(min=1), help="Threads (default: physical cores).")
@click.option("-np", "--parallel", default=4, show_default=True, type=click.IntRange(1, 64),
              help="Requests decoded together (slots).")
@click.option("-b", "--batch-size", default=128, show_default=True, type=click.IntRange(min=1),
              help="Prompt tokens evaluated per step, for all new requests together (chunked prefill).")
@click.option("--queue", "max_queue", default=64, show_default=True, type=click.IntRange(min=0),
              help="Requests that may wait for a slot; beyond: 503 with Retry-After.")
@click.option("--api-key", envvar="QLLAMA_API_KEY", help="Require this key (Authorization: Bearer KEY). Env: QLLAMA_API_KEY.")
@click.option("--alias", help="Model name reported by /v1/models (default: the file name).")
@click.option("--chat-template", "chat_template", metavar="NAME|FILE",
              help="Chat format of /v1/chat/completions: a built-in name or a Jinja file (default: the GGUF's own; "
                   "without one, chat requests get a 400 and /v1/completions still works).")
@kv_cache_options
@click.option("-v", "--verbose", is_flag=True, help="Log every HTTP request.")
def command(model, host, port, ctx_size, threads, parallel, batch_size, max_queue, api_key, alias, chat_template,
            type_k, type_v, verbose):
    """Serve MODEL over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models)."""
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        raise QllamaError(f"qllama serve needs the server extra: {EXTRA_HINT}") from None
    from ..api import load
    from ..server.app import ServerState, create_app
    from ..server.engine import model_forward
    from ..server.scheduler import Scheduler

    err = lambda msg: click.echo(msg, err=True)  # noqa: E731
    warning = security_warning(host, api_key)
    if warning:
        err(warning)
    llm = load(model, n_ctx=ctx_size or None, n_threads=threads, type_k=type_k, type_v=type_v, warmup_next=True)
    template = llm.chat_template(chat_template)  # a bad NAME or FILE fails here, before serving
    from .warm import warm_up

    warm_up(llm)  # compile (first run) or load the kernels now, not in the first client's request
    try:  # llguidance's view of the vocabulary (0.3-2 s), built now rather than in the first structured request
        from ..generation.constrained import llg_tokenizer

        llg_tokenizer(llm.tokenizer)
    except QllamaError:
        pass  # llguidance is not installed: a request that needs it gets a 400 saying so
    forward, new_cache, batched = model_forward(llm)
    scheduler = Scheduler(forward, new_cache, llm.tokenizer, llm.n_ctx, n_parallel=parallel,
                          max_queue=max_queue, chunk=batch_size)
    name = alias or os.path.basename(model)
    app = create_app(ServerState(llm, scheduler, name, api_key=api_key, chat_template=chat_template))
    sock = bind_socket(host, port)
    bound = sock.getsockname()
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    err(f"loaded {llm!r} in {llm.load_s:.2f} s, {llm.n_threads} threads; {parallel} slots of {llm.n_ctx} tokens "
        f"({'one pass per step' if batched else 'slots evaluated one after another'}); "
        f"chat template: {template.name if template is not None else 'none (chat requests get a 400)'}")
    err(f"listening on http://{shown}:{bound[1]} (OpenAI base_url http://{shown}:{bound[1]}/v1)")

    server = _Server(uvicorn.Config(app, log_level="info" if verbose else "warning", access_log=verbose,
                                    timeout_graceful_shutdown=10, lifespan="off"), scheduler)
    # The model runs on this, the main, thread and HTTP on another: a Numba parallel region
    # launched from any other thread cost ~90 us instead of ~12 us (OpenMP layer, measured), and
    # one stream decoded at 0.6x `qllama run`'s speed. uvicorn leaves signals to the main thread
    # when it runs elsewhere, so SIGTERM / Ctrl-C reach `server.handle_exit` from here.
    failed: list[BaseException] = []

    def serve_http() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread below
            failed.append(e)
        finally:
            scheduler.close()  # the HTTP side has ended (shutdown or failure): so does the model loop

    http = threading.Thread(target=serve_http, name="qllama-http", daemon=True)
    previous = {sig: signal.signal(sig, server.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    http.start()
    try:
        scheduler.run()
    finally:
        scheduler.close()
        server.should_exit = True
        http.join(timeout=20)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    if failed:
        raise failed[0]
    err("server stopped")


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but SIGTERM/SIGINT first end every in-flight request with an error
        event (so streams close and the graceful shutdown finishes), and the process then exits 0
        instead of re-raising the signal."""

        def __init__(self, config, scheduler):
            super().__init__(config)
            self.scheduler = scheduler

        def handle_exit(self, sig, frame) -> None:
            self.scheduler.close("the server is shutting down")
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True

    return Server


def _Server(config, scheduler):
    return _server_class()(config, scheduler)
