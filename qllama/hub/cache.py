"""The GGUF models in huggingface_hub's cache: list them (`qllama list`), remove one (`qllama rm`).

Listing goes through huggingface_hub's `scan_cache_dir`. Removal is careful file removal in
the cache's own layout: the snapshot links of the chosen files go, then every blob no other
snapshot link still points to (and its `.incomplete` partial), then empty folders; a repo left
with no files goes entirely (refs, listings, partial downloads).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from .records import HubError, HubRef, hf_module
from .refs import is_model_file, shard_info, cache_dir, choose, quant_tag, repo_folder


@dataclass
class ListedModel:
    """One cached model (all shards of a split model count as one)."""

    ref: str  # a reference that names exactly this model
    repo: str
    filename: str  # path in the repo (the first shard)
    quant: str | None
    size: int  # bytes, over the shards present
    path: str  # first shard, in the snapshot
    commit: str
    complete: bool  # every shard present


def list_models(cache: str | None = None) -> list[ListedModel]:
    """Every cached GGUF model file, by repo then file name."""
    hf = hf_module()
    try:
        info = hf.scan_cache_dir(cache or cache_dir())
    except hf.errors.CacheNotFound:
        return []
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model":
            continue
        seen: set[str] = set()  # files of the revisions a branch points to
        for rev in sorted(repo.revisions, key=lambda r: (bool(r.refs), r.last_modified), reverse=True):
            files = {os.path.relpath(f.file_path, rev.snapshot_path).replace(os.sep, "/"): f for f in rev.files}
            firsts = sorted(p for p in files if is_model_file(p) and shard_info(p)[1] == 1)
            if rev.refs:
                seen.update(firsts)
            else:  # a superseded commit: only what the current one lacks
                firsts = [p for p in firsts if p not in seen]
            tags = [quant_tag(p) for p in firsts]
            at = "" if "main" in rev.refs else f"@{sorted(rev.refs)[0]}" if rev.refs else f"@{rev.commit_hash}"
            for name, tag in zip(firsts, tags):
                prefix, _, n = shard_info(name)
                shards = [name] if n == 1 else [f"{prefix}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
                present = [files[s] for s in shards if s in files]
                unique = tag is not None and tags.count(tag) == 1
                ref = f"{repo.repo_id}{at}:{tag}" if unique else f"{repo.repo_id}{at}/{name}"
                out.append(ListedModel(ref, repo.repo_id, name, tag, sum(f.size_on_disk for f in present),
                                       str(files[name].file_path), rev.commit_hash, len(present) == n))
    return out


def remove(ref: HubRef, cache: str | None = None) -> tuple[list[str], int]:
    """Delete the cached files `ref` names (`org/repo` alone: all its GGUF files).

    Returns (the repo paths removed, bytes freed). No network.
    """
    storage = repo_folder(ref.repo, cache)
    snaps = os.path.join(storage, "snapshots")
    if not os.path.isdir(snaps):
        raise HubError(f"{ref.repo} is not in the cache ({cache or cache_dir()})")
    doomed: list[str] = []  # snapshot links to remove
    names: set[str] = set()
    for commit in sorted(os.listdir(snaps)):
        if ref.revision != "main" and commit != _commit_of(storage, ref.revision):
            continue
        snap = os.path.join(snaps, commit)
        files = [os.path.relpath(os.path.join(r, n), snap).replace(os.sep, "/")
                 for r, _, ns in os.walk(snap) for n in ns]
        if ref.tag is None and ref.filename is None:
            chosen = [p for p in files if p.lower().endswith(".gguf")]
        else:
            try:
                chosen = [p for p in choose(ref, files) if p in files]
            except HubError:
                continue
        names.update(chosen)
        doomed += [os.path.join(snap, *p.split("/")) for p in chosen]
    if not doomed:
        raise HubError(f"{ref} is not in the cache (`qllama list` shows what is)")
    before = _disk_bytes(storage)
    blobs = {os.path.realpath(p) for p in doomed}
    for p in doomed:
        os.remove(p)
    kept = {os.path.realpath(os.path.join(r, n)) for r, _, ns in os.walk(snaps) for n in ns}
    blob_dir = os.path.realpath(os.path.join(storage, "blobs"))
    for b in blobs - kept:
        if os.path.dirname(b) == blob_dir:
            for victim in (b, b + ".incomplete"):
                if os.path.isfile(victim):
                    os.remove(victim)
    _prune_empty(snaps)
    if not any(files for _, _, files in os.walk(snaps)):
        shutil.rmtree(storage, ignore_errors=True)  # refs, listings, partial downloads of the repo
        shutil.rmtree(os.path.join(os.path.dirname(storage), ".locks", os.path.basename(storage)), ignore_errors=True)
    freed = before - _disk_bytes(storage)
    return sorted(names), freed


def _disk_bytes(top: str) -> int:
    """Bytes of the regular files under `top` (links not followed)."""
    total = 0
    for root, _, files in os.walk(top):
        for n in files:
            p = os.path.join(root, n)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total


def _commit_of(storage: str, revision: str) -> str | None:
    try:
        with open(os.path.join(storage, "refs", revision)) as f:
            return f.read().strip()
    except OSError:
        return revision


def _prune_empty(top: str) -> None:
    for root, dirs, files in os.walk(top, topdown=False):
        if root != top and not os.listdir(root):
            os.rmdir(root)


def partial_downloads(cache: str | None = None) -> list[tuple[str, str, int]]:
    """(repo, blob name, bytes) of every resumable partial download."""
    base = cache or cache_dir()
    out = []
    try:
        folders = sorted(os.listdir(base))
    except OSError:
        return []
    for folder in folders:
        if not folder.startswith("models--"):
            continue
        blobs = os.path.join(base, folder, "blobs")
        for name in sorted(os.listdir(blobs)) if os.path.isdir(blobs) else []:
            if name.endswith(".incomplete") and name.count(".") == 1:  # ours: <sha256>.incomplete
                out.append((folder[8:].replace("--", "/", 1), name, os.path.getsize(os.path.join(blobs, name))))
    return out
