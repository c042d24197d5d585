"""Benchmark: what KV-cache reuse saves in a multi-turn chat, and that the API reuses as the CLI does.

1. Tokens evaluated per turn, one greedy conversation played three ways:
   - `qllama chat`'s path (`ChatSession.ask`: `qllama.chat.fit`, then `Model.chat_prompt_ids`);
   - the API's path (`Model.chat` with the whole message list, the caller keeping the answers);
   - re-tokenized history without the answer-token splice (`Model.chat_tokens`), for comparison.
   The first two must be equal turn by turn (the exit status is 1 otherwise).
2. Time (skipped with --reps 0): the same conversation on the CLI path, alternating with a run
   whose cache is emptied before every turn; the median prompt-evaluation time of each, per turn.

    python tools/bench_chat_reuse.py                       # a synthetic model (written to a temp dir)
    python tools/bench_chat_reuse.py --small --seed 12 --reps 0 --answer 8   # the splice at work
    python tools/bench_chat_reuse.py MODEL.gguf [--chat-template NAME|FILE] --turns 8 --answer 32 --reps 3
    python tools/bench_chat_reuse.py ../shared/models/shakespeare-spm-Q4_K_M.gguf --chat-template llama-2
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
    """The CLI path: per turn (prompt tokens in total, tokens evaluated, prompt seconds)."""
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


def play_api(llm, turns: int, answer: int, template: str | None, splice: bool = True) -> list[tuple[int, int]]:
    """The API path (`Model.chat`), or without the splice (`chat_tokens` + `stream`): per turn
    (prompt tokens in total, tokens evaluated)."""
    llm.session.reset()
    msgs: list[dict] = []
    rows = []
    for i in range(turns):
        msgs.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
        if splice:
            text = "".join(llm.chat(msgs, chat_template=template, max_tokens=answer, temperature=0.0))
        else:
            ids = llm.chat_tokens(msgs, chat_template=template)
            text = "".join(c.text for c in llm.stream(ids, max_tokens=answer, temperature=0.0))
        t = llm.last_timings
        rows.append((t.prompt_tokens + t.cached_tokens, t.prompt_tokens))
        msgs.append({"role": "assistant", "content": text})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="GGUF model (default: write a synthetic one)")
    ap.add_argument("--chat-template", help="a built-in name (llama-3, chatml, ...) or a Jinja file")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--answer", type=int, default=32, help="tokens per answer")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (0: token counts only)")
    ap.add_argument("--seed", type=int, default=0, help="weights of the synthetic model")
    ap.add_argument("--small", action="store_true",
                    help="a tiny synthetic model (64-dim, 2 layers, f32) whose random answers split non-canonically "
                         "(with --seed 12), so the splice shows")
    ap.add_argument("-c", "--ctx-size", type=int, default=0)
    ap.add_argument("-t", "--threads", type=int)
    a = ap.parse_args()

    import qllama
    from qllama.cli.chat_cmd import ChatSession

    tmp = tempfile.TemporaryDirectory()
    model = a.model
    if model is None:
        from tools.make_model import ModelSpec, write_model

        model = str(Path(tmp.name) / "bench-chat.gguf")
        shape = dict(n_embd=64, n_layer=2, weight_type="f32") if a.small else \
            dict(n_embd=512, n_layer=8, n_head=8, n_head_kv=4, n_ff=1536, weight_type="q8_0")
        write_model(model, ModelSpec(**shape, n_ctx=4096, chat_template=PLAIN_TEMPLATE, name="bench-chat", seed=a.seed))

    llm = qllama.load(model, n_ctx=a.ctx_size or None, n_threads=a.threads)
    chat = ChatSession(llm, chat_template=a.chat_template, max_tokens=a.answer,
                       sampling={"temperature": 0.0}, out=io.StringIO(), err=io.StringIO())
    print(f"model {Path(model).name}, {llm.n_threads} threads, n_ctx {llm.n_ctx}, {a.answer}-token answers, "
          f"chat template {chat.template_name}")

    cli_rows = play(chat, a.turns, True)
    api_rows = play_api(llm, a.turns, a.answer, a.chat_template)
    plain_rows = play_api(llm, a.turns, a.answer, a.chat_template, splice=False)
    print("tokens evaluated per turn (prompt tokens in total in brackets)")
    print(f"{'turn':>4} | {'qllama chat':>14} | {'Model.chat':>14} | {'no splice':>14}")
    for i, (c, p, q) in enumerate(zip(cli_rows, api_rows, plain_rows)):
        print(f"{i + 1:>4} | {c[1]:>6} ({c[0]:>5}) | {p[1]:>6} ({p[0]:>5}) | {q[1]:>6} ({q[0]:>5})")
    same = [(c[0], c[1]) for c in cli_rows] == api_rows
    print(f"total evaluated: qllama chat {sum(c[1] for c in cli_rows)}, Model.chat {sum(p[1] for p in api_rows)}, "
          f"no splice {sum(q[1] for q in plain_rows)}; API == CLI per turn: {same}")

    if a.reps > 0:
        play(chat, 1, True)  # warm-up (JIT caches, page cache)
        runs = {True: [], False: []}
        for _ in range(a.reps):
            for reuse in (True, False):  # alternate, so that machine noise hits both alike
                runs[reuse].append(play(chat, a.turns, reuse))
        print(f"\nprompt time, CLI path, median of {a.reps} alternating repetitions")
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
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
