"""GGUF file access: a fast header parser and zero-copy tensor views of the memory-mapped file.

``gguf.GGUFReader`` builds numpy views for every string of the vocabulary, which takes
seconds for a 262k-token model; this parser reads the header with ``struct`` in one pass.
Everything that can be checked cheaply (header bounds, tensor types, shapes and data
extents) is checked at open time, so a damaged download is reported before loading starts.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from tokenmill.errors import ModelFileError
from tokenmill.model.quant import SUPPORTED_QTYPES, GGMLWeight, unsupported_qtype_message

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

_SCALARS: dict[int, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: _U32,
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: _U64,
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_ARRAY_DTYPES: dict[int, np.dtype] = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("?"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}
# Unquantized ggml types that load as a plain torch tensor.
_TORCH_DTYPES: dict[GGMLQuantizationType, torch.dtype] = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
    GGMLQuantizationType.F64: torch.float64,
    GGMLQuantizationType.I8: torch.int8,
    GGMLQuantizationType.I16: torch.int16,
    GGMLQuantizationType.I32: torch.int32,
    GGMLQuantizationType.I64: torch.int64,
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: ggml dims reversed, so (rows, cols) for a 2-D weight
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


class _HeaderReader:
    """Sequential little-endian reads from the file buffer; overruns raise a 'truncated' error."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.size = len(buf)
        self.path = path
        self.pos = 0

    def truncated(self, needed: int) -> ModelFileError:
        return ModelFileError(
            self.path, f"truncated: header needs byte {needed} but the file has {self.size} bytes"
        )

    def skip(self, n: int) -> int:
        """Advance ``n`` bytes and return where they start."""
        start, end = self.pos, self.pos + n
        if end > self.size:
            raise self.truncated(end)
        self.pos = end
        return start

    def scalar(self, fmt: struct.Struct) -> Any:
        return fmt.unpack_from(self.buf, self.skip(fmt.size))[0]

    def string(self, what: str) -> str:
        n = self.scalar(_U64)
        start = self.skip(n)
        return self.decode(self.buf[start : start + n], what)

    def decode(self, raw: bytes, what: str) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ModelFileError(self.path, f"{what}: invalid UTF-8 ({exc.reason})") from None

    def value(self, vtype: int, key: str) -> Any:
        fmt = _SCALARS.get(vtype)
        if fmt is not None:
            return self.scalar(fmt)
        if vtype == GGUFValueType.STRING:
            return self.string(f"metadata '{key}'")
        if vtype == GGUFValueType.ARRAY:
            return self.array(key)
        raise ModelFileError(self.path, f"metadata '{key}' has unknown value type {vtype}")

    def array(self, key: str) -> list[Any]:
        item_type = self.scalar(_U32)
        count = self.scalar(_U64)
        dtype = _ARRAY_DTYPES.get(item_type)
        if dtype is not None:
            start = self.skip(count * dtype.itemsize)
            return np.frombuffer(self.buf, dtype=dtype, count=count, offset=start).tolist()
        if item_type == GGUFValueType.STRING:
            return self.string_array(count, key)
        if item_type != GGUFValueType.ARRAY:
            raise ModelFileError(
                self.path, f"metadata '{key}' has unknown array item type {item_type}"
            )
        if count * 12 > self.size - self.pos:  # every nested array has at least a 12-byte header
            raise self.truncated(self.pos + count * 12)
        return [self.array(key) for _ in range(count)]

    def string_array(self, count: int, key: str) -> list[str]:
        """Read ``count`` length-prefixed strings: the hot loop for vocabularies, kept minimal."""
        if count * 8 > self.size - self.pos:
            raise self.truncated(self.pos + count * 8)
        buf, pos, unpack = self.buf, self.pos, _U64.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for _ in range(count):
                (n,) = unpack(buf, pos)
                pos += 8
                append(buf[pos : pos + n].decode("utf-8"))
                pos += n
        except struct.error:
            raise self.truncated(pos + 8) from None
        except UnicodeDecodeError as exc:
            if pos + n > self.size:
                raise self.truncated(pos + n) from None
            raise ModelFileError(
                self.path, f"metadata '{key}'[{len(out)}]: invalid UTF-8 ({exc.reason})"
            ) from None
        if pos > self.size:
            raise self.truncated(pos)
        self.pos = pos
        return out


class GGUFFile:
    """A memory-mapped GGUF file: its metadata, tensor directory and tensor views."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._mm = _open_mmap(self.path)
        reader = _HeaderReader(self._mm, self.path)
        magic = self._mm[:4]
        if magic != GGUF_MAGIC:
            raise ModelFileError(self.path, f"not a GGUF file (magic {magic!r})")
        reader.skip(4)
        version = reader.scalar(_U32)
        if version & 0xFFFF == 0 and version:
            raise ModelFileError(self.path, "big-endian GGUF files are not supported")
        if version not in SUPPORTED_VERSIONS:
            supported = ", ".join(map(str, SUPPORTED_VERSIONS))
            raise ModelFileError(
                self.path, f"unsupported GGUF version {version} (supported: {supported})"
            )
        n_tensors = reader.scalar(_U64)
        n_kv = reader.scalar(_U64)

        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = reader.string("metadata key")
            if key in self.metadata:
                raise ModelFileError(self.path, f"duplicate metadata key '{key}'")
            self.metadata[key] = reader.value(reader.scalar(_U32), key)

        raw_infos = [self._read_tensor_info(reader) for _ in range(n_tensors)]
        alignment = self._alignment()
        data_start = -(-reader.pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, raw_type, rel_offset in raw_infos:
            if name in self.tensors:
                raise ModelFileError(self.path, "duplicate tensor name", tensor=name)
            self.tensors[name] = self._check_tensor(
                name, dims, raw_type, rel_offset, data_start, alignment
            )
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)

    def _read_tensor_info(self, reader: _HeaderReader) -> tuple[str, list[int], int, int]:
        name = reader.string("tensor name")
        n_dims = reader.scalar(_U32)
        if n_dims > MAX_DIMS:
            raise ModelFileError(
                self.path, f"{n_dims} dimensions (ggml allows at most {MAX_DIMS})", tensor=name
            )
        dims = list(struct.unpack_from(f"<{n_dims}Q", self._mm, reader.skip(8 * n_dims)))
        raw_type = reader.scalar(_U32)
        return name, dims, raw_type, reader.scalar(_U64)

    def _alignment(self) -> int:
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise ModelFileError(
                self.path, f"general.alignment {alignment!r} is not a power of two"
            )
        return alignment

    def _check_tensor(
        self,
        name: str,
        dims: list[int],
        raw_type: int,
        rel_offset: int,
        data_start: int,
        alignment: int,
    ) -> GGUFTensorInfo:
        try:
            qtype = GGMLQuantizationType(raw_type)
            block_size, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ModelFileError(self.path, f"unknown ggml type {raw_type}", tensor=name) from None
        cols = dims[0] if dims else 1
        if cols % block_size:
            raise ModelFileError(
                self.path,
                f"row length {cols} is not a multiple of the {qtype.name} block size {block_size}",
                tensor=name,
            )
        if rel_offset % alignment:
            raise ModelFileError(
                self.path,
                f"data offset {rel_offset} is not a multiple of the alignment {alignment}",
                tensor=name,
            )
        nbytes = math.prod(dims[1:]) * (cols // block_size) * type_size
        offset = data_start + rel_offset
        if offset + nbytes > len(self._mm):
            raise ModelFileError(
                self.path,
                f"truncated: tensor data ends at byte {offset + nbytes} "
                f"but the file has {len(self._mm)} bytes",
                tensor=name,
            )
        return GGUFTensorInfo(name, tuple(reversed(dims)), qtype, offset, nbytes)

    def load(self, name: str) -> torch.Tensor | GGMLWeight:
        """A view of the tensor's bytes: dense types as torch tensors, quantized ones as
        GGMLWeight."""
        info = self.tensors.get(name)
        if info is None:
            raise ModelFileError(self.path, "no such tensor in the file", tensor=name)
        raw = self._bytes[info.offset : info.offset + info.nbytes]
        dtype = _TORCH_DTYPES.get(info.qtype)
        if dtype is not None:
            if info.offset % dtype.itemsize:  # only with a tiny general.alignment
                raw = raw.clone()
            return raw.view(dtype).view(info.shape)
        if info.qtype not in SUPPORTED_QTYPES:
            raise ModelFileError(self.path, unsupported_qtype_message(info.qtype), tensor=name)
        block_size, type_size = GGML_QUANT_SIZES[info.qtype]
        return GGMLWeight(
            raw.view(-1, info.shape[-1] // block_size * type_size),
            info.qtype,
            info.shape,
            release=lambda: self._release(info.offset, info.nbytes),
        )

    def _release(self, offset: int, nbytes: int) -> None:
        """Drop the mapped pages that lie wholly inside these bytes from this process's memory."""
        start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (offset + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)


def _open_mmap(path: Path) -> mmap.mmap:
    """Map the file copy-on-write, so torch gets writable views without touching the file."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                raise ModelFileError(path, "empty file (0 bytes)")
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except IsADirectoryError:
        raise ModelFileError(path, "is a directory, not a GGUF file") from None
    except OSError as exc:
        raise ModelFileError(path, f"cannot open: {exc.strerror or exc}") from None


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Return the GGUF key/value metadata as plain Python values (str, int, float, bool, lists)."""
    return GGUFFile(path).metadata
