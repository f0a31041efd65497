"""Compiling and launching a ``csrc/`` kernel on torch's current CUDA stream, for the kernels outside the
attention backend (row-wise ops, LoRA): NVRTC through CuPy, one module per (device, file, instantiations).

Importing this module needs neither CuPy nor a GPU; the first :func:`function` call imports CuPy. Tensors
reach a kernel as raw device pointers (``data_ptr``), the way :mod:`kernels_cupy.cupy_backend` passes them,
and every launch is ordered on torch's current stream of the tensors' device, the stream torch's caching
allocator tracks them on.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kernels_cupy.kernels import load_source

NVRTC_OPTIONS = ("-std=c++17",)
_modules: dict[tuple[int, str, tuple[str, ...]], Any] = {}
_lock = threading.Lock()  # a worker compiles from its step thread, tests from several


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def function(device: torch.device, filename: str, expressions: tuple[str, ...], expression: str) -> Any:
    """The kernel ``expression`` (one of ``expressions``, the file's instantiations compiled together) of
    ``csrc/filename``, compiled by NVRTC for ``device`` on first use."""
    from kernels_cupy.cupy_backend import import_cupy  # CuPy itself stays lazy

    cp = import_cupy()
    key = (device_index(device), filename, expressions)
    with _lock:
        module = _modules.get(key)
        if module is None:
            with cp.cuda.Device(key[0]):
                module = cp.RawModule(code=load_source(filename), options=NVRTC_OPTIONS,
                                      name_expressions=expressions)
            _modules[key] = module
    return module.get_function(expression)


def pointer(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())  # 8 bytes by value: what a T* kernel parameter expects


def launch(fn: Any, device: torch.device, grid: tuple[int, int, int], block: int, args: Sequence[Any]) -> None:
    """Launch ``fn`` on torch's current stream of ``device``. ``args``: tensors become pointers; every other
    argument must already be a NumPy scalar of the parameter's exact C type (CuPy passes raw bytes)."""
    from kernels_cupy.cupy_backend import import_cupy

    cp = import_cupy()
    index = device_index(device)
    packed = tuple(pointer(a) if isinstance(a, torch.Tensor) else a for a in args)
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream, index)
    with cp.cuda.Device(index), stream:
        fn(grid, (block, 1, 1), packed)
