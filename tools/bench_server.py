"""Aggregate decode throughput and time to first token of OpenAI-compatible servers, under load.

For each server (qllama serve, and llama-cpp-python's `python -m llama_cpp.server` on the same
file and threads), at 1, 2, 4, 8 concurrent streams: every stream asks /v1/completions for
`-n` tokens of a distinct prompt (temperature 0, streamed). Reported per level:

- aggregate t/s: all completion tokens / wall time from the first request to the last token;
- per-stream t/s: median over the streams of (tokens - 1) / (last token - first token);
- TTFT: median and max time from sending a request to its first text chunk, all streams
  starting together (queueing and prefill of the others included);
- TTFT of a late joiner: one more request sent while the others are decoding, in a second,
  shorter pass of the level (LATE_TOKENS per stream), so that its prompt and tokens do not
  slow the streams whose aggregate and per-stream rates are measured;
- server's own share of step time (qllama): 1 - (wall in forward passes) / (wall in whole steps),
  from its /metrics counters: what sampling, detokenizing and handing events to the HTTP thread
  add to each step (the HTTP side's work between steps, while the model waits for the GIL,
  shows inside the forward passes instead: compare one stream's per-stream rate with bench tg);
- server CPU ms/token: CPU time (user + system, all threads) the server process used during the
  level (prompts included), per completion token. Unlike wall time it barely moves when other processes share the
  machine, so "tokens per CPU-second x one stream" is the batching gain a quiet machine would see
  (as long as the kernels' threads do not spin-wait much; compare with -t 1 on a busy machine).

With qllama, each repetition also runs `qllama bench` tg (the same decode without a server,
one token at a time) right after the server, so the server's own cost shows in the same run:
one stream's per-stream t/s over bench tg (like for like: nothing else runs in that pass).

With llama.cpp, each repetition also measures llama.cpp's own batched decode
(`tools/bench_lcpp_batch.py --engines llama.cpp`: k sequences per llama_decode, in a
subprocess, at the same levels and threads): the ratio qllama's server has to reach at every
stream count (issue 32). The table shows it beside qllama's rows.

The load average is printed with every level: on a busy machine, wall-clock rates are unreliable.

The ratio to one stream is what continuous batching buys: decode is bandwidth-bound, so one
pass over the weights for N streams costs little more than for one. llama-cpp-python's server
serves one request at a time (queued: it is started with --interrupt_requests False, else a new
request would abort the running one), so its aggregate stays flat. The servers run one after another
(A, B, A, B... with -r), on 127.0.0.1, and are always stopped.

    python tools/bench_server.py bench-models/llama-3.2-1b-q4_k_m.gguf -t 2 -n 64 -r 2
    python tools/bench_server.py model.gguf --levels 1,2 --no-llama-cpp     # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hum old songs "
         "about rivers mountains stars and the long road home").split()


def prompt_text(i: int, n_words: int) -> str:
    """A distinct prompt per stream (no shared prefix beyond the first word)."""
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(n_words))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far; NaN where /proc is missing."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on 127.0.0.1 with a /v1/completions endpoint; `stop()` always kills it."""

    def __init__(self, name: str, cmd: list[str], url: str, ready_timeout: float = 600.0):
        self.name = name
        self.url = url
        self.log = open(os.devnull, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        end = time.monotonic() + ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with status {self.proc.returncode}: {' '.join(cmd)}")
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"{name} did not start in {ready_timeout:.0f} s")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(20)
        self.log.close()


def qllama_server(model: str, threads: int, parallel: int, n_ctx: int) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "qllama", "serve", model, "--port", str(port), "-t", str(threads),
           "--parallel", str(parallel), "-c", str(n_ctx)]
    return Server("qllama", cmd, f"http://127.0.0.1:{port}")


def llama_cpp_server(model: str, threads: int, n_ctx: int) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", model, "--host", "127.0.0.1", "--port", str(port),
           "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx),
           "--n_batch", "512", "--verbose", "False",
           "--interrupt_requests", "False"]  # by default a new request aborts the running stream: queue instead
    return Server("llama.cpp", cmd, f"http://127.0.0.1:{port}")


def stream_one(url: str, prompt: str, n: int, out: dict) -> None:
    """One streamed completion; fills out with t_send, t_first, t_last, tokens."""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    out["t_send"] = time.perf_counter()
    chunks = 0
    usage = None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                usage = obj["usage"]["completion_tokens"]
            if obj.get("choices") and obj["choices"][0].get("text"):
                now = time.perf_counter()
                out.setdefault("t_first", now)
                out["t_last"] = now
                chunks += 1
    out["tokens"] = usage if usage is not None else chunks  # llama-cpp-python sends no usage


LATE_TOKENS = 24  # tokens per stream of the late-joiner pass (the late joiner itself asks for 8)


def run_streams(url: str, streams: int, n: int, prompt_words: int, late: bool) -> tuple[list[dict], dict, float]:
    """`streams` concurrent completions of n tokens; with `late`, one more request of 8 tokens
    once every stream decodes. (per-stream results, the late joiner's, the start time)"""
    outs = [{} for _ in range(streams)]
    threads = [threading.Thread(target=stream_one, args=(url, prompt_text(i, prompt_words), n, outs[i]))
               for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    late_out: dict = {}
    if late:
        while any("t_first" not in o for o in outs) and any(t.is_alive() for t in threads):
            time.sleep(0.01)
        lt = threading.Thread(target=stream_one, args=(url, prompt_text(99, prompt_words), 8, late_out))
        lt.start()
        threads.append(lt)
    for t in threads:
        t.join()
    return outs, late_out, t0


def step_seconds(url: str) -> tuple[float, float]:
    """(wall seconds in forward passes, in whole steps) so far, from qllama's /metrics; NaNs elsewhere."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return float("nan"), float("nan")
    values = dict(line.split(" ", 1) for line in text.splitlines() if line.startswith("qllama:"))
    return (float(values.get("qllama:forward_seconds_total", "nan")), float(values.get("qllama:step_seconds_total", "nan")))


def run_level(url: str, streams: int, n: int, prompt_words: int, late: bool, pid: int | None = None) -> dict:
    """One level: the measured pass (rates, TTFT, CPU), then with `late` the late-joiner pass."""
    cpu0 = cpu_seconds(pid) if pid else float("nan")
    fw0, st0 = step_seconds(url)
    outs, _, t0 = run_streams(url, streams, n, prompt_words, late=False)
    cpu = (cpu_seconds(pid) if pid else float("nan")) - cpu0
    fw1, st1 = step_seconds(url)
    late_out = run_streams(url, streams, LATE_TOKENS, prompt_words, late=True)[1] if late else {}
    t_end = max(o.get("t_last", t0) for o in outs)
    tokens = sum(o.get("tokens", 0) for o in outs)
    ttft = [o["t_first"] - o["t_send"] for o in outs if "t_first" in o]
    per = [(o["tokens"] - 1) / (o["t_last"] - o["t_first"]) for o in outs
           if o.get("tokens", 0) > 1 and o["t_last"] > o["t_first"]]
    return {
        "streams": streams,
        "tokens": tokens,
        "agg_tps": sum(o.get("tokens", 0) for o in outs) / (t_end - t0) if t_end > t0 else 0.0,
        "cpu_ms": 1000.0 * cpu / tokens if tokens else float("nan"),
        "own": 1.0 - (fw1 - fw0) / (st1 - st0) if st1 > st0 else float("nan"),  # NaN: no qllama counters
        "load": os.getloadavg()[0],
        "stream_tps": statistics.median(per) if per else 0.0,
        "ttft_med": statistics.median(ttft) if ttft else float("nan"),
        "ttft_max": max(ttft) if ttft else float("nan"),
        "ttft_late": (late_out["t_first"] - late_out["t_send"]) if "t_first" in late_out else float("nan"),
    }


def bench_tg(model: str, threads: int, n: int, n_ctx: int) -> float:
    """`qllama bench` tg: tokens/s of plain one-token decode in its own process."""
    cmd = [sys.executable, "-m", "qllama", "bench", model, "-p", "0", "-n", str(n), "-r", "1", "-t", str(threads),
           "--json", "-q"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"qllama bench failed: {out.stderr.strip()[-300:]}")
    return float(json.loads(out.stdout)["results"][0]["mean_tps"])


def lcpp_batch(model: str, threads: int, levels: list[int], n: int) -> dict[int, float]:
    """llama.cpp's batched-decode throughput ratio k / c(k) per level (tools/bench_lcpp_batch.py)."""
    tool = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_lcpp_batch.py")
    ks = sorted(set([1] + levels))
    cmd = [sys.executable, tool, model, "-t", str(threads), "--ks", ",".join(map(str, ks)), "--engines", "llama.cpp",
           "--reps", "1", "--steps", str(min(n, 16)), "--depth", "32"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"bench_lcpp_batch failed: {out.stderr.strip()[-300:]}")
    ratios = {}
    for line in out.stdout.splitlines():  # | llama.cpp | k | step ms | c(k) | throughput | ...
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 5 and cells[0] == "llama.cpp" and cells[1].isdigit():
            ratios[int(cells[1])] = float(cells[4])
    return ratios


def lcpp_ratio(batched: list[dict[int, float]], streams: int) -> str:
    """The median over repetitions of llama.cpp's batched ratio at this many sequences, or ""."""
    got = [r[streams] for r in batched if streams in r]
    return f"{statistics.median(got):.2f}" if got else ""


def _percent(share: float) -> str:
    return "" if share != share else f"{100.0 * share:.1f}%"  # (NaN: the server has no such counters)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--max-tokens", type=int, default=64, help="tokens per stream")
    ap.add_argument("--levels", default="1,2,4,8", help="concurrent streams to measure")
    ap.add_argument("--prompt-words", type=int, default=24)
    ap.add_argument("-c", "--ctx-size", type=int, default=1024)
    ap.add_argument("-r", "--repetitions", type=int, default=1)
    ap.add_argument("--no-llama-cpp", action="store_true", help="only qllama")
    ap.add_argument("--no-late", action="store_true", help="skip the late-joiner TTFT")
    ap.add_argument("--no-bench-tg", action="store_true", help="skip the `qllama bench` tg run of each repetition")
    ap.add_argument("--no-lcpp-batch", action="store_true", help="skip llama.cpp's batched decode (bench_lcpp_batch.py)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    a = ap.parse_args()
    levels = [int(x) for x in a.levels.split(",")]
    kinds = ["qllama"] + ([] if a.no_llama_cpp else ["llama.cpp"])
    rows = []
    for rep in range(a.repetitions):
        for kind in kinds:
            if kind == "qllama":
                srv = qllama_server(a.model, a.threads, max(levels) + 1, a.ctx_size)
            else:
                try:
                    srv = llama_cpp_server(a.model, a.threads, a.ctx_size)
                except RuntimeError as e:  # e.g. llama-cpp-python without its [server] extra
                    print(f"llama.cpp server not measured: {e}", file=sys.stderr, flush=True)
                    srv = None
            if srv is not None:
                try:
                    run_level(srv.url, 1, 4, a.prompt_words, late=False)  # warm-up (kernels, caches)
                    for streams in levels:
                        row = run_level(srv.url, streams, a.max_tokens, a.prompt_words, late=not a.no_late,
                                        pid=srv.proc.pid)
                        row.update(server=kind, rep=rep)
                        rows.append(row)
                        print(f"{kind:9s} rep {rep} streams {streams}: {row['agg_tps']:.2f} t/s aggregate, "
                              f"TTFT median {row['ttft_med']:.2f} s, {row['cpu_ms']:.1f} CPU ms/token, "
                              f"load {row['load']:.1f}", file=sys.stderr, flush=True)
                finally:
                    srv.stop()
            if kind == "llama.cpp" and not a.no_lcpp_batch:
                ratios = lcpp_batch(a.model, a.threads, levels, a.max_tokens)
                rows.append({"server": "lcpp-batch", "rep": rep, "ratios": ratios, "load": os.getloadavg()[0]})
                print(f"llama.cpp batched decode rep {rep}: " + ", ".join(f"{k} seq {r:.2f}x" for k, r in ratios.items())
                      + f", load {rows[-1]['load']:.1f}", file=sys.stderr, flush=True)
            if kind == "qllama" and not a.no_bench_tg:
                tg = bench_tg(a.model, a.threads, a.max_tokens, a.ctx_size)
                rows.append({"server": "bench", "rep": rep, "tg": tg, "load": os.getloadavg()[0]})
                print(f"qllama bench tg{a.max_tokens} rep {rep}: {tg:.2f} t/s, load {rows[-1]['load']:.1f}",
                      file=sys.stderr, flush=True)
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    loads = [r["load"] for r in rows]
    print(f"\nmodel {os.path.basename(a.model)}, {a.threads} threads, {a.max_tokens} tokens per stream, "
          f"{a.prompt_words}-word prompts, medians over {a.repetitions} repetition(s), "
          f"load average {min(loads):.1f}-{max(loads):.1f}\n")
    batched = [r["ratios"] for r in rows if r["server"] == "lcpp-batch"]
    print("| server | streams | aggregate t/s | x one stream | per-stream t/s | TTFT median s | TTFT max s "
          "| late joiner TTFT s | server CPU ms/token | tokens per CPU-s x one stream | server's own share of step time "
          "| llama.cpp batched decode x one |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for kind in kinds:
        base = base_cpu = None
        for streams in levels:
            mine = [r for r in rows if r["server"] == kind and r["streams"] == streams]
            if not mine:  # (the llama.cpp server did not start)
                continue
            med = {k: statistics.median(r[k] for r in mine) for k in
                   ("agg_tps", "stream_tps", "ttft_med", "ttft_max", "ttft_late", "cpu_ms", "own")}
            base = base or med["agg_tps"]
            base_cpu = base_cpu or med["cpu_ms"]
            print(f"| {kind} | {streams} | {med['agg_tps']:.2f} | {med['agg_tps'] / base:.2f} | "
                  f"{med['stream_tps']:.2f} | {med['ttft_med']:.2f} | {med['ttft_max']:.2f} | {med['ttft_late']:.2f} | "
                  f"{med['cpu_ms']:.1f} | {base_cpu / med['cpu_ms']:.2f} | {_percent(med['own'])} | {lcpp_ratio(batched, streams)} |")
    tg = [r["tg"] for r in rows if r["server"] == "bench"]
    one = [r["stream_tps"] for r in rows if r["server"] == "qllama" and r["streams"] == 1]
    if tg and one:
        print(f"\nqllama bench tg{a.max_tokens} (no server): {statistics.median(tg):.2f} t/s; one stream through the "
              f"server decodes at {statistics.median(one) / statistics.median(tg):.2f}x that (per-stream t/s)")


if __name__ == "__main__":
    main()
