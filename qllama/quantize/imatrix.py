"""llama.cpp's importance matrix (`qllama quantize --imatrix FILE`), read as llama-quantize reads it.

GGUF format (written by llama.cpp's tools/imatrix): for each weight W two f32 tensors,
`W.in_sum2` (GGUF shape (ne0, n_mat): the sums of squared activations of each input column, one
row per expert) and `W.counts` ((1, n_mat): how many activations each row summed), and the keys
`imatrix.datasets` (strings), `imatrix.chunk_count`, `imatrix.chunk_size`. The quantizer's weights
are in_sum2 / count in float32 (a row never reached in calibration, count 0: all ones).

Legacy `.dat` format: int32 n_entries; per entry int32 len, the name, int32 ncall, int32 nval and
nval float32 sums (weights sums / ncall); then optionally int32 chunk count, int32 len, a dataset.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

import numpy as np

from ..errors import GGUFError, QllamaError

IMATRIX_HOWTO = "make one with llama.cpp: llama-imatrix -m MODEL.gguf -f TEXT.txt -o imatrix.gguf"


class ImatrixError(QllamaError):
    """An importance matrix file that cannot be used."""


@dataclass
class ImportanceMatrix:
    """Weights per tensor name: float32 (n_mat * ne0,), llama.cpp's sums / counts."""

    weights: dict[str, np.ndarray]
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    path: str = ""

    def for_tensor(self, name: str, ne0: int, n_mat: int) -> np.ndarray | None:
        """The weights of tensor `name` as (n_mat, ne0), None when the matrix has no entry for it.
        A wrong size is an error, but for token_embd (llama.cpp ignores its entry then)."""
        w = self.weights.get(name)
        if w is None:
            return None
        if w.size != ne0 * n_mat:
            if name == "token_embd.weight":
                return None
            raise ImatrixError(f"{self.path}: the importance matrix has {w.size} values for {name}, "
                               f"which has {ne0 * n_mat} columns: it was made for another model")
        return w.reshape(n_mat, ne0)


def read_imatrix(path) -> ImportanceMatrix:
    """Read an importance matrix (GGUF or legacy .dat); a bad file raises ImatrixError (one line)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ImatrixError(f"{path}: cannot read the importance matrix: {e.strerror or e}") from None
    m = _read_gguf(path) if data[:4] == b"GGUF" else _read_legacy(path, data)
    if not m.weights:
        raise ImatrixError(f"{path}: the importance matrix has no entries")
    bad = [name for name, w in m.weights.items() if not np.isfinite(w).all()]
    if bad:
        raise ImatrixError(f"{path}: the importance matrix of {bad[0]} holds NaN or Inf")
    return m


def _read_gguf(path: str) -> ImportanceMatrix:
    from ..gguf.reader import GGUFFile
    from ..gguf.types import F32

    try:
        g = GGUFFile(path)
    except GGUFError as e:
        raise ImatrixError(f"not an importance matrix: {e}") from None
    with g:
        missing = [k for k in ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size") if k not in g.metadata]
        if missing:
            raise ImatrixError(f"{path}: not an importance matrix (no {missing[0]} key)")
        pairs: dict[str, list] = {}
        for name, t in g.tensors.items():
            for suffix, slot in ((".in_sum2", 0), (".counts", 1)):
                if name.endswith(suffix) and len(name) > len(suffix):
                    if t.type_id != F32:
                        raise ImatrixError(f"{path}: {name} is {t.type_name}, not f32")
                    pairs.setdefault(name[: -len(suffix)], [None, None])[slot] = t
        weights = {}
        for name, (sums, counts) in sorted(pairs.items()):
            if sums is None or counts is None:
                raise ImatrixError(f"{path}: mismatched sums and counts for {name}")
            ne0 = sums.shape[0]
            n_mat = sums.n_elements // max(ne0, 1)
            if counts.n_elements != n_mat:
                raise ImatrixError(f"{path}: {name} has {counts.n_elements} counts for {n_mat} rows of sums")
            s = g.tensor_array(sums.name).reshape(n_mat, ne0).astype(np.float32)  # (n_mat, ne0)
            c = g.tensor_array(counts.name).reshape(n_mat, 1).astype(np.float32)  # (n_mat, 1)
            with np.errstate(divide="ignore", invalid="ignore"):
                weights[name] = np.where(c > 0, s / np.where(c > 0, c, 1), np.float32(1)).astype(np.float32).reshape(-1)
        chunks = g.metadata["imatrix.chunk_count"]
        datasets = g.metadata["imatrix.datasets"]
    return ImportanceMatrix(weights, [str(d) for d in datasets] if isinstance(datasets, (list, np.ndarray)) else [],
                            int(chunks) if isinstance(chunks, (int, np.integer)) else 0, path)


def _read_legacy(path: str, data: bytes) -> ImportanceMatrix:
    def fail(what: str):
        return ImatrixError(f"{path}: not an importance matrix (GGUF or llama.cpp's legacy .dat): {what}")

    pos = 0

    def i32(what: str) -> int:
        nonlocal pos
        if pos + 4 > len(data):
            raise fail(f"the file ends before {what}")
        (v,) = struct.unpack_from("<i", data, pos)
        pos += 4
        return v

    n_entries = i32("the entry count")
    if n_entries < 1 or n_entries > len(data) // 12:
        raise fail(f"{n_entries} entries")
    weights = {}
    for i in range(n_entries):
        n = i32(f"entry {i + 1}'s name")
        if n < 0 or pos + n > len(data):
            raise fail(f"entry {i + 1}'s name")
        name = data[pos : pos + n].split(b"\0")[0].decode("utf-8", "replace")
        pos += n
        ncall = i32(f"entry {i + 1}'s call count")
        nval = i32(f"entry {i + 1}'s value count")
        if nval < 1 or pos + 4 * nval > len(data):
            raise fail(f"entry {i + 1} ({name}) has {nval} values")
        v = np.frombuffer(data, "<f4", nval, pos).astype(np.float32)
        pos += 4 * nval
        weights[name] = v / np.float32(ncall) if ncall > 0 else v.copy()
    chunks, datasets = 0, []
    if pos < len(data):  # the newer legacy files end with the chunk count and the dataset's name
        chunks = i32("the chunk count")
        n = i32("the dataset name")
        datasets = [data[pos : pos + max(n, 0)].decode("utf-8", "replace")]
    return ImportanceMatrix(weights, datasets, chunks, path)


def write_imatrix(path, sums: dict[str, np.ndarray], counts: dict[str, np.ndarray], *, datasets=("calibration.txt",),
                  chunk_count: int = 1, chunk_size: int = 512) -> None:
    """Write sums (name -> (n_mat, ne0) f32) and counts (name -> (n_mat,) f32) in llama.cpp's GGUF
    imatrix layout (tests, and tools that compute a matrix)."""
    import gguf

    w = gguf.GGUFWriter(os.fspath(path), arch="")
    w.add_string("general.type", "imatrix")
    w.add_array("imatrix.datasets", list(datasets))
    w.add_uint32("imatrix.chunk_count", chunk_count)
    w.add_uint32("imatrix.chunk_size", chunk_size)
    for name, s in sums.items():
        w.add_tensor(f"{name}.in_sum2", np.asarray(s, np.float32).reshape(-1, np.shape(s)[-1]))  # numpy (n_mat, ne0)
        w.add_tensor(f"{name}.counts", np.asarray(counts[name], np.float32).reshape(-1, 1))  # numpy (n_mat, 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
