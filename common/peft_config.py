"""A PEFT LoRA adapter's ``adapter_config.json`` read and checked, without torch: shared by the worker's loader
(workers/lora/adapter.py, which then reads the tensors) and the gateway's registration check
(tenancy/lora_check.py, which reads the safetensors header only), so the two refuse the same configs with the same
words."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MAX_RANK = 64
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
# An adapter's name is a directory under --lora-dir: one path component, nothing hidden, no "..".
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# PEFT's saved key for a Llama layer's pair (the adapter name is stripped on save).
KEY_RE = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# Config fields kvgate does not implement: an adapter using them is refused, never served differently.
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "modules_to_save": None,
                "rank_pattern": {}, "alpha_pattern": {}, "layer_replication": None}


def read_config(directory: Path) -> dict[str, Any]:
    """The directory's adapter_config.json; ValueError unless it is a LoRA config kvgate serves as written."""
    path = directory / CONFIG_FILE
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ValueError(f"{CONFIG_FILE}: larger than {MAX_CONFIG_BYTES} bytes")
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{CONFIG_FILE}: cannot be read as JSON ({type(e).__name__})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{CONFIG_FILE}: not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{CONFIG_FILE}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, plain in _UNSUPPORTED.items():
        v = cfg.get(key)
        if not (v is None or v == plain or v == {} or v == [] or v is False):
            raise ValueError(f"{CONFIG_FILE}: {key}={v!r} is not supported")
    return cfg


def rank_and_scale(cfg: dict[str, Any]) -> tuple[int, float]:
    """(r, the scale PEFT applies: lora_alpha / r, or / sqrt(r) with use_rslora)."""
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= MAX_RANK:
        raise ValueError(f"{CONFIG_FILE}: rank r must be an integer in [1, {MAX_RANK}], got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"{CONFIG_FILE}: lora_alpha must be a finite number, got {alpha!r}")
    return r, float(alpha) / (math.sqrt(r) if cfg.get("use_rslora") else r)


def target_names(cfg: dict[str, Any], known: Iterable[str]) -> list[str]:
    """The config's target modules, in kvgate's order (``known``'s: q, k, v, o, gate, up, down)."""
    order = list(known)
    names = cfg.get("target_modules")
    if isinstance(names, str):  # PEFT also takes a regex or "all-linear"; only explicit names are supported
        raise ValueError(f"{CONFIG_FILE}: target_modules must be a list of module names, got {names!r}")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{CONFIG_FILE}: target_modules must be a non-empty list of module names")
    unknown = sorted(set(names) - set(order))
    if unknown:
        raise ValueError(f"{CONFIG_FILE}: unknown target modules {unknown} (supported: {sorted(order)})")
    return sorted(set(names), key=order.index)


def layer_indices(cfg: dict[str, Any], num_layers: int) -> set[int]:
    """The decoder layers the adapter changes (layers_to_transform, default all)."""
    chosen = cfg.get("layers_to_transform")
    if chosen is None:
        return set(range(num_layers))
    chosen = [chosen] if isinstance(chosen, int) else chosen
    if not isinstance(chosen, list) or not all(type(i) is int and 0 <= i < num_layers for i in chosen):
        raise ValueError(f"{CONFIG_FILE}: layers_to_transform must name layers in [0, {num_layers})")
    return set(chosen)
