"""A small, fast, read-only reader of the GGUF container (v2/v3, little-endian), memory-mapped.

Why not `gguf.GGUFReader`: it builds a numpy view for every element of every metadata array, so
the default model's 49,152 token strings and 48,900 merges take seconds to open. Here strings are
decoded in one tight `struct.unpack_from` loop over a memoryview and numeric arrays in one
`np.frombuffer(...).tolist()`; tensor data stays in the memory map (zero-copy uint8 slices).

Every failure is a `LowbitError` with one line naming the file and what is wrong; the parser never
lets a struct.error/IndexError/ValueError escape, because a bad file must not look like a bug.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES, GGUFValueType

from lowbit.runtime.errors import LowbitError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # v1 used 32-bit lengths and counts; nothing current writes it
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp rejects more, and it bounds the dims read below

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
# Fixed-size value types: struct for a scalar, numpy dtype for a whole array in one call.
_SCALARS = MappingProxyType({
    GGUFValueType.UINT8: (struct.Struct("<B"), np.dtype("<u1")),
    GGUFValueType.INT8: (struct.Struct("<b"), np.dtype("<i1")),
    GGUFValueType.UINT16: (struct.Struct("<H"), np.dtype("<u2")),
    GGUFValueType.INT16: (struct.Struct("<h"), np.dtype("<i2")),
    GGUFValueType.UINT32: (struct.Struct("<I"), np.dtype("<u4")),
    GGUFValueType.INT32: (struct.Struct("<i"), np.dtype("<i4")),
    GGUFValueType.UINT64: (struct.Struct("<Q"), np.dtype("<u8")),
    GGUFValueType.INT64: (struct.Struct("<q"), np.dtype("<i8")),
    GGUFValueType.FLOAT32: (struct.Struct("<f"), np.dtype("<f4")),
    GGUFValueType.FLOAT64: (struct.Struct("<d"), np.dtype("<f8")),
    GGUFValueType.BOOL: (struct.Struct("<?"), np.dtype(np.bool_)),
})


class _Bad(Exception):
    """A specific, already-worded problem; GGUFFile prefixes the file name."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]   # ggml order, ne0 (the contiguous row length) first: a matrix is (K, N)
    n_elements: int
    n_bytes: int
    data_offset: int         # absolute offset in the file
    data: np.ndarray = field(repr=False, compare=False)  # uint8 memmap slice of n_bytes bytes


class _Cursor:
    """Reads values at a moving offset; `where` says what is being read, for error messages."""

    def __init__(self, buf: memoryview):
        self.buf, self.off, self.where = buf, 0, "header"

    def u32(self) -> int:
        (v,) = _U32.unpack_from(self.buf, self.off)
        self.off += 4
        return v

    def u64(self) -> int:
        (v,) = _U64.unpack_from(self.buf, self.off)
        self.off += 8
        return v

    def string(self) -> str:
        n = self.u64()
        end = self.off + n
        if end > len(self.buf):  # a slice would silently come back short
            raise struct.error("string past end of file")
        s = str(self.buf[self.off:end], "utf-8")
        self.off = end
        return s

    def value(self, vtype: int) -> Any:
        scalar = _SCALARS.get(vtype)
        if scalar is not None:
            (v,) = scalar[0].unpack_from(self.buf, self.off)
            self.off += scalar[0].size
            return v
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            return self.array()
        raise _Bad(f"unknown metadata value type {vtype} ({self.where})")

    def array(self) -> list[Any]:
        itype, n = self.u32(), self.u64()
        scalar = _SCALARS.get(itype)
        if scalar is not None:
            dtype = scalar[1]
            if n * dtype.itemsize > len(self.buf) - self.off:
                raise struct.error("array past end of file")
            out = np.frombuffer(self.buf, dtype, n, self.off).tolist() if n else []
            self.off += n * dtype.itemsize
            return out
        if itype == GGUFValueType.STRING:
            return self._string_array(n)
        if itype == GGUFValueType.ARRAY:  # nested arrays: each element carries its own type and count
            return [self.array() for _ in range(n)]
        raise _Bad(f"unknown metadata array element type {itype} ({self.where})")

    def _string_array(self, n: int) -> list[str]:
        # The hot loop (vocab, merges): locals only, no per-item bound check. Each item moves the
        # offset by >= 8, so a bogus count ends in struct.error; a short last item is caught below.
        buf, off, unpack, out = self.buf, self.off, _U64.unpack_from, []
        append = out.append
        for _ in range(n):
            start = off + 8
            off = start + unpack(buf, off)[0]
            append(str(buf[start:off], "utf-8"))
        if off > len(buf):
            raise struct.error("string past end of file")
        self.off = off
        return out


class GGUFFile:
    """Header, metadata and tensor infos of one GGUF file; tensor bytes stay memory-mapped."""

    path: Path
    version: int
    metadata: dict[str, Any]
    # each key's value type and, for an array, its elements' (None otherwise): what a writer needs to copy a
    # value as it was (a uint32 stays uint32: Python's int says nothing of its width)
    value_types: dict[str, tuple[GGUFValueType, GGUFValueType | None]]
    tensors: list[TensorInfo]
    file_size: int

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.file_size = self.path.stat().st_size
            # np.memmap cannot map an empty file; an empty file is simply "not a GGUF file".
            mm = np.memmap(self.path, dtype=np.uint8, mode="r") if self.file_size else None
        except (OSError, ValueError) as e:
            raise self._error(f"cannot open: {getattr(e, 'strerror', None) or e}") from None
        magic = bytes(mm[:4]) if mm is not None else b""
        if magic != GGUF_MAGIC:
            raise self._error(f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        cur = _Cursor(memoryview(mm))
        try:
            infos = self._parse_header(cur)
            self.tensors = self._build_tensors(mm, infos, cur.off)
        except _Bad as e:
            raise self._error(str(e)) from None
        except UnicodeDecodeError:
            raise self._error(f"invalid UTF-8 in a string ({cur.where}, near byte {cur.off})") from None
        except (struct.error, ValueError, IndexError, OverflowError):
            raise self._error(f"truncated GGUF header ({cur.where}, at byte {cur.off} of "
                              f"{self.file_size})") from None

    def _error(self, what: str) -> LowbitError:
        return LowbitError(f"{self.path}: {what}")

    def _parse_header(self, cur: _Cursor) -> list[tuple[str, tuple[int, ...], int, int]]:
        cur.off = 4
        version = cur.u32()
        if version & 0xFFFF == 0 and version >> 16:  # e.g. 3 written big-endian reads as 0x03000000
            raise _Bad(f"big-endian GGUF (version field {version:#010x}) is not supported")
        if version not in SUPPORTED_VERSIONS:
            raise _Bad(f"unsupported GGUF version {version} (supported: 2, 3)")
        self.version = version
        n_tensors, n_kv = cur.u64(), cur.u64()

        self.metadata, self.value_types = {}, {}
        for i in range(n_kv):
            cur.where = f"metadata entry #{i}"
            key = cur.string()
            cur.where = f"metadata key {key!r}"
            vtype = cur.u32()
            if key in self.metadata:
                raise _Bad(f"duplicate metadata key {key!r}")
            if key == "general.alignment" and vtype != GGUFValueType.UINT32:
                raise _Bad(f"general.alignment has value type {vtype}, expected uint32 (4)")
            item = _U32.unpack_from(cur.buf, cur.off)[0] if vtype == GGUFValueType.ARRAY else None  # read again below
            self.metadata[key] = cur.value(vtype)
            self.value_types[key] = (GGUFValueType(vtype), None if item is None else GGUFValueType(item))

        infos = []
        for i in range(n_tensors):
            cur.where = f"tensor info #{i}"
            name = cur.string()
            cur.where = f"tensor info #{i} {name!r}"
            n_dims = cur.u32()
            if n_dims > MAX_DIMS:
                raise _Bad(f"tensor {name} has {n_dims} dimensions (at most {MAX_DIMS})")
            shape = struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.off)
            cur.off += 8 * n_dims
            raw_type, rel_offset = cur.u32(), cur.u64()
            infos.append((name, shape, raw_type, rel_offset))
        cur.where = "end of tensor infos"
        return infos

    def _build_tensors(self, mm: np.memmap, infos: list, header_end: int) -> list[TensorInfo]:
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if align <= 0 or align & (align - 1):
            raise _Bad(f"general.alignment {align} is not a power of two")
        data_start = -(-header_end // align) * align  # tensor data begins at the next aligned byte
        tensors, seen = [], set()
        for name, shape, raw_type, rel_offset in infos:
            if name in seen:
                raise _Bad(f"duplicate tensor name {name!r}")
            seen.add(name)
            try:
                ttype = GGMLQuantizationType(raw_type)
                block_size, type_size = GGML_QUANT_SIZES[ttype]
            except (ValueError, KeyError):
                raise _Bad(f"tensor {name} has unknown tensor type id {raw_type}") from None
            if shape and shape[0] % block_size:
                raise _Bad(f"tensor {name} ({ttype.name}): row length {shape[0]} is not a "
                           f"multiple of the block size {block_size}")
            if rel_offset % align:
                raise _Bad(f"tensor {name} ({ttype.name}): data offset {rel_offset} is not a "
                           f"multiple of the alignment {align}")
            n_elements = math.prod(shape)
            n_bytes = n_elements // block_size * type_size
            start = data_start + rel_offset
            end = start + n_bytes
            if end > self.file_size:
                raise _Bad(f"truncated file: tensor {name} ({ttype.name}) ends at byte {end}, "
                           f"but the file has {self.file_size} bytes")
            tensors.append(TensorInfo(name, ttype, tuple(shape), n_elements, n_bytes, start,
                                      mm[start:end]))
        return tensors

    def read(self, t: TensorInfo) -> np.ndarray:
        """A tensor's bytes, read into memory of their own (uint8 [n_bytes], writeable): a load then holds
        what it has read and kept, never the mapping's pages — touching those counts the file in the
        process's resident memory on top of what is built from it (an 8B Q4_K_M held 13.5 GB that way
        against 4.35 GB of tensors)."""
        out = np.empty(t.n_bytes, np.uint8)
        view = memoryview(out)
        try:
            with open(self.path, "rb", buffering=0) as f:
                f.seek(t.data_offset)
                got = 0
                while got < t.n_bytes:
                    n = f.readinto(view[got:])
                    if not n:
                        raise self._error(f"truncated file: tensor {t.name} ends at byte "
                                          f"{t.data_offset + t.n_bytes}")
                    got += n
        except OSError as e:
            raise self._error(f"cannot read tensor {t.name}: {e.strerror or e}") from None
        return out

    def __repr__(self) -> str:
        return (f"GGUFFile({str(self.path)!r}, version={self.version}, "
                f"{len(self.metadata)} keys, {len(self.tensors)} tensors)")
