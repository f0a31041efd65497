"""A NumPy emulation of the CUDA kernels in ``csrc/``, thread mapping and all.

Each ``emulate_*`` function takes the kernel's arguments in the kernel's order (flat 1-D buffers for the
pointers, element strides as ints) plus the launch grid, and walks blockIdx -> warp -> tile exactly as the
CUDA code does: lanes are the last axis of the arrays (32 wide), ``__shfl_xor_sync`` is an index permutation
over that axis, the loads use the kernel's index arithmetic on the flat buffers, and the online-softmax
recurrences are the kernel's, in float32. Stores into 16-bit buffers are rounded to nearest even, as
``from_float<T>`` does. :class:`EmulatedAttentionBackend` runs the launch plans of
:mod:`kernels_cupy.kernels` -- the same plans the CuPy backend launches -- on CPU torch tensors, so the tests
check the index mapping, the argument order and the split-K decision against the torch reference without a GPU.
Slow by design (Python loops over CTAs and tiles): keep shapes small.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kernels_cupy.interface import AttentionMetadata, DecodeRows
from kernels_cupy.kernels import (
    NUM_WARPS,
    THREAD_GROUP,
    THREADS,
    TILE,
    WARP,
    Buf,
    ForwardPlan,
    KernelConfig,
    Launch,
    heads_per_cta,
    plan_forward,
    plan_write_kv,
)

F32 = np.float32
NEG_INF = F32(-np.inf)
NONE = np.empty(0, F32)  # stands for the nullptr arguments of the kernel wrappers
LANE = np.arange(WARP)  # (32,) lane id
GROUP = LANE // THREAD_GROUP  # (32,) token of the tile a lane scores
SUB = LANE % THREAD_GROUP  # (32,) lane's slot inside its thread group
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
TORCH_DTYPE = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """from_float<T> followed by to_float: the float32 value a store of type T keeps."""
    x = np.asarray(x, dtype=F32)
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(np.float16).astype(F32)
    if dtype == "bfloat16":  # round to nearest even on the upper 16 bits (NaN never reaches here)
        bits = x.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return rounded.astype(np.uint32).view(F32)
    raise ValueError(f"unknown dtype {dtype!r}")


def shfl_xor(x: np.ndarray, off: int) -> np.ndarray:
    """__shfl_xor_sync over the lane axis (last)."""
    return x[..., LANE ^ off]


# -------------------------------------------------------------------------------- attend.cuh


@dataclass
class WarpState:
    m: np.ndarray  # (QH, 32) running max, equal across lanes
    l: np.ndarray  # (QH, 32) running sum over this lane's group's tokens
    acc: np.ndarray  # (QH, 32, DPL) running p.v for dims lane * DPL + e

    @classmethod
    def init(cls, qh: int, head_dim: int) -> WarpState:
        return cls(np.full((qh, WARP), NEG_INF, F32), np.zeros((qh, WARP), F32),
                   np.zeros((qh, WARP, head_dim // WARP), F32))


def token_offset(bs: int, table: np.ndarray, tile_block: int, pos: np.ndarray, blk_stride: int,
                 tok_stride: int) -> np.ndarray:
    """attend.cuh token_offset: with BS >= TILE the whole tile lives in block `tile_block`."""
    block = np.full_like(pos, tile_block) if bs >= TILE else table[pos // bs]
    offset: np.ndarray = block.astype(np.int64) * blk_stride + (pos % bs) * tok_stride
    return offset


def attend_tiles(
    cfg: KernelConfig,
    k_cache: np.ndarray,  # flat (NB * BS * Hkv * D,)
    v_cache: np.ndarray,  # flat (NB * BS * Hkv * D,)
    table: np.ndarray,  # (max_blocks,) int, this sequence's block-table row
    kv_head: int,
    num_kv_heads: int,
    q_s: np.ndarray,  # (QH, D) float32 shared memory
    tile_begin: int,
    tile_end: int,
    tile_step: int,
    limit: int,
    st: WarpState,
) -> None:
    d, bs = cfg.head_dim, cfg.block_size
    vec = 16 // ITEMSIZE[cfg.dtype]
    nkv, dpl = d // (THREAD_GROUP * vec), d // WARP
    tok_stride = num_kv_heads * d
    blk_stride = bs * tok_stride
    head_off = kv_head * d
    # (32, NKV * VEC): element (j * TG + sub) * VEC + e of the K row, per lane
    kdims = ((np.arange(nkv)[None, :, None] * THREAD_GROUP + SUB[:, None, None]) * vec
             + np.arange(vec)[None, None, :]).reshape(WARP, nkv * vec)
    vdims = LANE[:, None] * dpl + np.arange(dpl)[None, :]  # (32, DPL)
    for tile in range(tile_begin, tile_end, tile_step):
        # q.k
        pos = tile * TILE + GROUP  # (32,)
        valid = pos < limit
        kpos = np.where(valid, pos, limit - 1)
        tile_block = int(table[(tile * TILE) // bs]) if bs >= TILE else 0
        krow = token_offset(bs, table, tile_block, kpos, blk_stride, tok_stride) + head_off  # (32,)
        kv = k_cache[krow[:, None] + kdims]  # (32, NKV * VEC)
        dot = (q_s[:, kdims] * kv[None]).sum(-1, dtype=F32)  # (QH, 32) per-lane partial dot
        off = THREAD_GROUP // 2
        while off > 0:
            dot = dot + shfl_xor(dot, off)
            off //= 2
        s = np.where(valid[None, :], dot, NEG_INF)
        # online softmax
        mt = s
        off = THREAD_GROUP
        while off < WARP:
            mt = np.maximum(mt, shfl_xor(mt, off))
            off *= 2
        m_new = np.maximum(st.m, mt)
        with np.errstate(invalid="raise"):  # -inf - -inf would mean a tile with no visible token
            alpha = np.exp2(st.m - m_new)
            p = np.exp2(s - m_new)  # (QH, 32)
        st.l = st.l * alpha + p
        st.acc = st.acc * alpha[:, :, None]
        st.m = m_new
        # p.v
        for t in range(TILE):
            vpos = min(tile * TILE + t, limit - 1)
            vrow = int(token_offset(bs, table, tile_block, np.array(vpos), blk_stride, tok_stride)) + head_off
            vv = v_cache[vrow + vdims]  # (32, DPL)
            pt = p[:, t * THREAD_GROUP]  # (QH,) __shfl_sync from lane t * TG
            st.acc = st.acc + pt[:, None, None] * vv[None, :, :]


def finish_warp(st: WarpState) -> None:
    l = np.where(SUB[None, :] == 0, st.l, F32(0))
    off = WARP // 2
    while off > 0:
        l = l + shfl_xor(l, off)
        off //= 2
    st.l = l


def store_q(
    cfg: KernelConfig, query: np.ndarray, row: int, head0: int, q_stride_t: int, q_stride_h: int,
    scale_log2: float,
) -> np.ndarray:  # (QH, D) float32: what the CTA (or warp) stages in shared memory
    i = np.arange(cfg.heads_per_cta * cfg.head_dim)  # union of the threads' strided loop indices
    h, d = i // cfg.head_dim, i % cfg.head_dim
    q: np.ndarray = (query[row * q_stride_t + (head0 + h) * q_stride_h + d] * F32(scale_log2)).astype(F32)
    return q.reshape(cfg.heads_per_cta, cfg.head_dim)


# ------------------------------------------------------------------------------ paged_decode.cu


def _decode_cta(
    cfg: KernelConfig, grid: tuple[int, int, int], bx: int, by: int, bz: int, split: bool,
    out: np.ndarray, tmp_out: np.ndarray, max_logits: np.ndarray, exp_sums: np.ndarray,  # unused ones empty
    query: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
    block_tables: np.ndarray, seq_lens: np.ndarray, max_blocks: int, num_kv_heads: int,
    q_stride_t: int, q_stride_h: int, scale_log2: float, partition_size: int,
) -> None:
    qh, d = cfg.heads_per_cta, cfg.head_dim
    num_heads = grid[0] * qh
    head0 = bx * qh
    kv_head = head0 // (num_heads // num_kv_heads)
    seq = by
    length = int(seq_lens[seq])
    start = bz * partition_size if split else 0
    if start >= length:
        return
    end = min(length, start + partition_size) if split else length
    q_s = store_q(cfg, query, seq, head0, q_stride_t, q_stride_h, scale_log2)
    table = block_tables[seq * max_blocks:(seq + 1) * max_blocks]
    m_s = np.empty((NUM_WARPS, qh), F32)
    l_s = np.empty((NUM_WARPS, qh), F32)
    o_s = np.empty((NUM_WARPS, qh, d), F32)
    for warp in range(NUM_WARPS):
        st = WarpState.init(qh, d)
        attend_tiles(cfg, k_cache, v_cache, table, kv_head, num_kv_heads, q_s,
                     start // TILE + warp, math.ceil(end / TILE), NUM_WARPS, end, st)
        finish_warp(st)
        m_s[warp], l_s[warp] = st.m[:, 0], st.l[:, 0]  # lane 0 publishes
        o_s[warp] = st.acc.reshape(qh, d)  # lane * DPL + e
    i = np.arange(qh * d)  # merge: thread i owns (i / D, i % D)
    h, dd = i // d, i % d
    m = m_s[:, h].max(0)
    c = np.exp2(m_s[:, h] - m[None, :])  # (NW, QH * D)
    l = (l_s[:, h] * c).sum(0, dtype=F32)
    o = (o_s[:, h, dd] * c).sum(0, dtype=F32)
    if split:
        idx = (seq * num_heads + head0 + h) * grid[2] + bz
        tmp_out[idx * d + dd] = o / l
        first = dd == 0
        max_logits[idx[first]] = m[first]
        exp_sums[idx[first]] = l[first]
    else:
        out[(seq * num_heads + head0 + h) * d + dd] = round_to(o / l, cfg.query_dtype)


def _grid(grid: tuple[int, int, int]) -> list[tuple[int, int, int]]:
    return [(x, y, z) for z in range(grid[2]) for y in range(grid[1]) for x in range(grid[0])]


def emulate_paged_decode(
    cfg: KernelConfig, grid: tuple[int, int, int], out: np.ndarray, query: np.ndarray, k_cache: np.ndarray,
    v_cache: np.ndarray, block_tables: np.ndarray, seq_lens: np.ndarray, max_blocks: int, num_kv_heads: int,
    q_stride_t: int, q_stride_h: int, scale_log2: float,
) -> None:
    for bx, by, bz in _grid(grid):
        _decode_cta(cfg, grid, bx, by, bz, False, out, NONE, NONE, NONE, query, k_cache, v_cache, block_tables,
                    seq_lens, max_blocks, num_kv_heads, q_stride_t, q_stride_h, scale_log2, 0)


def emulate_paged_decode_split(
    cfg: KernelConfig, grid: tuple[int, int, int], tmp_out: np.ndarray, max_logits: np.ndarray,
    exp_sums: np.ndarray, query: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
    seq_lens: np.ndarray, max_blocks: int, num_kv_heads: int, q_stride_t: int, q_stride_h: int,
    scale_log2: float, partition_size: int,
) -> None:
    for bx, by, bz in _grid(grid):
        _decode_cta(cfg, grid, bx, by, bz, True, NONE, tmp_out, max_logits, exp_sums, query, k_cache, v_cache,
                    block_tables, seq_lens, max_blocks, num_kv_heads, q_stride_t, q_stride_h, scale_log2,
                    partition_size)


def emulate_paged_decode_reduce(
    cfg: KernelConfig, grid: tuple[int, int, int], out: np.ndarray, tmp_out: np.ndarray, max_logits: np.ndarray,
    exp_sums: np.ndarray, seq_lens: np.ndarray, max_partitions: int, partition_size: int,
) -> None:
    d = cfg.head_dim
    num_heads = grid[0]
    for head, seq, _ in _grid(grid):
        parts = math.ceil(int(seq_lens[seq]) / partition_size)
        base = (seq * num_heads + head) * max_partitions
        dd = np.arange(d)  # threads d, d + 128, ... cover every dim once
        ml = max_logits[base:base + parts]  # (parts,)
        m = ml.max()
        c = exp_sums[base:base + parts] * np.exp2(ml - m)  # (parts,)
        o = (c[:, None] * tmp_out[(base + np.arange(parts))[:, None] * d + dd[None, :]]).sum(0, dtype=F32)
        out[(seq * num_heads + head) * d + dd] = round_to(o / c.sum(dtype=F32), cfg.query_dtype)


# ------------------------------------------------------------------------------ paged_prefill.cu


def emulate_paged_prefill(
    cfg: KernelConfig, grid: tuple[int, int, int], out: np.ndarray, query: np.ndarray, k_cache: np.ndarray,
    v_cache: np.ndarray, block_tables: np.ndarray, seq_lens: np.ndarray, query_start_loc: np.ndarray,
    first_seq: int, max_blocks: int, num_kv_heads: int, q_stride_t: int, q_stride_h: int, scale_log2: float,
) -> None:
    qh, d = cfg.heads_per_cta, cfg.head_dim
    num_heads = grid[0] * qh
    for bx, by, bz in _grid(grid):
        head0 = bx * qh
        kv_head = head0 // (num_heads // num_kv_heads)
        seq = first_seq + by
        q0 = int(query_start_loc[seq])
        qlen = int(query_start_loc[seq + 1]) - q0
        length = int(seq_lens[seq])
        table = block_tables[seq * max_blocks:(seq + 1) * max_blocks]
        for warp in range(NUM_WARPS):
            r = bz * NUM_WARPS + warp
            if r >= qlen:
                continue
            row = q0 + r
            q_s = store_q(cfg, query, row, head0, q_stride_t, q_stride_h, scale_log2)
            limit = length - qlen + r + 1
            st = WarpState.init(qh, d)
            attend_tiles(cfg, k_cache, v_cache, table, kv_head, num_kv_heads, q_s, 0, math.ceil(limit / TILE), 1,
                         limit, st)
            finish_warp(st)
            dims = (row * num_heads + head0 + np.arange(qh))[:, None] * d + np.arange(d)[None, :]  # (QH, D)
            out[dims] = round_to(st.acc.reshape(qh, d) / st.l[:, :1], cfg.query_dtype)


# -------------------------------------------------------------------------- reshape_and_cache.cu


def emulate_reshape_and_cache(
    cfg: KernelConfig, grid: tuple[int, int, int], block: int, key: np.ndarray, value: np.ndarray,
    k_cache: np.ndarray, v_cache: np.ndarray, slot_mapping: np.ndarray, num_kv_heads: int, head_dim: int,
    key_stride_t: int, key_stride_h: int, value_stride_t: int, value_stride_h: int,
) -> None:
    n = num_kv_heads * head_dim
    for t in range(grid[0]):
        slot = int(slot_mapping[t])
        if slot < 0:
            continue
        for tid in range(block):
            i = np.arange(tid, n, block)  # this thread's strided loop
            h, d = i // head_dim, i % head_dim
            k_cache[slot * n + i] = round_to(key[t * key_stride_t + h * key_stride_h + d], cfg.dtype)
            v_cache[slot * n + i] = round_to(value[t * value_stride_t + h * value_stride_h + d], cfg.dtype)


# -------------------------------------------------------------------- running plans on host buffers


def flat(t: torch.Tensor) -> np.ndarray:
    """The float32 (or int) 1-D span of storage a strided tensor covers, from its first element: what a
    kernel sees through the data pointer."""
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) if t.numel() else 0
    view = t.as_strided((span,), (1,))
    if view.is_floating_point():
        return view.detach().float().numpy().copy()
    return view.detach().numpy().copy()


def execute(cfg: KernelConfig, launch: Launch, buffers: dict[str, np.ndarray]) -> None:
    """Run one planned launch on host buffers, passing the arguments in the kernel's order."""
    args: list[Any] = [buffers[a.name] if isinstance(a, Buf) else a.value for a in launch.args]
    if launch.role == "reshape_and_cache":
        emulate_reshape_and_cache(cfg, launch.grid, launch.block, *args)
        return
    kernels: dict[str, Callable[..., None]] = {
        "decode": emulate_paged_decode, "decode_split": emulate_paged_decode_split,
        "decode_reduce": emulate_paged_decode_reduce, "prefill": emulate_paged_prefill}
    kernels[launch.role](cfg, launch.grid, *args)


class EmulatedAttentionBackend:
    """:class:`kernels_cupy.interface.AttentionBackend` on CPU tensors, through the CUDA kernels' emulation."""

    name = "emulated"

    def __init__(self, sm_count: int = 132, partition_size: int = 512, split: str = "auto") -> None:
        self.sm_count, self.partition_size, self.split = sm_count, partition_size, split
        self.last_plan: ForwardPlan | None = None  # for tests: which kernels the last forward ran
        self._rows = DecodeRows()

    @staticmethod
    def _config(cache: torch.Tensor, num_q_heads: int, query_dtype: torch.dtype) -> KernelConfig:
        _, bs, hkv, d = cache.shape
        return KernelConfig(TORCH_DTYPE[cache.dtype], d, bs, heads_per_cta(num_q_heads, hkv, d),
                            TORCH_DTYPE[query_dtype])

    def write_kv(
        self,
        key: torch.Tensor,  # (T, Hkv, D)
        value: torch.Tensor,  # (T, Hkv, D)
        k_cache: torch.Tensor,  # (NB, BS, Hkv, D)
        v_cache: torch.Tensor,  # (NB, BS, Hkv, D)
        meta: AttentionMetadata,
    ) -> None:
        cfg = self._config(k_cache, k_cache.shape[2], key.dtype)
        launch = plan_write_kv(key.shape[0], key.shape[1], key.shape[2], (key.stride(0), key.stride(1)),
                               (value.stride(0), value.stride(1)))
        bufs = {"key": flat(key), "value": flat(value), "k_cache": flat(k_cache), "v_cache": flat(v_cache),
                "slot_mapping": meta.slot_mapping.numpy()}
        execute(cfg, launch, bufs)
        k_cache.copy_(torch.from_numpy(bufs["k_cache"]).view(k_cache.shape))
        v_cache.copy_(torch.from_numpy(bufs["v_cache"]).view(v_cache.shape))

    def forward(
        self,
        query: torch.Tensor,  # (T, Hq, D)
        key: torch.Tensor,  # (T, Hkv, D) unused: the kernels read this step's K/V back from the cache
        value: torch.Tensor,  # (T, Hkv, D)
        k_cache: torch.Tensor,  # (NB, BS, Hkv, D)
        v_cache: torch.Tensor,  # (NB, BS, Hkv, D)
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # (T, Hq, D)
        t, hq, d = query.shape
        cfg = self._config(k_cache, hq, query.dtype)
        q = query
        split = self.split
        if split == "invariant":  # as the CuPy backend does: every query row a decode row, split-K always
            meta, split = self._rows.of(meta, k_cache.shape[1]), "always"
        plan = plan_forward(hq, k_cache.shape[2], d, (q.stride(0), q.stride(1)), meta.block_tables.shape[1],
                            meta.query_lens_cpu, meta.seq_lens_cpu, meta.num_decodes, scale, self.sm_count,
                            self.partition_size, split)
        self.last_plan = plan
        bufs = {"out": np.full(t * hq * d, np.nan, F32), "query": flat(q), "k_cache": flat(k_cache),
                "v_cache": flat(v_cache), "block_tables": meta.block_tables.contiguous().numpy().reshape(-1),
                "seq_lens": meta.seq_lens.numpy(), "query_start_loc": meta.query_start_loc.numpy()}
        bufs.update({name: np.full(int(np.prod(shape)), np.nan, F32) for name, shape in plan.temps.items()})
        for launch in plan.launches:
            execute(cfg, launch, bufs)
        return torch.from_numpy(bufs["out"]).view(t, hq, d).to(query.dtype)
