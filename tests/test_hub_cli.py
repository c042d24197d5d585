"""`qllama pull / list / rm` and model references on the command line, against the loopback
FakeHub of test_hub.py (reached through HF_ENDPOINT, with the cache in HF_HOME): output, one-line
errors, Ctrl-C during a download, the progress bar in a terminal, and the bundled demo model.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_hub import CHUNK, MB, TOKEN, FakeHub, blob, tiny_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake():
    with FakeHub() as f:
        yield f


def env_for(fake: FakeHub, home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(home), HF_ENDPOINT=fake.url, HF_HUB_DISABLE_TELEMETRY="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def qllama(env: dict, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qllama", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=env.get("CWD", None))


def one_error_line(p: subprocess.CompletedProcess, code: int = 1) -> str:
    assert p.returncode == code, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    return lines[0]


def test_pull_list_inspect_rm(fake: FakeHub, tmp_path: Path) -> None:
    data = tiny_model(tmp_path / "t.gguf", "q8_0")
    commit = fake.add("org/tiny", {"tiny-Q8_0.gguf": data, "tiny-F32.gguf": tiny_model(tmp_path / "f.gguf")})
    env = env_for(fake, tmp_path / "home")
    p = qllama(env, "pull", "org/tiny:q8_0")
    assert p.returncode == 0, p.stderr
    path = p.stdout.strip()
    assert path == str(tmp_path / "home" / "hub" / "models--org--tiny" / "snapshots" / commit / "tiny-Q8_0.gguf")
    assert Path(path).read_bytes() == data
    assert p.stderr.startswith(f"downloaded org/tiny/tiny-Q8_0.gguf ({len(data) / 1e6:.1f} MB) in ")
    n = len(fake.log)
    p = qllama(env, "inspect", "org/tiny:Q8_0")  # from the cache: no request
    assert p.returncode == 0 and "tiny-Q8_0.gguf" in p.stdout and len(fake.log) == n, p.stderr
    p = qllama(env, "tokenize", "hf://org/tiny/tiny-Q8_0.gguf", "hello", "--ids")
    assert p.returncode == 0 and p.stdout.strip().startswith("["), p.stderr
    p = qllama(env, "run", "org/tiny:Q8_0", "hello", "-n", "3", "--temp", "0", "--raw")
    assert p.returncode == 0 and p.stdout.strip(), p.stderr
    assert len(fake.log) == n
    p = qllama(env, "pull", "org/tiny:Q8_0")  # asks the hub again, downloads nothing
    assert p.returncode == 0 and "org/tiny/tiny-Q8_0.gguf is up to date" in p.stderr
    assert len(fake.requests("GET", "/blobs/")) == 1
    p = qllama(env, "list")
    lines = p.stdout.splitlines()
    assert lines[0].split() == ["REFERENCE", "QUANT", "SIZE", "PATH"]
    assert lines[1].split()[0] == "demo"
    assert lines[2].split() == ["org/tiny:Q8_0", "Q8_0", f"{len(data) / 1e6:.1f}", "MB", path]
    doc = json.loads(qllama(env, "list", "--json").stdout)
    assert doc["cache"] == str(tmp_path / "home" / "hub")
    assert doc["models"][1] == dict(ref="org/tiny:Q8_0", quant="Q8_0", size=len(data), path=path, complete=True)
    p = qllama(env, "rm", "org/tiny:Q8_0")
    assert p.returncode == 0 and p.stdout.startswith("removed org/tiny: tiny-Q8_0.gguf ("), p.stderr
    assert not os.path.exists(path)
    assert "org/tiny" not in qllama(env, "list").stdout
    line = one_error_line(qllama(dict(env, HF_HUB_OFFLINE="1"), "inspect", "org/tiny:Q8_0"))
    assert line == f"error: org/tiny:Q8_0 is not in the local cache ({tmp_path / 'home' / 'hub'}) and HF_HUB_OFFLINE is set"
    assert one_error_line(qllama(env, "rm", "org/tiny")) == f"error: org/tiny is not in the cache ({tmp_path / 'home' / 'hub'})"
    assert one_error_line(qllama(env, "rm", "demo")) == "error: demo is part of the qllama package and cannot be removed"


def test_errors_are_one_line(fake: FakeHub, tmp_path: Path) -> None:
    fake.add("org/repo", {"m-Q4_K_M.gguf": blob(100), "m-Q8_0.gguf": blob(100, 1)})
    gated = tiny_model(tmp_path / "g.gguf")
    fake.add("org/gated", {"g-Q4_K_M.gguf": gated}, gated=True)
    env = env_for(fake, tmp_path / "home")
    cases = [
        (("run", "nobody/nothing", "hi"), f"error: no repository nobody/nothing on {fake.url} (a private repository needs HF_TOKEN)"),
        (("pull", "org/repo:IQ1_S"), "error: org/repo has no IQ1_S file; quant tags available: Q4_K_M, Q8_0"),
        (("pull", "org/gated"), f"error: org/gated is a gated repository: accept its conditions on {fake.url}/org/gated "
                                "and set HF_TOKEN to an access token of that account"),
        (("inspect", "missing.gguf"), "error: missing.gguf: no such file"),  # local paths as before
    ]
    for args, want in cases:
        assert one_error_line(qllama(env, *args)) == want
    assert one_error_line(qllama(env, "pull", "missing.gguf"), code=2).startswith("error: missing.gguf is not a hub reference")
    assert not list((tmp_path / "home" / "hub").glob("models--org--gated/snapshots/*/*"))
    p = qllama(dict(env, HF_TOKEN=TOKEN), "pull", "org/gated")
    assert p.returncode == 0 and Path(p.stdout.strip()).read_bytes() == gated, p.stderr
    dead = dict(env, HF_ENDPOINT="http://127.0.0.1:9")
    assert one_error_line(qllama(dead, "pull", "org/other")).startswith("error: cannot reach http://127.0.0.1:9 (")
    # with the network gone, the cached model still runs; nothing is asked
    assert qllama(dead, "inspect", "org/gated").returncode == 0
    assert qllama(dict(env, HF_HUB_OFFLINE="1"), "pull", "org/gated").returncode == 0


def test_ctrl_c_during_a_download(fake: FakeHub, tmp_path: Path) -> None:
    data = blob(24 * MB)
    fake.add("org/big", {"big-Q4_K_M.gguf": data})
    sha = fake.blob_sha("org/big", "big-Q4_K_M.gguf")
    fake.delay = 0.01  # ~6 MB/s: the download takes seconds
    env = env_for(fake, tmp_path / "home")
    storage = tmp_path / "home" / "hub" / "models--org--big"
    part = storage / "blobs" / f"{sha}.incomplete"
    proc = subprocess.Popen([sys.executable, "-m", "qllama", "pull", "org/big"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (part.exists() and part.stat().st_size >= CHUNK) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert part.exists() and proc.poll() is None
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and out == ""
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines == ["error: download of org/big interrupted; the partial file is kept in the cache and the next "
                     "`qllama pull` (or run) resumes it"]
    assert not list(storage.glob("snapshots/*/*")) and not (storage / "blobs" / sha).exists()  # nothing loadable
    kept = part.stat().st_size
    assert kept >= CHUNK and kept % CHUNK == 0  # whole chunks, a prefix of the file
    assert part.read_bytes() == data[:kept]
    fake.delay = 0
    p = qllama(env, "pull", "org/big")
    assert p.returncode == 0, p.stderr
    assert hashlib.sha256(Path(p.stdout.strip()).read_bytes()).hexdigest() == sha
    assert fake.requests("GET", "/blobs/")[-1][2]["range"] == f"bytes={kept}-"
    assert not part.exists()


def test_progress_bar_in_a_terminal(fake: FakeHub, tmp_path: Path) -> None:
    pexpect = pytest.importorskip("pexpect")
    fake.add("org/big", {"big-Q4_K_M.gguf": blob(24 * MB)})
    fake.delay = 0.004
    env = env_for(fake, tmp_path / "home", TERM="xterm", COLUMNS="100")
    child = pexpect.spawn(sys.executable, ["-m", "qllama", "pull", "org/big"], env=env, timeout=60, encoding="utf-8")
    # tqdm's bar: percent, bytes done/total, elapsed<remaining (ETA), speed
    child.expect(r"big-Q4_K_M\.gguf: +\d+%\|.*\| *[\d.]+M/25\.2M \[\d\d:\d\d<\d\d:\d\d, +[\d.]+MB/s\]")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert "downloaded org/big/big-Q4_K_M.gguf (25.2 MB)" in child.before


def test_demo_is_bundled(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path), HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9")
    p = qllama(env, "inspect", "demo")
    assert p.returncode == 0 and "shakespeare-spm-Q4_K_M.gguf" in p.stdout, p.stderr
    p = qllama(env, "tokenize", "demo", "ROMEO:", "--ids")
    assert p.returncode == 0 and p.stdout.strip().startswith("[1,"), p.stderr


@pytest.mark.slow
def test_pip_install_then_run_demo_without_network(tmp_path: Path) -> None:
    """`pip install . && qllama run demo "ROMEO:"` in a fresh venv (non-editable), with the hub unreachable."""
    venv = tmp_path / "v"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    deps = next(p for p in sys.path if p.endswith("site-packages") and Path(p, "numpy").is_dir())
    (site / "deps.pth").write_text(deps + "\n")  # the dependencies, without the editable qllama
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-deps", str(REPO)], capture_output=True,
                         text=True, timeout=600)
    if pip.returncode:
        pytest.skip(f"pip could not build the package here: {pip.stderr.strip().splitlines()[-1:]}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9")
    p = subprocess.run([str(venv / "bin" / "qllama"), "run", "demo", "ROMEO:", "-n", "8", "--temp", "0"], env=env,
                       capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert len(p.stdout.strip()) > 0
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import qllama.hub.refs as h; print(h.demo_path())"],
                           capture_output=True, text=True, env=env, cwd=tmp_path)
    assert where.stdout.strip().startswith(str(site))
