"""What the CUDA kernels are and how they are launched, in plain Python (no CuPy, no GPU).

The CuPy backend, the NumPy emulation and the compile tests all read this module, so the kernel names,
template arguments, argument types and launch geometry live in exactly one place and the emulation walks
the same grid the GPU would.

Shapes (one engine step), as in :mod:`kernels_cupy.interface`:
  T tokens, B sequences (decodes first), Hq query heads, Hkv KV heads, D head_dim, NB blocks, BS block size.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

CSRC_DIR = Path(__file__).resolve().parent / "csrc"

# Launch geometry; must match the #defines in csrc/common.cuh (a test checks).
WARP = 32
NUM_WARPS = 4
THREADS = WARP * NUM_WARPS
THREAD_GROUP = 2  # lanes per key token in the q.k dot product
TILE = WARP // THREAD_GROUP  # key tokens one warp scores per step
MAX_HEADS_PER_CTA = 8
RESHAPE_MAX_THREADS = 512

DEFAULT_PARTITION_SIZE = 512  # split-K partition, tokens; a multiple of TILE
# Split-K only pays when the unsplit grid cannot keep every SM streaming: ~4 CTAs of 128 threads per SM keep
# enough 16-token tiles in flight to cover HBM latency on A100/H100.
SPLIT_CTAS_PER_SM = 4

# How a backend splits attention: "invariant" runs every query row as a decode row with split-K always on at a
# fixed partition size (batch-invariant, the engine's default); the others choose per step (cupy_backend.py).
SPLIT_MODES = ("invariant", "auto", "always", "never")

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)
CUDA_TYPE = {"float32": "float", "float16": "half_t", "bfloat16": "bf16_t"}

# Kernel function and file of each role.
KERNEL_FUNCTIONS = {
    "reshape_and_cache": "reshape_and_cache",
    "decode": "paged_decode",
    "decode_split": "paged_decode_split",
    "decode_reduce": "paged_decode_reduce",
    "prefill": "paged_prefill",
}
KERNEL_FILES = {
    "reshape_and_cache": "reshape_and_cache.cu",
    "decode": "paged_decode.cu",
    "decode_split": "paged_decode.cu",
    "decode_reduce": "paged_decode.cu",
    "prefill": "paged_prefill.cu",
}
SOURCE_FILES = ("reshape_and_cache.cu", "paged_decode.cu", "paged_prefill.cu")

# Argument types of each __global__ kernel, in order. "ptr" is any device pointer (passed as 8 bytes), "i32"
# int, "i64" long long (i64 in the .cu), "f32" float. CuPy passes raw bytes, so a Python int where the kernel
# wants an int would shift every later argument: the backend casts through this table and a test checks it
# against the .cu signatures.
SIGNATURES: dict[str, tuple[str, ...]] = {
    "reshape_and_cache": ("ptr",) * 5 + ("i32", "i32", "i64", "i64", "i64", "i64"),
    "paged_decode": ("ptr",) * 6 + ("i32", "i32", "i64", "i64", "f32"),
    "paged_decode_split": ("ptr",) * 8 + ("i32", "i32", "i64", "i64", "f32", "i32"),
    "paged_decode_reduce": ("ptr",) * 5 + ("i32", "i32"),
    "paged_prefill": ("ptr",) * 7 + ("i32", "i32", "i32", "i64", "i64", "f32"),
}

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class KernelConfig:
    """One compiled specialisation: the template arguments of every attention kernel."""

    dtype: str  # KV cache: "float32" | "float16" | "bfloat16"
    head_dim: int  # D
    block_size: int  # BS
    heads_per_cta: int  # QH
    query_dtype: str = ""  # query, output and new K/V (the model's dtype); "" = same as the cache

    def __post_init__(self) -> None:
        if not self.query_dtype:
            object.__setattr__(self, "query_dtype", self.dtype)
        reason = unsupported_reason(self.dtype, self.head_dim, self.block_size)
        if reason:
            raise ValueError(reason)
        if self.query_dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"query dtype {self.query_dtype} not in {SUPPORTED_DTYPES}")
        if not 1 <= self.heads_per_cta <= max_heads_per_cta(self.head_dim):
            raise ValueError(f"heads_per_cta must be in [1, {max_heads_per_cta(self.head_dim)}], "
                             f"got {self.heads_per_cta}")

    def name_expression(self, role: str) -> str:
        """The template instantiation NVRTC is asked for (and CuPy looks the kernel up by)."""
        tq, t = CUDA_TYPE[self.query_dtype], CUDA_TYPE[self.dtype]
        d, bs, qh = self.head_dim, self.block_size, self.heads_per_cta
        names = {
            "reshape_and_cache": f"reshape_and_cache<{tq}, {t}>",
            "decode": f"paged_decode<{tq}, {t}, {d}, {bs}, {qh}>",
            "decode_split": f"paged_decode_split<{tq}, {t}, {d}, {bs}, {qh}>",
            "decode_reduce": f"paged_decode_reduce<{tq}, {d}>",
            "prefill": f"paged_prefill<{tq}, {t}, {d}, {bs}, {qh}>",
        }
        if role not in names:
            raise ValueError(f"unknown kernel role {role!r}")
        return names[role]

    def file_expressions(self, filename: str) -> tuple[str, ...]:
        """Every instantiation of this config that lives in one source file (one NVRTC module)."""
        return tuple(self.name_expression(r) for r, f in KERNEL_FILES.items() if f == filename)


def unsupported_reason(dtype: str, head_dim: int, block_size: int) -> str | None:
    """Why the CUDA kernels cannot serve this cache layout, or None if they can."""
    if dtype not in SUPPORTED_DTYPES:
        return f"dtype {dtype} not in {SUPPORTED_DTYPES}"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {head_dim} not in {SUPPORTED_HEAD_DIMS}"
    if not 1 <= block_size <= 256 or block_size & (block_size - 1):
        return f"block_size {block_size} is not a power of two in [1, 256]"
    return None


def max_heads_per_cta(head_dim: int) -> int:
    # Each lane keeps QH * D / 32 fp32 accumulators; beyond 16 of them ptxas starts spilling (measured with
    # --resource-usage on sm_80/sm_90).
    return max(1, min(MAX_HEADS_PER_CTA, 512 // head_dim))


def heads_per_cta(num_q_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Largest divisor of the GQA ratio that fits one CTA: all its heads then share one KV head."""
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    group = num_q_heads // num_kv_heads
    return max(q for q in range(1, max_heads_per_cta(head_dim) + 1) if group % q == 0)


# ---------------------------------------------------------------------------------------------- sources

_INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.MULTILINE)


def load_source(filename: str) -> str:
    """The .cu text with its local includes inlined (each once).

    NVRTC could take -I instead, but CuPy's on-disk kernel cache keys on the source text only: inlining makes
    an edit to a header invalidate the cache as it should.
    """
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = (CSRC_DIR / name).read_text()
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text).replace("#pragma once\n", "")

    return expand(filename)


def instantiation_unit(filename: str, expressions: tuple[str, ...]) -> str:
    """A translation unit that forces the given instantiations, as NVRTC name expressions do: for nvcc."""
    refs = ",\n".join(f"    (void*)&{e}" for e in expressions)
    return f"{load_source(filename)}\n\nvoid* kvgate_instances[] = {{\n{refs}\n}};\n"


# ----------------------------------------------------------------------------------------------- launches

Dim3 = tuple[int, int, int]


@dataclass(frozen=True)
class DecodePlan:
    """How the decode rows of one step are launched."""

    grid: Dim3  # (Hq / QH, num_decodes, num_partitions)
    split: bool  # split-K kernel + reduce (possibly with one partition when forced)
    num_partitions: int  # grid.z: partitions of the longest context; 1 when not split
    partition_size: int  # tokens per partition when split


def plan_decode(
    num_decodes: int,
    num_q_heads: int,
    qh: int,
    max_seq_len: int,  # longest context among the decodes
    sm_count: int,
    partition_size: int = DEFAULT_PARTITION_SIZE,
    mode: str = "auto",  # "auto" | "always" | "never"
) -> DecodePlan:
    """Split the context (split-K) when the unsplit grid is too small to fill the GPU and the context long."""
    if partition_size < TILE or partition_size % TILE:
        raise ValueError(f"partition_size must be a positive multiple of {TILE}, got {partition_size}")
    if mode not in ("auto", "always", "never"):
        raise ValueError(f"split mode must be auto, always or never, got {mode!r}")
    ctas = (num_q_heads // qh) * num_decodes
    parts = max(1, math.ceil(max_seq_len / partition_size))
    if mode == "auto":
        split = parts > 1 and ctas < SPLIT_CTAS_PER_SM * sm_count
    else:
        split = mode == "always"
    n = parts if split else 1
    return DecodePlan((num_q_heads // qh, num_decodes, n), split, n, partition_size)


def reduce_grid(num_decodes: int, num_q_heads: int) -> Dim3:
    return (num_q_heads, num_decodes, 1)


def prefill_grid(num_prefills: int, num_q_heads: int, qh: int, max_query_len: int) -> Dim3:
    return (num_q_heads // qh, num_prefills, math.ceil(max_query_len / NUM_WARPS))


def reshape_threads(num_kv_heads: int, head_dim: int) -> int:
    """Threads per token of reshape_and_cache: the row, rounded up to whole warps, at most 512."""
    return min(RESHAPE_MAX_THREADS, math.ceil(num_kv_heads * head_dim / WARP) * WARP)


# ------------------------------------------------------------------------------- launch plans (symbolic)
#
# A plan names buffers instead of holding them, so the CuPy backend (binding torch CUDA tensors) and the
# NumPy emulation (binding host arrays) execute the very same launches with the very same argument order.


@dataclass(frozen=True)
class Buf:
    """A device buffer argument, by role name: out, query, key, value, k_cache, v_cache, slot_mapping,
    block_tables, seq_lens, query_start_loc, tmp_out, max_logits, exp_sums."""

    name: str


@dataclass(frozen=True)
class Scalar:
    kind: str  # "i32" | "i64" | "f32"
    value: int | float


Arg = Buf | Scalar


@dataclass(frozen=True)
class Launch:
    role: str  # key of KERNEL_FUNCTIONS
    grid: Dim3
    block: int  # threads per CTA (1-D)
    args: tuple[Arg, ...]

    def __post_init__(self) -> None:
        kinds = tuple("ptr" if isinstance(a, Buf) else a.kind for a in self.args)
        if kinds != SIGNATURES[self.function]:
            raise ValueError(f"{self.function} takes {SIGNATURES[self.function]}, plan passes {kinds}")
        if min(self.grid) < 1 or self.grid[1] > 65535 or self.grid[2] > 65535:
            raise ValueError(f"{self.function}: grid {self.grid} out of CUDA limits")

    @property
    def function(self) -> str:
        return KERNEL_FUNCTIONS[self.role]


@dataclass(frozen=True)
class ForwardPlan:
    launches: tuple[Launch, ...]
    temps: dict[str, tuple[int, ...]]  # float32 scratch buffers to allocate, by name and shape
    decode: DecodePlan | None


def plan_write_kv(
    num_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    key_strides: tuple[int, int],  # (token, head) strides of key, in elements; the last dim is unit-stride
    value_strides: tuple[int, int],
) -> Launch:
    return Launch(
        "reshape_and_cache", (num_tokens, 1, 1), reshape_threads(num_kv_heads, head_dim),
        (Buf("key"), Buf("value"), Buf("k_cache"), Buf("v_cache"), Buf("slot_mapping"),
         Scalar("i32", num_kv_heads), Scalar("i32", head_dim),
         Scalar("i64", key_strides[0]), Scalar("i64", key_strides[1]),
         Scalar("i64", value_strides[0]), Scalar("i64", value_strides[1])))


def plan_forward(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    query_strides: tuple[int, int],  # (token, head) strides of query, in elements
    max_blocks: int,  # columns of block_tables
    query_lens: tuple[int, ...],  # (B,) host
    seq_lens: tuple[int, ...],  # (B,) host
    num_decodes: int,
    scale: float,
    sm_count: int,
    partition_size: int = DEFAULT_PARTITION_SIZE,
    split_mode: str = "auto",
) -> ForwardPlan:
    """Launches for one attention forward: decode rows (maybe split-K + reduce), then prefill chunks."""
    qh = heads_per_cta(num_q_heads, num_kv_heads, head_dim)
    scale_log2 = Scalar("f32", scale * LOG2E)
    common = (Scalar("i32", max_blocks), Scalar("i32", num_kv_heads),
              Scalar("i64", query_strides[0]), Scalar("i64", query_strides[1]), scale_log2)
    caches = (Buf("k_cache"), Buf("v_cache"), Buf("block_tables"), Buf("seq_lens"))
    launches: list[Launch] = []
    temps: dict[str, tuple[int, ...]] = {}
    decode: DecodePlan | None = None
    if num_decodes:
        decode = plan_decode(num_decodes, num_q_heads, qh, max(seq_lens[:num_decodes]), sm_count,
                             partition_size, split_mode)
        if decode.split:
            p = decode.num_partitions
            temps = {"tmp_out": (num_decodes, num_q_heads, p, head_dim),
                     "max_logits": (num_decodes, num_q_heads, p), "exp_sums": (num_decodes, num_q_heads, p)}
            launches.append(Launch("decode_split", decode.grid, THREADS,
                                   (Buf("tmp_out"), Buf("max_logits"), Buf("exp_sums"), Buf("query"), *caches,
                                    *common, Scalar("i32", partition_size))))
            launches.append(Launch("decode_reduce", reduce_grid(num_decodes, num_q_heads), THREADS,
                                   (Buf("out"), Buf("tmp_out"), Buf("max_logits"), Buf("exp_sums"), Buf("seq_lens"),
                                    Scalar("i32", p), Scalar("i32", partition_size))))
        else:
            launches.append(Launch("decode", decode.grid, THREADS, (Buf("out"), Buf("query"), *caches, *common)))
    num_prefills = len(seq_lens) - num_decodes
    if num_prefills:
        grid = prefill_grid(num_prefills, num_q_heads, qh, max(query_lens[num_decodes:]))
        launches.append(Launch("prefill", grid, THREADS,
                               (Buf("out"), Buf("query"), *caches, Buf("query_start_loc"),
                                Scalar("i32", num_decodes), *common)))
    return ForwardPlan(tuple(launches), temps, decode)
