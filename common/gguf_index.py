"""A GGUF file's tensors (name, type, shape, raw data mapped from the file) and scalar metadata, read without
decoding its arrays. Torch-free: the worker maps the quantized blocks with it, ``kvgatectl plan`` the shapes.

``gguf.GGUFReader`` turns every metadata value into numpy views, element by element. smollm2's GGUF carries its
tokenizer in the metadata (49,152 tokens and 48,900 merges as string arrays), so building a reader cost ~6 s of
CPU on a Zen 1: more than half of a worker's start, paid again by every restart, and all of ``kvgatectl plan``'s
wait. Nothing here needs those arrays' items: this walks the key-value section by lengths (``struct.unpack_from``
over a memory map), decodes scalars and strings, keeps each array's length, and maps each tensor's bytes exactly
as GGUFReader does (tests/test_gguf_index.py compares the two on smollm2's file and on a written file holding
every value type). Layout (ggml's docs/gguf.md, versions 2 and 3, little-endian): magic, version, tensor count,
key-value count; the pairs; the tensor infos; padding to the alignment; the data. Anything else (a big-endian
file, version 1) is read by GGUFReader instead.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_SCALARS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
            GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
            GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
            GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}
_SCALAR_BYTES = {t: struct.calcsize(f) for t, f in _SCALARS.items()}
# Tensor types GGUFReader maps as elements (the rest as rows of raw block bytes).
_ELEMENT_DTYPES: dict[GGMLQuantizationType, Any] = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # innermost dimension first, as GGUF lists them (a linear's weight: (K, N))
    data: np.ndarray  # read-only map of the file: elements, or (rows, bytes per row) for block types

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


@dataclass
class GGUFIndex:
    tensors: dict[str, Tensor] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)  # scalar and string values by key
    array_lengths: dict[str, int] = field(default_factory=dict)  # array values: their item count only


class _Cursor:
    def __init__(self, buf: np.ndarray) -> None:
        self.buf, self.offs = buf.data, 0  # a memoryview of the map

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.offs)
        self.offs += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        self.offs += n
        return bytes(self.buf[self.offs - n:self.offs]).decode("utf-8")

    def skip_value(self, kind: int) -> None:
        t = GGUFValueType(kind)
        if t in _SCALAR_BYTES:
            self.offs += _SCALAR_BYTES[t]
        elif t == GGUFValueType.STRING:
            n = self.take("<Q")  # (not `self.offs += self.take(...)`: that reads offs before take moves it)
            self.offs += n
        else:
            self.skip_items(self.take("<I"), self.take("<Q"))

    def skip_items(self, item: int, count: int) -> None:
        if GGUFValueType(item) in _SCALAR_BYTES:
            self.offs += count * _SCALAR_BYTES[GGUFValueType(item)]
        else:
            for _ in range(count):
                self.skip_value(item)


def _walk(buf: np.ndarray) -> GGUFIndex | None:
    cur = _Cursor(buf)
    if cur.take("<I") != GGUF_MAGIC or cur.take("<I") not in (2, 3):
        return None
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    index = GGUFIndex()
    for _ in range(n_kv):
        key, kind = cur.string(), GGUFValueType(cur.take("<I"))
        if kind in _SCALARS:
            index.metadata[key] = cur.take(_SCALARS[kind])
        elif kind == GGUFValueType.STRING:
            index.metadata[key] = cur.string()
        else:
            item, count = cur.take("<I"), cur.take("<Q")
            index.array_lengths[key] = count
            cur.skip_items(item, count)
    infos = []
    for _ in range(n_tensors):
        name, n_dims = cur.string(), cur.take("<I")
        dims = tuple(cur.take("<Q") for _ in range(n_dims))
        infos.append((name, dims, GGMLQuantizationType(cur.take("<I")), cur.take("<Q")))
    alignment = int(index.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"GGUF alignment {alignment} is not a power of two")
    start = -(-cur.offs // alignment) * alignment
    for info in infos:
        if info[0] in index.tensors:
            raise ValueError(f"the tensor {info[0]!r} is in the GGUF twice")
        index.tensors[info[0]] = _mapped(buf, start, *info)
    return index


def _mapped(buf: np.ndarray, start: int, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType,
            offset: int) -> Tensor:
    n_elems = int(np.prod(dims))
    np_dims: tuple[int, ...] = tuple(reversed(dims))
    block, type_size = GGML_QUANT_SIZES[kind]
    dtype = _ELEMENT_DTYPES.get(kind)
    if dtype is None:
        dtype, count, np_dims = np.uint8, n_elems * type_size // block, quant_shape_to_byte_shape(np_dims, kind)
    else:
        count = n_elems
    at = start + offset
    data = buf[at:at + np.dtype(dtype).itemsize * count].view(dtype)[:count].reshape(np_dims)
    return Tensor(name, kind, dims, data)


def _from_reader(path: Path) -> GGUFIndex:
    """The library's reader: slow on large arrays, but it reads what the walk above leaves to it."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    index = GGUFIndex()
    for t in reader.tensors:
        index.tensors[t.name] = Tensor(t.name, t.tensor_type, tuple(int(x) for x in t.shape), t.data)
    for key, f in reader.fields.items():
        if f.types and f.types[0] == GGUFValueType.ARRAY:
            index.array_lengths[key] = len(f.data)
        elif not key.startswith("GGUF."):
            index.metadata[key] = f.contents()
    return index


def read_index(path: Path) -> GGUFIndex:
    """``path``'s tensors (data mapped read-only) and metadata; a file that is not GGUF raises ValueError."""
    buf = np.memmap(path, mode="r")
    try:
        found = _walk(buf)
    except (struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a readable GGUF file ({e})") from None
    return found if found is not None else _from_reader(path)


def read_tensors(path: Path) -> dict[str, Tensor]:
    """Name -> tensor, the data mapped read-only from ``path``."""
    return read_index(path).tensors
