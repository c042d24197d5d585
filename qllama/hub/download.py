"""One file from the hub into huggingface_hub's cache: resumable, verified, never half-visible.

`download` asks the hub for the file's metadata (HEAD .../resolve/<commit>/<file>: sha256 in
X-Linked-Etag, size, the CDN location it redirects to), then fetches the body with
huggingface_hub's `http_get` into `blobs/<sha256>.incomplete`, resuming from what is there
(an HTTP range request). Only when the size and the sha256 match does the partial become
`blobs/<sha256>` and get its `snapshots/<commit>/<file>` link, so an interrupted, cut or
corrupt download is never found as a model. A corrupt partial is deleted; a cut one is kept for
the next attempt (also after Ctrl-C or a full disk). `hub_errors` turns huggingface_hub's and
the network's exceptions into one-line `HubError`s.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil

from ..errors import QllamaError
from .records import HubError, HubRef, HubUnreachable, hf_module

_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_SHA1_RE = re.compile(r"[0-9a-f]{40}")


def write_ref(storage: str, revision: str, commit: str) -> None:
    if revision == commit:
        return
    path = os.path.join(storage, "refs", *revision.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(commit)


def download(hf, ref: HubRef, name: str, commit: str, storage: str, listed: tuple[int | None, str | None],
             endpoint: str | None, token: str | None, progress: bool) -> tuple[str, bool]:
    """One file into the cache: (snapshot path, whether bytes were fetched).

    listed: (size, sha256) from the repo listing, used where the file's own headers lack them.
    """
    from urllib.parse import urlsplit

    pointer = os.path.join(storage, "snapshots", commit, *name.split("/"))
    if os.path.isfile(pointer):
        return pointer, False
    url = hf.hf_hub_url(ref.repo, name, revision=commit, endpoint=endpoint)
    meta = hf.get_hf_file_metadata(url, token=token, endpoint=endpoint)  # HEAD: sha256, size, where
    etag, size = meta.etag, meta.size if meta.size is not None else listed[0]
    if not etag or "/" in etag or etag.startswith("."):
        raise HubError(f"{ref.repo}/{name}: the hub gave no usable checksum (ETag {etag!r})")
    blob = os.path.join(storage, "blobs", etag)
    os.makedirs(os.path.dirname(blob), exist_ok=True)
    os.makedirs(os.path.dirname(pointer), exist_ok=True)
    fetched = False
    lock = os.path.join(os.path.dirname(storage), ".locks", os.path.basename(storage), f"{etag}.lock")
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    with hf.utils.WeakFileLock(lock):
        if not os.path.isfile(blob):
            headers = hf.utils.build_hf_headers(token=token)
            if urlsplit(meta.location).netloc != urlsplit(url).netloc:
                headers.pop("authorization", None)  # a signed CDN URL: the token stays on the hub
            want = etag if _SHA256_RE.fullmatch(etag) or not listed[1] else listed[1]
            _fetch_blob(hf, meta.location, blob, want, size, headers, os.path.basename(name), progress)
            fetched = True
        _link(blob, pointer)
    return pointer, fetched


def _fetch_blob(hf, url: str, blob: str, checksum: str, size: int | None, headers: dict, label: str,
                progress: bool) -> None:
    """Download to blob.incomplete (resuming it), verify against `checksum`, then rename to the blob.

    checksum: a sha256 (an LFS file) or a git blob sha1 (a small file in git); anything else is
    a mirror's opaque ETag and cannot be checked.
    """
    from huggingface_hub.file_download import http_get

    part = blob + ".incomplete"
    try:
        fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o644)
        with os.fdopen(fd, "r+b") as f:
            have = f.seek(0, os.SEEK_END)
            if size is not None and have > size:  # not a prefix of this blob: start over
                f.truncate(0)
                have = f.seek(0)
            if size is not None:
                free = shutil.disk_usage(os.path.dirname(part)).free
                if size - have > free:
                    raise HubError(f"not enough disk space for {label}: {_mb(size - have)} more needed, "
                                   f"{_mb(free)} free in {os.path.dirname(part)}")
            out = _Hashing(f, checksum, have)
            http_get(url, out, resume_size=have, headers=headers, expected_size=size, displayed_filename=label,
                     tqdm_class=None if progress else hf.utils.silent_tqdm)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise HubError(f"disk full while downloading {label}: {_mb(_size_of(part))} of {_mb(size)} kept in "
                           f"{part}; free some space and try again to resume") from None
        if "Consistency check failed" in str(e):
            raise HubError(f"{label}: the download stopped at {_mb(_size_of(part))} of {_mb(size)}; "
                           "try again to resume") from None
        raise
    got = out.hexdigest() or _file_hash(part, checksum)
    if got is not None and got != checksum:
        os.remove(part)  # a corrupt download is no use for resuming either
        raise HubError(f"{label}: checksum mismatch (the hub says {checksum[:16]}..., the download has "
                       f"{got[:16]}...); the bad download was deleted, try again")
    os.replace(part, blob)


class _Hashing:
    """The partial file as http_get writes it: sha256 of the bytes on the fly, so that a large model
    is not read back in full after its download. Any seek other than a restart from byte 0 (which
    http_get does when the server ignores the range) leaves the hash to a re-read of the file."""

    def __init__(self, f, checksum: str, have: int):
        self.f = f
        self.h = hashlib.sha256() if _SHA256_RE.fullmatch(checksum) else None
        if self.h is not None and have:
            f.seek(0)
            while f.tell() < have and (chunk := f.read(min(1 << 22, have - f.tell()))):
                self.h.update(chunk)
            f.seek(have)

    def write(self, b) -> int:
        if self.h is not None:
            self.h.update(b)
        return self.f.write(b)

    def seek(self, pos: int, whence: int = 0) -> int:
        if self.h is not None:
            self.h = hashlib.sha256() if (pos, whence) == (0, 0) else None
        return self.f.seek(pos, whence)

    def __getattr__(self, name: str):  # tell, truncate, flush...
        return getattr(self.f, name)

    def hexdigest(self) -> str | None:
        return self.h.hexdigest() if self.h is not None else None


def _size_of(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _mb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e6:.1f} MB"


def _file_hash(path: str, etag: str) -> str | None:
    """The file's sha256 (LFS etag) or git blob sha1 (small files), as the etag's kind; None if unknown."""
    if _SHA256_RE.fullmatch(etag):
        h = hashlib.sha256()
    elif _SHA1_RE.fullmatch(etag):
        h = hashlib.sha1(b"blob %d\0" % os.path.getsize(path))
    else:
        return None
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _link(blob: str, pointer: str) -> None:
    """snapshots/<commit>/<file> -> ../../blobs/<etag>, as huggingface_hub links it (a copy without symlinks)."""
    if os.path.lexists(pointer):
        os.remove(pointer)
    try:
        os.symlink(os.path.relpath(blob, os.path.dirname(pointer)), pointer)
    except OSError:
        shutil.copyfile(blob, pointer)


class hub_errors:
    """Turn huggingface_hub's and the network's exceptions into one-line HubErrors."""

    def __init__(self, ref: HubRef, endpoint: str | None):
        self.ref, self.endpoint = ref, endpoint

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ, exc, tb) -> bool:
        if exc is None or isinstance(exc, (QllamaError, KeyboardInterrupt)):
            return False
        msg = _explain(exc, self.ref, self.endpoint or hf_module().constants.ENDPOINT)
        if msg is None:
            return False
        unreachable = isinstance(exc, (hf_module().errors.OfflineModeIsEnabled, ConnectionError, TimeoutError, *_network_errors()))
        raise (HubUnreachable if unreachable else HubError)(msg) from None


def _explain(exc: BaseException, ref: HubRef, endpoint: str) -> str | None:
    from huggingface_hub import errors as E

    repo = ref.repo
    if isinstance(exc, E.GatedRepoError):
        return (f"{repo} is a gated repository: accept its conditions on {endpoint}/{repo} and set HF_TOKEN "
                "to an access token of that account")
    if isinstance(exc, E.RepositoryNotFoundError):
        local = f"{ref} is not a local file, and " if ref.filename else ""
        return f"{local}no repository {repo} on {endpoint} (a private repository needs HF_TOKEN)"
    if isinstance(exc, E.RevisionNotFoundError):
        return f"{repo} has no revision {ref.revision}"
    if isinstance(exc, E.EntryNotFoundError):
        return f"{repo} has no file {ref.filename or ''}".rstrip()
    if isinstance(exc, E.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", "?")
        hint = " (is HF_TOKEN valid?)" if status in (401, 403) else ""
        return f"the hub answered HTTP {status} for {ref}{hint}"
    if isinstance(exc, E.OfflineModeIsEnabled):
        return f"{ref} is not in the local cache and HF_HUB_OFFLINE is set"
    if isinstance(exc, _network_errors()) or isinstance(exc, (ConnectionError, TimeoutError)):
        return f"cannot reach {endpoint} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})" \
               f" and {ref} is not in the local cache"
    return None


def _network_errors() -> tuple[type, ...]:
    kinds: list[type] = []
    for mod in ("httpx2", "httpx"):
        try:
            m = __import__(mod)
        except ImportError:
            continue
        kinds += [m.TransportError]
    try:
        import requests

        kinds.append(requests.ConnectionError)
    except ImportError:
        pass
    return tuple(kinds)
