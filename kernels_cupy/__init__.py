"""Attention kernels: the backend interface, the torch reference (CPU path and test oracle) and, on CUDA,
CuPy RawKernels. Importing this package never imports CuPy; the CUDA backend is loaded on demand."""

import torch

from kernels_cupy.interface import AttentionBackend, AttentionMetadata
from kernels_cupy.torch_ref import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend", "cuda_backend_or_reference"]


def cuda_backend_or_reference(device: torch.device | str) -> AttentionBackend:
    """The CuPy CUDA backend where CUDA and CuPy are present, else the torch reference (logged on CUDA)."""
    from kernels_cupy.cupy_backend import cuda_backend_or_reference as select  # CuPy itself stays lazy

    return select(device)
