"""The CUDA attention backend: the kernels in ``csrc/`` compiled by NVRTC through CuPy and launched on
torch's current CUDA stream, straight on torch's memory.

Importing this module needs neither CuPy nor a GPU; constructing :class:`CupyAttentionBackend` needs both.
:func:`cuda_backend_or_reference` is the safe way in: it falls back to the torch reference, saying why.

Tensors reach the kernels as raw device pointers (``tensor.data_ptr()``, the same address that
``__cuda_array_interface__`` / DLPack would hand CuPy): no copy and no per-call wrapper object. A decode step
launches 1-2 kernels per layer, so ``cupy.from_dlpack``'s few microseconds per tensor would be a visible share
of the step, and CuPy has no bfloat16 dtype anyway. Lifetimes are safe because every launch is ordered on
torch's current stream, the stream torch's caching allocator tracks the tensors on.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import numpy as np
import torch

from kernels_cupy.interface import AttentionBackend, AttentionMetadata, DecodeRows
from kernels_cupy.kernels import (
    DEFAULT_PARTITION_SIZE,
    KERNEL_FILES,
    SPLIT_MODES,
    Buf,
    KernelConfig,
    Launch,
    TILE,
    Scalar,
    heads_per_cta,
    load_source,
    plan_forward,
    plan_write_kv,
    unsupported_reason,
)
from kernels_cupy.torch_ref import TorchAttentionBackend

log = logging.getLogger(__name__)

TORCH_DTYPE_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
TORCH_DTYPES = {name: dt for dt, name in TORCH_DTYPE_NAME.items()}
NVRTC_OPTIONS = ("-std=c++17",)
_NP_INT: dict[str, type[np.signedinteger[Any]]] = {"i32": np.int32, "i64": np.int64}


def import_cupy() -> Any:
    """CuPy, or a RuntimeError that says how to get it."""
    try:
        return importlib.import_module("cupy")
    except ImportError as e:
        raise RuntimeError("the CUDA attention backend needs CuPy: pip install 'kvgate[cuda]' "
                           "(cupy-cuda12x)") from e


def cupy_unavailable_reason(device: torch.device) -> str | None:
    """Why the CuPy backend cannot run on ``device``, or None if it can."""
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        import_cupy()
    except RuntimeError as e:
        return str(e)
    return None


def cuda_backend_or_reference(device: torch.device | str) -> AttentionBackend:
    """The CuPy backend where it can run, else the torch reference, logging why on CUDA devices."""
    device = torch.device(device)
    reason = cupy_unavailable_reason(device)
    if reason is None:
        return CupyAttentionBackend()
    if device.type == "cuda":
        log.warning("CUDA attention kernels unavailable (%s); using the torch reference backend", reason)
    return TorchAttentionBackend()


def _pointer(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())  # 8 bytes by value: what a T* kernel parameter expects


def _scalar(a: Scalar) -> np.generic:
    return np.float32(a.value) if a.kind == "f32" else _NP_INT[a.kind](int(a.value))


def _pack(launch: Launch, buffers: dict[str, torch.Tensor]) -> tuple[np.generic, ...]:
    """Kernel arguments with exactly the C types of the signature (CuPy passes raw bytes)."""
    return tuple(_pointer(buffers[a.name]) if isinstance(a, Buf) else _scalar(a) for a in launch.args)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """The kernels take (token, head) strides but need unit stride along head_dim."""
    return t if t.stride(-1) == 1 else t.contiguous()


class CupyAttentionBackend:
    """:class:`kernels_cupy.interface.AttentionBackend` on CUDA with the RawKernels of ``csrc/``.

    Layouts the kernels do not cover (head_dim outside 32/64/128/256, other dtypes) go to the torch reference,
    logged once per layout.

    ``split``: ``invariant`` (the default, what the engine runs) treats every query row as a decode row
    (:func:`kernels_cupy.interface.as_decode_rows`, once a step) and always splits its context at the fixed
    ``partition_size``: a row's result then depends on its own context alone, not on its batch, its chunk, a
    prefix-cache hit or whether a CUDA graph runs it (the determinism rule). ``auto`` / ``always`` / ``never``
    run prefill chunks through the prefill kernel and choose split-K per step (auto: by the grid's size), which
    is faster for long prompts but lets a row's last bits depend on its step; tests and benchmarks use them.
    """

    name = "cupy"

    def __init__(self, split: str = "invariant", partition_size: int = DEFAULT_PARTITION_SIZE) -> None:
        if split not in SPLIT_MODES:
            raise ValueError(f"split must be one of {SPLIT_MODES}, got {split!r}")
        if partition_size < TILE or partition_size % TILE:
            raise ValueError(f"partition_size must be a positive multiple of {TILE}, got {partition_size}")
        self._cp = import_cupy()
        self.split, self.partition_size = split, partition_size
        self._modules: dict[tuple[int, str, tuple[str, ...]], Any] = {}  # (device, file, expressions) -> module
        self._sm_count: dict[int, int] = {}
        self._reference = TorchAttentionBackend()
        self._fallback_logged: set[tuple[str, int, int]] = set()
        self._rows = DecodeRows()  # mode "invariant": the step's rows as decode rows, built once a step

    # ------------------------------------------------------------------ compilation and launching

    def _function(self, device: int, cfg: KernelConfig, role: str, filename: str) -> Any:
        """The kernel, compiling its file's instantiations for ``cfg`` on first use (NVRTC, cached)."""
        exprs = cfg.file_expressions(filename)
        key = (device, filename, exprs)
        module = self._modules.get(key)
        if module is None:
            module = self._cp.RawModule(code=load_source(filename), options=NVRTC_OPTIONS, name_expressions=exprs)
            self._modules[key] = module
        return module.get_function(cfg.name_expression(role))

    def _launch(self, device: torch.device, cfg: KernelConfig, launches: tuple[Launch, ...],
                buffers: dict[str, torch.Tensor]) -> None:
        """Run the launches in order on torch's current stream of ``device``."""
        cp = self._cp
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = cp.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream, index)
        with cp.cuda.Device(index), stream:
            for launch in launches:
                fn = self._function(index, cfg, launch.role, KERNEL_FILES[launch.role])
                fn(launch.grid, (launch.block, 1, 1), _pack(launch, buffers))

    def _sms(self, device: torch.device) -> int:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._sm_count:
            self._sm_count[index] = torch.cuda.get_device_properties(index).multi_processor_count
        return self._sm_count[index]

    def _config(self, cache: torch.Tensor, num_q_heads: int, query_dtype: torch.dtype) -> KernelConfig | None:
        """The kernel specialisation for this cache and query dtype, or None (logged once) where the
        reference must run."""
        _, bs, hkv, d = cache.shape
        dtype = TORCH_DTYPE_NAME.get(cache.dtype, str(cache.dtype))
        reason = unsupported_reason(dtype, d, bs)
        if reason is None:
            # A query dtype the kernels lack is cast to the cache's (a copy, but a rare case).
            qdtype = TORCH_DTYPE_NAME.get(query_dtype, dtype)
            return KernelConfig(dtype, d, bs, heads_per_cta(num_q_heads, hkv, d), qdtype)
        if (dtype, d, bs) not in self._fallback_logged:
            self._fallback_logged.add((dtype, d, bs))
            log.warning("CUDA attention kernels do not cover this layout (%s); using the torch reference", reason)
        return None

    @staticmethod
    def _check(k_cache: torch.Tensor, v_cache: torch.Tensor, *tensors: torch.Tensor) -> None:
        for cache in (k_cache, v_cache):
            if not cache.is_cuda or not cache.is_contiguous() or cache.dim() != 4:
                raise ValueError("the CUDA backend needs contiguous CUDA caches of shape (NB, BS, Hkv, D)")
        if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
            raise ValueError(f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache "
                             f"{tuple(v_cache.shape)} {v_cache.dtype} differ")
        for t in (v_cache, *tensors):
            if t.device != k_cache.device:
                raise ValueError(f"tensor on {t.device}, caches on {k_cache.device}")

    # ------------------------------------------------------------------------------------ protocol

    def write_kv(
        self,
        key: torch.Tensor,  # (T, Hkv, D)
        value: torch.Tensor,  # (T, Hkv, D)
        k_cache: torch.Tensor,  # (NB, BS, Hkv, D)
        v_cache: torch.Tensor,  # (NB, BS, Hkv, D)
        meta: AttentionMetadata,
    ) -> None:
        self._check(k_cache, v_cache, key, value, meta.slot_mapping)
        cfg = self._config(k_cache, k_cache.shape[2], key.dtype)
        if cfg is None:
            self._reference.write_kv(key, value, k_cache, v_cache, meta)
            return
        if key.shape[0] == 0:
            return
        io_dtype = TORCH_DTYPES[cfg.query_dtype]  # the kernel converts to the cache's dtype as it stores
        key = _unit_last(key.to(io_dtype))  # (T, Hkv, D)
        value = _unit_last(value.to(io_dtype))  # (T, Hkv, D)
        slots = meta.slot_mapping.to(torch.int64).contiguous()  # (T,)
        launch = plan_write_kv(key.shape[0], key.shape[1], key.shape[2], (key.stride(0), key.stride(1)),
                               (value.stride(0), value.stride(1)))
        self._launch(k_cache.device, cfg, (launch,), {"key": key, "value": value, "k_cache": k_cache,
                                                   "v_cache": v_cache, "slot_mapping": slots})

    def forward(
        self,
        query: torch.Tensor,  # (T, Hq, D)
        key: torch.Tensor,  # (T, Hkv, D) unused: the kernels read this step's K/V back from the cache
        value: torch.Tensor,  # (T, Hkv, D)
        k_cache: torch.Tensor,  # (NB, BS, Hkv, D), already holding this step's K
        v_cache: torch.Tensor,  # (NB, BS, Hkv, D)
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # (T, Hq, D)
        self._check(k_cache, v_cache, query, meta.block_tables, meta.seq_lens, meta.query_start_loc)
        t, hq, d = query.shape
        cfg = self._config(k_cache, hq, query.dtype)
        if cfg is None:
            return self._reference.forward(query, key, value, k_cache, v_cache, meta, scale)
        if t == 0:
            return torch.empty_like(query)
        split = self.split
        if split == "invariant":
            meta, split = self._rows.of(meta, k_cache.shape[1]), "always"
        q = _unit_last(query.to(TORCH_DTYPES[cfg.query_dtype]))  # (T, Hq, D)
        out = torch.empty((t, hq, d), dtype=q.dtype, device=query.device)  # (T, Hq, D) contiguous
        tables = meta.block_tables.to(torch.int32).contiguous()  # (B, max_blocks)
        plan = plan_forward(hq, k_cache.shape[2], d, (q.stride(0), q.stride(1)), tables.shape[1],
                            meta.query_lens_cpu, meta.seq_lens_cpu, meta.num_decodes, scale,
                            self._sms(query.device), self.partition_size, split)
        buffers = {"out": out, "query": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables,
                   "seq_lens": meta.seq_lens.to(torch.int32).contiguous(),
                   "query_start_loc": meta.query_start_loc.to(torch.int32).contiguous()}
        for name, shape in plan.temps.items():  # split-K scratch, on torch's allocator and stream
            buffers[name] = torch.empty(shape, dtype=torch.float32, device=query.device)
        self._launch(query.device, cfg, plan.launches, buffers)
        return out if out.dtype == query.dtype else out.to(query.dtype)
