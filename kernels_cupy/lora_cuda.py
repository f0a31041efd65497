"""Host side of ``csrc/lora.cu``: a step's LoRA tables, the kernels' arguments and launch geometry, the launches.

Everything but :func:`launch_add` is plain torch/NumPy on any device, so tests/test_lora_cuda_emulate.py runs the
very tables and grids a GPU would get through its NumPy emulation of the kernels (CPU tensors have addresses too:
the emulation resolves the records' pointers against the tensors it was given).

A step packs, once: ``row_map`` (n, 2) int32 (each LoRA row's flat row and its group) and ``meta``
(L, P, G, LORA_REC) int64 (per layer, projection and group: the adapter's A, rank, scale and slices, as raw device
addresses). Each projection is then two launches covering every group: shrink into ``h`` (n, r_cap) fp32, expand
into y. Each adapter's (L, P, LORA_REC) records are built once and kept while the adapter lives: a step only stacks
them (one small copy to the device).

Kept free of ``workers`` (kernels_cupy is below it): adapters reach here through the Protocols below.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from kernels_cupy.kernels import NUM_WARPS, THREADS

FILE = "lora.cu"
MAX_SLICES = 3  # LORA_MAX_SLICES in csrc/lora.cu: q, k, v on qkv_proj
REC = 4 + 5 * MAX_SLICES  # LORA_REC: a, R, scale bits, n_slices, then (b, lo, hi, r_lo, r_hi) per slice
PROJS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # meta's P axis, in this order
CUDA_TYPE = {torch.float32: "float", torch.float16: "half_t", torch.bfloat16: "bf16_t"}
KERNELS = ("lora_shrink", "lora_expand")
# Every instantiation in one NVRTC module: the step compiles once whatever dtype the model runs.
EXPRESSIONS = tuple(f"{k}<{t}>" for k in KERNELS for t in CUDA_TYPE.values())
# Argument kinds, as kernels_cupy.kernels.SIGNATURES: CuPy passes raw bytes, so each scalar is cast to its C type.
SIGNATURES: dict[str, tuple[str, ...]] = {
    "lora_shrink": ("ptr", "ptr", "ptr", "ptr", "i32", "i32"),
    "lora_expand": ("ptr", "ptr", "ptr", "ptr", "i32", "i32"),
}
Grid = tuple[int, int, int]


class SliceLike(Protocol):  # workers.lora.adapter.LoraSlice
    @property
    def lo(self) -> int: ...
    @property
    def hi(self) -> int: ...
    @property
    def r_lo(self) -> int: ...
    @property
    def r_hi(self) -> int: ...
    @property
    def b(self) -> torch.Tensor: ...


class ProjLike(Protocol):  # workers.lora.adapter.LoraProj
    @property
    def a(self) -> torch.Tensor: ...
    @property
    def slices(self) -> Sequence[SliceLike]: ...


class AdapterLike(Protocol):  # workers.lora.adapter.LoraAdapter
    @property
    def scale(self) -> float: ...
    @property
    def layers(self) -> Sequence[Mapping[str, ProjLike]]: ...


def _weights(t: torch.Tensor, shape: tuple[int, int]) -> int:
    """t's address, once it is what the kernels read: contiguous fp32 of ``shape``."""
    if t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != shape:
        raise ValueError(f"LoRA weights must be contiguous fp32 {shape}, not {t.dtype} {tuple(t.shape)}")
    return int(t.data_ptr())


def scale_bits(scale: float) -> int:
    """The scale as the fp32 bit pattern the kernel reads back (torch's mul_ by a Python float uses it in fp32)."""
    return int(np.array([scale], dtype=np.float32).view(np.int32)[0])


def proj_record(p: ProjLike | None, scale: float) -> list[int]:
    """One group's LORA_REC record on one projection (all zero: the adapter does not target it)."""
    rec = [0] * REC
    if p is None:
        return rec
    if len(p.slices) > MAX_SLICES:
        raise ValueError(f"{len(p.slices)} LoRA slices on one projection, the kernel holds {MAX_SLICES}")
    r, k = p.a.shape
    rec[:4] = [_weights(p.a, (r, k)), r, scale_bits(scale), len(p.slices)]
    for j, s in enumerate(p.slices):
        if not (0 <= s.r_lo < s.r_hi <= r and 0 <= s.lo < s.hi):
            raise ValueError(f"LoRA slice {j}: bad columns")
        rec[4 + 5 * j:9 + 5 * j] = [_weights(s.b, (s.hi - s.lo, s.r_hi - s.r_lo)), s.lo, s.hi, s.r_lo, s.r_hi]
    return rec


_tables: dict[int, tuple[weakref.ref[Any], torch.Tensor]] = {}  # id(adapter) -> (the adapter, its records)


def adapter_table(adapter: AdapterLike) -> torch.Tensor:
    """(L, P, REC) int64 on the CPU: the adapter's records on every layer and projection, built on first use and
    kept while the adapter lives (its weights never move, so the addresses stay valid)."""
    hit = _tables.get(id(adapter))
    if hit is not None and hit[0]() is adapter:
        return hit[1]
    rows = [[proj_record(layer.get(p), adapter.scale) for p in PROJS] for layer in adapter.layers]
    table = torch.tensor(rows, dtype=torch.int64).reshape(len(adapter.layers), len(PROJS), REC)
    key = id(adapter)
    _tables[key] = (weakref.ref(adapter, lambda _: _tables.pop(key, None)), table)
    return table


@dataclass(frozen=True)
class LoraStep:
    """One step's tables, on the device of its tensors."""

    row_map: torch.Tensor  # (n, 2) int32: flat row of x/y, group
    meta: torch.Tensor  # (L, P, G, REC) int64
    r_cap: int  # the largest R (n_targets * r) of any group on any projection: h's row length
    targeted: tuple[tuple[bool, ...], ...]  # [layer][proj]: some group has an adapter there (else no launch)

    @property
    def n(self) -> int:
        return int(self.row_map.shape[0])


def pack_step(groups: Sequence[tuple[AdapterLike, Sequence[int]]], device: torch.device) -> LoraStep:
    """The step's tables from its groups (adapter, its flat rows); every adapter must have the same layer count."""
    rows = [(r, g) for g, (_, rs) in enumerate(groups) for r in rs]
    row_map = torch.tensor(rows, dtype=torch.int32).reshape(len(rows), 2)
    meta = torch.stack([adapter_table(a) for a, _ in groups], dim=2)  # (L, P, G, REC)
    r_cap = int(meta[..., 1].max()) if meta.numel() else 0
    targeted = tuple(tuple(bool(b) for b in layer) for layer in (meta[..., 1] > 0).any(dim=2).tolist())
    if device.type != "cpu":  # one copy each; pinned memory would not pay at this size
        row_map, meta = row_map.to(device), meta.to(device)
    return LoraStep(row_map, meta.contiguous(), max(r_cap, 1), targeted)


def shrink_geometry(n: int, r_cap: int) -> tuple[Grid, int]:
    """lora_shrink's grid and block: a CTA per (row, NUM_WARPS consecutive outputs), a warp per output."""
    return (n, math.ceil(r_cap / NUM_WARPS), 1), THREADS


def expand_geometry(n: int, out: int) -> tuple[Grid, int]:
    """lora_expand's grid and block: a CTA per (row, THREADS consecutive columns of y), a thread per column."""
    return (n, math.ceil(out / THREADS), 1), THREADS


def proj_index(proj: str) -> int:
    return PROJS.index(proj)


def shrink_args(step: LoraStep, layer: int, proj: str, x: torch.Tensor, h: torch.Tensor) -> tuple[Any, ...]:
    """lora_shrink's arguments in order: x (T, in), row_map (n, 2), meta (G, REC), h (n, r_cap), in, r_cap."""
    return (x, step.row_map, step.meta[layer, proj_index(proj)], h, np.int32(x.shape[1]), np.int32(step.r_cap))


def expand_args(step: LoraStep, layer: int, proj: str, y: torch.Tensor, h: torch.Tensor) -> tuple[Any, ...]:
    """lora_expand's arguments in order: y (T, out), row_map (n, 2), meta (G, REC), h (n, r_cap), out, r_cap."""
    return (y, step.row_map, step.meta[layer, proj_index(proj)], h, np.int32(y.shape[1]), np.int32(step.r_cap))


def check_operands(x: torch.Tensor, y: torch.Tensor) -> str | None:
    """Why x (T, in) and y (T, out) cannot go to the kernels as they are, or None."""
    if x.dtype != y.dtype or x.dtype not in CUDA_TYPE:
        return f"dtypes {x.dtype}, {y.dtype}"
    if not (x.is_contiguous() and y.is_contiguous()) or x.shape[0] != y.shape[0]:
        return "non-contiguous or mismatched operands"
    return None


def launch_add(step: LoraStep, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor,
               h: torch.Tensor) -> None:
    """y (T, out) += the step's deltas on one projection, in place; x (T, in), h (n, r_cap) fp32 scratch: CUDA
    tensors on one device, x and y contiguous and of one dtype (:func:`check_operands`)."""
    from kernels_cupy import nvrtc

    if step.n == 0 or not step.targeted[layer][proj_index(proj)]:
        return
    t = CUDA_TYPE[x.dtype]
    shrink = nvrtc.function(x.device, FILE, EXPRESSIONS, f"lora_shrink<{t}>")
    expand = nvrtc.function(x.device, FILE, EXPRESSIONS, f"lora_expand<{t}>")
    grid, block = shrink_geometry(step.n, step.r_cap)
    nvrtc.launch(shrink, x.device, grid, block, shrink_args(step, layer, proj, x, h))
    grid, block = expand_geometry(step.n, y.shape[1])
    nvrtc.launch(expand, x.device, grid, block, expand_args(step, layer, proj, y, h))

