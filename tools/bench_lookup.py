"""Prompt-lookup decoding vs plain greedy on a task that copies from its prompt.

SmolLM2-135M-Instruct (through its chat template) is asked to fix a typo in a ~30-line function
and print it back. Runs alternate plain / lookup (A B A B ...) in one process so that a busy
machine slows both alike; reported: median decode tokens/s of each, the speedup, the acceptance
rate and tokens per forward, the load average, and whether the outputs were identical.

    python tools/bench_lookup.py [--model PATH] [--lookup 8] [--reps 5] [-n 400] [-t THREADS] [--temp T]

Without --model it uses tools/fetch_smollm2.py's cached copy. -n 120 covers the code only; the
default 400 also the free text the model writes after it (which copies little). --temp T > 0
samples (seed = the repetition): the same distribution, not the same tokens, so the identity
check is greedy's only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import qllama  # noqa: E402

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

# Tasks the lookup policy was not tuned on (issue 32): a code edit that prints most of a file
# back, a quotation from a document, a JSON reformatting.
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

TASKS = {
    "fix": "Fix the typo in this function and print the whole corrected function back:\n\n" + CODE,
    "edit": "Rename the method `total` to `count` in this class and print the whole class back:\n\n" + EDIT_CODE,
    "quote": "Here is a document:\n\n" + DOCUMENT + "\n\nCopy the whole document out word for word, "
             "then say in one sentence when the lighthouse was automated.",
    "json": "Reformat this JSON with an indent of two spaces, keeping every key and value:\n\n" + JSON_DATA,
}
TASK = TASKS["fix"]


def run(model: qllama.Model, ids: list[int], n: int, lookup: int, temp: float = 0.0,
        seed: int = 0) -> tuple[list[int], object, float]:
    """(generated ids, Timings, CPU seconds of this process during the decode)."""
    out: list[int] = []
    cpu = 0.0
    chunks = model.stream(ids, max_tokens=n, temperature=temp, seed=seed, lookup=lookup)
    first = next(chunks)  # the prompt is evaluated before the first chunk: CPU time from here on
    out += first.token_ids
    c0 = time.process_time()
    for chunk in chunks:
        out += chunk.token_ids
    cpu = time.process_time() - c0
    return out, model.last_timings, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF (default: SmolLM2-135M-Instruct Q4_1 via tools/fetch_smollm2.py)")
    ap.add_argument("--lookup", type=int, default=8, help="drafts per forward")
    ap.add_argument("--reps", type=int, default=5, help="pairs of runs (plain, lookup)")
    ap.add_argument("-n", "--max-tokens", type=int, default=400)
    ap.add_argument("-t", "--threads", type=int)
    ap.add_argument("--temp", type=float, default=0.0, help="temperature (0: greedy)")
    ap.add_argument("--task", choices=sorted(TASKS), default="fix",
                    help="fix: the tuned-on task; edit, quote, json: copy-heavy tasks it was not tuned on")
    a = ap.parse_args()
    path = a.model
    if path is None:
        from tools.fetch_smollm2 import fetch

        path = str(fetch())
    model = qllama.load(path, n_ctx=2048, n_threads=a.threads)
    model.warmup()
    ids = model.prepare_prompt(TASKS[a.task])[0]
    print(f"task {a.task}, model {os.path.basename(path)}, {model.n_threads} threads, prompt {len(ids)} tokens, "
          f"max {a.max_tokens} tokens, lookup {a.lookup}, temperature {a.temp}")
    run(model, ids, 16, a.lookup)  # warm the batched shapes
    tps = {0: [], a.lookup: []}
    cpu_tps = {0: [], a.lookup: []}  # tokens per CPU second: the work per token, less sensitive to a busy machine
    outs, last = {}, {}
    loads = []
    for rep in range(a.reps):
        for n_draft in (0, a.lookup):
            model.session.reset()  # every run evaluates the whole prompt: the same work each time
            out, t, cpu = run(model, ids, a.max_tokens, n_draft, a.temp, seed=rep)
            tps[n_draft].append(t.gen_tps)
            cpu_tps[n_draft].append((t.gen_tokens - 1) / cpu if cpu > 0 else 0.0)
            outs[n_draft], last[n_draft] = out, t
            loads.append(os.getloadavg()[0])
            extra = (f", {t.draft_accepted}/{t.draft_tokens} drafts accepted, "
                     f"{t.gen_tokens / max(1, t.gen_forwards):.2f} tokens/forward") if n_draft else ""
            print(f"  rep {rep} {'lookup' if n_draft else 'plain '}: {t.gen_tokens} tokens, {t.gen_tps:7.2f} tok/s, "
                  f"{cpu_tps[n_draft][-1]:7.2f} tok/CPU-s{extra}")
    plain, fast = statistics.median(tps[0]), statistics.median(tps[a.lookup])
    t = last[a.lookup]
    rate = t.draft_accepted / t.draft_tokens if t.draft_tokens else 0.0
    print(f"{'plain greedy' if a.temp <= 0 else 'plain':<13}: median {plain:7.2f} tok/s")
    print(f"lookup {a.lookup:<6}: median {fast:7.2f} tok/s  ({fast / plain:.2f}x), acceptance {100 * rate:.1f}%, "
          f"{t.gen_tokens / max(1, t.gen_forwards):.2f} tokens per forward")
    pc, fc = statistics.median(cpu_tps[0]), statistics.median(cpu_tps[a.lookup])
    print(f"per CPU second: plain {pc:.2f}, lookup {fc:.2f} tokens ({fc / pc:.2f}x)")
    same = outs[0] == outs[a.lookup] if a.temp <= 0 else "n/a (sampling)"
    print(f"identical output: {same}; load average during the runs: "
          f"median {statistics.median(loads):.2f} (1 min), {os.cpu_count()} CPUs")
    print("--- output ---")
    print(model.detokenize(outs[a.lookup]))


if __name__ == "__main__":
    main()
