"""CUDA graphs of the decode step: one captured model forward per batch-size bucket, replayed on static buffers.

A small model's decode step on a GPU is bound by launches, not by the GPU: ~20 eager kernels and two CuPy
attention launches a layer, each a few microseconds of Python and driver time (bench/RESULTS.md measured ~21 ms a
step for smollm2's 30 layers on an H100 at any batch size). A graph replays the whole forward in one launch.

What a graph fixes at capture and how a replay stays correct:
- Shapes: the batch is padded up to its bucket. Padding rows write nowhere (slot -1: reshape_and_cache skips
  it) and read one token of whatever block their table row names (a finite value; their logits are dropped).
- Attention launch geometry: captured with split-K always on and as many partitions as the longest context
  (max_model_len) needs; partitions past a sequence's end exit at once and the reduce reads only the live
  ones, so any context length up to max_model_len replays correctly.
- Block tables: a static (bucket, max_model_len / BS) table; a step's rows are copied in, columns past a row's
  length are never read (seq_lens bound every read).

Only pure decode steps replay (every sequence one new token, every row sampled: no prefill chunk, draft or
prompt logprobs); the rest run eagerly. Numerics: a graph runs the eager step's arithmetic, so a row's bits are
the same replayed or eager, at any bucket: attention in the backend's "invariant" mode (every row a decode row,
split-K at a fixed partition size), GEMMs on fixed row tiles (workers/models/cuda_linear.py) and RMSNorm through
the row kernel (kernels_cupy/rows_cuda.py); none of them depends on how many rows share the step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from kernels_cupy.interface import AttentionBackend, AttentionMetadata

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# (input_ids (B,), positions (B,), kv_caches, meta, backend, logits_indices (B,)) -> logits (B, V) fp32
Forward = Callable[[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], AttentionMetadata,
                    AttentionBackend, torch.Tensor], torch.Tensor]


def buckets_for(max_batch: int) -> tuple[int, ...]:
    """The captured batch sizes: the fixed ladder up to max_batch, and max_batch itself."""
    return tuple(sorted({b for b in BUCKETS if b < max_batch} | {max_batch}))


def bucket_of(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding n rows, or None (n is larger than any: run eagerly)."""
    return next((b for b in buckets if b >= n), None)


def is_pure_decode(meta: AttentionMetadata, num_rows: int, num_sampled: int) -> bool:
    """Every sequence has one new token and every row is sampled (no prefill, draft or prompt-logprob rows)."""
    return meta.num_decodes == meta.num_seqs == num_rows == num_sampled


class DecodeGraphs:
    """The captured decode forwards of one model on one device, and their static inputs."""

    def __init__(self, forward: Forward, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 backend: AttentionBackend, device: torch.device, max_model_len: int, block_size: int,
                 max_batch: int) -> None:
        self.forward, self.kv_caches, self.backend, self.device = forward, kv_caches, backend, device
        self.max_model_len = max_model_len
        self.buckets = buckets_for(max_batch)
        n, cols = self.buckets[-1], -(-max_model_len // block_size)
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(n, dtype=i64, device=device)  # (N,)
        self.positions = torch.zeros(n, dtype=i64, device=device)  # (N,)
        self.slots = torch.full((n,), -1, dtype=i64, device=device)  # (N,) -1: padding, never written
        self.seq_lens = torch.ones(n, dtype=i32, device=device)  # (N,) >= 1 for every row, padding included
        self.block_tables = torch.zeros((n, cols), dtype=i32, device=device)  # (N, max_model_len / BS)
        self.query_start_loc = torch.arange(n + 1, dtype=i32, device=device)  # (N + 1,) one query row per sequence
        self.rows = torch.arange(n, dtype=i64, device=device)  # (N,) every row sampled
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # bucket -> (bucket, V) fp32, the graph's output
        self.replays = 0  # steps served by a graph (tests and logs read it)

    def _meta(self, b: int) -> AttentionMetadata:
        # Host-side lengths at their maximum: they pick the captured launch geometry (see the module docstring).
        return AttentionMetadata(self.slots[:b], self.query_start_loc[:b + 1], self.seq_lens[:b],
                                 self.block_tables[:b], (1,) * b, (self.max_model_len,) * b, b, self.max_model_len)

    def _run(self, b: int) -> torch.Tensor:
        return self.forward(self.input_ids[:b], self.positions[:b], self.kv_caches, self._meta(b), self.backend,
                            self.rows[:b])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool (a smaller graph reuses the larger's
        blocks). The static inputs hold padding only, so capture writes no cache slot."""
        pool = torch.cuda.graph_pool_handle()
        main = torch.cuda.current_stream(self.device)
        for b in reversed(self.buckets):
            side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            side.wait_stream(main)
            with torch.cuda.stream(side):  # one eager run first: lazy init (cuBLAS workspaces, NVRTC modules)
                self._run(b)
            main.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = self._run(b)
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured CUDA graphs of the decode step for batch sizes %s", ",".join(map(str, self.buckets)))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Logits (B, V) of a pure decode step by graph replay, or None where no bucket holds B rows or a
        context is longer than the capture allowed (the caller runs the step eagerly)."""
        n = input_ids.shape[0]
        b = bucket_of(n, self.buckets)
        if b is None or b not in self.graphs or meta.max_seq_len > self.max_model_len:
            return None
        cols = meta.block_tables.shape[1]
        if cols > self.block_tables.shape[1]:
            return None
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :cols].copy_(meta.block_tables)
        if b > n:  # padding rows: write nowhere, read one token
            self.slots[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(1)
        self.graphs[b].replay()
        self.replays += 1
        return self.logits[b][:n]
