"""A Batch file run one request at a time against the same file with continuous batching.

Loads MODEL once, then runs the same requests through `qllama.batch.BatchEngine` with 1 slot
(one by one: the server's path, no batching) and with N slots, alternating A B A B (the machines
are shared: compare within one run), and prints requests/s and generated tokens/s per round and
the median ratio.

    python tools/bench_batch.py MODEL [-n 16] [--max-tokens 32] [--parallel 8] [--rounds 2] [-t THREADS]

Requests: chat requests ("Write a short poem about ...") when the model has a chat template,
else completions of Shakespeare-like openings; temperature 0.
"""

from __future__ import annotations

import argparse
import statistics
import time

import qllama
from qllama import batch

TOPICS = ["the sea", "autumn", "a cat", "the moon", "coffee", "a city at night", "rain", "mountains",
          "a library", "trains", "bread", "winter", "a garden", "the stars", "music", "friendship"]
OPENINGS = ["ROMEO:", "JULIET:", "KING HENRY:", "To be, or not", "HAMLET:", "First Citizen:", "MENENIUS:", "O"]


def requests(llm, n: int, max_tokens: int) -> list[batch.BatchRequest]:
    chat = llm.chat_template(None) is not None
    out = []
    for i in range(n):
        if chat:
            text = f"Write a short poem about {TOPICS[i % len(TOPICS)]}." + " Please." * (i // len(TOPICS))
            out.append(batch.BatchRequest(i + 1, f"q{i}", "/v1/chat/completions", {
                "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0}))
        else:
            text = OPENINGS[i % len(OPENINGS)] + " " * (i // len(OPENINGS))
            out.append(batch.BatchRequest(i + 1, f"q{i}", "/v1/completions",
                                          {"prompt": text, "max_tokens": max_tokens, "temperature": 0}))
    return out


def run(engine: batch.BatchEngine, reqs) -> tuple[float, int, dict]:
    lines = {}
    t0 = time.perf_counter()
    engine.run(reqs, lambda r, line: lines.__setitem__(r.custom_id, line))
    dt = time.perf_counter() - t0
    tokens = sum(line["response"]["body"]["usage"]["completion_tokens"] for line in lines.values())
    texts = {k: line["response"]["body"]["choices"][0] for k, line in lines.items()}
    return dt, tokens, texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("-n", type=int, default=16, help="requests")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int)
    a = ap.parse_args()
    llm = qllama.load(a.model, n_threads=a.threads)
    llm.warmup()
    reqs = requests(llm, a.n, a.max_tokens)
    one = batch.BatchEngine(llm, parallel=1)
    many = batch.BatchEngine(llm, parallel=a.parallel)
    run(many, reqs[: a.parallel])  # warm both paths (first forward_many shapes)
    print(f"{llm!r}, {llm.n_threads} threads; {a.n} requests x {a.max_tokens} tokens max")
    print("| round | slots | seconds | requests/s | generated tokens/s |")
    print("| --- | --- | --- | --- | --- |")
    ratios, ref = [], None
    for r in range(a.rounds):
        times = {}
        for name, eng in (("1", one), (str(a.parallel), many)):
            dt, tokens, texts = run(eng, reqs)
            if ref is None:
                ref = texts
            elif texts != ref:
                print("warning: the answers differ between runs")
            times[name] = dt
            print(f"| {r + 1} | {name} | {dt:.2f} | {a.n / dt:.2f} | {tokens / dt:.1f} |", flush=True)
        ratios.append(times["1"] / times[str(a.parallel)])
    print(f"median speed-up of {a.parallel} slots over one by one: {statistics.median(ratios):.2f}x "
          f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)}); same answers: {texts == ref}")


if __name__ == "__main__":
    main()
