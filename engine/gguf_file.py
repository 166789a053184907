"""Open a GGUF file: metadata, tensor table, and zero-copy views of the tensor data.

The header is parsed here rather than with ``gguf.GGUFReader``: that reader builds one numpy view
per array element, which takes tens of seconds for Gemma 3's 262,144-token vocabulary; this
parser reads the same header in well under a second. Tensor data is memory-mapped
read-only; the ``gguf`` package supplies the type constants and the dequantizers.

File layout (GGUF v2/v3, little-endian):
    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv × (key: str, value_type u32, value)
    n_tensors × (name: str, n_dims u32, dims u64[n_dims], ggml_type u32, offset u64)
    padding to `general.alignment` (default 32)
    tensor data; each tensor at data_start + offset
where str = (len u64, utf-8 bytes). dims are innermost first: a (rows, cols) matrix is
stored with dims [cols, rows].
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from .errors import ModelError, UnsupportedModel

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32


class GGUFError(ModelError):
    """A GGUF file cannot be used; the message says why in words a user can act on."""


class UnsupportedTensorType(UnsupportedModel, GGUFError):
    """A tensor stored in a type the engine cannot read (the message names the tensor and type)."""


_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_NUMPY_DTYPES = {
    GGUFValueType.UINT8: np.uint8,
    GGUFValueType.INT8: np.int8,
    GGUFValueType.UINT16: np.uint16,
    GGUFValueType.INT16: np.int16,
    GGUFValueType.UINT32: np.uint32,
    GGUFValueType.INT32: np.int32,
    GGUFValueType.FLOAT32: np.float32,
    GGUFValueType.BOOL: np.bool_,
    GGUFValueType.UINT64: np.uint64,
    GGUFValueType.INT64: np.int64,
    GGUFValueType.FLOAT64: np.float64,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first): (out_features, in_features) for weights
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return self.ggml_type.name


class _Cursor:
    """Sequential little-endian reads over a buffer, raising GGUFError at the end of the data."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf = buf
        self.pos = 0
        self.path = path

    def _need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise GGUFError(
                f"{self.path.name}: the file ends inside its header (at byte {len(self.buf):,}); "
                "it is truncated or still downloading"
            )

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self._need(n)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def array(self, count: int, dtype: type) -> np.ndarray:
        size = np.dtype(dtype).itemsize * count
        self._need(size)
        out = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
        self.pos += size
        return out


def _read_value(cur: _Cursor, vtype: int) -> Any:
    try:
        vtype = GGUFValueType(vtype)
    except ValueError:
        raise GGUFError(f"{cur.path.name}: unknown metadata value type {vtype}; the file is damaged")
    if vtype == GGUFValueType.STRING:
        return cur.string()
    if vtype == GGUFValueType.ARRAY:
        item_type = GGUFValueType(cur.scalar("<I"))
        count = cur.scalar("<Q")
        if item_type in _NUMPY_DTYPES:
            # Numeric arrays (token scores and types) stay numpy arrays: cheap and vectorised.
            return cur.array(count, _NUMPY_DTYPES[item_type])
        return [_read_value(cur, item_type) for _ in range(count)]
    return cur.scalar(_SCALAR_FORMATS[vtype])


class GGUFFile:
    """A memory-mapped GGUF file.

    Attributes:
        path: the file.
        metadata: key → value (str, int, float, bool, list[str], or numpy array for numeric arrays).
        tensors: name → TensorInfo.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such file")
        size = self.path.stat().st_size
        if size < 24:
            raise GGUFError(f"{self.path.name}: {size} bytes is too small to be a GGUF model file")
        with open(self.path, "rb") as fh:
            magic = fh.read(4)
            if magic != GGUF_MAGIC:
                raise GGUFError(
                    f"{self.path.name}: not a GGUF file (it starts with {magic!r}, a GGUF model "
                    "starts with b'GGUF')"
                )
            self._mmap = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self.file_size = size
        self._buf = memoryview(self._mmap)
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self._parse()

    def _parse(self) -> None:
        cur = _Cursor(self._buf, self.path)
        cur.pos = 4
        self.version = cur.scalar("<I")
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path.name}: GGUF version {self.version} is not supported (2 or 3)")
        n_tensors = cur.scalar("<Q")
        n_kv = cur.scalar("<Q")
        if n_tensors > 1_000_000 or n_kv > 1_000_000:
            raise GGUFError(f"{self.path.name}: the header is damaged ({n_tensors} tensors, {n_kv} keys)")
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = _read_value(cur, cur.scalar("<I"))
        raw_infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            if n_dims > 8:
                raise GGUFError(f"{self.path.name}: tensor {name!r} has {n_dims} dimensions; damaged file")
            dims = [cur.scalar("<Q") for _ in range(n_dims)]
            ggml_type = cur.scalar("<I")
            offset = cur.scalar("<Q")
            raw_infos.append((name, dims, ggml_type, offset))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = (cur.pos + alignment - 1) // alignment * alignment
        for name, dims, type_id, offset in raw_infos:
            try:
                ggml_type = GGMLQuantizationType(type_id)
            except ValueError:
                raise UnsupportedTensorType(
                    f"{self.path.name}: tensor {name!r} has tensor type id {type_id}, which this "
                    "engine does not know (a newer quantization type?)"
                )
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
            n_elements = int(np.prod(dims)) if dims else 1
            if dims and dims[0] % block_size:
                raise GGUFError(
                    f"{self.path.name}: tensor {name!r} row of {dims[0]} values is not a whole "
                    f"number of {ggml_type.name} blocks"
                )
            nbytes = n_elements // block_size * type_size
            start = data_start + offset
            if start + nbytes > self.file_size:
                raise GGUFError(
                    f"{self.path.name}: the file is truncated: tensor {name!r} needs bytes up to "
                    f"{start + nbytes:,} but the file has {self.file_size:,}. Download it again."
                )
            self.tensors[name] = TensorInfo(name, tuple(reversed(dims)), ggml_type, start, nbytes)

    # -- metadata helpers -------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path.name}: metadata has no general.architecture")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path.name}: metadata key {key!r} is missing")
        return self.metadata[key]

    # -- tensor data ------------------------------------------------------------------------
    def tensor_info(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(f"{self.path.name}: tensor {name!r} is missing; the file is incomplete or not a {self.get('general.architecture', 'known')} model")
        return info

    def raw(self, name: str) -> np.ndarray:
        """Zero-copy view of a tensor's bytes, shaped (rows, bytes per row) (uint8) or natural
        dtype for F32/F16 etc. Rows are the outermost dims flattened."""
        info = self.tensor_info(name)
        block_size, type_size = GGML_QUANT_SIZES[info.ggml_type]
        row_values = info.shape[-1]
        n_rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        row_bytes = row_values // block_size * type_size
        return np.frombuffer(self._buf, dtype=np.uint8, count=info.nbytes, offset=info.offset).reshape(
            n_rows, row_bytes
        )

    def release(self, view: np.ndarray) -> None:
        """Drop the resident pages of a view of the file (from `raw`) from this process, once a
        copy of those bytes replaced it: the map is read-only and file-backed, so a page read
        again comes back from the file. Only whole pages inside the view are dropped."""
        base = np.frombuffer(self._buf, dtype=np.uint8, count=1).ctypes.data
        offset = view.ctypes.data - base
        if not (0 <= offset and offset + view.nbytes <= self.file_size) or not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        start = -(-offset // page) * page
        stop = (offset + view.nbytes) // page * page
        if stop > start:
            self._mmap.madvise(mmap.MADV_DONTNEED, start, stop - start)

    def sha256(self, chunk: int = 1 << 22) -> str:
        """sha256 of the whole file (cached beside nothing: the caller caches)."""
        h = hashlib.sha256()
        for i in range(0, self.file_size, chunk):
            h.update(self._buf[i : i + chunk])
        return h.hexdigest()

    def close(self) -> None:
        try:
            self._buf.release()
            self._mmap.close()
        except (BufferError, ValueError):
            pass  # views into the map are still alive; the map is freed with them


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Just the metadata of a GGUF file (for tokenizer tests and `omlx info`)."""
    return GGUFFile(path).metadata
