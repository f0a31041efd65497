"""An adapter directory checked before it is registered, without torch: where it is (only directly under the
configured adapter directory), its ``adapter_config.json``, and its ``adapter_model.safetensors`` header (names,
dtypes, shapes and byte ranges against the base model's ``config.json``).

The config is checked by the same code as the worker's loader (common/peft_config.py). The loader checks the
tensors themselves, but it needs torch, which neither the gateway nor kvgatectl may import; so their names, dtypes
and shapes are checked here over the file's header, and
``tests/test_lora_registration.py`` runs the loader's own refusal cases through both. One check is left to the
worker: finiteness needs the data (a NaN adapter is refused when a request first loads it, a 400).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.peft_config import (CONFIG_FILE, KEY_RE, MAX_RANK, NAME_RE, WEIGHTS_FILE, layer_indices, rank_and_scale,
                                read_config, target_names)

__all__ = ["CONFIG_FILE", "MAX_RANK", "WEIGHTS_FILE", "AdapterSummary", "BaseShapes", "LoraContext", "check_adapter",
           "resolve_adapter_dir"]

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header
_FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}
_INT_BYTES = {"I64": 8, "U64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}


@dataclass(frozen=True)
class BaseShapes:
    """What an adapter's shapes are checked against: the base model's dimensions (its config.json)."""

    hidden: int
    intermediate: int
    layers: int
    q: int  # attention heads x head_dim
    kv: int  # key/value heads x head_dim

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> BaseShapes:
        """As workers/models/llama.py LlamaConfig.from_hf reads the same file."""
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        return cls(int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"]),
                   heads * head_dim, kv_heads * head_dim)

    def targets(self) -> dict[str, tuple[str, int, int]]:
        """PEFT module name -> (parent module, out features, in features), in kvgate's order."""
        h, i, q, kv = self.hidden, self.intermediate, self.q, self.kv
        return {"q_proj": ("self_attn", q, h), "k_proj": ("self_attn", kv, h), "v_proj": ("self_attn", kv, h),
                "o_proj": ("self_attn", h, q), "gate_proj": ("mlp", i, h), "up_proj": ("mlp", i, h),
                "down_proj": ("mlp", h, i)}


@dataclass(frozen=True)
class LoraContext:
    """Where adapters may be registered from, and the base model they must fit."""

    directory: Path
    base: BaseShapes

    @classmethod
    def load(cls, lora_dir: str | Path, model_dir: Path) -> LoraContext:
        cfg = json.loads((model_dir / "config.json").read_text())
        return cls(Path(lora_dir), BaseShapes.from_config(cfg))


@dataclass(frozen=True)
class AdapterSummary:
    rank: int
    targets: tuple[str, ...]


def resolve_adapter_dir(lora_dir: Path, lora_path: object) -> str:
    """The name of the adapter's directory under ``lora_dir`` (what workers are sent), for a path relative to it or
    absolute; ValueError for anything else: ``..``, a path outside it (symlinks followed), or nested deeper."""
    if not isinstance(lora_path, str) or not lora_path or "\x00" in lora_path:
        raise ValueError(f"'lora_path' must be a non-empty path, got {lora_path!r}")
    path = Path(lora_path)
    if ".." in path.parts:
        raise ValueError("'lora_path' must not contain '..'")
    root = lora_dir.resolve()
    real = (path if path.is_absolute() else lora_dir / path).resolve()  # symlinks followed: where it really is
    if real != root and root not in real.parents:
        raise ValueError(f"'lora_path' {lora_path!r} is outside the adapter directory (symlinks are followed)")
    if real.parent != root:
        raise ValueError(f"'lora_path' {lora_path!r} must be a directory directly inside the adapter directory "
                         "(workers address adapters by that one name)")
    if not NAME_RE.fullmatch(real.name):
        raise ValueError(f"the adapter's directory name {real.name!r} must be letters, digits, '.', '_' or '-'")
    if not real.is_dir():
        raise ValueError(f"'lora_path' {lora_path!r}: no such directory in the adapter directory")
    return real.name


def check_adapter(directory: Path, base: BaseShapes) -> AdapterSummary:
    """Everything the worker's loader checks but finiteness; ValueError saying what is wrong."""
    cfg = read_config(directory)
    r, _ = rank_and_scale(cfg)
    known = base.targets()
    names = target_names(cfg, known)
    layers = layer_indices(cfg, base.layers)
    _check_tensors(_read_header(directory / WEIGHTS_FILE), names, layers, known, r)
    return AdapterSummary(r, tuple(names))


Header = dict[str, tuple[str, tuple[int, ...]]]  # tensor name -> (dtype, shape)


def _read_header(path: Path) -> Header:
    """The tensors a safetensors file declares; ValueError unless its byte ranges tile the data exactly (a
    truncated or padded file fails here, as safetensors' own loader fails on it)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
                raise ValueError("truncated or not a safetensors file")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        raise ValueError(f"{WEIGHTS_FILE}: cannot be read ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{WEIGHTS_FILE}: cannot be read (its header is not a JSON object)")
    out: Header = {}
    spans = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype, shape, span = _entry(key, info)
        out[key] = (dtype, shape)
        spans.append(span)
    end = 0
    for begin, stop in sorted(spans):
        if begin != end:
            raise ValueError(f"{WEIGHTS_FILE}: cannot be read (tensor byte ranges overlap or leave gaps)")
        end = stop
    if end != size - 8 - n:
        raise ValueError(f"{WEIGHTS_FILE}: cannot be read (the data is {size - 8 - n} bytes, the header "
                         f"describes {end}: truncated or corrupt)")
    return out


def _entry(key: str, info: Any) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    bad = ValueError(f"{WEIGHTS_FILE}: cannot be read (bad header entry for {key!r})")
    if not isinstance(info, dict):
        raise bad
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or not isinstance(shape, list) or not isinstance(offsets, list):
        raise bad
    itemsize = _FLOAT_BYTES.get(dtype) or _INT_BYTES.get(dtype)
    if itemsize is None or not all(type(d) is int and d >= 0 for d in shape) or len(offsets) != 2 \
            or not all(type(o) is int for o in offsets):
        raise bad
    begin, stop = int(offsets[0]), int(offsets[1])
    if not 0 <= begin <= stop or stop - begin != math.prod(shape) * itemsize:
        raise bad
    return dtype, tuple(int(d) for d in shape), (begin, stop)


def _check_tensors(header: Header, names: list[str], layers: set[int], known: dict[str, tuple[str, int, int]],
                   r: int) -> None:
    found: dict[tuple[int, str, str], tuple[str, tuple[int, ...]]] = {}
    for key, entry in header.items():
        m = KEY_RE.fullmatch(key)
        if m is None or m.group(3) not in names or int(m.group(1)) not in layers \
                or known[m.group(3)][0] != m.group(2):
            raise ValueError(f"{WEIGHTS_FILE}: unexpected tensor {key!r} (targets {names}, layers "
                             f"{min(layers)}..{max(layers)})")
        found[(int(m.group(1)), m.group(3), m.group(4))] = entry
    for i in sorted(layers):
        for name in names:
            _, out_features, in_features = known[name]
            for ab, want in (("A", (r, in_features)), ("B", (out_features, r))):
                if (i, name, ab) not in found:
                    raise ValueError(f"{WEIGHTS_FILE}: layer {i} {name} lacks lora_{ab}")
                dtype, shape = found[(i, name, ab)]
                if shape != want:
                    raise ValueError(f"{WEIGHTS_FILE}: layer {i} {name}.lora_{ab} has shape {shape}, the base "
                                     f"model needs {want} (rank {r})")
                if dtype not in _FLOAT_BYTES:
                    raise ValueError(f"{WEIGHTS_FILE}: layer {i} {name}.lora_{ab} is not finite floating point")
