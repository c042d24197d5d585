"""Two qllama checkouts against each other: `qllama bench` run alternately (A B A B) in each
tree, medians of each test, and the ratio after / before. For "same speed" claims of a change
that must not move speed (a refactor): make a worktree of the old commit and pass both trees.

    git worktree add /tmp/before <commit>
    python tools/bench_ab.py --before /tmp/before [--after .] [-r 4] MODEL -- -p 128 -n 64 -t 1,2

(the options first: argparse takes what follows MODEL and `--` as qllama bench's arguments)

Two environments of one tree compare the same way (--before defaults to this tree): a setting
read at start (QLLAMA_FUSED=0, the unfused one-token steps), or a knob an experiment compiles into
the kernels from the environment; each side then gets a kernel cache directory of its own (the
sources' digest alone would share one):

    python tools/bench_ab.py --env-after QLLAMA_FUSED=0 MODEL -- -p 0 -n 16 -t 1,2

Each run is a fresh process (`python -m qllama bench --json -r 3 ...` with PYTHONPATH set to its
tree); each tree compiles into its own kernel cache directory (the digest of its sources).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--before", default=".", help="the old tree (a git worktree; default: this one)")
    ap.add_argument("--after", default=".", help="the new tree (default: this one)")
    ap.add_argument("--env-before", default="", help="KEY=VALUE,... set for the before runs")
    ap.add_argument("--env-after", default="", help="KEY=VALUE,... set for the after runs")
    ap.add_argument("-r", "--rounds", type=int, default=4, help="A B rounds")
    ap.add_argument("bench_args", nargs="*", help="arguments of qllama bench (after --)")
    a = ap.parse_args()
    trees = {"before": os.path.abspath(a.before), "after": os.path.abspath(a.after)}
    envs = {name: dict(kv.split("=", 1) for kv in spec.split(",") if kv) for name, spec in
            (("before", a.env_before), ("after", a.env_after))}
    if trees["before"] == trees["after"] and envs["before"] != envs["after"]:  # one tree: a cache each
        scratch = tempfile.mkdtemp(prefix="qllama-ab-")
        for name in envs:
            envs[name]["QLLAMA_CACHE_DIR"] = os.path.join(scratch, name)
    # a file path is made absolute (each run's working directory is its tree); a model name stays
    model = os.path.abspath(a.model) if os.path.exists(a.model) else a.model
    res: dict[str, dict[str, list[float]]] = {k: {} for k in trees}
    for r in range(a.rounds):
        for name, tree in trees.items():
            env = {**os.environ, "PYTHONPATH": tree, **envs[name]}
            out = subprocess.run([sys.executable, "-m", "qllama", "bench", model, "--json", "-r", "3", *a.bench_args],
                                 cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
            if out.returncode:
                sys.exit(f"error: qllama bench failed in {tree}: {out.stderr.strip().splitlines()[-1:]}")
            for x in json.loads(out.stdout)["results"]:
                res[name].setdefault(f'{x["test"]} t{x["threads"]}', []).append(x["mean_tps"])
            print(f"round {r} {name}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in res[name].items())
                  + f" (load {os.getloadavg()[0]:.2f})", flush=True)
    for key in res["before"]:
        b, n = statistics.median(res["before"][key]), statistics.median(res["after"].get(key, [float("nan")]))
        print(f"{key}: before {b:.1f} t/s, after {n:.1f} t/s, after / before {n / b:.3f}")


if __name__ == "__main__":
    main()
