"""Model references -> local GGUF files, through huggingface_hub and its standard cache.

A reference names a model wherever a path does (`qllama run REF`, `qllama.load(REF)`):

    path/to/model.gguf        a local file (anything that exists on disk is taken as a path)
    demo                      the small Shakespeare model shipped inside the package
    org/repo                  the repo's Q4_K_M file, else the first of PREFERENCE it has,
                              else its first GGUF model file
    org/repo:Q8_0             the file of that quant tag (case-insensitive, as llama.cpp's -hf)
    org/repo/dir/file.gguf    that file
    hf://org/repo[...]        the same forms, never taken as a local path; also with hf.co/ (as
                              ollama writes them) or https://huggingface.co/ in front, and a
                              file's .../resolve/<rev>/<file>.gguf or .../blob/... web address
    org/repo@rev...           any of the hub forms at a branch, tag or commit (default main)

Files land in huggingface_hub's cache (HF_HOME / HF_HUB_CACHE: blobs named by their sha256,
snapshots/<commit>/<file> links to them, refs/<branch> -> commit), so `huggingface-cli` and
llama.cpp see them too. HF_TOKEN (gated and private repos), HF_ENDPOINT and HF_HUB_OFFLINE
are honoured by huggingface_hub itself.

The cache is consulted first: a reference whose files are cached resolves with no network
request at all (so with the network down or HF_HUB_OFFLINE=1 it runs at once). `org/repo`
without a tag is chosen from the repo listing cached with the download (huggingface_hub's
`trees/<commit>.json`), so it picks the same file online and offline. `fetch(..., refresh=True)`
(`qllama pull`) asks the hub again.

A download goes to `blobs/<sha256>.incomplete` and is resumed from there (HTTP range) by the
next attempt; it becomes the blob only after its size and sha256 match what the hub announced
(X-Linked-Etag), so an interrupted, cut or corrupt download never sits where a model is found.
A split model (`*-00001-of-0000N.gguf`) is fetched shard by shard and resolves to its first
shard, which `qllama.gguf.reader.GGUFFile` opens together with the others. (One file's download:
`qllama.hub.download`; listing and removing cached models: `qllama.hub.cache`.)

huggingface_hub is imported only when a hub reference is used: local paths stay fast.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

from .download import download, hub_errors, write_ref
from .records import CachedModel, HubError, HubRef, HubUnreachable, hf_module

DEMO = "demo"
DEMO_FILE = "shakespeare-spm-Q4_K_M.gguf"

# `org/repo` without a tag: the first of these the repo has (qllama runs them all; most compact
# first among those whose quality loss is small, then the exact ones), else its first GGUF file.
PREFERENCE = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q5_K_S", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
              "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K", "F16", "BF16", "F32")

_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"  # one part of a repo id (the hub also forbids '--' and '..')
_REPO_RE = re.compile(rf"({_NAME})/({_NAME})(?:@([A-Za-z0-9._/-]+?))?(?::([A-Za-z0-9_.-]+))?")
_FILE_RE = re.compile(rf"({_NAME})/({_NAME})(?:@([A-Za-z0-9._-]+))?/(.+\.gguf)", re.IGNORECASE)
_SPLIT_RE = re.compile(r"^(.+)-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_TAG_RE = re.compile(r"[-.]([A-Za-z0-9_]+)$")
# prefixes that make a reference a hub reference: hf:// (huggingface_hub's), hf.co/ (ollama's), URLs
_URL_RE = re.compile(r"(hf://|(?:https?://)?(?:www\.)?(?:hf\.co|huggingface\.co)/)")
_WEB_FILE_RE = re.compile(rf"({_NAME}/{_NAME})/(?:resolve|blob)/([^/]+)/(.+\.gguf)(?:\?.*)?", re.IGNORECASE)
_NOT_MODELS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")  # GGUF side files (llama.cpp's list)
_SHA1_RE = re.compile(r"[0-9a-f]{40}")


# -- references ------------------------------------------------------------------------------


def parse(text: str) -> tuple[str, Any]:
    """Classify a reference: ("local", path) | ("demo", path) | ("hub", HubRef).

    Anything that exists on disk is a local path; so is anything that does not look like a
    hub reference (a missing `model.gguf` keeps its "no such file" error).
    """
    m = _URL_RE.match(text)
    if m:
        rest = text[m.end():]
        web = _WEB_FILE_RE.fullmatch(rest)  # a file's page or download link, as copied from the browser
        ref = HubRef(web[1], filename=web[3], revision=web[2]) if web else _hub_ref(rest)
        if ref is None:
            raise HubError(f"{text}: not a hub reference (expected {m[0]}org/repo[:QUANT] or {m[0]}org/repo/file.gguf)")
        return "hub", ref
    if os.path.lexists(text):
        return "local", text
    if text == DEMO:
        return "demo", demo_path()
    if text.startswith((".", "/", "~")) or "\\" in text:
        return "local", text
    ref = _hub_ref(text)
    if ref is None or (ref.filename is None and ref.repo.lower().endswith(".gguf")):
        return "local", text  # e.g. dir/model.gguf that does not exist
    return "hub", ref


def _hub_ref(text: str) -> HubRef | None:
    m = _FILE_RE.fullmatch(text)
    if m:
        return HubRef(f"{m[1]}/{m[2]}", filename=m[4], revision=m[3] or "main")
    m = _REPO_RE.fullmatch(text)
    if m:
        return HubRef(f"{m[1]}/{m[2]}", tag=m[4].upper() if m[4] else None, revision=m[3] or "main")
    return None


def demo_path() -> str:
    """The bundled demo model (package data)."""
    from importlib.resources import files

    path = files("qllama") / "data" / DEMO_FILE
    if not path.is_file():
        raise HubError(f"the demo model is missing from this installation ({path})")
    return os.fspath(path)


def resolve(model: str | os.PathLike, **kwargs: Any) -> str:
    """The local path of a model reference, downloading it first if needed (see `fetch`).

    Local paths come back unchanged (not even checked: the reader gives the error).
    """
    if not isinstance(model, str):
        return os.fspath(model)
    kind, value = parse(model)
    if kind != "hub":
        return value
    return fetch(value, **kwargs).path


# -- choosing a file in a repo ------------------------------------------------------------------


def quant_tag(filename: str) -> str | None:
    """The quant tag a GGUF file name carries (`...-Q4_K_M.gguf`, `x.q8_0-00001-of-00002.gguf`), upper-case."""
    stem = os.path.basename(filename)
    m = _SPLIT_RE.match(stem)
    stem = m[1] if m else stem[:-5] if stem.lower().endswith(".gguf") else stem
    m = _TAG_RE.search(stem)
    tag = m[1].upper() if m else None
    return tag if tag and any(c.isdigit() for c in tag) else None


def is_model_file(path: str) -> bool:
    """A GGUF that is a model (not an mmproj, imatrix or LoRA side file)."""
    name = os.path.basename(path).lower()
    return name.endswith(".gguf") and not any(s in name for s in _NOT_MODELS)


def shard_info(path: str) -> tuple[str, int, int]:
    """(prefix, 1-based index, count) of a file name; (path, 1, 1) when it is not split."""
    m = _SPLIT_RE.match(path)
    return (m[1], int(m[2]), int(m[3])) if m else (path, 1, 1)


def _has_tag(path: str, tag: str) -> bool:
    if quant_tag(path) == tag:
        return True
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(tag)}(?=[./-])", path, re.IGNORECASE) is not None


def choose(ref: HubRef, files: list[str]) -> list[str]:
    """The files (all shards, first first) that `ref` names among a repo's file paths."""
    models = sorted(p for p in files if is_model_file(p) and shard_info(p)[1] == 1)
    if ref.filename:
        if ref.filename not in files:
            listed = ", ".join(sorted(p for p in files if p.lower().endswith(".gguf"))[:12]) or "none"
            raise HubError(f"{ref.repo} has no file {ref.filename} (its GGUF files: {listed})")
        prefix, _, n = shard_info(ref.filename)
        primary = ref.filename if n == 1 else f"{prefix}-00001-of-{n:05d}.gguf"
    elif ref.tag:
        primary = next((p for p in models if _has_tag(p, ref.tag)), None)
        if primary is None:
            tags = sorted({t for p in models if (t := quant_tag(p))}) or ["none"]
            raise HubError(f"{ref.repo} has no {ref.tag} file; quant tags available: {', '.join(tags)}")
    else:
        primary = next((p for t in PREFERENCE for p in models if _has_tag(p, t)), models[0] if models else None)
        if primary is None:
            raise HubError(f"{ref.repo} has no GGUF model files")
    prefix, _, n = shard_info(primary)
    if n == 1:
        return [primary]
    shards = [f"{prefix}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    missing = [s for s in shards if s not in files]
    if missing:
        raise HubError(f"{ref.repo}: split model {primary} lacks shard {missing[0]}")
    return shards


# -- the cache ----------------------------------------------------------------------------------


def cache_dir() -> str:
    """huggingface_hub's cache folder (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub).

    Worked out as huggingface_hub.constants does, without importing it (a cached model then
    starts as fast as a local path); once it is imported, its value is the one used.
    """
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        return constants.HF_HUB_CACHE
    expand = lambda p: os.path.expandvars(os.path.expanduser(p))  # noqa: E731
    xdg = os.getenv("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    home = expand(os.getenv("HF_HOME", os.path.join(xdg, "huggingface")))
    return expand(os.getenv("HF_HUB_CACHE", os.getenv("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub"))))


def repo_folder(repo: str, cache: str | None = None) -> str:
    return os.path.join(cache or cache_dir(), "models--" + repo.replace("/", "--"))


def _read_ref(storage: str, revision: str) -> str | None:
    if _SHA1_RE.fullmatch(revision):
        return revision
    try:
        with open(os.path.join(storage, "refs", revision)) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _listing_path(storage: str, commit: str) -> str:
    return os.path.join(storage, "trees", f"{commit}.json")  # huggingface_hub's own tree cache


def _read_listing(storage: str, commit: str) -> list[str] | None:
    try:
        with open(_listing_path(storage, commit), encoding="utf-8") as f:
            return list(json.load(f)["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_listing(storage: str, commit: str, siblings: list[Any]) -> None:
    """Keep the repo listing (huggingface_hub's trees/<commit>.json format) for offline choices."""
    files = {}
    for s in siblings:
        info: dict[str, Any] = {"size": s.size or 0, "blob_id": s.blob_id or ""}
        if s.lfs is not None:
            info.update(lfs_sha256=s.lfs.sha256, lfs_size=s.lfs.size)
        files[s.rfilename] = info
    path = _listing_path(storage, commit)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"format_version": 1, "files": dict(sorted(files.items()))}, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass  # only an optimisation for later offline use


def _snapshot_files(snap: str) -> list[str]:
    out = []
    for root, _, names in os.walk(snap):
        out += [os.path.relpath(os.path.join(root, n), snap).replace(os.sep, "/") for n in names]
    return out


def cached(ref: HubRef, cache: str | None = None, any_quant: bool = False) -> CachedModel | None:
    """The cached files of `ref`, or None (no network, no error).

    `org/repo` names the file the repo listing prefers; with any_quant (the hub is out of reach)
    it may also name the best of the files that are cached, as llama.cpp does offline.
    """
    storage = repo_folder(ref.repo, cache)
    commit = _read_ref(storage, ref.revision)
    if commit is None:
        return None
    snap = os.path.join(storage, "snapshots", commit)
    present = _snapshot_files(snap)
    listings = [_read_listing(storage, commit) or present]
    if any_quant and ref.tag is None and ref.filename is None:
        listings.append(present)
    for listing in listings:
        try:
            names = choose(ref, listing)
        except HubError:
            continue
        paths = [os.path.join(snap, *n.split("/")) for n in names]
        if all(os.path.isfile(p) for p in paths):
            return CachedModel(HubRef(ref.repo, filename=names[0], revision=ref.revision), commit, paths)
    return None


# -- fetching -----------------------------------------------------------------------------------


def fetch(
    ref: HubRef,
    *,
    refresh: bool = False,
    cache: str | None = None,
    endpoint: str | None = None,
    token: str | None = None,
    progress: bool = True,
) -> CachedModel:
    """The files of `ref` in the cache, downloaded (and verified) if they are not there.

    refresh: ask the hub even when a cached copy exists (a newer commit is fetched; identical
    blobs are not downloaded again). Offline (HF_HUB_OFFLINE=1) only the cache is used.
    """

    if not refresh:
        hit = cached(ref, cache)  # before importing huggingface_hub: a cached model needs nothing else
        if hit is not None:
            return hit
    hf = hf_module()
    endpoint = (endpoint or hf.constants.ENDPOINT).rstrip("/")
    offline = hf.constants.is_offline_mode()
    if offline:
        hit = cached(ref, cache, any_quant=True)
        if hit is not None:
            return hit
        raise HubUnreachable(f"{ref} is not in the local cache ({cache or cache_dir()}) and HF_HUB_OFFLINE is set")
    try:
        with hub_errors(ref, endpoint):
            api = hf.HfApi(endpoint=endpoint, token=token)
            info = api.model_info(ref.repo, revision=ref.revision, files_metadata=True)
            siblings = info.siblings or []
            names = choose(ref, [s.rfilename for s in siblings])
            storage = repo_folder(ref.repo, cache)
            _write_listing(storage, info.sha, siblings)
            listed = {s.rfilename: (s.lfs.size, s.lfs.sha256) if s.lfs else (s.size, None) for s in siblings}
            model = CachedModel(HubRef(ref.repo, filename=names[0], revision=ref.revision), info.sha)
            for name in names:
                path, got = download(hf, ref, name, info.sha, storage, listed[name], endpoint, token, progress)
                model.paths.append(path)
                model.downloaded |= got
            write_ref(storage, ref.revision, info.sha)
    except HubUnreachable:
        hit = None if refresh else cached(ref, cache, any_quant=True)
        if hit is None:
            raise
        return hit
    return model
