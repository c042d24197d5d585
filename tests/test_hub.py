"""Model references and downloads (qllama.hub) against a real HTTP server on loopback that
answers huggingface.co's endpoints as the hub does.

`FakeHub` runs two threaded http.servers on 127.0.0.1 (ephemeral ports): the "hub" (model info
at /api/models/{repo}/revision/{rev}, tree listing, HEAD/GET /{repo}/resolve/{rev}/{file}
answered with a 302 to the CDN and X-Repo-Commit / X-Linked-Etag / X-Linked-Size / ETag, or
with the hub's X-Error-Code errors) and the "CDN" (the blobs, with range requests). It can
cut a connection mid-file, serve corrupt bytes, or go slowly. huggingface_hub reaches it
through `endpoint=` here and through HF_ENDPOINT in the CLI tests (test_hub_cli.py). Every
request is logged, so a test can count them.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import numpy as np
import pytest

from qllama.hub import refs as hub
from qllama.hub.refs import HubError, HubRef

MB = 1 << 20
CHUNK = 10 * MB  # huggingface_hub writes the body in chunks of this size (its DOWNLOAD_CHUNK_SIZE)
MAX_REQUESTS = 400  # the servers refuse more: a runaway client cannot loop forever
TOKEN = "hf_qllama_test_token"


class FakeHub:
    """huggingface.co (and its CDN) on loopback; use as a context manager."""

    def __init__(self) -> None:
        self.repos: dict[str, dict] = {}
        self.log: list[tuple[str, str, dict[str, str]]] = []  # (method, path, headers) in arrival order
        self.cut: dict[str, int] = {}  # sha256 -> cut the next GET of that blob after this many bytes
        self.corrupt: set[str] = set()  # sha256 of blobs served with one byte flipped
        self.delay = 0.0  # seconds per 64 KiB sent by the CDN
        self.opaque_etags = False  # a mirror: no X-Linked-Etag, an ETag that is no checksum
        self.ignore_range = False  # a CDN that answers every range request with the whole file (200)
        self._servers: list[ThreadingHTTPServer] = []

    def add(self, repo: str, files: dict[str, bytes], gated: bool = False) -> str:
        """Publish a repo; returns its commit hash."""
        commit = hashlib.sha1((repo + "".join(sorted(files))).encode()).hexdigest()
        shas = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
        self.repos[repo] = dict(commit=commit, files=files, sha=shas, gated=gated)
        return commit

    def blob_sha(self, repo: str, name: str) -> str:
        return self.repos[repo]["sha"][name]

    def requests(self, method: str | None = None, prefix: str = "") -> list[tuple[str, str, dict]]:
        return [r for r in self.log if (method is None or r[0] == method) and r[1].startswith(prefix)]

    def __enter__(self) -> "FakeHub":
        for handler in (_HubHandler, _CdnHandler):
            srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
            srv.daemon_threads = True
            srv.fake = self  # type: ignore[attr-defined]
            threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
            self._servers.append(srv)
        self.url = f"http://127.0.0.1:{self._servers[0].server_port}"
        self.cdn = f"http://127.0.0.1:{self._servers[1].server_port}"  # another origin, as cdn-lfs.hf.co is
        return self

    def __exit__(self, *exc: object) -> None:
        for srv in self._servers:
            srv.shutdown()
            srv.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 20  # an idle keep-alive connection ends by itself

    def log_message(self, *args: object) -> None:
        pass

    @property
    def fake(self) -> FakeHub:
        return self.server.fake  # type: ignore[attr-defined]

    def do_GET(self) -> None:
        self._handle("GET")

    def do_HEAD(self) -> None:
        self._handle("HEAD")

    def _handle(self, method: str) -> None:
        f = self.fake
        f.log.append((method, self.path, {k.lower(): v for k, v in self.headers.items()}))
        if len(f.log) > MAX_REQUESTS:
            return self._send(503, b"too many requests", method)
        self.route(method, urlsplit(self.path))

    def _send(self, status: int, body: bytes = b"", method: str = "GET", headers: dict | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str, method: str, extra: dict | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        headers = {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"}
        self._send(status, body, method, {**headers, **(extra or {})})


class _HubHandler(_Handler):
    def route(self, method: str, url) -> None:
        parts = [unquote(p) for p in url.path.split("/")[1:]]
        f = self.fake
        if parts[:2] == ["api", "models"] and (len(parts) == 4 or len(parts) >= 6 and parts[4] in ("revision", "tree")):
            repo, kind, rev = f"{parts[2]}/{parts[3]}", parts[4] if len(parts) > 4 else "revision", "/".join(parts[5:6]) or "main"
            r = f.repos.get(repo)
            if r is None:  # the hub answers 401 (not 404) to an anonymous request for an unknown repo
                return self._error(401, "RepoNotFound", "Repository not found", method)
            if rev not in ("main", r["commit"]):
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", method)
            if kind == "tree":
                items = [dict(type="file", path=n, size=len(d), oid=_git_oid(d),
                              lfs=dict(oid=r["sha"][n], size=len(d), pointerSize=134)) for n, d in r["files"].items()]
                return self._send(200, json.dumps(items).encode(), method, {"Content-Type": "application/json"})
            blobs = parse_qs(url.query).get("blobs") == ["True"] or parse_qs(url.query).get("blobs") == ["true"]
            sib = [dict(rfilename=n) | (dict(size=len(d), blobId=_git_oid(d),
                                              lfs=dict(sha256=r["sha"][n], size=len(d), pointerSize=134)) if blobs else {})
                   for n, d in sorted(r["files"].items())]
            info = dict(_id="x", id=repo, sha=r["commit"], private=False, gated="manual" if r["gated"] else False,
                        disabled=False, tags=["gguf"], siblings=sib)
            return self._send(200, json.dumps(info).encode(), method, {"Content-Type": "application/json"})
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, rev, name = f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:])
            r = f.repos.get(repo)
            if r is None:
                return self._error(401, "RepoNotFound", "Repository not found", method)
            if r["gated"] and self.headers.get("Authorization") != f"Bearer {TOKEN}":
                return self._error(401, "GatedRepo", f"Access to model {repo} is restricted. You must have access to "
                                   "it and be authenticated to access it. Please log in.", method)
            if rev not in ("main", r["commit"]):
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", method)
            if name not in r["files"]:
                return self._error(404, "EntryNotFound", f"{name} does not exist", method,
                                   {"X-Repo-Commit": r["commit"]})
            data, sha = r["files"][name], r["sha"][name]
            headers = {"Location": f"{f.cdn}/blobs/{sha}?sig=signed", "X-Repo-Commit": r["commit"],
                       "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": len(data), "ETag": f'"{_git_oid(data)}"'}
            if f.opaque_etags:
                headers.pop("X-Linked-Etag")
                headers["ETag"] = f'W/"mirror-{sha[:8]}"'
            return self._send(302, b"Found. Redirecting", method, headers)
        self._send(404, b"not found", method)


class _CdnHandler(_Handler):
    def route(self, method: str, url) -> None:
        f = self.fake
        sha = url.path.rsplit("/", 1)[-1]
        data = next((r["files"][n] for r in f.repos.values() for n in r["files"] if r["sha"][n] == sha), None)
        if data is None:
            return self._send(404, b"no such blob", method)
        if sha in f.corrupt:
            data = bytes([data[0] ^ 1]) + data[1:]
        start = 0
        rng = None if f.ignore_range else self.headers.get("Range")
        if rng:
            start = int(rng.split("=")[1].split("-")[0])
        body = data[start:]
        self.send_response(206 if rng else 200)
        if rng:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{sha}"')
        self.end_headers()
        if method == "HEAD":
            return
        cut = f.cut.pop(sha, None) if method == "GET" else None
        limit = len(body) if cut is None else min(cut - start, len(body))
        try:
            for i in range(0, limit, 1 << 16):
                self.wfile.write(body[i : min(i + (1 << 16), limit)])
                if f.delay:
                    time.sleep(f.delay)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            return
        if cut is not None:  # the connection drops mid-body
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# ---------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------


def blob(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).bytes(n)


@pytest.fixture
def fake():
    with FakeHub() as f:
        yield f


@pytest.fixture
def cache(tmp_path: Path, monkeypatch) -> str:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return str(tmp_path / "hub")


def fetch(fake: FakeHub, ref: str, cache: str, **kw) -> hub.CachedModel:
    kind, r = hub.parse(ref)
    assert kind == "hub", ref
    return hub.fetch(r, cache=cache, endpoint=fake.url, progress=False, **kw)


def tiny_model(path: Path, weight_type: str = "f32", seed: int = 0) -> bytes:
    make_model = pytest.importorskip("tools.make_model")
    make_model.write_model(path, make_model.ModelSpec(weight_type=weight_type, seed=seed))
    return path.read_bytes()


# ---------------------------------------------------------------------------------------------
# references
# ---------------------------------------------------------------------------------------------


def test_parse_references(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "here.gguf").write_bytes(b"x")
    cases = {
        "model.gguf": ("local", "model.gguf"),  # missing: still a path (its error is "no such file")
        "dir/model.gguf": ("local", "dir/model.gguf"),
        "org/here.gguf": ("local", "org/here.gguf"),  # exists
        "./org/repo/x.gguf": ("local", "./org/repo/x.gguf"),
        "/abs/org/repo/x.gguf": ("local", "/abs/org/repo/x.gguf"),
        "org/repo": ("hub", HubRef("org/repo")),
        "org/repo:q8_0": ("hub", HubRef("org/repo", tag="Q8_0")),
        "Org-1/Repo.v2-GGUF:Q4_K_M": ("hub", HubRef("Org-1/Repo.v2-GGUF", tag="Q4_K_M")),
        "org/repo/sub/m-Q4_0.gguf": ("hub", HubRef("org/repo", filename="sub/m-Q4_0.gguf")),
        "hf://org/repo/m.gguf": ("hub", HubRef("org/repo", filename="m.gguf")),
        "hf://org/here.gguf": ("hub", HubRef("org/here.gguf")),  # hf:// is never a local path
        "org/repo@v1.0:Q8_0": ("hub", HubRef("org/repo", tag="Q8_0", revision="v1.0")),
        "org/repo@dev/m.gguf": ("hub", HubRef("org/repo", filename="m.gguf", revision="dev")),
        "hf.co/org/repo:Q8_0": ("hub", HubRef("org/repo", tag="Q8_0")),  # ollama's spelling
        "https://huggingface.co/org/repo": ("hub", HubRef("org/repo")),
        "https://huggingface.co/org/repo/resolve/main/d/m-Q4_0.gguf?download=true":
            ("hub", HubRef("org/repo", filename="d/m-Q4_0.gguf")),
        "https://hf.co/org/repo/blob/v2/m.gguf": ("hub", HubRef("org/repo", filename="m.gguf", revision="v2")),
    }
    for text, want in cases.items():
        assert hub.parse(text) == want, text
    assert hub.parse("demo")[0] == "demo"
    (tmp_path / "demo").write_bytes(b"x")
    assert hub.parse("demo") == ("local", "demo")  # a file on disk wins
    with pytest.raises(HubError, match="not a hub reference"):
        hub.parse("hf://nothing")
    assert str(HubRef("o/r", tag="Q8_0", revision="v1")) == "o/r@v1:Q8_0"
    assert hub.resolve(Path("x.gguf")) == "x.gguf" and hub.resolve("missing.gguf") == "missing.gguf"


def test_choose_and_quant_tags() -> None:
    files = ["README.md", "m-Q8_0.gguf", "m-Q4_K_M.gguf", "m.f16.gguf", "mmproj-m-Q4_K_M.gguf",
             "big/m-Q6_K-00001-of-00002.gguf", "big/m-Q6_K-00002-of-00002.gguf", "m-IQ4_XS.gguf"]
    assert hub.choose(HubRef("o/r"), files) == ["m-Q4_K_M.gguf"]  # never the mmproj side file
    assert hub.choose(HubRef("o/r", tag="F16"), files) == ["m.f16.gguf"]
    assert hub.choose(HubRef("o/r", tag="Q6_K"), files) == ["big/m-Q6_K-00001-of-00002.gguf",
                                                             "big/m-Q6_K-00002-of-00002.gguf"]
    assert hub.choose(HubRef("o/r", filename="big/m-Q6_K-00002-of-00002.gguf"), files)[0].endswith("00001-of-00002.gguf")
    assert hub.choose(HubRef("o/r"), ["a-Q5_1.gguf", "a-Q8_0.gguf", "a-Q6_K.gguf"]) == ["a-Q6_K.gguf"]  # PREFERENCE
    assert hub.choose(HubRef("o/r"), ["z-IQ2_XXS.gguf", "a-IQ3_S.gguf"]) == ["a-IQ3_S.gguf"]  # none preferred: first
    with pytest.raises(HubError, match=r"o/r has no Q2_K file; quant tags available: F16, IQ4_XS, Q4_K_M, Q6_K, Q8_0"):
        hub.choose(HubRef("o/r", tag="Q2_K"), files)
    with pytest.raises(HubError, match="has no GGUF model files"):
        hub.choose(HubRef("o/r"), ["README.md", "mmproj-x.gguf"])
    with pytest.raises(HubError, match="lacks shard"):
        hub.choose(HubRef("o/r", tag="Q6_K"), files[:-2])
    assert [hub.quant_tag(n) for n in ("x-Q4_K_M.gguf", "x.q8_0.gguf", "x-bf16-00001-of-00003.gguf", "model.gguf")] == \
        ["Q4_K_M", "Q8_0", "BF16", None]


# ---------------------------------------------------------------------------------------------
# downloads
# ---------------------------------------------------------------------------------------------


def test_download_then_cache_hit_makes_no_request(fake: FakeHub, cache: str) -> None:
    data = blob(3 * MB)
    commit = fake.add("org/repo", {"m-Q8_0.gguf": blob(1000, 1), "m-Q4_K_M.gguf": data, "README.md": b"hi"})
    m = fetch(fake, "org/repo", cache)
    assert m.downloaded and m.commit == commit
    assert Path(m.path).read_bytes() == data
    sha = fake.blob_sha("org/repo", "m-Q4_K_M.gguf")
    assert m.path == os.path.join(cache, "models--org--repo", "snapshots", commit, "m-Q4_K_M.gguf")
    assert os.path.realpath(m.path) == os.path.join(cache, "models--org--repo", "blobs", sha)
    assert [r[0] for r in fake.log] == ["GET", "HEAD", "GET"]  # model info, file metadata, the blob
    assert "blobs=True" in fake.log[0][1] or "blobs=true" in fake.log[0][1]
    assert "authorization" not in fake.log[2][2]  # the CDN never sees a token
    n = len(fake.log)
    for ref in ("org/repo", "org/repo:q4_k_m", "org/repo/m-Q4_K_M.gguf", "hf://org/repo/m-Q4_K_M.gguf"):
        again = fetch(fake, ref, cache)
        assert again.path == m.path and not again.downloaded
    assert len(fake.log) == n  # cache hits: no request at all
    # the other quant is fetched on demand; `pull` (refresh) asks the hub and downloads nothing new
    assert Path(fetch(fake, "org/repo:Q8_0", cache).path).read_bytes() == blob(1000, 1)
    assert not fetch(fake, "org/repo", cache, refresh=True).downloaded
    assert fake.requests("GET", "/blobs/") and len(fake.requests("GET", "/blobs/")) == 2


def test_a_cached_model_needs_no_network(fake: FakeHub, cache: str, monkeypatch) -> None:
    import huggingface_hub.constants as hc

    fake.add("org/repo", {"m-Q4_K_M.gguf": blob(2000), "m-Q8_0.gguf": blob(3000, 1)})
    fetch(fake, "org/repo:Q8_0", cache)
    fetch(fake, "org/repo", cache)
    n = len(fake.log)
    dead = "http://127.0.0.1:9"  # nothing listens there
    for ref in ("org/repo", "org/repo:Q8_0", "org/repo/m-Q8_0.gguf"):
        m = hub.fetch(hub.parse(ref)[1], cache=cache, endpoint=dead, progress=False)
        assert not m.downloaded
    assert hub.fetch(HubRef("org/repo"), cache=cache, endpoint=dead).path.endswith("m-Q4_K_M.gguf")  # same choice
    # a cache hit does not even import huggingface_hub (it starts as fast as a local path)
    import subprocess
    import sys

    code = "import sys, qllama.hub.refs as h; print(h.resolve('org/repo:Q8_0'), 'huggingface_hub' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | {"HF_HUB_CACHE": cache}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60).stdout.split()
    assert out == [fetch(fake, "org/repo:Q8_0", cache).path, "False"]
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    assert hub.fetch(HubRef("org/repo"), cache=cache, endpoint=fake.url, refresh=True).path.endswith("m-Q4_K_M.gguf")
    assert len(fake.log) == n
    with pytest.raises(HubError, match=r"org/repo:Q5_K_M is not in the local cache .* HF_HUB_OFFLINE is set"):
        hub.fetch(HubRef("org/repo", tag="Q5_K_M"), cache=cache, endpoint=fake.url)
    with pytest.raises(HubError, match="other/repo is not in the local cache"):
        hub.fetch(HubRef("other/repo"), cache=cache, endpoint=fake.url)
    assert len(fake.log) == n
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    with pytest.raises(HubError, match=r"cannot reach http://127.0.0.1:9 .* other/repo is not in the local cache"):
        hub.fetch(HubRef("other/repo"), cache=cache, endpoint=dead)


def no_reread(monkeypatch) -> None:
    """Fail if a finished download is read back to hash it (it is hashed as it is written)."""
    from qllama.hub import download as hub_download

    def boom(*a):
        raise AssertionError("the download was read back to be hashed")

    monkeypatch.setattr(hub_download, "_file_hash", boom)


def test_resume_after_the_server_cuts_the_connection(fake: FakeHub, cache: str, monkeypatch) -> None:
    no_reread(monkeypatch)
    data = blob(24 * MB)
    fake.add("org/repo", {"m-Q4_K_M.gguf": data})
    sha = fake.blob_sha("org/repo", "m-Q4_K_M.gguf")
    fake.cut[sha] = 15 * MB  # after 15 MB the connection drops; one 10 MB chunk was written
    m = fetch(fake, "org/repo", cache)
    assert Path(m.path).read_bytes() == data
    gets = fake.requests("GET", "/blobs/")
    assert len(gets) == 2 and "range" not in gets[0][2]
    assert gets[1][2]["range"] == f"bytes={CHUNK}-"  # resumed, not restarted
    assert not os.path.exists(os.path.join(cache, "models--org--repo", "blobs", sha + ".incomplete"))


def test_resume_a_partial_left_by_an_earlier_run(fake: FakeHub, cache: str, monkeypatch) -> None:
    no_reread(monkeypatch)
    data = blob(12 * MB)
    fake.add("org/repo", {"m-Q4_K_M.gguf": data})
    sha = fake.blob_sha("org/repo", "m-Q4_K_M.gguf")
    blobs = Path(cache, "models--org--repo", "blobs")
    blobs.mkdir(parents=True)
    (blobs / f"{sha}.incomplete").write_bytes(data[: 5 * MB])
    m = fetch(fake, "org/repo", cache)
    assert Path(m.path).read_bytes() == data
    assert fake.requests("GET", "/blobs/")[0][2]["range"] == f"bytes={5 * MB}-"
    assert not (blobs / f"{sha}.incomplete").exists()
    # a server that ignores the range sends everything again: the partial is rewritten from byte 0
    fake.ignore_range = True
    fake.add("org/two", {"t-Q4_K_M.gguf": data[::-1]})
    sha2 = fake.blob_sha("org/two", "t-Q4_K_M.gguf")
    blobs2 = Path(cache, "models--org--two", "blobs")
    blobs2.mkdir(parents=True)
    (blobs2 / f"{sha2}.incomplete").write_bytes(data[::-1][: 3 * MB])
    assert Path(fetch(fake, "org/two", cache).path).read_bytes() == data[::-1]
    assert fake.requests("GET", "/blobs/")[-1][2]["range"] == f"bytes={3 * MB}-"


def test_checksum_mismatch_leaves_nothing_loadable(fake: FakeHub, cache: str) -> None:
    fake.add("org/repo", {"m-Q4_K_M.gguf": blob(MB)})
    sha = fake.blob_sha("org/repo", "m-Q4_K_M.gguf")
    fake.corrupt.add(sha)
    with pytest.raises(HubError, match=rf"m-Q4_K_M.gguf: checksum mismatch \(the hub says {sha[:16]}\.\.\., .*deleted"):
        fetch(fake, "org/repo", cache)
    storage = Path(cache, "models--org--repo")
    assert not list(storage.glob("blobs/*")) and not list(storage.glob("snapshots/*/*.gguf"))
    assert hub.cached(HubRef("org/repo"), cache) is None
    # a partial that is not a prefix of the file is caught the same way, then a retry works
    fake.corrupt.clear()
    (storage / "blobs" / f"{sha}.incomplete").write_bytes(b"garbage")
    with pytest.raises(HubError, match="checksum mismatch"):
        fetch(fake, "org/repo", cache)
    assert Path(fetch(fake, "org/repo", cache).path).read_bytes() == blob(MB)


def test_an_opaque_etag_is_checked_against_the_listing(fake: FakeHub, cache: str) -> None:
    """A mirror whose ETag is no checksum: the sha256 of the repo listing is what the file must match."""
    fake.opaque_etags = True
    fake.add("org/repo", {"m-Q4_K_M.gguf": blob(MB)})
    sha = fake.blob_sha("org/repo", "m-Q4_K_M.gguf")
    fake.corrupt.add(sha)
    with pytest.raises(HubError, match=rf"checksum mismatch \(the hub says {sha[:16]}"):
        fetch(fake, "org/repo", cache)
    fake.corrupt.clear()
    m = fetch(fake, "org/repo", cache)
    assert Path(m.path).read_bytes() == blob(MB) and os.path.basename(os.path.realpath(m.path)) == f"mirror-{sha[:8]}"


def test_hub_errors_are_one_clear_line(fake: FakeHub, cache: str) -> None:
    fake.add("org/repo", {"m-Q4_K_M.gguf": blob(100), "m-Q8_0.gguf": blob(100, 1)})
    fake.add("org/gated", {"g-Q4_K_M.gguf": blob(100)}, gated=True)
    cases = [
        ("nobody/nothing", rf"no repository nobody/nothing on {fake.url} \(a private repository needs HF_TOKEN\)"),
        ("nobody/nothing/x.gguf", "nobody/nothing/x.gguf is not a local file, and no repository nobody/nothing"),
        ("org/repo:Q2_K", "org/repo has no Q2_K file; quant tags available: Q4_K_M, Q8_0"),
        ("org/repo/missing.gguf", r"org/repo has no file missing.gguf \(its GGUF files: m-Q4_K_M.gguf, m-Q8_0.gguf\)"),
        ("org/repo@v9", "org/repo has no revision v9"),
        ("org/gated", rf"org/gated is a gated repository: accept its conditions on {fake.url}/org/gated and set HF_TOKEN"),
    ]
    for ref, msg in cases:
        with pytest.raises(HubError, match=msg) as e:
            fetch(fake, ref, cache)
        assert "\n" not in str(e.value)
    assert not list(Path(cache).glob("models--org--gated/snapshots/*/*"))
    m = fetch(fake, "org/gated", cache, token=TOKEN)
    assert Path(m.path).read_bytes() == blob(100)
    assert fake.requests("HEAD")[-1][2]["authorization"] == f"Bearer {TOKEN}"


def test_disk_full_keeps_the_partial_for_resume(fake: FakeHub, cache: str, monkeypatch) -> None:
    import errno

    data = blob(24 * MB)
    fake.add("org/repo", {"m-Q4_K_M.gguf": data})
    sha = fake.blob_sha("org/repo", "m-Q4_K_M.gguf")
    part = Path(cache, "models--org--repo", "blobs", f"{sha}.incomplete")

    real_fdopen = os.fdopen

    class FullDisk:  # the file system fills up after the first 10 MB chunk
        def __init__(self, f):
            self.f = f

        def write(self, b):
            if self.f.tell() + len(b) > CHUNK:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(os, "fdopen", lambda *a, **k: FullDisk(real_fdopen(*a, **k)))
    with pytest.raises(HubError, match=rf"disk full while downloading m-Q4_K_M.gguf: 10.5 MB of 25.2 MB kept in .*{sha}"
                                       r".incomplete; free some space and try again to resume"):
        fetch(fake, "org/repo", cache)
    assert part.stat().st_size == CHUNK
    assert hub.cached(HubRef("org/repo"), cache) is None and not part.with_suffix("").exists()
    monkeypatch.setattr(os, "fdopen", real_fdopen)
    assert Path(fetch(fake, "org/repo", cache).path).read_bytes() == data
    assert fake.requests("GET", "/blobs/")[-1][2]["range"] == f"bytes={CHUNK}-"
    # not enough room for what is left: said before a byte is fetched
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda p: type("Usage", (), {"free": 1000})())
    fake.add("org/other", {"o-Q4_K_M.gguf": blob(MB)})
    n = len(fake.requests("GET", "/blobs/"))
    with pytest.raises(HubError, match=r"not enough disk space for o-Q4_K_M.gguf: 1.0 MB more needed, 0.0 MB free"):
        fetch(fake, "org/other", cache)
    assert len(fake.requests("GET", "/blobs/")) == n


def test_split_model_downloads_every_shard_and_loads_as_one(fake: FakeHub, cache: str, tmp_path: Path) -> None:
    from test_gguf import split_gguf

    import qllama
    from qllama.gguf.reader import GGUFFile

    whole = tmp_path / "whole.gguf"
    tiny_model(whole, "q8_0")
    (tmp_path / "s").mkdir()
    shards = split_gguf(whole, tmp_path / "s", "tiny-Q8_0", max_tensors=7)
    assert len(shards) >= 3
    files = {f"Q8_0/{p.name}": p.read_bytes() for p in shards}
    files["tiny-f16.gguf"] = b"not this one"
    fake.add("org/split", files)
    m = fetch(fake, "org/split:q8_0", cache)
    assert len(m.paths) == len(shards) and m.path.endswith("Q8_0/tiny-Q8_0-00001-of-%05d.gguf" % len(shards))
    with GGUFFile(m.path) as g, GGUFFile(whole) as w:
        assert len(g.paths) == len(shards) and list(g.tensors) == list(w.tensors)
    a = qllama.load(whole, n_ctx=32)
    b = qllama.load(m.path, n_ctx=32)
    ids = a.tokenize("hello world")
    np.testing.assert_array_equal(a.logits(ids), b.logits(ids))
    # a later shard named explicitly resolves to the whole model; losing a shard is "not cached"
    assert fetch(fake, f"org/split/Q8_0/{shards[1].name}", cache).path == m.path
    os.remove(m.paths[-1])
    assert hub.cached(HubRef("org/split", tag="Q8_0"), cache) is None


def test_load_takes_a_reference(fake: FakeHub, tmp_path: Path, monkeypatch) -> None:
    """qllama.load resolves references through huggingface_hub's own settings (HF_HOME, HF_ENDPOINT)."""
    import huggingface_hub.constants as hc

    import qllama

    data = tiny_model(tmp_path / "t.gguf")
    fake.add("org/tiny", {"tiny-F32.gguf": data})
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hfcache"))
    monkeypatch.setattr(hc, "ENDPOINT", fake.url)  # what HF_ENDPOINT sets when huggingface_hub is imported
    monkeypatch.setattr(hc, "HUGGINGFACE_CO_URL_TEMPLATE", fake.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    m = qllama.load("org/tiny", n_ctx=16)
    assert m.path.startswith(str(tmp_path / "hfcache")) and Path(m.path).read_bytes() == data
    assert qllama.load("demo", n_ctx=16).metadata["general.architecture"] == "llama"


def test_list_and_rm(fake: FakeHub, cache: str, tmp_path: Path) -> None:
    from qllama.hub.cache import list_models, partial_downloads, remove

    fake.add("org/repo", {"m-Q4_K_M.gguf": blob(2000), "m-Q8_0.gguf": blob(3000, 1), "README.md": b"x"})
    fake.add("org/two", {"a/x.gguf": blob(500, 2), "b/x.gguf": blob(600, 3)})
    for ref in ("org/repo", "org/repo:Q8_0", "org/two/a/x.gguf", "org/two/b/x.gguf"):
        fetch(fake, ref, cache)
    rows = [(m.ref, m.quant, m.size, os.path.basename(m.path)) for m in list_models(cache)]
    assert rows == [("org/repo:Q4_K_M", "Q4_K_M", 2000, "m-Q4_K_M.gguf"), ("org/repo:Q8_0", "Q8_0", 3000, "m-Q8_0.gguf"),
                    ("org/two/a/x.gguf", None, 500, "x.gguf"), ("org/two/b/x.gguf", None, 600, "x.gguf")]
    for m in list_models(cache):  # every listed reference resolves to the listed file
        assert fetch(fake, m.ref, cache).path == m.path
    # a new commit of org/two that keeps a/x.gguf: `pull` links the same blob, `list` shows it once
    old = fake.repos["org/two"]["commit"]
    fake.add("org/two", {"a/x.gguf": blob(500, 2), "c/new.gguf": blob(100, 4)})
    before = len(fake.requests("GET", "/blobs/"))
    assert not fetch(fake, "org/two/a/x.gguf", cache, refresh=True).downloaded
    assert len(fake.requests("GET", "/blobs/")) == before
    now = list_models(cache)
    assert [m.ref for m in now] == [r[0] for r in rows[:3]] + [f"org/two@{old}/b/x.gguf"]  # only in the old commit
    assert now[2].commit == fake.repos["org/two"]["commit"] and now[3].commit == old
    assert fetch(fake, now[3].ref, cache).path == now[3].path
    sha8 = fake.blob_sha("org/repo", "m-Q8_0.gguf")
    Path(cache, "models--org--repo", "blobs", "f" * 64 + ".incomplete").write_bytes(b"partial")
    assert partial_downloads(cache) == [("org/repo", "f" * 64 + ".incomplete", 7)]
    assert remove(HubRef("org/repo", tag="q8_0".upper()), cache) == (["m-Q8_0.gguf"], 3000)
    assert not Path(cache, "models--org--repo", "blobs", sha8).exists()
    assert [m.ref for m in list_models(cache)][:1] == ["org/repo:Q4_K_M"]
    with pytest.raises(HubError, match="org/repo:Q8_0 is not in the cache"):
        remove(HubRef("org/repo", tag="Q8_0"), cache)
    names, freed = remove(HubRef("org/repo"), cache)
    assert names == ["m-Q4_K_M.gguf"] and 2000 + 7 < freed < 2000 + 7 + 4096  # the blob, the partial, the listing
    assert not Path(cache, "models--org--repo").exists()
    assert remove(HubRef("org/two"), cache)[0] == ["a/x.gguf", "b/x.gguf"]
    assert list_models(cache) == [] and not Path(cache, "models--org--two").exists()
    with pytest.raises(HubError, match="org/two is not in the cache"):
        remove(HubRef("org/two"), cache)


@pytest.fixture
def small_fs(tmp_path: Path):
    """A real 30 MB tmpfs (needs root and mount; else skip); unmounted afterwards."""
    import shutil
    import subprocess

    mnt = tmp_path / "fs"
    mnt.mkdir()
    if not shutil.which("mount") or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(mnt)],
                                                   capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_really_full_disk(fake: FakeHub, small_fs: Path, monkeypatch) -> None:
    """ENOSPC from the file system itself, mid-download: one clear error, the partial kept, resume later."""
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    cache = str(small_fs / "hub")
    data = blob(24 * MB)
    fake.add("org/repo", {"m-Q4_K_M.gguf": data})
    sha = fake.blob_sha("org/repo", "m-Q4_K_M.gguf")
    part = Path(cache, "models--org--repo", "blobs", f"{sha}.incomplete")
    fake.delay = 0.002
    filler = small_fs / "filler"

    def fill_the_disk() -> None:  # once the first chunk is on disk, something else takes all the space
        deadline = time.monotonic() + 60
        while not (part.exists() and part.stat().st_size >= CHUNK) and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            with open(filler, "wb", buffering=0) as f:
                while True:
                    f.write(bytes(MB))
        except OSError:
            pass

    t = threading.Thread(target=fill_the_disk, daemon=True)
    t.start()
    with pytest.raises(HubError, match=r"disk full while downloading m-Q4_K_M.gguf: .* kept in .*\.incomplete; free some space"):
        fetch(fake, "org/repo", cache)
    t.join(10)
    kept = part.stat().st_size
    assert CHUNK <= kept < len(data) and part.read_bytes() == data[:kept]  # a prefix: resumable
    assert hub.cached(HubRef("org/repo"), cache) is None and not part.with_suffix("").exists()
    filler.unlink()
    fake.delay = 0
    assert Path(fetch(fake, "org/repo", cache).path).read_bytes() == data
    assert fake.requests("GET", "/blobs/")[-1][2]["range"] == f"bytes={kept}-"


def test_the_cache_is_shared_with_huggingface_hub(fake: FakeHub, cache: str) -> None:
    """huggingface_hub's own downloader works against FakeHub, and each side finds what the other fetched."""
    import huggingface_hub as hf
    from qllama.hub.cache import list_models

    fake.add("org/a", {"a-Q4_K_M.gguf": blob(3000), "README.md": b"# a"})
    fake.add("org/b", {"b-Q8_0.gguf": blob(4000, 1)})
    theirs = hf.hf_hub_download("org/a", "a-Q4_K_M.gguf", cache_dir=cache, endpoint=fake.url)
    n = len(fake.log)
    assert fetch(fake, "org/a", cache).path == theirs and len(fake.log) == n  # found without a request
    ours = fetch(fake, "org/b", cache).path
    assert hf.try_to_load_from_cache("org/b", "b-Q8_0.gguf", cache_dir=cache) == ours
    assert hf.hf_hub_download("org/b", "b-Q8_0.gguf", cache_dir=cache, local_files_only=True) == ours
    Path(cache, "models--org--b", "blobs", "e" * 64 + ".incomplete").write_bytes(b"partial")
    scan = hf.scan_cache_dir(cache)
    assert not scan.warnings and {r.repo_id for r in scan.repos} == {"org/a", "org/b"}
    assert [m.ref for m in list_models(cache)] == ["org/a:Q4_K_M", "org/b:Q8_0"]


def test_out_of_reach_org_repo_takes_the_best_cached_quant(fake: FakeHub, cache: str, monkeypatch) -> None:
    """Only Q8_0 cached, the listing prefers Q4_K_M: without the hub, `org/repo` runs the Q8_0 (as llama.cpp does)."""
    import huggingface_hub.constants as hc

    fake.add("org/repo", {"m-Q4_K_M.gguf": blob(2000), "m-Q8_0.gguf": blob(3000, 1)})
    q8 = fetch(fake, "org/repo:Q8_0", cache).path
    dead = "http://127.0.0.1:9"
    assert hub.fetch(HubRef("org/repo"), cache=cache, endpoint=dead, progress=False).path == q8
    with pytest.raises(HubError, match="cannot reach"):  # `pull` must say it could not ask
        hub.fetch(HubRef("org/repo"), cache=cache, endpoint=dead, refresh=True, progress=False)
    with pytest.raises(HubError, match="cannot reach"):  # a tag is a tag
        hub.fetch(HubRef("org/repo", tag="Q4_K_M"), cache=cache, endpoint=dead, progress=False)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    assert hub.fetch(HubRef("org/repo"), cache=cache, endpoint=fake.url).path == q8
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)
    n = len(fake.requests("GET", "/blobs/"))
    assert hub.fetch(HubRef("org/repo"), cache=cache, endpoint=fake.url, progress=False).path.endswith("m-Q4_K_M.gguf")
    assert len(fake.requests("GET", "/blobs/")) == n + 1  # online, the preferred file is fetched
