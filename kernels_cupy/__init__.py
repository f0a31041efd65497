"""Attention kernels: the backend interface, the torch reference (CPU path and test oracle) and, on CUDA,
CuPy RawKernels. Importing this package never imports CuPy; the CUDA backend is loaded on demand."""

from kernels_cupy.interface import AttentionBackend, AttentionMetadata
from kernels_cupy.torch_ref import TorchAttentionBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend"]
