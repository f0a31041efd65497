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
CUDA without CuPy and for a build without the kernel. Where the C++ decode stack runs the step, it calls the same
``lora_add`` after each of its projections with the groups ``stack_groups`` hands it (workers/models/decode_stack.py),
so a row's bits are the same on both paths (tests/test_lora_stack.py); ``add`` is then not called at all.

On CUDA (with CuPy) two CuPy RawKernels a projection cover every group (kernels_cupy/lora_cuda.py, csrc/lora.cu):
a warp per shrink output and a thread per expand output, each one fixed-order fp32 chain whatever the batch, so a
row's bits are again its own; the step's row map and adapter records go to the device once, at its first
projection. Without CuPy the F.linear loop runs (logged once), not batch-invariant.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kernels_cupy import lora_cuda
from workers.lora.adapter import LoraAdapter

log = logging.getLogger(__name__)
_cuda_kernels: bool | None = None  # CuPy importable: decided (and a fallback logged) once a process


def cuda_kernels() -> bool:
    """Whether the CUDA path may use csrc/lora.cu (CuPy importable); logs the fallback once."""
    global _cuda_kernels
    if _cuda_kernels is None:
        _cuda_kernels = importlib.util.find_spec("cupy") is not None
        if not _cuda_kernels:
            log.warning("CuPy is not importable: LoRA deltas on CUDA run torch's F.linear per adapter, which is "
                        "not batch-invariant")
    return _cuda_kernels


class LoraBatch:
    """Row groups of one step, one per adapter present (base rows belong to none)."""

    def __init__(self, groups: Sequence[tuple[LoraAdapter, torch.Tensor]], kernel: Any | None,
                 row_lists: Sequence[Sequence[int]] | None = None) -> None:
        self.groups = list(groups)  # (adapter, rows (n,) int64 of the flat batch)
        self._kernel = kernel
        self._fused = kernel is not None and hasattr(kernel, "lora_add")
        self._row_lists = row_lists  # the groups' rows as host lists (the CUDA tables; None: read back)
        self._cuda: tuple[lora_cuda.LoraStep, torch.Tensor] | None = None  # tables, h (n, r_cap) fp32 scratch

    @staticmethod
    def build(row_adapters: Mapping[str, list[int]], adapters: Mapping[str, LoraAdapter], kernel: Any | None,
              device: torch.device) -> LoraBatch | None:
        """``row_adapters``: adapter name -> its rows of the flat batch; None when no row uses an adapter."""
        used = [(name, rows) for name, rows in row_adapters.items() if rows]
        groups = [(adapters[name], torch.tensor(rows, dtype=torch.int64, device=device)) for name, rows in used]
        return LoraBatch(groups, kernel, [rows for _, rows in used]) if groups else None

    def stack_groups(self) -> Sequence[tuple[LoraAdapter, torch.Tensor]] | None:
        """(adapter, rows (n,) int64) per group for the C++ decode stack, or None where ``add`` would not run
        ``lora_add`` (no CPU kernel: the Python loop's F.linear), whose arithmetic the stack reproduces."""
        return self.groups if self._fused else None

    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # (n, in) @ (out, in)^T -> (n, out)
        if self._kernel is not None and x.device.type == "cpu" and x.dtype == torch.float32:
            out: torch.Tensor = self._kernel.flinear(x.contiguous(), w, None)  # widens 16-bit weights itself
            return out
        return F.linear(x.float(), w.float())  # a 16-bit adapter's weights widened exactly

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
        if x.device.type == "cuda" and cuda_kernels() and lora_cuda.check_operands(x.contiguous(), y) is None:
            self._cuda_add(layer, proj, x.contiguous(), y)
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

    def _cuda_add(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """The CUDA kernels: the step's tables are built at its first projection and serve every later one."""
        if self._cuda is None:
            rows = self._row_lists if self._row_lists is not None else [r.tolist() for _, r in self.groups]
            step = lora_cuda.pack_step([(a, r) for (a, _), r in zip(self.groups, rows)], x.device)
            h = torch.empty((step.n, step.r_cap), dtype=torch.float32, device=x.device)  # (n, r_cap)
            self._cuda = (step, h)
        step, h = self._cuda
        lora_cuda.launch_add(step, layer, proj, x, y, h)
