"""common.gguf_index maps a GGUF's tensors as gguf.GGUFReader does (names, types, shapes, the same bytes) and reads
the same scalar and string metadata and array lengths, without decoding the arrays: on smollm2's file, and on a
written file holding every metadata value type, nested and string arrays, a custom alignment and element and block
tensor types."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from common.model_files import ALIASES, alias_path
from common.gguf_index import read_index, read_tensors


def _assert_same(path: Path) -> int:
    reader = gguf.GGUFReader(str(path))
    index = read_index(path)
    for key, f in reader.fields.items():
        if f.types[:2] == [gguf.GGUFValueType.ARRAY] * 2:  # the reader flattens nested arrays; we count the outer
            assert index.array_lengths[key] == int(f.parts[4][0]), key  # (key length, key, type, item type, count)
        elif f.types[0] == gguf.GGUFValueType.ARRAY:
            assert index.array_lengths[key] == len(f.data), key
        elif not key.startswith("GGUF."):  # the reader's own header fields
            assert index.metadata[key] == f.contents(), key
    assert len(index.metadata) + len(index.array_lengths) == len([k for k in reader.fields if k[:5] != "GGUF."])
    theirs = {t.name: t for t in reader.tensors}
    ours = read_tensors(path)
    assert list(ours) == list(theirs)
    for name, t in theirs.items():
        o = ours[name]
        assert (o.tensor_type, o.shape) == (t.tensor_type, tuple(int(x) for x in t.shape)), name
        assert (o.data.dtype, o.data.shape) == (t.data.dtype, t.data.shape), name
        assert np.array_equal(o.data, t.data), name
    return len(theirs)


def test_smollm2_tensors_are_the_readers() -> None:
    assert _assert_same(alias_path(*ALIASES["smollm2"])) == 272


def _blocks(rng: np.random.Generator, kind: Q, rows: int, k: int) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, k // block * size), dtype=np.uint8)
    for off in range(0, raw.shape[1], size):  # finite f16 scales: the comparison is of bytes, NaN or not
        raw[:, off + 1] &= 0x3B
    return raw


@pytest.mark.parametrize("alignment", [None, 1024])  # 1024: the data starts elsewhere than at 32
def test_every_value_type_and_tensor_kind(tmp_path: Path, alignment: int | None) -> None:
    rng = np.random.default_rng(3)
    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    scalars: list[tuple[Callable[[str, Any], None], Any]] = [
        (w.add_uint8, 7), (w.add_int8, -7), (w.add_uint16, 700), (w.add_int16, -700), (w.add_uint32, 70000),
        (w.add_int32, -70000), (w.add_float32, 1.5), (w.add_uint64, 2**40), (w.add_int64, -(2**40)),
        (w.add_float64, 2.25), (w.add_bool, True)]
    for add, value in scalars:
        add(f"test.{add.__name__}", value)
    w.add_string("test.string", "ünïcödé ✓")
    w.add_array("test.strings", ["", "a", "ünï", "x" * 1000])
    w.add_array("test.ints", [1, 2, 3])
    w.add_array("test.floats", [0.5, 1.5])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_tensor("f32", rng.standard_normal((3, 64), dtype=np.float32))
    w.add_tensor("f16", rng.standard_normal((5, 32)).astype(np.float16))
    w.add_tensor("i32", np.arange(10, dtype=np.int32))
    for kind in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        w.add_tensor(kind.name.lower(), _blocks(rng, kind, 4, 64), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert _assert_same(path) == 6


def test_an_unusual_file_goes_to_the_library_reader(tmp_path: Path) -> None:
    """Version 1 (32-bit counts) is not walked here: the library's reader gets it, and refuses it."""
    path = tmp_path / "v1.gguf"
    path.write_bytes(struct.pack("<III", gguf.GGUF_MAGIC, 1, 0) + b"\0" * 64)
    with pytest.raises(ValueError, match="version 1"):
        read_tensors(path)
