"""Where compiled kernels go: the user's cache, never the installed package (issue: a
`__pycache__` left in site-packages shadowed a later editable install)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from qllama.kernels import jit

REPO = Path(__file__).resolve().parent.parent


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("QLLAMA_CACHE_DIR", raising=False)
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if sys.platform.startswith("linux"):
        assert jit.cache_root() == tmp_path / "xdg" / "qllama"
    monkeypatch.setenv("QLLAMA_CACHE_DIR", str(tmp_path / "mine"))
    assert jit.cache_root() == tmp_path / "mine"
    digest = jit.SOURCES_DIGEST.hex()[:16]
    assert jit.kernel_cache_dir() == tmp_path / "mine" / "kernels" / digest


def test_kernels_of_the_package_locate_in_the_user_cache():
    """Numba's own lookup picks qllama's locator for a kernel module, and its path is the user cache."""
    from numba.core.caching import CacheImpl

    from qllama.kernels import layer_ops

    func = layer_ops.round_f16.py_func
    for cls in CacheImpl._locator_classes:
        loc = cls.from_function(func, layer_ops.__file__)
        if loc is not None:
            break
    assert isinstance(loc, jit.KernelCacheLocator)
    assert Path(loc.get_cache_path()) == jit.kernel_cache_dir()
    assert not Path(loc.get_cache_path()).is_relative_to(REPO / "qllama")


def test_an_unwritable_cache_is_one_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    env = {**os.environ, "QLLAMA_CACHE_DIR": str(blocker), "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "qllama", "run", "demo", "hi", "-n", "1"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("error: the kernel cache") and "QLLAMA_CACHE_DIR" in lines[-1]
    assert "Traceback" not in r.stderr


def test_a_run_writes_nothing_into_the_package(tmp_path):
    """A cold run (its own empty cache) compiles into QLLAMA_CACHE_DIR and leaves qllama/ as it was."""
    before = {p for p in (REPO / "qllama").rglob("*") if "__pycache__" in p.parts and p.suffix in (".nbi", ".nbc")}
    env = {**os.environ, "QLLAMA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    env.pop("NUMBA_CACHE_DIR", None)
    r = subprocess.run([sys.executable, "-m", "qllama", "run", "demo", "ROMEO:", "-n", "4", "--temp", "0"], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    after = {p for p in (REPO / "qllama").rglob("*") if "__pycache__" in p.parts and p.suffix in (".nbi", ".nbc")}
    assert after == before
    assert list((tmp_path / "cache" / "kernels").rglob("*.nbi"))
    # the same sources again (another process, -t 1 after a 2-thread warm-up): nothing to compile
    r2 = subprocess.run([sys.executable, "-m", "qllama", "run", "demo", "ROMEO:", "-n", "4", "--temp", "0", "-t", "1"],
                        env=env, capture_output=True, text=True, timeout=900)
    assert r2.returncode == 0 and "compiling" not in r2.stderr, r2.stderr


@pytest.mark.slow
def test_readme_commands_leave_a_working_install(tmp_path):
    """The README's two commands in order, then qllama from another directory (issue 28, item 1)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py, exe = str(venv / "bin" / "python"), str(venv / "bin" / "qllama")
    env = {**os.environ, "QLLAMA_CACHE_DIR": str(tmp_path / "cache"), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    env.pop("NUMBA_CACHE_DIR", None)

    def run(*cmd, cwd=REPO, timeout=1200):
        r = subprocess.run(list(cmd), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-2000:])
        return r

    run(py, "-m", "pip", "install", "-q", str(REPO))
    first = run(exe, "run", "demo", "ROMEO:", "-n", "8", "--temp", "0", cwd=tmp_path)
    assert "compiling" in first.stderr
    run(py, "-m", "pip", "install", "-q", "-e", str(REPO))
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert not (Path(site) / "qllama").exists(), "the regular install left files behind"
    version = run(exe, "version", cwd=tmp_path)
    assert "kernel cache: " + str(tmp_path / "cache") in version.stdout
    again = run(exe, "run", "demo", "ROMEO:", "-n", "8", "--temp", "0", cwd=tmp_path)
    assert "compiling" not in again.stderr  # the same sources' kernels, found after the reinstall
    assert again.stdout == first.stdout
