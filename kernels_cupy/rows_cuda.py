"""Batch-invariant row-wise ops on CUDA (``csrc/rows.cu``): RMSNorm with the residual add, one CTA a row in a
fixed sum order, where torch's reduction would change a row's sum order with the number of rows.

:func:`cuda_rows_or_none` is the way in: None (logged) where CuPy cannot be had, and the caller keeps torch's
reference ops, which are correct but not batch-invariant.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from kernels_cupy import nvrtc

log = logging.getLogger(__name__)

FILE = "rows.cu"
THREADS = 128  # KVG_THREADS in csrc/common.cuh
_TYPE = {torch.float32: "float", torch.float16: "half_t", torch.bfloat16: "bf16_t"}
EXPRESSIONS = tuple(f"rms_norm_rows<{t}>" for t in _TYPE.values())


def rms_norm_args(out: torch.Tensor, x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor,
                  eps: float) -> tuple[tuple[int, int, int], tuple[object, ...]]:
    """(grid, arguments) of one rms_norm_rows launch: a CTA per row. ``delta`` None passes a null pointer."""
    null = np.uint64(0)
    return (x.shape[0], 1, 1), (out, x, null if delta is None else delta, w, np.int32(x.shape[1]),
                                np.float32(eps))


class CudaRowOps:
    """RMSNorm for the model's CUDA tensors; :meth:`covers` says which (dtype, layout) it takes."""

    @staticmethod
    def covers(x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor) -> bool:
        tensors = (x, w) if delta is None else (x, w, delta)
        return (x.is_cuda and x.dim() == 2 and x.dtype in _TYPE and all(t.dtype == x.dtype for t in tensors)
                and all(t.is_contiguous() for t in tensors) and (delta is None or delta.shape == x.shape))

    def rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
        """x (T, H), updated in place by ``delta`` (T, H) when given; returns the normalised (T, H)."""
        out = torch.empty_like(x)
        if x.shape[0] == 0:
            return out
        fn = nvrtc.function(x.device, FILE, EXPRESSIONS, f"rms_norm_rows<{_TYPE[x.dtype]}>")
        grid, args = rms_norm_args(out, x, delta, w, eps)
        nvrtc.launch(fn, x.device, grid, THREADS, args)
        return out


def cuda_rows_or_none(device: torch.device) -> CudaRowOps | None:
    """The CUDA row ops where CuPy and a GPU are there, else None (logged once per call)."""
    from kernels_cupy.cupy_backend import cupy_unavailable_reason

    reason = cupy_unavailable_reason(device)
    if reason is not None:
        log.warning("CUDA row kernels unavailable (%s): RMSNorm runs torch's reduction, which is not "
                    "batch-invariant", reason)
        return None
    return CudaRowOps()
