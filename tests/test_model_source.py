"""A GGUF's converted directory records the file it came from, so a worker handed the directory (the gateway
passes directories) keeps the GGUF's own quantized blocks; a changed or missing GGUF is not trusted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from common import model_files as mf


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVGATE_CACHE", str(tmp_path / "cache"))
    return tmp_path


def _fake_converted(gguf: Path) -> Path:
    out = mf.converted_dir(gguf)
    out.mkdir(parents=True)
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"")
    return out


def test_resolving_a_gguf_records_its_source_in_the_directory(cache: Path) -> None:
    gguf = cache / "m.Q4_1.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)
    out = _fake_converted(gguf)
    assert mf.gguf_source(str(out)) is None  # converted before records existed: nothing recorded yet
    assert mf.resolve(str(gguf)).directory == out
    assert json.loads((out / mf.SOURCE_FILE).read_text())["gguf"] == str(gguf.resolve())
    assert mf.gguf_source(str(out)) == gguf.resolve()


def test_a_changed_or_missing_gguf_is_not_taken_for_the_source(cache: Path) -> None:
    gguf = cache / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)
    out = _fake_converted(gguf)
    mf.write_source(out, gguf)
    assert mf.gguf_source(str(out)) == gguf.resolve()
    gguf.write_bytes(b"GGUF" + b"\1" * 80)  # rewritten in place: other blocks than the directory's weights
    assert mf.gguf_source(str(out)) is None
    mf.write_source(out, gguf)
    os.remove(gguf)
    assert mf.gguf_source(str(out)) is None
    (out / mf.SOURCE_FILE).write_text("not json")
    assert mf.gguf_source(str(out)) is None


def test_a_plain_model_directory_has_no_gguf(cache: Path) -> None:
    d = cache / "hf"
    d.mkdir()
    (d / "config.json").write_text("{}")
    assert mf.gguf_source(str(d)) is None
