"""Prompt-lookup decoding vs plain greedy on tasks that copy from their prompt.

SmolLM2-135M-Instruct (through its chat template) runs every task of the chosen set in one run.
For each task, runs alternate plain / lookup (A B A B ...) in one process so that a busy machine
slows both alike; reported per task: median decode tokens/s of each (wall and per CPU second of
this process), the speedup, the acceptance rate and tokens per forward, the share of the output
that copies (a token a match of 4+ tokens predicts: the most lookup can take), and whether the
outputs were identical; and the load average.

    python tools/bench_lookup.py [--set held|tune|all] [--tasks fix,edit,quote,json] [--model PATH]
                                 [--lookup 8] [--reps 3] [-n 256] [-t THREADS] [--temp T] [--show]
    python tools/bench_lookup.py --costs [-t THREADS]   # what a verify batch of T rows costs

Tasks: `fix` is the README's (fix a typo in a 30-line function and print it back: the policy was
first tuned on it); `edit` (rename something in a piece of code and print it all back), `quote`
(repeat a passage of a document word for word) and `json` (pretty-print a one-line JSON) each
have a tuning set (`--set tune`: the texts the policy was tuned on) and a held-out set (`--set
held`, the default: texts written before the tuning and not run during it). Without --model it
uses tools/fetch_smollm2.py's cached copy. --temp T > 0 samples (seed = the repetition): the same
distribution, not the same tokens, so the identity check is greedy's only.

--costs: CPU time of one forward of T tokens with every row's logits (a verify batch), in
one-token decode steps (the fused kernels), T = 1..16, medians: where lookup's time goes; a
second line the same through the unfused blocks (models/step.Execution's fused_rows=1: the
fused n-token steps' before), interleaved with the first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import qllama

CODE = '''def parse_config(path):
    """Read a key = value config file into a dict."""
    result = {}
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if "=" not in line:
                raise ValueError(f"line {lineno}: expected key = value")
            key, value = line.split("=", 1)
            key = key.strip()
            value = value.strip()
            if value.lower() in ("true", "yes", "on"):
                value = True
            elif value.lower() in ("false", "no", "off"):
                value = False
            else:
                try:
                    value = int(value)
                except ValueError:
                    try:
                        value = float(value)
                    except ValueError:
                        pass
            if key in result:
                raise ValueError(f"line {lineno}: duplicate key {key!r}")
            result[key] = vaule
    return result
'''

# The tuning set of the copy tasks (issue 32): the texts the policy was tuned on.
EDIT_CODE = '''class Inventory {
  constructor() {
    this.items = new Map();
  }

  add(name, count) {
    const current = this.items.get(name) || 0;
    this.items.set(name, current + count);
    return this.items.get(name);
  }

  remove(name, count) {
    const current = this.items.get(name) || 0;
    if (count > current) {
      throw new Error(`not enough ${name}: have ${current}, asked for ${count}`);
    }
    this.items.set(name, current - count);
    return this.items.get(name);
  }

  total() {
    let sum = 0;
    for (const count of this.items.values()) {
      sum += count;
    }
    return sum;
  }
}
'''

DOCUMENT = (
    "The lighthouse at Point Arden was built in 1871 by the coastal survey, after two ships ran "
    "aground on the reef in the same winter. Its lamp burned whale oil until 1889, then kerosene, "
    "and was electrified in 1934. The keeper's log records that the light was dark for only three "
    "nights in its first sixty years, each time because the supply boat could not land. In 1962 "
    "the station was automated and the last keeper, Margaret Holm, moved to the village, where she "
    "ran the post office for another twenty years. The tower was restored in 1998 with money raised "
    "by the village, and it is now open to visitors on summer weekends."
)

JSON_DATA = ('{"orders":[{"id":1041,"customer":"Ada Park","items":[{"sku":"PEN-01","qty":3},'
             '{"sku":"INK-BLK","qty":1}],"paid":true},{"id":1042,"customer":"Ben Ortiz","items":'
             '[{"sku":"PAD-A5","qty":2}],"paid":false},{"id":1043,"customer":"Chen Wei","items":'
             '[{"sku":"PEN-02","qty":5},{"sku":"PAD-A4","qty":1}],"paid":true}]}')


# The held-out set: written before the tuning, not run during it.
HELD_C = """#include <stdio.h>
#include <string.h>

#define MAX_NAME 32

struct account {
    char name[MAX_NAME];
    long balance;
};

int deposit(struct account *acc, long amount) {
    if (amount <= 0) {
        return -1;
    }
    acc->balance += amount;
    return 0;
}

int withdraw(struct account *acc, long amount) {
    if (amount <= 0 || amount > acc->balance) {
        return -1;
    }
    acc->balance -= amount;
    return 0;
}

void print_account(const struct account *acc) {
    printf("%s: %ld\\n", acc->name, acc->balance);
}
"""

HELD_PY = """class TaskQueue:
    def __init__(self, limit=100):
        self.limit = limit
        self.pending = []
        self.done = []

    def push(self, task):
        if len(self.pending) >= self.limit:
            raise OverflowError("queue is full")
        self.pending.append(task)

    def pop(self):
        if not self.pending:
            return None
        task = self.pending.pop(0)
        self.done.append(task)
        return task

    def stats(self):
        return {"pending": len(self.pending), "done": len(self.done)}
"""

HELD_DOC_1 = (
    "The first bicycles had no pedals at all. Riders of the running machine, shown in Mannheim in "
    "1817, pushed themselves along with their feet and coasted down hills. Pedals fixed to the front "
    "wheel came in the 1860s, and to go faster makers built ever larger front wheels, until the high "
    "wheeler stood taller than its rider. The safety bicycle of the 1880s, with two wheels of equal "
    "size and a chain to the back wheel, ended that race, and with air-filled tyres it became the "
    "machine we ride today."
)

HELD_DOC_2 = (
    "Tea reached Europe through Dutch traders early in the seventeenth century, first as a costly "
    "medicine sold by apothecaries. In Britain it became fashionable after the marriage of Charles II "
    "to Catherine of Braganza, who brought the habit from Portugal. High taxes made smuggling common, "
    "and by the 1780s more tea came into the country illegally than legally, until the tax was cut "
    "from over one hundred percent to about twelve."
)

HELD_JSON_1 = ('{"server": {"host": "0.0.0.0", "port": 8080, "workers": 4}, "database": {"url": '
               '"postgres://db:5432/shop", "pool": 10, "timeout": 30}, "features": ["search", "cart", '
               '"reviews"], "debug": false}')

HELD_JSON_2 = ('{"products": [{"sku": "LMP-220", "name": "Desk lamp", "price": 24.5, "stock": 12}, '
               '{"sku": "CHR-031", "name": "Office chair", "price": 139.0, "stock": 3}, {"sku": '
               '"MUG-007", "name": "Coffee mug", "price": 6.25, "stock": 48}], "currency": "EUR"}')

# the tuning set's other texts
TUNE_PY = """import csv

def parse_row(row):
    name, qty, price = row
    return {"name": name.strip(), "qty": int(qty), "price": float(price)}

def load(path):
    items = []
    with open(path, newline="") as fh:
        reader = csv.reader(fh)
        next(reader)
        for row in reader:
            items.append(parse_row(row))
    return items

def total(items):
    return sum(item["qty"] * item["price"] for item in items)
"""

TUNE_DOC_2 = (
    "Bees communicate the location of flowers through a movement called the waggle dance. A forager "
    "that has found a good source returns to the hive and runs a short straight line while shaking its "
    "body, then circles back to the start and repeats the run. The angle of the run relative to vertical "
    "shows the direction of the flowers relative to the sun, and the length of the run shows the distance."
)

TUNE_JSON_2 = ('{"name": "Ada Park", "email": "ada@example.com", "age": 34, "tags": ["admin", "editor"], '
               '"address": {"street": "12 Elm Road", "city": "Leeds", "zip": "LS1 4AB"}}')


def edit(old: str, new: str, code: str) -> str:
    return f"Rename `{old}` to `{new}` everywhere in this code and print the whole code back:\n\n{code}"


def quote(document: str) -> str:
    return f"Repeat the following text exactly, word for word:\n\n{document}"


def reformat(data: str) -> str:
    return f"Pretty-print this JSON with an indent of two spaces:\n\n{data}"


class Task(NamedTuple):
    name: str
    kind: str  # fix, edit, quote or json
    set: str  # tune (the policy was tuned on it), held (held out), readme (the README's task)
    prompt: str


TASK = "Fix the typo in this function and print the whole corrected function back:\n\n" + CODE
TASKS = [
    Task("fix", "fix", "readme", TASK),
    Task("edit-t1", "edit", "tune", edit("total", "count", EDIT_CODE)),
    Task("edit-t2", "edit", "tune", edit("parse_row", "parse_record", TUNE_PY)),
    Task("quote-t1", "quote", "tune", quote(DOCUMENT)),
    Task("quote-t2", "quote", "tune", quote(TUNE_DOC_2)),
    Task("json-t1", "json", "tune", reformat(JSON_DATA)),
    Task("json-t2", "json", "tune", reformat(TUNE_JSON_2)),
    Task("edit-h1", "edit", "held", edit("withdraw", "take_out", HELD_C)),
    Task("edit-h2", "edit", "held", edit("push", "put", HELD_PY)),
    Task("quote-h1", "quote", "held", quote(HELD_DOC_1)),
    Task("quote-h2", "quote", "held", quote(HELD_DOC_2)),
    Task("json-h1", "json", "held", reformat(HELD_JSON_1)),
    Task("json-h2", "json", "held", reformat(HELD_JSON_2)),
]


def run(model: qllama.Model, ids: list[int], n: int, lookup: int, temp: float = 0.0,
        seed: int = 0) -> tuple[list[int], object, float]:
    """(generated ids, Timings, CPU seconds of this process during the decode)."""
    out: list[int] = []
    chunks = model.stream(ids, max_tokens=n, temperature=temp, seed=seed, lookup=lookup)
    first = next(chunks)  # the prompt is evaluated before the first chunk: CPU time from here on
    out += first.token_ids
    c0 = time.process_time()
    for chunk in chunks:
        out += chunk.token_ids
    cpu = time.process_time() - c0
    return out, model.last_timings, cpu


class Result(NamedTuple):
    task: Task
    tokens: int
    plain_tps: float  # medians
    lookup_tps: float
    plain_cpu_tps: float  # tokens per CPU second: the work per token, less sensitive to a busy machine
    lookup_cpu_tps: float
    accepted: int  # of the last lookup run
    drafted: int
    per_forward: float
    identical: bool | str
    text: str
    copied: float  # share of the output tokens a match of MIN_MATCH+ tokens predicts: what lookup can take


def copied_share(prompt: list[int], out: list[int]) -> float:
    """The share of out[1:] (the first token comes from the prompt's logits) whose token is the one
    that followed the history's best match of at least lookup.MIN_MATCH tokens: how much of the
    output copies its prompt or itself (a paraphrase copies little)."""
    from qllama.generation.lookup import MIN_MATCH, NgramDrafter

    d = NgramDrafter(prompt + out[:1], min_match=MIN_MATCH)
    hits = 0
    for t in out[1:]:
        hits += d.draft(1) == [t]
        d.append(t)
    return hits / max(1, len(out) - 1)


def bench_task(model: qllama.Model, task: Task, a: argparse.Namespace, loads: list[float]) -> Result:
    ids = model.prepare_prompt(task.prompt)[0]
    tps: dict[int, list[float]] = {0: [], a.lookup: []}
    cpu_tps: dict[int, list[float]] = {0: [], a.lookup: []}
    outs, last = {}, {}
    for rep in range(a.reps):
        for n_draft in (0, a.lookup):
            model.session.reset()  # every run evaluates the whole prompt: the same work each time
            out, t, cpu = run(model, ids, a.max_tokens, n_draft, a.temp, seed=rep)
            tps[n_draft].append(t.gen_tps)
            cpu_tps[n_draft].append((t.gen_tokens - 1) / cpu if cpu > 0 else 0.0)
            outs[n_draft], last[n_draft] = out, t
            loads.append(os.getloadavg()[0])
    t = last[a.lookup]
    return Result(task, t.gen_tokens, statistics.median(tps[0]), statistics.median(tps[a.lookup]),
                  statistics.median(cpu_tps[0]), statistics.median(cpu_tps[a.lookup]), t.draft_accepted,
                  t.draft_tokens, t.gen_tokens / max(1, t.gen_forwards),
                  outs[0] == outs[a.lookup] if a.temp <= 0 else "n/a", model.detokenize(outs[a.lookup]),
                  copied_share(list(ids), outs[0]))


def verify_costs(model: qllama.Model, sizes=tuple(range(1, 17)), reps: int = 9) -> dict[str, dict[int, float]]:
    """CPU seconds of one forward of T tokens with every row's logits after a 200-token prompt
    (T = 1: the session's one-token decode, the fused kernels), medians over `reps` (rounds
    interleaved across T and the two executions): {"fused": {T: s}, "unfused": {T: s}}."""
    import numpy as np

    from qllama.models.step import PLAIN, Plain

    session = model.session
    session.reset()
    session.prefill(model.prepare_prompt(TASK)[0][:200])
    base = session.cache.n_past
    rng = np.random.default_rng(0)
    ways = {"fused": PLAIN, "unfused": Plain(fused_rows=1)}
    times: dict[str, dict[int, list[float]]] = {w: {t: [] for t in sizes} for w in ways}
    for _ in range(reps):
        for t in sizes:
            toks = [int(x) for x in rng.integers(100, 10000, t)]
            for way, execution in ways.items():
                c0 = time.process_time()
                with session.model.executing(execution):
                    if t == 1:
                        session.decode(toks[0])
                    else:
                        session.model.forward(toks, session.cache, all_logits=True, n_threads=model.n_threads)
                times[way][t].append(time.process_time() - c0)
                session.cache.rewind(base)
                del session.tokens[base:]
    return {w: {t: statistics.median(v) for t, v in per.items()} for w, per in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF (default: SmolLM2-135M-Instruct Q4_1 via tools/fetch_smollm2.py)")
    ap.add_argument("--lookup", type=int, default=8, help="drafts per forward")
    ap.add_argument("--reps", type=int, default=3, help="pairs of runs (plain, lookup) per task")
    ap.add_argument("-n", "--max-tokens", type=int, default=256)
    ap.add_argument("-t", "--threads", type=int)
    ap.add_argument("--temp", type=float, default=0.0, help="temperature (0: greedy)")
    ap.add_argument("--set", choices=("held", "tune", "all"), default="held",
                    help="held: the held-out texts (default); tune: the texts the policy was tuned on")
    ap.add_argument("--tasks", default="fix,edit,quote,json", help="kinds of task, comma-separated")
    ap.add_argument("--show", action="store_true", help="print each task's lookup output")
    ap.add_argument("--costs", action="store_true", help="only measure what a verify batch of T rows costs")
    a = ap.parse_args()
    kinds = a.tasks.split(",")
    bad = sorted(set(kinds) - {t.kind for t in TASKS})
    if bad:
        sys.exit(f"error: unknown task kind {', '.join(bad)} (fix, edit, quote, json)")
    path = a.model
    if path is None:
        from tools.fetch_smollm2 import fetch

        path = str(fetch())
    model = qllama.load(path, n_ctx=2048, n_threads=a.threads)
    model.warmup()
    if a.costs:
        costs = verify_costs(model)
        one = costs["fused"][1]
        print(f"model {os.path.basename(path)}, {model.n_threads} threads, load {os.getloadavg()[0]:.2f}: "
              f"CPU time of a forward of T tokens (all logits) in one-token steps ({1e3 * one:.2f} ms)")
        for way, per in costs.items():
            print(f"{way:8s}" + "  ".join(f"T={t}: {c / one:.2f}" for t, c in per.items()))
        return
    tasks = [t for t in TASKS if t.kind in kinds and (t.set == "readme" or a.set in ("all", t.set))]
    print(f"model {os.path.basename(path)}, {model.n_threads} threads, max {a.max_tokens} tokens, lookup {a.lookup}, "
          f"temperature {a.temp}, {a.reps} A B pairs per task, set {a.set}")
    run(model, model.prepare_prompt(TASK)[0], 16, a.lookup)  # warm the batched shapes
    loads: list[float] = []
    results = []
    for task in tasks:
        r = bench_task(model, task, a, loads)
        results.append(r)
        print(f"  {task.name:9} {r.tokens:4d} tokens  plain {r.plain_tps:6.1f} t/s  lookup {r.lookup_tps:6.1f} t/s "
              f"({r.lookup_tps / r.plain_tps:.2f}x; per CPU s {r.lookup_cpu_tps / r.plain_cpu_tps:.2f}x)  "
              f"accepted {r.accepted}/{r.drafted}  {r.per_forward:.2f} tokens/forward  copied {100 * r.copied:.0f}%  "
              f"identical {r.identical}",
              flush=True)
        if a.show:
            print("    | " + r.text.replace("\n", "\n    | "))
    print(f"load average during the runs: median {statistics.median(loads):.2f}, max {max(loads):.2f} (1 min), "
          f"{os.cpu_count()} CPUs")
    print("| task | tokens | plain t/s | lookup t/s | speedup | per CPU s | acceptance | tokens/forward | copied | identical |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in results:
        rate = f"{100 * r.accepted / r.drafted:.0f}%" if r.drafted else "-"
        print(f"| {r.task.name} | {r.tokens} | {r.plain_tps:.1f} | {r.lookup_tps:.1f} | {r.lookup_tps / r.plain_tps:.2f}x "
              f"| {r.lookup_cpu_tps / r.plain_cpu_tps:.2f}x | {rate} | {r.per_forward:.2f} | {100 * r.copied:.0f}% | {r.identical} |")


if __name__ == "__main__":
    main()
