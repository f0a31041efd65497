"""The elementwise ops around a decoder layer's matmuls, behind one interface: the C++ kernels
(``kernels_cupy/cpu/fused_ops.cpp``) on fp32 CPU tensors, the CUDA row kernels (``kernels_cupy/rows_cuda.py``:
RMSNorm, whose torch reduction is not batch-invariant) on CUDA tensors, the torch references everywhere else.

A decode step of SmolLM2 ran ~600 small aten ops (RMSNorm as float/pow/mean/add/rsqrt/mul/to/mul, rope as
slice/neg/cat/mul/mul/add per q and k, silu/mul, residual adds), several microseconds of dispatch each: a
quarter of a batch-1 int4 step. Fused, each is one call. The references are the oracle (tests/test_fused_ops.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x (T, H); with ``delta``, x += delta first, in place (x is the residual stream)."""
    if delta is not None:
        x.add_(delta)
    h = x.float()  # normalise in fp32 whatever the model dtype, as the reference does
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding: x (T, heads, D), cos/sin (T, 1, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:  # (T, 2I) -> (T, I)
    inter = gate_up.shape[-1] // 2
    out: torch.Tensor = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    return out


class FusedOps:
    """Dispatch: the kernel for fp32 CPU tensors where it was built, the CUDA row ops (``cuda``) for CUDA
    tensors they cover, else the references."""

    def __init__(self, kernel: Any | None, cuda: Any | None = None) -> None:
        self.kernel: Any = kernel
        self.cuda: Any = cuda

    def usable(self, x: torch.Tensor) -> bool:
        return self.kernel is not None and x.dtype == torch.float32 and x.device.type == "cpu"

    def rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
        if self.usable(x) and w.dtype == torch.float32:
            out: torch.Tensor = self.kernel.rms_norm(x, delta, w, eps)
            return out
        if self.cuda is not None and self.cuda.covers(x, delta, w):
            cuda_out: torch.Tensor = self.cuda.rms_norm(x, delta, w, eps)
            return cuda_out
        return rms_norm_ref(x, delta, w, eps)

    def rope_qk_(self, qkv: torch.Tensor, heads: int, head_dim: int, tables: tuple[torch.Tensor, torch.Tensor],
                 positions: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Rope of the first ``heads`` heads (q, then k) of each row of qkv (T, >= heads * D), in place.
        tables: cos/sin (max_len, D) fp32; rows: the step's (T, 1, D) rows, where the caller has them."""
        cos, sin = tables
        if self.usable(qkv) and qkv.stride(-1) == 1 and cos.dtype == torch.float32:
            self.kernel.rope_(qkv, cos, sin, positions, heads, head_dim)
            return
        if rows is None:
            rows = (cos[positions][:, None, :].to(qkv.dtype), sin[positions][:, None, :].to(qkv.dtype))
        x = qkv[:, :heads * head_dim].view(qkv.shape[0], heads, head_dim)
        x.copy_(rope_ref(x, *rows))

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.usable(gate_up):
            out: torch.Tensor = self.kernel.silu_mul(gate_up)
            return out
        return silu_mul_ref(gate_up)


REFERENCE = FusedOps(None)
