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
bytes that are really there before anything is allocated or viewed. Nothing here imports
numba, so `qllama inspect` starts fast.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

from .errors import GGUFError
from .ggml_types import GGML_TYPES, type_name

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 8  # no real file nests arrays; a hostile one could recurse forever


class ValueType(IntEnum):
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
    """The GGUF type of a metadata value; `item` is the element type of an array."""

    type: ValueType
    item: "MetadataType | None" = None

    def __str__(self) -> str:
        if self.type == ValueType.ARRAY:
            return f"array[{self.item}]"
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

    @property
    def type_name(self) -> str:
        return type_name(self.type_id)


class _Cursor:
    """Bounds-checked sequential reads over the mapped bytes."""

    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf: mmap.mmap, pos: int, end: int):
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

    def string(self, what: str) -> str:
        n = self.u64(what)
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return _decode(raw)


def _decode(raw: bytes) -> str:
    # surrogateescape keeps invalid UTF-8 (some vocabularies have such tokens) reversible.
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("utf-8", "surrogateescape")


class GGUFFile:
    """A GGUF file opened read-only through mmap.

    Attributes:
        path, version, alignment, data_offset (absolute start of the data section),
        metadata: dict key -> value (numeric arrays are read-only numpy views, string arrays
            are lists of str, nested arrays are lists),
        metadata_types: dict key -> MetadataType,
        tensors: dict name -> TensorInfo, in file order.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise GGUFError(f"{self.path}: no such file") from None
        except IsADirectoryError:
            raise GGUFError(f"{self.path}: is a directory") from None
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
        self.file_size = size
        try:
            self._parse()
        except GGUFError as e:
            self.close()
            raise GGUFError(f"{self.path}: {e}") from None

    # -- parsing ---------------------------------------------------------------------------

    def _parse(self) -> None:
        cur = _Cursor(self._mm, 0, self.file_size)
        cur.need(4, "magic")
        magic = bytes(self._mm[0:4])
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
        # Each metadata entry takes >= 8+1+4+1 bytes and each tensor info >= 8+1+4+8+4+8:
        # a count that cannot fit in the file is corrupt (and must not drive an allocation).
        if n_kv * 14 > self.file_size or n_tensors * 33 > self.file_size:
            raise GGUFError(f"corrupt header: {n_tensors} tensors and {n_kv} metadata entries cannot fit in {self.file_size} bytes")

        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, MetadataType] = {}
        for _ in range(n_kv):
            key = cur.string("metadata key")
            vtype = self._read_type(cur)
            value, mtype = self._read_value(cur, vtype, depth=0)
            if key in self.metadata:
                raise GGUFError(f"duplicate metadata key {key!r}")
            self.metadata[key] = value
            self.metadata_types[key] = mtype

        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if "general.alignment" in self.metadata:
            if self.metadata_types["general.alignment"].type != ValueType.UINT32:
                raise GGUFError("general.alignment must be a uint32")
            if alignment == 0 or alignment & (alignment - 1):
                raise GGUFError(f"general.alignment {alignment} is not a power of two")
        self.alignment = int(alignment)

        tensors: dict[str, TensorInfo] = {}
        for _ in range(n_tensors):
            name = cur.string("tensor name")
            n_dims = cur.u32("tensor n_dims")
            if n_dims > MAX_DIMS:
                raise GGUFError(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
            shape = tuple(cur.u64("tensor dimension") for _ in range(n_dims))
            type_id = cur.u32("tensor type")
            offset = cur.u64("tensor offset")
            if name in tensors:
                raise GGUFError(f"duplicate tensor name {name!r}")
            tensors[name] = self._tensor_info(name, shape, type_id, offset)
        self.tensors = tensors

        self.data_offset = _align(cur.pos, self.alignment)
        for t in tensors.values():
            if t.offset % self.alignment:
                raise GGUFError(f"tensor {t.name!r} offset {t.offset} is not a multiple of the alignment {self.alignment}")
            if t.n_bytes is not None and self.data_offset + t.offset + t.n_bytes > self.file_size:
                raise GGUFError(
                    f"tensor {t.name!r} ({t.n_bytes} bytes at data offset {t.offset}) extends past "
                    f"the end of the file ({self.file_size} bytes): the file is truncated or corrupt"
                )

    @staticmethod
    def _read_type(cur: _Cursor) -> int:
        t = cur.u32("value type")
        if t > ValueType.FLOAT64:
            raise GGUFError(f"unknown metadata value type {t} at offset {cur.pos - 4}")
        return t

    def _read_value(self, cur: _Cursor, vtype: int, depth: int) -> tuple[Any, MetadataType]:
        if vtype == ValueType.STRING:
            return cur.string("string value"), MetadataType(ValueType.STRING)
        if vtype == ValueType.ARRAY:
            if depth >= MAX_ARRAY_NESTING:
                raise GGUFError(f"arrays nested deeper than {MAX_ARRAY_NESTING}")
            itype = self._read_type(cur)
            count = cur.u64("array length")
            if itype == ValueType.STRING:
                cur.need(count * 8, "string array")  # every string has a u64 length
                return _read_string_array(cur, count), MetadataType(ValueType.ARRAY, MetadataType(ValueType.STRING))
            if itype == ValueType.ARRAY:
                cur.need(count * 12, "nested array")  # every array has a u32 type + u64 count
                items = []
                item_type = MetadataType(ValueType.ARRAY, None)
                for _ in range(count):
                    sub_type = self._read_type(cur)
                    value, item_type = self._read_value(cur, sub_type, depth + 1)
                    items.append(value)
                return items, MetadataType(ValueType.ARRAY, item_type)
            _, dtype = _SCALARS[itype]
            cur.need(count * dtype.itemsize, "array data")
            arr = np.frombuffer(self._mm, dtype=dtype, count=count, offset=cur.pos)
            cur.pos += count * dtype.itemsize
            if itype == ValueType.BOOL:
                arr = arr != 0
            return arr, MetadataType(ValueType.ARRAY, MetadataType(ValueType(itype)))
        fmt, _ = _SCALARS[vtype]
        cur.need(fmt.size, "scalar value")
        (value,) = fmt.unpack_from(self._mm, cur.pos)
        cur.pos += fmt.size
        return value, MetadataType(ValueType(vtype))

    @staticmethod
    def _tensor_info(name: str, shape: tuple[int, ...], type_id: int, offset: int) -> TensorInfo:
        n_elements = 1
        for d in shape:
            n_elements *= d
        if n_elements >= 2**62:
            raise GGUFError(f"tensor {name!r} has an impossible shape {list(shape)}")
        gtype = GGML_TYPES.get(type_id)
        n_bytes = None
        if gtype is not None:
            row = shape[0] if shape else 1
            if row % gtype.block_size:
                raise GGUFError(
                    f"tensor {name!r}: row length {row} is not a multiple of the {gtype.name} block size {gtype.block_size}"
                )
            n_bytes = n_elements // gtype.block_size * gtype.type_size
        return TensorInfo(name, shape, type_id, offset, n_elements, n_bytes)

    # -- access ----------------------------------------------------------------------------

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of a tensor: a read-only uint8 view into the mmap (no copy)."""
        t = self._info(name)
        if t.n_bytes is None:
            raise GGUFError(f"tensor {name!r} has type {t.type_name}, whose size qllama does not know")
        return np.frombuffer(self._mm, dtype=np.uint8, count=t.n_bytes, offset=self.data_offset + t.offset)

    def tensor_array(self, name: str) -> np.ndarray:
        """A typed, read-only view of a f32/f16/bf16/f64/int tensor, numpy shape = reversed GGUF shape.

        bf16 is returned as its raw uint16 bits (numpy has no bfloat16).
        """
        t = self._info(name)
        dtype = _TENSOR_DTYPES.get(t.type_name)
        if dtype is None:
            raise GGUFError(f"tensor {name!r} has block type {t.type_name}: use tensor_bytes()")
        arr = np.frombuffer(self._mm, dtype=dtype, count=t.n_elements, offset=self.data_offset + t.offset)
        return arr.reshape(tuple(reversed(t.shape)) if t.shape else ())

    def _info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"no tensor named {name!r}") from None

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def close(self) -> None:
        mm = getattr(self, "_mm", None)
        if mm is not None:
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
        return f"GGUFFile({self.path!r}, v{self.version}, {len(self.metadata)} keys, {len(self.tensors)} tensors)"


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def _read_string_array(cur: _Cursor, count: int) -> list[str]:
    # The hot loop of opening a Llama 3 vocab (400K strings): kept free of method calls.
    buf, pos, end = cur.buf, cur.pos, cur.end
    unpack = _U64.unpack_from
    out: list[str] = [""] * count
    try:
        for i in range(count):
            (n,) = unpack(buf, pos)
            pos += 8
            if n > end - pos:
                break
            raw = buf[pos : pos + n]
            pos += n
            try:
                out[i] = raw.decode("utf-8")
            except UnicodeDecodeError:
                out[i] = raw.decode("utf-8", "surrogateescape")
        else:
            cur.pos = pos
            return out
    except struct.error:
        pass
    cur.pos = pos
    cur.need(end - pos + 1, "string array element")  # raises with the position
    raise AssertionError("unreachable")
