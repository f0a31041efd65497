"""A GGUF file's tensors (name, type, shape, raw data mapped from the file) without decoding its metadata.

``gguf.GGUFReader`` turns every metadata value into numpy views, element by element. smollm2's GGUF carries its
tokenizer in the metadata (49,152 tokens and 48,900 merges as string arrays), so building a reader cost ~7.5 s of
CPU on a Zen 1: more than half of a worker's start, paid again by every restart. The linear layers need none of
the values: this walks the key-value section by lengths only (``struct.unpack_from`` over a memory map), reads
``general.alignment``, and maps each tensor's bytes exactly as GGUFReader does (tests/test_gguf_index.py compares
the two on smollm2's file and on a written file holding every value type). Layout (ggml's docs/gguf.md, versions
2 and 3, little-endian): magic, version, tensor count, key-value count; the pairs; the tensor infos; padding to
the alignment; the data. Anything else (a big-endian file, version 1) is read by GGUFReader instead.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_SCALAR_BYTES = {GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
                 GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4, GGUFValueType.BOOL: 1,
                 GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8}
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
        else:  # ARRAY: item type, count, items
            item, count = self.take("<I"), self.take("<Q")
            if GGUFValueType(item) in _SCALAR_BYTES:
                self.offs += count * _SCALAR_BYTES[GGUFValueType(item)]
            else:
                for _ in range(count):
                    self.skip_value(item)


def _tensors(buf: np.ndarray) -> list[Tensor] | None:
    cur = _Cursor(buf)
    if cur.take("<I") != GGUF_MAGIC or cur.take("<I") not in (2, 3):
        return None
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    alignment = GGUF_DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key, kind = cur.string(), cur.take("<I")
        if key == "general.alignment" and kind == GGUFValueType.UINT32:
            alignment = cur.take("<I")
        else:
            cur.skip_value(kind)
    infos = []
    for _ in range(n_tensors):
        name, n_dims = cur.string(), cur.take("<I")
        dims = tuple(cur.take("<Q") for _ in range(n_dims))
        infos.append((name, dims, GGMLQuantizationType(cur.take("<I")), cur.take("<Q")))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"GGUF alignment {alignment} is not a power of two")
    start = -(-cur.offs // alignment) * alignment
    return [_mapped(buf, start, *info) for info in infos]


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


def read_tensors(path: Path) -> dict[str, Tensor]:
    """Name -> tensor, the data mapped read-only from ``path``."""
    buf = np.memmap(path, mode="r")
    found = _tensors(buf)
    if found is None:  # not the common layout: the library's reader, slow but complete
        from gguf import GGUFReader

        found = [Tensor(t.name, t.tensor_type, tuple(int(x) for x in t.shape), t.data)
                 for t in GGUFReader(str(path)).tensors]
    out: dict[str, Tensor] = {}
    for t in found:
        if t.name in out:
            raise ValueError(f"GGUF {path} has the tensor {t.name!r} twice")
        out[t.name] = t
    return out
