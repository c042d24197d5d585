"""Benchmark: what KV-cache reuse saves in a multi-turn chat (`qllama chat`'s ChatSession).

Plays the same greedy conversation twice per repetition, alternating: once as `qllama chat` runs
it (the cache keeps the history, only the new turn is evaluated) and once with the cache emptied
before every turn (the whole history is evaluated again). Prints, per turn, the tokens evaluated
and the median prompt-evaluation time of each, and the speedup.

    python tools/bench_chat_reuse.py                       # a synthetic model (written to a temp dir)
    python tools/bench_chat_reuse.py MODEL.gguf [--chat-template FILE] --turns 8 --answer 32 --reps 3
    python tools/bench_chat_reuse.py ../shared/models/shakespeare-spm-Q4_K_M.gguf --builtin llama-2
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

QUESTIONS = [
    "Hello! Who are you, and what can you do for me today?",
    "Tell me a short story about a cat who lived in a lighthouse.",
    "What happened to the cat when the winter storms came?",
    "Did the lighthouse keeper ever find out?",
    "Summarise the story in two sentences.",
    "Now tell it again, but from the point of view of the sea.",
    "Which version do you like better, and why?",
    "Thank you! One last question: what is the moral of the story?",
]

PLAIN_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>{% endif %}")


def play(chat, turns: int, reuse: bool) -> list[tuple[int, int, float]]:
    """One conversation; per turn (prompt tokens in total, tokens evaluated, prompt seconds)."""
    chat.conv.turns.clear()
    chat.llm.session.reset()
    rows = []
    for i in range(turns):
        if not reuse:
            chat.llm.session.reset()
        chat.ask(QUESTIONS[i % len(QUESTIONS)])
        t = chat.llm.last_timings
        rows.append((t.prompt_tokens + t.cached_tokens, t.prompt_tokens, t.prompt_s))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="GGUF model (default: write a synthetic one)")
    ap.add_argument("--chat-template", help="Jinja template file")
    ap.add_argument("--builtin", help="use this built-in template family (e.g. llama-2)")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--answer", type=int, default=32, help="tokens per answer")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("-c", "--ctx-size", type=int, default=0)
    ap.add_argument("-t", "--threads", type=int)
    a = ap.parse_args()

    import qllama
    from qllama.chat import BUILTIN_TEMPLATES
    from qllama.cli.chat_cmd import ChatSession

    tmp = tempfile.TemporaryDirectory()
    model = a.model
    if model is None:
        from tools.make_model import ModelSpec, write_model

        model = str(Path(tmp.name) / "bench-chat.gguf")
        write_model(model, ModelSpec(n_embd=512, n_layer=8, n_head=8, n_head_kv=4, n_ff=1536, n_ctx=4096,
                                     weight_type="q8_0", chat_template=PLAIN_TEMPLATE, name="bench-chat"))
    template = a.chat_template
    if a.builtin:
        template = str(Path(tmp.name) / f"{a.builtin}.jinja")
        Path(template).write_text(BUILTIN_TEMPLATES[a.builtin])

    llm = qllama.load(model, n_ctx=a.ctx_size or None, n_threads=a.threads)
    chat = ChatSession(llm, chat_template=template, max_tokens=a.answer,
                       sampling={"temperature": 0.0}, out=io.StringIO(), err=io.StringIO())
    play(chat, 1, True)  # warm-up (JIT caches, page cache)
    runs = {True: [], False: []}
    for _ in range(a.reps):
        for reuse in (True, False):  # alternate, so that machine noise hits both alike
            runs[reuse].append(play(chat, a.turns, reuse))

    print(f"model {Path(model).name}, {llm.n_threads} threads, n_ctx {llm.n_ctx}, {a.answer}-token answers, "
          f"median of {a.reps} alternating repetitions")
    print(f"{'turn':>4} {'prompt':>7} | {'reuse: eval':>11} {'ms':>8} | {'no reuse: eval':>14} {'ms':>8} | speedup")
    tot_r = tot_n = 0.0
    for i in range(a.turns):
        n_prompt, ev_r, _ = runs[True][0][i]
        _, ev_n, _ = runs[False][0][i]
        ms_r = 1000 * statistics.median(r[i][2] for r in runs[True])
        ms_n = 1000 * statistics.median(r[i][2] for r in runs[False])
        tot_r, tot_n = tot_r + ms_r, tot_n + ms_n
        print(f"{i + 1:>4} {n_prompt:>7} | {ev_r:>11} {ms_r:>8.1f} | {ev_n:>14} {ms_n:>8.1f} | {ms_n / max(ms_r, 1e-9):6.1f}x")
    print(f"total prompt time: {tot_r:.0f} ms with reuse, {tot_n:.0f} ms without ({tot_n / max(tot_r, 1e-9):.1f}x)")
    tmp.cleanup()


if __name__ == "__main__":
    main()
