"""Ray: batch jobs over N model replicas (Ray Data) and `qllama serve` as a Ray Serve application.
Needs the ray extra: pip install 'qllama[ray]' (ray[data,serve]).

Batch (`qllama batch MODEL -i IN -o OUT --ray ADDRESS --replicas N`, or `run_on_ray`): the
requests still to answer become a Ray Dataset; `map_batches` hands groups of them to a pool of
N `BatchActor`s, each of which loads the model once and answers its group with `BatchEngine`,
the same in-process server app and continuous-batching scheduler as a local `qllama batch`. The
driver writes each result line to the output file as the groups come back (same format, same
resume rule as the local run: qllama.batch).

Serve (`serve run qllama.integrations.ray:app model=MODEL num_replicas=2 parallel=4`): each
replica loads the model and runs `qllama serve`'s own Starlette app (Ray Serve's proxy forwards
to it as ASGI, streams included), with its scheduler in a thread of the replica.

Loopback: Ray replaces 127.0.0.1 by the machine's external address unless
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0; `init` sets it (when unset) and passes the node address
127.0.0.1 for a local cluster or a loopback ADDRESS.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Callable

from ..errors import QllamaError

RAY_HINT = "pip install 'qllama[ray]'"
LOOPBACK = "127.0.0.1"
# read by Ray when it is imported: keep 127.0.0.1 as given (else Ray swaps in the external address)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def _ray():
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise QllamaError(f"Ray is not installed: {RAY_HINT}") from None
    return ray


def _loopback(address: str) -> bool:
    host = address.split("://", 1)[-1].rsplit(":", 1)[0]
    return address == "local" or host in ("127.0.0.1", "localhost") or host.startswith("127.")


def init(address: str, *, num_cpus: int | None = None) -> bool:
    """Connect to the Ray cluster at `address` (`local`: start one on 127.0.0.1 for this process).
    Returns True if this call started or connected Ray (the caller then shuts it down)."""
    ray = _ray()
    if ray.is_initialized():
        return False
    kw: dict = {"logging_level": "WARNING", "log_to_driver": True}
    kw["address"] = address  # "local": always a new local instance, never a cluster found on the machine
    if address == "local":
        kw.update(include_dashboard=False, num_cpus=num_cpus or os.cpu_count() or 1)
    if _loopback(address):
        kw["_node_ip_address"] = LOOPBACK
    try:
        ray.init(**kw)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise QllamaError(f"cannot reach the Ray cluster at {address}: {str(e).strip().splitlines()[0]}") from None
    return True


# -- batch jobs: Ray Data -------------------------------------------------------------------------


class BatchActor:
    """One model replica of a Ray Data batch job: `__call__` answers a group of requests (rows of
    BatchRequest.record() as JSON) with the server's continuous batching; returns their result lines."""

    def __init__(self, model: str, model_name: str, n_threads: int | None = None, parallel: int = 8,
                 n_ctx: int | None = None, chunk: int = 128, chat_template: str | None = None,
                 type_k: str | None = None, type_v: str | None = None):
        from ..api import load
        from ..batch import BatchEngine

        llm = load(model, n_ctx=n_ctx, n_threads=n_threads, type_k=type_k, type_v=type_v)
        llm.chat_template(chat_template)
        llm.warmup()
        self.engine = BatchEngine(llm, model_name=model_name, parallel=parallel, chunk=chunk,
                                  chat_template=chat_template)

    def __call__(self, rows: dict) -> dict:
        import numpy as np

        from ..batch import BatchRequest

        reqs = [BatchRequest.from_record(json.loads(r)) for r in rows["request"]]
        out: dict[int, str] = {}
        self.engine.run(reqs, lambda req, line: out.__setitem__(req.line, json.dumps(line, ensure_ascii=False)))
        return {"line": np.array([r.line for r in reqs], dtype=np.int64),
                "result": np.array([out[r.line] for r in reqs], dtype=object)}


def run_on_ray(todo, on_result: Callable, *, address: str, model: str, model_name: str, replicas: int = 1,
               cpus_per_replica: int = 1, n_threads: int | None = None, parallel: int = 8, n_ctx: int | None = None,
               chunk: int = 128, chat_template: str | None = None, type_k: str | None = None,
               type_v: str | None = None, rows_per_call: int = 16, echo: Callable[[str], None] = lambda m: None) -> None:
    """Answer `todo` (BatchRequests) on `replicas` BatchActors of the Ray cluster at `address`,
    calling on_result(request, line) on this process as each group of results comes back."""
    if not todo:
        return
    ray = _ray()
    # a local Ray: the replicas' CPUs, and one for Ray Data's own tasks (without it, the last
    # replica waited ~30 s for a CPU on 2 cores)
    started = init(address, num_cpus=replicas * cpus_per_replica + 1 if address == "local" else None)
    try:
        from ray.data import ActorPoolStrategy, DataContext

        ctx = DataContext.get_current()
        ctx.enable_progress_bars = False  # ours is on the driver's stderr
        logging.getLogger("ray.data").setLevel(logging.WARNING)
        by_line = {r.line: r for r in todo}
        rows_per_call = max(1, min(rows_per_call, -(-len(todo) // replicas)))  # every replica gets work
        ds = ray.data.from_items([{"request": json.dumps(r.record())} for r in todo], override_num_blocks=-(-len(todo) // rows_per_call))
        kwargs = dict(model=model, model_name=model_name, n_threads=n_threads or cpus_per_replica, parallel=parallel,
                      n_ctx=n_ctx, chunk=chunk, chat_template=chat_template, type_k=type_k, type_v=type_v)
        echo(f"Ray: {replicas} replica{'s' if replicas > 1 else ''} of {model} ({cpus_per_replica} CPU each), "
             f"{len(todo)} requests in groups of {rows_per_call}")
        results = ds.map_batches(BatchActor, fn_constructor_kwargs=kwargs, batch_size=rows_per_call,
                                 compute=ActorPoolStrategy(size=replicas), num_cpus=cpus_per_replica,
                                 batch_format="numpy")
        for group in results.iter_batches(batch_size=None, batch_format="numpy"):
            for line, text in zip(group["line"], group["result"]):
                on_result(by_line[int(line)], json.loads(text))
    except Exception as e:  # noqa: BLE001 - Ray wraps the actors' failures: one error line
        if isinstance(e, QllamaError):
            raise
        cause = getattr(e, "cause", None) or e
        raise QllamaError(f"the Ray job failed: {type(cause).__name__}: {str(cause).strip().splitlines()[-1] if str(cause).strip() else ''}") from None
    finally:
        if started:
            ray.shutdown()


# -- serving: Ray Serve -----------------------------------------------------------------------------


class ServeReplica:
    """One `qllama serve` replica inside Ray Serve: the model, its scheduler (in a thread of the
    replica) and the server's Starlette app as the deployment's ASGI ingress."""

    def __init__(self, model: str, model_name: str | None = None, parallel: int = 4, n_ctx: int | None = None,
                 n_threads: int | None = None, chunk: int = 128, max_queue: int = 64,
                 chat_template: str | None = None, api_key: str | None = None):
        from ..api import load
        from ..server.app import ServerState, create_app
        from ..server.engine import model_forward
        from ..server.scheduler import Scheduler

        llm = load(model, n_ctx=n_ctx, n_threads=n_threads)
        llm.chat_template(chat_template)
        llm.warmup()
        forward, new_cache, _ = model_forward(llm)
        self.scheduler = Scheduler(forward, new_cache, llm.tokenizer, llm.n_ctx, n_parallel=parallel,
                                   max_queue=max_queue, chunk=chunk)
        self.scheduler.start()
        self._app = create_app(ServerState(llm, self.scheduler, model_name or os.path.basename(model),
                                           api_key=api_key, chat_template=chat_template))

    def __serve_build_asgi_app__(self):
        return self._app

    def __del__(self):
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.close()


def _arg(args: dict, key: str, cast, default):
    v = args.get(key)
    if v is None or v == "":
        return default
    try:
        return cast(v)
    except (TypeError, ValueError):
        raise ValueError(f"{key}={v!r}: expected {cast.__name__}") from None


def app(args: dict):
    """The Ray Serve application builder: `serve run qllama.integrations.ray:app model=MODEL
    [num_replicas=N] [parallel=4] [num_cpus=1] [threads=N] [ctx_size=N] [batch_size=128]
    [chat_template=NAME|FILE] [alias=NAME] [api_key=KEY]`."""
    from ray import serve

    if not args.get("model"):
        raise ValueError("give the model: serve run qllama.integrations.ray:app model=MODEL")
    num_cpus = _arg(args, "num_cpus", float, 1.0)
    replica = serve.deployment(
        serve.ingress()(ServeReplica), name="qllama",
        num_replicas=_arg(args, "num_replicas", int, 1),
        ray_actor_options={"num_cpus": num_cpus},
        max_ongoing_requests=_arg(args, "max_ongoing_requests", int, 64),
    )
    return replica.bind(
        model=args["model"], model_name=args.get("alias") or None, parallel=_arg(args, "parallel", int, 4),
        n_ctx=_arg(args, "ctx_size", int, None), n_threads=_arg(args, "threads", int, max(1, int(num_cpus))),
        chunk=_arg(args, "batch_size", int, 128), chat_template=args.get("chat_template") or None,
        api_key=args.get("api_key") or None)
