"""A read-only GGUF reader: header, metadata, tensor infos, and zero-copy tensor views.

Layout of a GGUF file (all little-endian):

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv        (v2, v3; v1 used u32 counts)
    n_kv      x  [ string key | u32 value_type | value ]
    n_tensors x  [ string name | u32 n_dims | u64 ne[n_dims] | u32 ggml_type | u64 offset ]
    padding to general.alignment (default 32)
    data section: each tensor at data_start + offset (offset a multiple of the alignment)

A string is a u64 byte length followed by UTF-8 bytes (no NUL). An array value is
u32 element_type | u64 count | elements, and arrays may nest.

The file is untrusted input: every count, length, offset and size is checked against the
bytes that are really there before anything is allocated or viewed, so a crafted file gives
a `GGUFError` with a one-line message, never a hang, a crash or a huge allocation. Keys and
tensor names must be valid UTF-8; string *values* keep invalid UTF-8 reversibly
(`surrogateescape`: `s.encode("utf-8", "surrogateescape")` gives the file's bytes back).
Nothing here imports numba, so `qllama inspect` starts fast.

A model may be split over several files (llama.cpp's gguf-split, `<prefix>-00001-of-00003.gguf`
...): each shard is a complete GGUF file holding some of the tensors, with `split.no` (0-based,
u16), `split.count` (u16) and, in the first, `split.tensors.count` (i32) and all the other
metadata. Opening the first shard opens the others by name and presents them as one file;
every shard gets the same validation as a single file, and the shards must agree on their
numbering, hold disjoint tensor names, and add up to `split.tensors.count`.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from array import array
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Any

import numpy as np

from ..errors import GGUFError
from .types import GGML_TYPES, type_name

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 8  # no real file nests arrays; a hostile one could recurse forever
INT64_MAX = 2**63 - 1  # ggml keeps dims, element counts and byte sizes in int64

# Smallest possible encodings, used to reject counts that cannot fit in the file before
# looping over them: a metadata entry is key length (8) + type (4) + a 1-byte value at least;
# a tensor info is name length (8) + n_dims (4) + type (4) + offset (8).
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8
_LEN_BYTES = 8  # the u64 length in front of every string
_ARRAY_HEADER_BYTES = 4 + 8  # element type + count in front of every array

# Below this many strings the plain loop beats the vectorised gather (numpy call overhead).
_VECTOR_MIN_STRINGS = 64
# _scan_starts looks at this many bytes per string first (vocab strings average ~20 with their
# prefix), growing 4x while needed up to the max; beyond it the sequential walk is used.
_SCAN_BYTES_PER_STRING = 24
_SCAN_MAX_BYTES_PER_STRING = 384
_SCAN_MAX_WINDOW = 1 << 28  # bytes; bounds the scan's temporaries (2 bools per byte)

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS_COUNT = "split.no", "split.count", "split.tensors.count"
MAX_SPLITS = 99999  # the file names have 5 digits


class ValueType(IntEnum):
    """The 13 GGUF metadata value types (gguf_type in ggml)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# Scalar value types: (struct format, numpy dtype) - little-endian.
_SCALARS: dict[int, tuple[struct.Struct, np.dtype]] = {
    ValueType.UINT8: (struct.Struct("<B"), np.dtype("<u1")),
    ValueType.INT8: (struct.Struct("<b"), np.dtype("<i1")),
    ValueType.UINT16: (struct.Struct("<H"), np.dtype("<u2")),
    ValueType.INT16: (struct.Struct("<h"), np.dtype("<i2")),
    ValueType.UINT32: (struct.Struct("<I"), np.dtype("<u4")),
    ValueType.INT32: (struct.Struct("<i"), np.dtype("<i4")),
    ValueType.FLOAT32: (struct.Struct("<f"), np.dtype("<f4")),
    ValueType.BOOL: (struct.Struct("<?"), np.dtype("<u1")),
    ValueType.UINT64: (struct.Struct("<Q"), np.dtype("<u8")),
    ValueType.INT64: (struct.Struct("<q"), np.dtype("<i8")),
    ValueType.FLOAT64: (struct.Struct("<d"), np.dtype("<f8")),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# numpy dtypes of the tensor types that have a direct element view.
_TENSOR_DTYPES = {
    "f32": np.dtype("<f4"), "f16": np.dtype("<f2"), "bf16": np.dtype("<u2"),  # bf16: raw bits
    "f64": np.dtype("<f8"), "i8": np.dtype("<i1"), "i16": np.dtype("<i2"),
    "i32": np.dtype("<i4"), "i64": np.dtype("<i8"),
}


@dataclass(frozen=True)
class MetadataType:
    """The GGUF type of a metadata value; `item` is the element type of an array.

    `item` is None only for an empty array of arrays (whose inner type the file does not say).
    """

    type: ValueType
    item: "MetadataType | None" = None

    def __str__(self) -> str:
        if self.type == ValueType.ARRAY:
            return f"array[{self.item if self.item is not None else '?'}]"
        return self.type.name.lower()


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry. `shape` is in GGUF/ggml order: ne0 (the row length) first."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int  # relative to the data section
    n_elements: int
    n_bytes: int | None  # None when the type id is unknown to us
    shard: int = 0  # which file of a split model holds it (0 = the first, or the only one)

    @property
    def type_name(self) -> str:
        return type_name(self.type_id)


class _Cursor:
    """Bounds-checked sequential reads over the file's bytes."""

    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf: Any, pos: int, end: int):
        self.buf, self.pos, self.end = buf, pos, end

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.end - self.pos:
            raise GGUFError(
                f"truncated or corrupt file: {what} needs {n} bytes at offset {self.pos}, "
                f"but only {max(self.end - self.pos, 0)} remain"
            )

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def raw_string(self, what: str) -> bytes:
        start = self.pos
        n = self.u64(f"{what} length")
        self.need(n, f"{what} (string of {n} bytes starting at offset {start})")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw

    def strict_string(self, what: str) -> str:
        """A key or a name: must be valid UTF-8 (they are identifiers, not free text)."""
        start = self.pos
        raw = self.raw_string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(
                f"invalid UTF-8 in {what} at offset {start + _LEN_BYTES + e.start} "
                f"(bytes {raw[max(e.start - 8, 0) : e.end + 8]!r})"
            ) from None

    def string(self, what: str) -> str:
        """A string value: invalid UTF-8 is kept reversibly (surrogateescape)."""
        return self.raw_string(what).decode("utf-8", "surrogateescape")


class GGUFFile:
    """A GGUF file opened read-only through mmap.

    Attributes:
        path, version, alignment, data_offset (absolute start of the data section),
        file_size (bytes; summed over all shards of a split model),
        paths: the files read, in shard order (one for a model that is not split),
        metadata: dict key -> value (numeric arrays are read-only numpy views, string arrays
            are lists of str, nested arrays are lists),
        metadata_types: dict key -> MetadataType,
        tensors: dict name -> TensorInfo, in file order.

    Raises `GGUFError` (one line, starting with the path) for anything that is not a valid
    GGUF v2/v3 file. Given the first shard of a split model, opens all its shards (the
    attributes then describe the whole model; `data_offset` stays the first shard's).
    """

    def __init__(self, path: str | os.PathLike, *, _shard: bool = False):
        self.path = os.fspath(path)
        self._mm: Any = None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise GGUFError(f"{self.path}: no such file") from None
        except OSError as e:
            raise GGUFError(f"{self.path}: {e.strerror}") from None
        if stat.S_ISDIR(st.st_mode):
            raise GGUFError(f"{self.path}: is a directory")
        if not stat.S_ISREG(st.st_mode):  # a FIFO or a device would block or never end
            raise GGUFError(f"{self.path}: not a regular file")
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise GGUFError(f"{self.path}: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise GGUFError(f"{self.path}: empty file, not a GGUF file")
            try:
                self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                raise GGUFError(f"{self.path}: cannot map file: {e}") from None
        finally:
            os.close(fd)
        self._init_parsed(size)
        if not _shard:
            try:
                self._open_splits()
            except GGUFError:
                self.close()
                raise

    @classmethod
    def from_bytes(cls, data: bytes, name: str = "<bytes>") -> "GGUFFile":
        """Parse a GGUF image held in memory (tests, fuzzing); views point into `data`."""
        self = cls.__new__(cls)
        self.path = name
        self._mm = bytes(data)
        if not self._mm:
            raise GGUFError(f"{name}: empty file, not a GGUF file")
        self._init_parsed(len(self._mm))
        return self

    def _init_parsed(self, size: int) -> None:
        self.file_size = size
        self.paths = [self.path]
        self._files: list[GGUFFile] = [self]  # shard i of a split model is self._files[i]
        try:
            self._parse()
        except GGUFError as e:
            self.close()
            raise GGUFError(f"{self.path}: {e}") from None

    # -- parsing ---------------------------------------------------------------------------

    def _parse(self) -> None:
        buf = self._mm
        cur = _Cursor(buf, 0, self.file_size)
        if self.file_size < 4:
            raise GGUFError(f"not a GGUF file (only {self.file_size} bytes)")
        magic = bytes(buf[0:4])
        if magic != GGUF_MAGIC:
            raise GGUFError(f"not a GGUF file (magic {magic!r}, expected b'GGUF')")
        cur.pos = 4
        version = cur.u32("version")
        if version == 1:
            raise GGUFError("GGUF version 1 is obsolete and not supported; re-convert the model")
        if version not in (2, 3):
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in (1, 2, 3):
                raise GGUFError("big-endian GGUF files are not supported")
            raise GGUFError(f"unsupported GGUF version {version} (supported: 2, 3)")
        self.version = version
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("metadata count")
        rest = self.file_size - cur.pos
        if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > rest:
            raise GGUFError(
                f"truncated or corrupt header: {n_tensors} tensors and {n_kv} metadata entries "
                f"cannot fit in {self.file_size} bytes"
            )

        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, MetadataType] = {}
        for _ in range(n_kv):
            key = cur.strict_string("metadata key")
            if key in self.metadata:
                raise GGUFError(f"duplicate metadata key {_q(key)}")
            vtype = self._read_type(cur, f"value of {_q(key)}")
            value, mtype = self._read_value(cur, vtype, 0, key)
            self.metadata[key] = value
            self.metadata_types[key] = mtype

        self.alignment = self._read_alignment()

        tensors: dict[str, TensorInfo] = {}
        for i in range(n_tensors):
            name = cur.strict_string(f"name of tensor #{i}")
            if name in tensors:
                raise GGUFError(f"duplicate tensor name {_q(name)}")
            n_dims = cur.u32(f"n_dims of tensor {_q(name)}")
            if n_dims > MAX_DIMS:
                raise GGUFError(f"tensor {_q(name)} has {n_dims} dimensions (at most {MAX_DIMS})")
            shape = tuple(cur.u64(f"dimensions of tensor {_q(name)}") for _ in range(n_dims))
            type_id = cur.u32(f"type of tensor {_q(name)}")
            offset = cur.u64(f"offset of tensor {_q(name)}")
            tensors[name] = _tensor_info(name, shape, type_id, offset)
        self.tensors = tensors
        self.data_offset = _align(cur.pos, self.alignment)
        self._check_tensor_placement()

    def _read_alignment(self) -> int:
        if "general.alignment" not in self.metadata:
            return DEFAULT_ALIGNMENT
        if self.metadata_types["general.alignment"].type != ValueType.UINT32:
            raise GGUFError(
                f"general.alignment must be a uint32, not {self.metadata_types['general.alignment']}"
            )
        alignment = int(self.metadata["general.alignment"])
        if alignment == 0 or alignment & (alignment - 1):
            raise GGUFError(f"general.alignment {alignment} is not a power of two")
        return alignment

    def _check_tensor_placement(self) -> None:
        """Every tensor aligned, inside the file, and no two overlapping."""
        data_size = self.file_size - self.data_offset
        if self.tensors and data_size < 0:
            raise GGUFError(
                f"the data section would start at offset {self.data_offset}, past the end of the "
                f"file ({self.file_size} bytes): the file is truncated"
            )
        placed = []
        for t in self.tensors.values():
            if t.offset % self.alignment:
                raise GGUFError(
                    f"tensor {_q(t.name)} offset {t.offset} is not a multiple of the alignment {self.alignment}"
                )
            size = t.n_bytes if t.n_bytes is not None else 0  # unknown type: at least its start must be inside
            if t.offset > data_size or size > data_size - t.offset:
                raise GGUFError(
                    f"tensor {_q(t.name)} ({t.n_bytes if t.n_bytes is not None else '?'} bytes at data offset "
                    f"{t.offset}) extends past the end of the file ({self.file_size} bytes): "
                    "the file is truncated or corrupt"
                )
            if t.n_bytes:
                placed.append(t)
        placed.sort(key=lambda t: t.offset)
        for a, b in zip(placed, placed[1:]):
            if a.offset + a.n_bytes > b.offset:
                raise GGUFError(
                    f"tensors {_q(a.name)} (data offset {a.offset}, {a.n_bytes} bytes) and {_q(b.name)} "
                    f"(data offset {b.offset}) overlap"
                )

    @staticmethod
    def _read_type(cur: _Cursor, what: str) -> int:
        t = cur.u32(f"type of {what}")
        if t > ValueType.FLOAT64:
            raise GGUFError(f"unknown metadata value type {t} for {what} at offset {cur.pos - 4}")
        return t

    def _read_value(self, cur: _Cursor, vtype: int, depth: int, key: str) -> tuple[Any, MetadataType]:
        if vtype == ValueType.STRING:
            return cur.string(f"value of {_q(key)}"), MetadataType(ValueType.STRING)
        if vtype == ValueType.ARRAY:
            if depth >= MAX_ARRAY_NESTING:
                raise GGUFError(f"{_q(key)}: arrays nested deeper than {MAX_ARRAY_NESTING}")
            itype = self._read_type(cur, f"elements of {_q(key)}")
            count = cur.u64(f"array length of {_q(key)}")
            if itype == ValueType.STRING:
                cur.need(count * _LEN_BYTES, f"array of {count} strings {_q(key)}")  # each has a u64 length
                items = _read_string_array(cur, count, key)
                return items, MetadataType(ValueType.ARRAY, MetadataType(ValueType.STRING))
            if itype == ValueType.ARRAY:
                cur.need(count * _ARRAY_HEADER_BYTES, f"array of {count} arrays {_q(key)}")
                items = []
                item_type = None
                for _ in range(count):
                    value, item_type = self._read_value(cur, ValueType.ARRAY, depth + 1, key)
                    items.append(value)
                return items, MetadataType(ValueType.ARRAY, item_type)
            _, dtype = _SCALARS[itype]
            cur.need(count * dtype.itemsize, f"array of {count} {ValueType(itype).name.lower()} {_q(key)}")
            arr = np.frombuffer(self._mm, dtype=dtype, count=count, offset=cur.pos)  # (count,) view
            cur.pos += count * dtype.itemsize
            if itype == ValueType.BOOL:
                arr = arr != 0
            return arr, MetadataType(ValueType.ARRAY, MetadataType(ValueType(itype)))
        fmt, _ = _SCALARS[vtype]
        cur.need(fmt.size, f"value of {_q(key)}")
        (value,) = fmt.unpack_from(self._mm, cur.pos)
        cur.pos += fmt.size
        return value, MetadataType(ValueType(vtype))

    # -- split models ------------------------------------------------------------------------

    def _split_int(self, key: str) -> int | None:
        if key not in self.metadata:
            return None
        mtype = self.metadata_types[key]
        if mtype.type not in _INT_TYPES:
            raise GGUFError(f"{self.path}: {key} must be an integer, not {mtype}")
        return int(self.metadata[key])

    def _open_splits(self) -> None:
        """If this is the first shard of a split model, open the others and merge their tensors."""
        n = self._split_int(SPLIT_COUNT)
        if n is None or n == 1:
            return
        if not 1 <= n <= MAX_SPLITS:
            raise GGUFError(f"{self.path}: {SPLIT_COUNT} {n} is out of range (1..{MAX_SPLITS})")
        no = self._split_int(SPLIT_NO)
        if no is None:
            raise GGUFError(f"{self.path}: {SPLIT_COUNT} is {n} but {SPLIT_NO} is missing")
        if no != 0:
            first = split_path(split_prefix(self.path, no, n) or "<prefix>", 0, n) if 0 <= no < n else "the first shard"
            raise GGUFError(f"{self.path}: shard {no + 1} of {n} of a split model; open the first shard ({first})")
        prefix = split_prefix(self.path, 0, n)
        if prefix is None:
            raise GGUFError(
                f"{self.path}: shard 1 of a model split in {n}, but the file name does not end in "
                f"-00001-of-{n:05d}.gguf, so the other shards cannot be found"
            )
        tensors = dict(self.tensors)
        for i in range(1, n):
            shard = GGUFFile(split_path(prefix, i, n), _shard=True)
            self._files.append(shard)  # closed with self, also on an error below
            got = (shard._split_int(SPLIT_NO), shard._split_int(SPLIT_COUNT))
            if got != (i, n):
                raise GGUFError(
                    f"{shard.path}: {SPLIT_NO} {got[0]} and {SPLIT_COUNT} {got[1]}, expected {i} and {n}"
                )
            for name, t in shard.tensors.items():
                if name in tensors:
                    raise GGUFError(f"{shard.path}: tensor {_q(name)} is also in an earlier shard")
                tensors[name] = replace(t, shard=i)
        expected = self._split_int(SPLIT_TENSORS_COUNT)
        if expected is not None and expected != len(tensors):
            raise GGUFError(
                f"{self.path}: corrupt split model: {SPLIT_TENSORS_COUNT} is {expected} but the {n} shards "
                f"hold {len(tensors)} tensors"
            )
        self.tensors = tensors
        self.paths = [f.path for f in self._files]
        self.file_size = sum(f.file_size for f in self._files)

    # -- access ----------------------------------------------------------------------------

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of a tensor: a read-only uint8 view into the mmap (no copy)."""
        t = self._info(name)
        if t.n_bytes is None:
            raise GGUFError(f"tensor {_q(name)} has type {t.type_name}, whose size qllama does not know")
        f = self._files[t.shard]
        return np.frombuffer(f._mm, dtype=np.uint8, count=t.n_bytes, offset=f.data_offset + t.offset)

    def tensor_array(self, name: str) -> np.ndarray:
        """A typed, read-only view of a f32/f16/bf16/f64/int tensor, numpy shape = reversed GGUF shape.

        bf16 is returned as its raw uint16 bits (numpy has no bfloat16).
        """
        t = self._info(name)
        dtype = _TENSOR_DTYPES.get(t.type_name)
        if dtype is None:
            raise GGUFError(f"tensor {_q(name)} has block type {t.type_name}: use tensor_bytes()")
        f = self._files[t.shard]
        arr = np.frombuffer(f._mm, dtype=dtype, count=t.n_elements, offset=f.data_offset + t.offset)
        return arr.reshape(tuple(reversed(t.shape)) if t.shape else ())

    def _info(self, name: str) -> TensorInfo:
        if self._mm is None:
            raise GGUFError(f"{self.path}: the file is closed")
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"no tensor named {_q(name)}") from None

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, or `default` when the key is absent."""
        return self.metadata.get(key, default)

    def close(self) -> None:
        """Release the mmap, of every shard (views still alive keep it mapped until they go)."""
        for shard in getattr(self, "_files", [])[1:]:
            shard.close()
        mm = getattr(self, "_mm", None)
        if isinstance(mm, mmap.mmap):
            try:
                mm.close()
            except BufferError:
                pass  # views are still alive; the map goes away with them
        self._mm = None

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        shards = f", {len(self._files)} shards" if len(self._files) > 1 else ""
        return f"GGUFFile({self.path!r}, v{self.version}, {len(self.metadata)} keys, {len(self.tensors)} tensors{shards})"


def split_path(prefix: str, index: int, count: int) -> str:
    """The file name of shard `index` (0-based) of `count`, as llama.cpp's gguf-split names it."""
    return f"{prefix}-{index + 1:05d}-of-{count:05d}.gguf"


def split_prefix(path: str, index: int, count: int) -> str | None:
    """The common prefix of a split model's file names, given shard `index`'s path; None if it does not match."""
    suffix = f"-{index + 1:05d}-of-{count:05d}.gguf"
    return path[: -len(suffix)] if len(path) > len(suffix) and path.endswith(suffix) else None


_INT_TYPES = frozenset({ValueType.UINT8, ValueType.INT8, ValueType.UINT16, ValueType.INT16, ValueType.UINT32,
                        ValueType.INT32, ValueType.UINT64, ValueType.INT64})


def _q(name: str, limit: int = 80) -> str:
    """A key or tensor name quoted for an error message, cut if absurdly long."""
    r = repr(name)
    return r if len(r) <= limit else r[: limit - 5] + "...'"


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def _tensor_info(name: str, shape: tuple[int, ...], type_id: int, offset: int) -> TensorInfo:
    for d in shape:
        if d > INT64_MAX:
            raise GGUFError(f"tensor {_q(name)} has a dimension out of range: {list(shape)}")
    n_elements = 1
    for d in shape:
        n_elements *= d  # Python ints: no wrap-around (the 2**42+1 trick of llama.cpp PR 18674)
    if n_elements > INT64_MAX:
        raise GGUFError(f"tensor {_q(name)} dimensions {list(shape)} overflow: {n_elements} elements")
    if offset > INT64_MAX:
        raise GGUFError(f"tensor {_q(name)} offset {offset} is out of range")
    gtype = GGML_TYPES.get(type_id)
    n_bytes = None
    if gtype is not None:
        row = shape[0] if shape else 1
        if row % gtype.block_size:
            raise GGUFError(
                f"tensor {_q(name)}: row length {row} is not a multiple of the {gtype.name} block size {gtype.block_size}"
            )
        n_bytes = n_elements // gtype.block_size * gtype.type_size
    return TensorInfo(name, shape, type_id, offset, n_elements, n_bytes)


def _string_array_error(cur: _Cursor, i: int, count: int, pos: int, key: str) -> GGUFError:
    return GGUFError(
        f"truncated or corrupt file: string {i} of {count} in {_q(key)} (at offset {pos}) "
        f"runs past the end of the file ({cur.end} bytes)"
    )


def _read_string_array(cur: _Cursor, count: int, key: str) -> list[str]:
    """`count` length-prefixed strings from the cursor, decoded (surrogateescape).

    The hot path of opening a Llama 3 vocab (128K tokens + 280K merges), in two vectorised
    steps: find where each string starts (`_scan_starts`, else the sequential walk), then drop
    the 8-byte length prefixes except their last byte, overwrite that byte with a separator
    that occurs in no string, decode the whole run once and split it. An ASCII separator
    cannot merge with invalid UTF-8 around it, so the result equals decoding each string.
    """
    if count < _VECTOR_MIN_STRINGS:
        return _read_string_array_loop(cur, count, key)
    buf, pos = cur.buf, cur.pos
    found = _scan_starts(buf, pos, cur.end, count)
    if found is None:
        found = _walk_starts(cur, count, key)
    s, p = found  # s: (count,) string starts relative to pos; p: absolute end of the array
    cur.pos = p

    region = np.frombuffer(buf, dtype=np.uint8, count=p - pos, offset=pos)  # (R,) the whole array
    keep = np.ones(len(region), dtype=bool)  # (R,) True for string bytes and one byte per prefix
    for k in range(2, _LEN_BYTES + 1):
        keep[s - k] = False
    packed = region[keep]  # (R - 7*count,) sep s0 sep s1 ...
    sep_at = s - 1 - (_LEN_BYTES - 1) * np.arange(1, count + 1)  # (count,) where each prefix byte landed
    for sep in _separators(packed, sep_at, count):
        packed[sep_at] = sep
        joined = packed.tobytes()
        if joined.count(sep) == count:  # the separator occurs only where we put it
            parts = joined.decode("utf-8", "surrogateescape").split(chr(sep))
            return parts[1:]  # parts[0] is the empty text before the first separator
    cur.pos = pos  # every ASCII byte occurs in some string: decode them one by one
    return _read_string_array_loop(cur, count, key)


def _walk_starts(cur: _Cursor, count: int, key: str) -> tuple[np.ndarray, int]:
    """The sequential walk over the lengths: (starts relative to cur.pos, absolute end)."""
    buf, pos, end = cur.buf, cur.pos, cur.end
    unpack = _U64.unpack_from
    starts = array("q", bytes(8 * count))  # (count,) absolute start of each string's bytes
    p = pos
    i = 0
    try:
        for i in range(count):
            (n,) = unpack(buf, p)
            p += 8
            starts[i] = p
            p += n
            if p > end:
                break
    except struct.error:  # fewer than 8 bytes left for a length
        raise _string_array_error(cur, i, count, p, key) from None
    if p > end:
        raise _string_array_error(cur, i, count, starts[i] - 8, key)
    return np.frombuffer(starts, dtype=np.int64) - pos, p


def _scan_starts(buf: Any, pos: int, end: int, count: int) -> tuple[np.ndarray, int] | None:
    """Find the string starts without a Python loop, or None (then the walk decides).

    A length below 2**16 has zero bytes 2..7, which text almost never has: every offset whose
    bytes 2..7 are zero is a candidate prefix. A prefix of length < 256 also makes the offset
    before it a candidate, so of two adjacent candidates the later is kept. The guess is then
    *verified exactly*: the first candidate is the array's start and each next candidate is
    where the previous string ends, which is precisely the sequential walk. Anything unusual
    (a string >= 64 KiB, NUL bytes in strings, a truncated file) fails the check and falls
    back to the walk, which also produces the error messages.
    """
    window = _SCAN_BYTES_PER_STRING * count + 64
    while True:
        w = min(end - pos, window, _SCAN_MAX_WINDOW)
        if w < 8 * count:
            return None
        region = np.frombuffer(buf, dtype=np.uint8, count=w, offset=pos)  # (w,)
        zero = region == 0
        cand = zero[2 : w - 5].copy()  # (w-7,) cand[q]: bytes q+2..q+7 are zero
        for k in range(3, _LEN_BYTES):
            cand &= zero[k : w - 7 + k]
        idx = np.flatnonzero(cand[: w - 7])  # candidate prefix offsets (relative), ascending
        later = np.empty(len(idx), dtype=bool)  # a candidate directly followed by another
        later[:-1] = idx[1:] == idx[:-1] + 1
        later[-1:] = False
        idx = idx[~later]
        if len(idx) >= count:
            break
        if w < window or window >= _SCAN_MAX_BYTES_PER_STRING * count:
            return None  # end of file or of the scan budget, or unusually long strings: walk
        window *= 4
    c = idx[:count]  # (count,)
    if c[0] != 0:
        return None
    lengths = region[c].astype(np.int64) + (region[c + 1].astype(np.int64) << 8)  # bytes 2..7 are zero
    nxt = c + _LEN_BYTES + lengths  # (count,) where each string ends
    if not np.array_equal(nxt[:-1], c[1:]) or pos + int(nxt[-1]) > end:
        return None
    return c + _LEN_BYTES, pos + int(nxt[-1])


def _separators(packed: np.ndarray, sep_at: np.ndarray, count: int):
    """Candidate separator bytes: NUL first (almost never in a vocab), else any unused ASCII byte."""
    yield 0
    packed[sep_at] = 0
    used = np.bincount(packed, minlength=256)[:128]  # (128,) ASCII byte counts
    used[0] -= count  # the separators we wrote
    for b in np.flatnonzero(used == 0):
        if b:
            yield int(b)


def _read_string_array_loop(cur: _Cursor, count: int, key: str) -> list[str]:
    """The plain per-string loop (small arrays, and the fallback of the vectorised path)."""
    buf, pos, end = cur.buf, cur.pos, cur.end
    unpack = _U64.unpack_from
    out: list[str] = []
    for i in range(count):
        if end - pos < 8:
            raise _string_array_error(cur, i, count, pos, key)
        (n,) = unpack(buf, pos)
        if n > end - pos - 8:
            raise _string_array_error(cur, i, count, pos, key)
        out.append(bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", "surrogateescape"))
        pos += 8 + n
    cur.pos = pos
    return out
