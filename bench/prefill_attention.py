"""Prefill attention on the CPU: the C++ paged kernel (every prompt row a decode row, ``chunk_as_decode_rows``)
against the torch reference's SDPA paths for the same chunk.

A cold prompt of P rows (nothing cached) is one chunk: the reference attends to the fresh K/V with a causal
SDPA (``_causal``, what it runs for a cold prefill) or, over a cached prefix, gathers the blocks and runs a
masked SDPA (``_prefill``); the kernel reads the paged cache as P decode rows. Also decode steps (one row per
sequence) for a few batch sizes, where the kernel splits long contexts into fixed chunks. Best of
``--repeats`` calls, after one warm-up. SmolLM2-135M shapes by default. Run:
``.venv/bin/python bench/prefill_attention.py [--prompts 128,512,1024] [--threads N] [--kv-dtype float32]``
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels_cupy import kv_quant  # noqa: E402
from kernels_cupy.cpu import load  # noqa: E402
from kernels_cupy.cpu.backend import CpuAttentionBackend, chunk_as_decode_rows  # noqa: E402
from kernels_cupy.torch_ref import TorchAttentionBackend  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", default="128,512,1024")
    p.add_argument("--decode-batches", default="1,16", help="decode rows per step ('' to skip)")
    p.add_argument("--decode-contexts", default="256,1024,4096")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--clock", choices=("wall", "thread"), default="wall",
                   help="thread: this thread's CPU time, with --threads 1 (steadier on a shared, loaded machine)")
    return p.parse_args(argv)


CLOCK: Callable[[], float] = time.perf_counter


def best_ms(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = CLOCK()
        fn()
        times.append(CLOCK() - t)
    return min(times) * 1e3


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "unknown")


def paged(k: torch.Tensor, v: torch.Tensor, bs: int, dtype: torch.dtype,
          gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(L, Hkv, D) K/V into shuffled blocks of a (NB, BS, Hkv, W) cache of `dtype`; returns the caches and the
    block table (NB,) int32."""
    nb = -(-k.shape[0] // bs)
    perm = torch.randperm(nb, generator=gen)
    caches = []
    for x in (k, v):
        rows = torch.zeros(nb * bs, *x.shape[1:])
        rows[: x.shape[0]] = x
        cache = torch.zeros(nb, bs, x.shape[1], kv_quant.row_width(x.shape[2], dtype), dtype=dtype)
        cache[perm] = kv_quant.to_cache(rows, dtype).view(nb, bs, *cache.shape[2:])
        caches.append(cache)
    return caches[0], caches[1], perm.to(torch.int32)


def prefill_row(args: argparse.Namespace, kernel: CpuAttentionBackend, p: int) -> str:
    gen = torch.Generator().manual_seed(p)
    hq, hkv, d, dtype = args.heads, args.kv_heads, args.head_dim, DTYPES[args.kv_dtype]
    q, k, v = torch.randn(p, hq, d, generator=gen), torch.randn(p, hkv, d, generator=gen), torch.randn(p, hkv, d, generator=gen)
    kc, vc, table = paged(k, v, args.block_size, dtype, gen)
    kr, vr = kv_quant.as_cached(k, dtype), kv_quant.as_cached(v, dtype)
    scale = d ** -0.5
    tables, lens = chunk_as_decode_rows(table, p, p)
    tables = tables.contiguous()
    ours = best_ms(lambda: kernel._mod.paged_decode(q, kc, vc, tables, lens, scale), args.repeats)
    causal = best_ms(lambda: TorchAttentionBackend._causal(q, kr, vr, scale), args.repeats)
    masked = best_ms(lambda: TorchAttentionBackend._prefill(q, kc, vc, table, p, scale), args.repeats)
    diff = (kernel._mod.paged_decode(q, kc, vc, tables, lens, scale) - TorchAttentionBackend._causal(q, kr, vr, scale))
    return (f"{p:>7} {ours:>10.3f} {causal:>12.3f} {masked:>12.3f} {causal / ours:>8.2f} {masked / ours:>8.2f}"
            f" {diff.abs().max().item():>9.1e}")


def decode_row(args: argparse.Namespace, kernel: CpuAttentionBackend, batch: int, ctx: int) -> str:
    gen = torch.Generator().manual_seed(batch * 7919 + ctx)
    hq, hkv, d, bs, dtype = args.heads, args.kv_heads, args.head_dim, args.block_size, DTYPES[args.kv_dtype]
    nb = batch * -(-ctx // bs)
    kc = kv_quant.to_cache(torch.randn(nb, bs, hkv, d, generator=gen), dtype)
    vc = kv_quant.to_cache(torch.randn(nb, bs, hkv, d, generator=gen), dtype)
    tables = torch.randperm(nb, generator=gen).to(torch.int32).view(batch, -1)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn(batch, hq, d, generator=gen)
    ours = best_ms(lambda: kernel._mod.paged_decode(q, kc, vc, tables, lens, d ** -0.5), args.repeats)
    return f"{batch:>6} {ctx:>8} {ours:>10.3f}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    global CLOCK
    if args.clock == "thread":
        if args.threads != 1:
            sys.exit("--clock thread measures one thread: pass --threads 1")
        CLOCK = time.thread_time
    if args.threads:
        torch.set_num_threads(args.threads)
    mod = load()
    if mod is None:
        sys.exit("the CPU kernel is not built here (see kernels_cupy/cpu/__init__.py)")
    kernel = CpuAttentionBackend(mod)
    print(f"cpu: {cpu_model()}; torch threads {torch.get_num_threads()}; Hq={args.heads} Hkv={args.kv_heads} "
          f"D={args.head_dim} BS={args.block_size} {args.kv_dtype} cache; best of {args.repeats}, ms ({args.clock} clock)")
    print("prefill, one cold chunk of P rows: kernel (P decode rows) vs SDPA causal over fresh K/V (the reference's"
          " cold path) and masked SDPA over the gathered cache (its cached-prefix path)")
    print(f"{'P':>7} {'kernel':>10} {'sdpa causal':>12} {'sdpa masked':>12} {'x causal':>8} {'x masked':>8} {'max|diff|':>9}")
    for p in (int(x) for x in args.prompts.split(",") if x):
        print(prefill_row(args, kernel, p), flush=True)
    if args.decode_batches:
        print("decode: one row per sequence")
        print(f"{'batch':>6} {'context':>8} {'kernel':>10}")
        for batch in (int(x) for x in args.decode_batches.split(",")):
            for ctx in (int(x) for x in args.decode_contexts.split(",")):
                print(decode_row(args, kernel, batch, ctx), flush=True)


if __name__ == "__main__":
    main()
