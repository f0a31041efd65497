"""One step's LoRA work: which rows of the flat batch belong to which adapter, and the per-row delta
``y[row] += (B_a (A_a x[row])) * scale_a`` on every projection adapter ``a`` targets.

Determinism: a row's result must not depend on what shares its step. torch's matmul (MKL) sums in an order that
depends on the row count, so the shrink (x A^T) and the expand (h B^T) run through the fixed-order fp32 kernel of
``--quantization none`` (``flinear``, kernels_cupy/cpu/fgemm.h), whose every output element is one fixed chain of
FMAs whatever M. Rows are gathered per adapter (an exact copy), and the delta is added to the base output row by
row in fp32 (one rounding per element), so a row's bits are the same alone or beside any rows of any adapters.
Base rows are not touched at all. Without the kernel (no C++ build, CUDA) torch's F.linear runs, which is not
batch-invariant, like the base linears there.

On the CPU the whole loop runs in C++ (``lora_add``, kernels_cupy/cpu/lora_add.h: one call a projection, the
groups on the threads, the same arithmetic bit for bit: tests/test_lora_batch.py); the Python loop stays for
CUDA and for a build without the kernel. Steps with LoRA rows do not use the C++ decode stack.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from workers.lora.adapter import LoraAdapter


class LoraBatch:
    """Row groups of one step, one per adapter present (base rows belong to none)."""

    def __init__(self, groups: Sequence[tuple[LoraAdapter, torch.Tensor]], kernel: Any | None) -> None:
        self.groups = list(groups)  # (adapter, rows (n,) int64 of the flat batch)
        self._kernel = kernel
        self._fused = kernel is not None and hasattr(kernel, "lora_add")

    @staticmethod
    def build(row_adapters: Mapping[str, list[int]], adapters: Mapping[str, LoraAdapter], kernel: Any | None,
              device: torch.device) -> LoraBatch | None:
        """``row_adapters``: adapter name -> its rows of the flat batch; None when no row uses an adapter."""
        groups = [(adapters[name], torch.tensor(rows, dtype=torch.int64, device=device))
                  for name, rows in row_adapters.items() if rows]
        return LoraBatch(groups, kernel) if groups else None

    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # (n, in) @ (out, in)^T -> (n, out)
        if self._kernel is not None and x.device.type == "cpu" and x.dtype == torch.float32:
            out: torch.Tensor = self._kernel.flinear(x.contiguous(), w, None)
            return out
        return F.linear(x.float(), w)

    def _fused_args(self, layer: int, proj: str) -> tuple[Any, ...] | None:
        """lora_add's per-group and per-slice arguments for one projection (None: no adapter targets it). Each
        projection is called once a step, so they are assembled per call from what each adapter keeps ready."""
        rows: list[torch.Tensor] = []
        a: list[torch.Tensor] = []
        b: list[torch.Tensor] = []
        scale: list[float] = []
        s_group: list[int] = []
        s_cols: list[int] = []
        for adapter, r in self.groups:
            p = adapter.layers[layer].get(proj)
            if p is None:
                continue
            s_group += [len(rows)] * len(p.slices)
            s_cols += p.cols
            b += p.bs
            rows.append(r)
            a.append(p.a)
            scale.append(adapter.scale)
        return (rows, a, scale, s_group, s_cols, b) if rows else None

    def add(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y (T, out) += each adapter's delta on its own rows of x (T, in), in place."""
        kernel = self._kernel
        if self._fused and kernel is not None and x.device.type == "cpu" and x.dtype == torch.float32 \
                and y.dtype == torch.float32 and y.is_contiguous():
            args = self._fused_args(layer, proj)
            if args is not None:
                kernel.lora_add(x.contiguous(), y, *args)
            return
        for adapter, rows in self.groups:
            p = adapter.layers[layer].get(proj)
            if p is None:
                continue
            h = self._linear(x.index_select(0, rows).float(), p.a)  # (n, n_targets * r): every target's shrink
            for s in p.slices:
                d = self._linear(h[:, s.r_lo:s.r_hi], s.b)  # (n, hi - lo)
                d.mul_(adapter.scale)  # PEFT's order: (B (A x)) * scale, then added to the base output
                y[rows, s.lo:s.hi] += d.to(y.dtype)
