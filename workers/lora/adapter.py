"""A PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) read, checked against the base
model and mapped onto kvgate's fused projections.

PEFT trains one (A, B) pair per Hugging Face module; kvgate fuses q/k/v into ``qkv_proj`` and gate/up into
``gate_up_proj``, so each pair becomes an output slice of its fused layer: q_proj adds to columns [0, Hq*D) of
qkv_proj, k_proj to the next Hkv*D, and so on.

Width: on the CPU an adapter saved in fp16 or bf16 (PEFT saves the training dtype; most fine-tunes are 16-bit) is
kept at that width: the C++ kernels widen each weight to fp32 exactly as they read it, so the numerics are those
of the fp32 copy, and a decode step reads half the bytes (every resident adapter's weights, every step: the cost
of multi-LoRA on a memory-bound CPU, bench/RESULTS.md). Anything else (fp32, mixed dtypes; CUDA, whose kernels
read fp32) is kept in fp32. Everything is read and checked before anything is built: a file
that fails any check raises ValueError and leaves nothing behind (the registry only ever holds whole adapters).
"""

from __future__ import annotations

import functools
import mmap
from dataclasses import dataclass
from pathlib import Path

import torch

from common.peft_config import (CONFIG_FILE, KEY_RE, MAX_RANK, NAME_RE, WEIGHTS_FILE, layer_indices, rank_and_scale,
                                read_config, target_names)
from workers.models.decode_stack import STACK_PROJS
from workers.models.llama import LlamaConfig

__all__ = ["CONFIG_FILE", "MAX_RANK", "NAME_RE", "WEIGHTS_FILE", "LoraAdapter", "load_adapter", "targets"]


@dataclass(frozen=True)
class Target:
    """Where one PEFT module lands in kvgate: its fused projection, output columns [lo, hi), input width."""

    module: str  # "self_attn" or "mlp": PEFT's parent module
    proj: str  # kvgate's projection: qkv_proj, o_proj, gate_up_proj, down_proj
    lo: int
    hi: int
    in_features: int


def targets(cfg: LlamaConfig) -> dict[str, Target]:
    """PEFT module name -> its place in kvgate's fused layers, for this base model."""
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim, \
        cfg.num_key_value_heads * cfg.head_dim
    return {
        "q_proj": Target("self_attn", "qkv_proj", 0, q, h),
        "k_proj": Target("self_attn", "qkv_proj", q, q + kv, h),
        "v_proj": Target("self_attn", "qkv_proj", q + kv, q + 2 * kv, h),
        "o_proj": Target("self_attn", "o_proj", 0, h, q),
        "gate_proj": Target("mlp", "gate_up_proj", 0, i, h),
        "up_proj": Target("mlp", "gate_up_proj", i, 2 * i, h),
        "down_proj": Target("mlp", "down_proj", 0, h, i),
    }


@dataclass(frozen=True)
class LoraSlice:
    """One PEFT module's pair inside a fused projection: rows [r_lo, r_hi) of the projection's stacked A give
    its shrink, ``b`` its expand into output columns [lo, hi)."""

    lo: int
    hi: int
    r_lo: int
    r_hi: int
    b: torch.Tensor  # (hi - lo, r) fp32 (or the file's fp16/bf16 on the CPU), contiguous


@dataclass(frozen=True)
class LoraProj:
    """An adapter's pairs on one fused projection: the A of every targeted module stacked, so one shrink call
    serves them all (each output column of the kernel is summed on its own, so stacking changes no bit)."""

    a: torch.Tensor  # (n_targets * r, in) fp32 (or the file's fp16/bf16 on the CPU), contiguous
    slices: tuple[LoraSlice, ...]

    @functools.cached_property
    def cols(self) -> list[int]:
        """(lo, hi, r_lo, r_hi) of every slice, flat: lora_add's per-slice columns (kernels_cupy/cpu/lora_add.h)."""
        return [c for s in self.slices for c in (s.lo, s.hi, s.r_lo, s.r_hi)]

    @functools.cached_property
    def bs(self) -> list[torch.Tensor]:
        """Every slice's expand b, in slice order."""
        return [s.b for s in self.slices]


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int
    scale: float  # lora_alpha / r (or / sqrt(r) with use_rslora), applied as PEFT does: (B (A x)) * scale
    layers: tuple[dict[str, LoraProj], ...]  # per decoder layer: kvgate projection -> its pairs
    nbytes: int


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    path = directory / WEIGHTS_FILE
    try:
        return load(path.read_bytes())  # whole file in memory: a truncated one fails here, not half-read
    except (OSError, SafetensorError, ValueError, RuntimeError) as e:
        raise ValueError(f"{WEIGHTS_FILE}: cannot be read ({e})") from None


def stored_dtype(sd: dict[str, torch.Tensor], device: torch.device) -> torch.dtype:
    """The width an adapter's weights are kept at (module docstring): the file's own 16-bit dtype on the CPU where
    every tensor has it, else fp32."""
    dtypes = {w.dtype for w in sd.values()}
    if device.type == "cpu" and len(dtypes) == 1 and dtypes <= {torch.float16, torch.bfloat16}:
        return dtypes.pop()
    return torch.float32


def _pairs(sd: dict[str, torch.Tensor], names: list[str], layers: set[int], known: dict[str, Target],
           r: int, dtype: torch.dtype) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A (r, in), B (out, r)) in ``dtype``, every key and shape checked."""
    found: dict[tuple[int, str, str], torch.Tensor] = {}
    for key, w in sd.items():
        m = KEY_RE.fullmatch(key)
        if m is None or m.group(3) not in names or int(m.group(1)) not in layers \
                or known[m.group(3)].module != m.group(2):
            raise ValueError(f"{WEIGHTS_FILE}: unexpected tensor {key!r} (targets {names}, layers "
                             f"{min(layers)}..{max(layers)})")
        found[(int(m.group(1)), m.group(3), m.group(4))] = w
    out = {}
    for i in sorted(layers):
        for name in names:
            t = known[name]
            a, b = found.get((i, name, "A")), found.get((i, name, "B"))
            if a is None or b is None:
                raise ValueError(f"{WEIGHTS_FILE}: layer {i} {name} lacks lora_{'A' if a is None else 'B'}")
            for w, want, ab in ((a, (r, t.in_features), "A"), (b, (t.hi - t.lo, r), "B")):
                if tuple(w.shape) != want:
                    raise ValueError(f"{WEIGHTS_FILE}: layer {i} {name}.lora_{ab} has shape {tuple(w.shape)}, "
                                     f"the base model needs {want} (rank {r})")
                if not w.is_floating_point() or not bool(torch.isfinite(w).all()):
                    raise ValueError(f"{WEIGHTS_FILE}: layer {i} {name}.lora_{ab} is not finite floating point")
            out[(i, name)] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    return out


def load_adapter(directory: Path, name: str, base: LlamaConfig, device: torch.device | None = None) -> LoraAdapter:
    """Read, check and map one adapter directory; raises ValueError saying what is wrong (nothing is kept)."""
    if not directory.is_dir():
        raise ValueError(f"adapter {name!r}: no directory {directory}")
    cfg = read_config(directory)
    r, scale = rank_and_scale(cfg)
    known = targets(base)
    names = target_names(cfg, known)
    layers = layer_indices(cfg, base.num_hidden_layers)
    dev = device or torch.device("cpu")
    sd = read_weights(directory)
    pairs = _pairs(sd, names, layers, known, r, stored_dtype(sd, dev))
    built: list[dict[str, LoraProj]] = [{} for _ in range(base.num_hidden_layers)]
    for i in sorted(layers):
        by_proj: dict[str, list[str]] = {}
        for n in names:
            by_proj.setdefault(known[n].proj, []).append(n)
        for proj, mods in by_proj.items():
            a = torch.cat([pairs[(i, n)][0] for n in mods]).to(dev).contiguous()  # (len(mods) * r, in)
            slices = tuple(LoraSlice(known[n].lo, known[n].hi, j * r, (j + 1) * r, pairs[(i, n)][1].to(dev))
                           for j, n in enumerate(mods))
            built[i][proj] = LoraProj(a, slices)
    if dev.type == "cpu":
        built = _packed(built)
    nbytes = sum(p.a.nbytes + sum(s.b.nbytes for s in p.slices) for layer in built for p in layer.values())
    return LoraAdapter(name, r, scale, tuple(built), nbytes)


_HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page


def _huge_page_buffer(numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """A flat tensor of at least ``numel`` elements and the index where its first huge page starts: anonymous
    memory the kernel is asked to back with transparent huge pages (madvise; a no-op where THP is `never`). The
    slack before that index is never touched, so it takes no memory."""
    size = torch.empty(0, dtype=dtype).element_size()
    nbytes = (numel * size + 2 * _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux: huge pages where the system allows them
        mem.madvise(mmap.MADV_HUGEPAGE)
    buf = torch.frombuffer(mem, dtype=dtype)  # the tensor holds the mapping: it lives as long as any view
    return buf, (-buf.data_ptr() % _HUGE_PAGE) // size


def _packed(layers: list[dict[str, LoraProj]]) -> list[dict[str, LoraProj]]:
    """The same weights as views into one buffer that starts on a huge page, in the order a decode step reads
    them (layer by layer, each projection's A then its slices' B). A step reads every resident adapter's weights
    once, from memory; as thousands of small tensors on 4 KiB pages that was a TLB miss (a nested page walk in a
    VM) every 4 KiB, where the hardware prefetchers also stop. One huge-page buffer made a 16-row step's deltas
    8-12% faster on a Zen 4 VM (bench/lora_packing.py, bench/RESULTS.md). Values and shapes are unchanged, so no
    bit of any row moves."""
    order = [[proj for proj in STACK_PROJS if proj in layer] for layer in layers]  # the stack's order
    parts = [t for layer, projs in zip(layers, order) for proj in projs for t in (layer[proj].a, *layer[proj].bs)]
    if not parts:
        return layers
    pad = 64 // parts[0].element_size()  # each tensor starts on a cache line

    def span(t: torch.Tensor) -> int:  # elements t takes in the buffer: itself, up to the next cache line
        return (t.numel() + pad - 1) // pad * pad

    raw, pos = _huge_page_buffer(sum(span(t) for t in parts), parts[0].dtype)

    def place(t: torch.Tensor) -> torch.Tensor:
        nonlocal pos
        view = raw[pos:pos + t.numel()].view(t.shape)
        view.copy_(t)
        pos += span(t)
        return view

    out: list[dict[str, LoraProj]] = []
    for layer, projs in zip(layers, order):
        packed = {}
        for proj in projs:
            p = layer[proj]
            a = place(p.a)
            packed[proj] = LoraProj(a, tuple(LoraSlice(s.lo, s.hi, s.r_lo, s.r_hi, place(s.b)) for s in p.slices))
        out.append(packed)
    return out
