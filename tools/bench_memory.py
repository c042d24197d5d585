"""Peak memory and time to first token, each measured in a fresh process.

Usage:
    python tools/bench_memory.py MODEL [-t 2] [-c 4096] [-n 128] [--prompt-tokens 64] [--engine qllama|llama.cpp|both]
                                 [-r REPS] [--cold] [--json]

A child process starts, imports the engine, loads MODEL, evaluates a prompt of random token ids,
takes the greedy first token, then decodes N-1 more. It reports:
- `ttft_s`: wall time from the parent's spawn of the process to the first token (import, load,
  Numba compile or cache load, prompt evaluation);
- `rss_load_mb`, `rss_peak_load_mb`: RSS and peak RSS (VmHWM) right after load; `rss_peak_mb`:
  peak RSS after generating; `rss_file_mb` / `rss_anon_mb`: its mapped-file and anonymous parts;
- the budget of issue 5: file size + KV cache (at the context size) + 300 MB.

With `--cold`, qllama runs with an empty Numba cache (a new NUMBA_CACHE_DIR): the first run
after install. Without it, the same cache directory is first filled by an untimed run, so the
figure is the warm start.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MB = 1024 * 1024
BUDGET_EXTRA_MB = 300  # issue 5: peak RSS <= file + KV cache + 300 MB


def _status_kb() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process in kB (Linux /proc)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0])
    return out


def _child(engine: str, model: str, n_ctx: int, threads: int, n_gen: int, prompt_tokens: int, batch: int) -> None:
    """Runs in the measured process; prints one JSON line. Imports happen here, after the spawn."""
    t_start = time.time()
    import numpy as np

    rng = np.random.default_rng(1234)
    if engine == "qllama":
        sys.path.insert(0, str(REPO))
        import qllama

        m = qllama.load(model, n_ctx=n_ctx, n_threads=threads, batch_size=batch)
        n_vocab = m.n_vocab
        kv_bytes = m.session.cache.nbytes
        after_load = _status_kb()
        t_loaded = time.time()
        ids = [int(t) for t in rng.integers(0, n_vocab, prompt_tokens)]
        logits, _ = m.session.prefill(ids)
        tok = int(np.argmax(logits))
        t_first = time.time()
        for _ in range(n_gen - 1):
            tok = int(np.argmax(m.session.decode(tok)))
    else:
        import llama_cpp

        llm = llama_cpp.Llama(model, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=batch,
                              verbose=False)
        n_vocab = llm.n_vocab()
        ctx = llm._ctx.ctx
        md = llm.metadata
        arch = md.get("general.architecture", "llama")
        n_layer = int(md[f"{arch}.block_count"])
        n_head = int(md[f"{arch}.attention.head_count"])
        n_head_kv = int(md.get(f"{arch}.attention.head_count_kv", n_head))
        n_embd = int(md[f"{arch}.embedding_length"])
        kv_bytes = 2 * n_layer * n_ctx * n_head_kv * (n_embd // n_head) * 2  # f16 K and V
        after_load = _status_kb()
        t_loaded = time.time()
        ids = [int(t) for t in rng.integers(0, n_vocab, prompt_tokens)]

        def last_logits():
            ptr = llama_cpp.llama_get_logits_ith(ctx, -1)
            return np.ctypeslib.as_array(ptr, shape=(n_vocab,))

        llm.eval(ids)
        tok = int(np.argmax(last_logits()))
        t_first = time.time()
        for _ in range(n_gen - 1):
            llm.eval([tok])
            tok = int(np.argmax(last_logits()))
    t_end = time.time()
    end = _status_kb()
    print(json.dumps({
        "engine": engine,
        "t_start": t_start,
        "t_loaded": t_loaded,
        "t_first": t_first,
        "t_end": t_end,
        "n_gen": n_gen,
        "kv_bytes": kv_bytes,
        "rss_load_mb": after_load["VmRSS"] / 1024,
        "rss_peak_load_mb": after_load["VmHWM"] / 1024,
        "rss_peak_mb": end["VmHWM"] / 1024,
        "rss_file_mb": end.get("RssFile", 0) / 1024,
        "rss_anon_mb": end.get("RssAnon", 0) / 1024,
    }), flush=True)


def measure(engine: str, model: str | os.PathLike, *, n_ctx: int = 4096, threads: int = 2, n_gen: int = 128,
            prompt_tokens: int = 64, batch: int = 512, numba_cache_dir: str | None = None, timeout: float = 1800) -> dict:
    """Spawn one measured process; returns its report plus `ttft_s`, `tg_tps` and the memory budget."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    if numba_cache_dir:
        env["NUMBA_CACHE_DIR"] = numba_cache_dir
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", engine, os.fspath(model), "-c", str(n_ctx),
           "-t", str(threads), "-n", str(n_gen), "--prompt-tokens", str(prompt_tokens), "-b", str(batch)]
    t_spawn = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} child failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    rep = json.loads(proc.stdout.strip().splitlines()[-1])
    file_mb = os.path.getsize(model) / MB
    rep.update(
        ttft_s=rep["t_first"] - t_spawn,
        startup_s=rep["t_start"] - t_spawn,  # interpreter start before our first line ran
        load_s=rep["t_loaded"] - rep["t_start"],
        tg_tps=(rep["n_gen"] - 1) / (rep["t_end"] - rep["t_first"]) if rep["n_gen"] > 1 else 0.0,
        file_mb=file_mb,
        budget_mb=file_mb + rep["kv_bytes"] / MB + BUDGET_EXTRA_MB,
    )
    rep["within_budget"] = rep["rss_peak_mb"] <= rep["budget_mb"]
    return rep


def summarize(reports: list[dict]) -> dict:
    """One row from repeated runs: medians of the times and speeds, the largest RSS figures."""
    out = dict(reports[-1])
    for key in ("ttft_s", "load_s", "startup_s", "tg_tps"):
        out[key] = statistics.median(r[key] for r in reports)
    for key in ("rss_load_mb", "rss_peak_load_mb", "rss_peak_mb", "rss_file_mb", "rss_anon_mb"):
        out[key] = max(r[key] for r in reports)
    out["within_budget"] = out["rss_peak_mb"] <= out["budget_mb"]
    out["runs"] = len(reports)
    out["ttft_all_s"] = [r["ttft_s"] for r in reports]
    return out


def measure_starts(model, *, reps: int = 3, cold: bool = True, llamacpp: bool = True, say=lambda m: None,
                   **kw) -> list[dict]:
    """TTFT / RSS rows: qllama cold (empty Numba cache, once), qllama warm and llama.cpp (reps each,
    alternating, medians)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="qllama-numba-") as cache_dir:
        if cold:
            say("qllama cold start (empty Numba cache)...")
            rows.append({**summarize([measure("qllama", model, numba_cache_dir=cache_dir, **kw)]), "start": "cold"})
        else:  # fill the cache, untimed
            measure("qllama", model, numba_cache_dir=cache_dir, **{**kw, "n_gen": 2})
        warm, other = [], []
        for r in range(reps):
            say(f"warm start {r + 1}/{reps}...")
            warm.append(measure("qllama", model, numba_cache_dir=cache_dir, **kw))
            if llamacpp:
                other.append(measure("llama.cpp", model, **kw))
        rows.append({**summarize(warm), "start": "warm"})
        if other:
            rows.append({**summarize(other), "start": "warm"})
    return rows


def format_report(reps: list[dict]) -> str:
    lines = [
        "| engine | start | runs | TTFT s (median) | import+load s | tg t/s | RSS after load MB | peak RSS MB (file + anon) "
        "| budget MB | ok |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in reps:
        lines.append(
            f"| {r['engine']} | {r.get('start', 'warm')} | {r.get('runs', 1)} | {r['ttft_s']:.2f} | {r['load_s']:.2f} | {r['tg_tps']:.2f} | "
            f"{r['rss_load_mb']:.0f} | {r['rss_peak_mb']:.0f} ({r['rss_file_mb']:.0f} + {r['rss_anon_mb']:.0f}) | "
            f"{r['budget_mb']:.0f} | {'yes' if r['within_budget'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx-size", type=int, default=4096)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-b", "--batch-size", type=int, default=512)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--engine", choices=["qllama", "llama.cpp", "both"], default="qllama")
    ap.add_argument("-r", "--reps", type=int, default=1, help="warm runs per engine (medians are reported)")
    ap.add_argument("--cold", action="store_true", help="also measure qllama with an empty Numba cache")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", choices=["qllama", "llama.cpp"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args.child, args.model, args.ctx_size, args.threads, args.n_gen, args.prompt_tokens, args.batch_size)
        return
    kw = dict(n_ctx=args.ctx_size, threads=args.threads, n_gen=args.n_gen, prompt_tokens=args.prompt_tokens,
              batch=args.batch_size)
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.engine == "llama.cpp":
        reports = [{**summarize([measure("llama.cpp", args.model, **kw) for _ in range(args.reps)]), "start": "warm"}]
    else:
        reports = measure_starts(args.model, reps=args.reps, cold=args.cold, llamacpp=args.engine == "both", say=say,
                                 **kw)
    if args.json:
        print(json.dumps(reports))
    else:
        print(f"model {args.model} ({os.path.getsize(args.model) / MB:.0f} MB), {args.threads} threads, n_ctx "
              f"{args.ctx_size}, prompt {args.prompt_tokens} tokens, {args.n_gen} generated")
        print(format_report(reports))


if __name__ == "__main__":
    main()
