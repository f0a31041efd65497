"""Decode attention bandwidth: the CuPy paged kernels vs torch SDPA on a contiguous cache of the same data.

Decode attention is memory-bound: each step must read every cached K/V byte once, so the figure of merit is
achieved bandwidth = (bytes of K/V read) / time, against the device's peak HBM bandwidth. For each
(batch, context) the same K/V live twice: paged (NB, BS, Hkv, D) behind a shuffled block table (as a
fragmented cache is), and contiguous (B, Hkv, L, D) for ``scaled_dot_product_attention`` (queries grouped
per KV head so SDPA sees (B, Hkv, G, D) against (B, Hkv, L, D): exact GQA, no K/V repeat). Every row also
reports the max difference between the two outputs.

Timings replay a CUDA graph of ``--iters`` calls (so Python launch overhead is not measured; ``--eager`` to
include it) and report the mean per call. Fixed seeds. Run on a GPU:
``.venv/bin/python bench/attention.py [--peak-gbps N] [--batches 1,4,16,64,256] [--contexts 512,2048,8192,32768]``
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels_cupy.interface import AttentionBackend, AttentionMetadata  # noqa: E402

# Peak HBM bandwidth, GB/s (1e9 B/s), by a substring of torch.cuda.get_device_name(); first match wins.
PEAK_GBPS = (("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100 NVL", 3900.0), ("H100", 3350.0),
             ("A100-SXM4-80GB", 2039.0), ("A100", 1555.0))
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class Row:
    batch: int
    context: int
    kv_bytes: int
    ours_us: float | None
    split: bool
    sdpa_us: float | None
    max_diff: float | None
    note: str = ""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,4,16,64,256")
    p.add_argument("--contexts", default="512,2048,8192,32768")
    p.add_argument("--heads", type=int, default=32, help="query heads (Llama-3-8B: 32)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float16")
    p.add_argument("--split", choices=("auto", "always", "never"), default="auto")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-gbps", type=float, default=None, help="device peak HBM GB/s (default: by device name)")
    p.add_argument("--max-gib", type=float, default=20.0, help="skip shapes whose K+V exceed this, per layout")
    p.add_argument("--eager", action="store_true", help="time eager calls instead of CUDA-graph replays")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def require_cuda() -> None:
    """Exit with a plain message where there is nothing to measure."""
    if not torch.cuda.is_available():
        sys.exit("bench/attention.py measures GPU memory bandwidth: torch sees no CUDA device here. "
                 "Run it on a CUDA machine with `pip install 'kvgate[cuda]'`.")
    try:
        import cupy  # noqa: F401
    except ImportError:
        sys.exit("bench/attention.py needs CuPy for the paged kernels: pip install 'kvgate[cuda]' (cupy-cuda12x).")


def default_peak(name: str) -> float | None:
    return next((gbps for key, gbps in PEAK_GBPS if key in name), None)


def time_us(fn: Callable[[], torch.Tensor], iters: int, warmup: int, eager: bool) -> tuple[float, str]:
    """(mean microseconds per call, how timed): a CUDA graph of `iters` calls replayed, else eager calls."""
    for _ in range(warmup):  # also compiles and loads the CuPy modules: no module loads during capture
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    if not eager:
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # captures on torch's side stream, which the kernels follow
                for _ in range(iters):
                    fn()
            graph.replay()  # the first replay uploads the graph
            torch.cuda.synchronize()
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) * 1000.0 / iters, "graph"
        except RuntimeError as e:  # a capture failure must not hide the numbers: fall back, say so
            print(f"  (CUDA graph capture failed: {e}; timing eagerly)", file=sys.stderr)
            torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters, "eager"


def build_caches(
    batch: int, context: int, hkv: int, d: int, bs: int, dtype: torch.dtype, gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cont, v_cont) (B, Hkv, L, D); (k_cache, v_cache) (NB, BS, Hkv, D); block table (B, L / BS) int32,
    shuffled physical ids: the same K/V in both layouts."""
    nblk = math.ceil(context / bs)
    k_cont = torch.randn(batch, hkv, context, d, generator=gen, device="cuda", dtype=dtype)
    v_cont = torch.randn(batch, hkv, context, d, generator=gen, device="cuda", dtype=dtype)
    perm = torch.randperm(batch * nblk, generator=gen, device="cuda")  # (B * nblk,)
    k_cache = torch.zeros(batch * nblk, bs, hkv, d, device="cuda", dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    for b in range(batch):  # one sequence at a time keeps the transposed temporary small
        ids = perm[b * nblk:(b + 1) * nblk]
        pad = nblk * bs - context
        for cont, cache in ((k_cont, k_cache), (v_cont, v_cache)):
            rows = F.pad(cont[b].transpose(0, 1), (0, 0, 0, 0, 0, pad))  # (nblk * BS, Hkv, D)
            cache[ids] = rows.reshape(nblk, bs, hkv, d)
    return k_cont, v_cont, k_cache, v_cache, perm.view(batch, nblk).to(torch.int32)


def decode_meta(batch: int, context: int, table: torch.Tensor) -> AttentionMetadata:
    dev = table.device
    return AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=dev),  # unused by forward
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=dev),
        block_tables=table, query_lens_cpu=(1,) * batch, seq_lens_cpu=(context,) * batch,
        num_decodes=batch, max_seq_len=context)


def measure(args: argparse.Namespace, backend: AttentionBackend, batch: int, context: int) -> Row:
    hq, hkv, d, bs, dtype = args.heads, args.kv_heads, args.head_dim, args.block_size, DTYPES[args.dtype]
    kv_bytes = 2 * batch * context * hkv * d * torch.finfo(dtype).bits // 8
    if kv_bytes > args.max_gib * 2**30:
        return Row(batch, context, kv_bytes, None, False, None, None, f"skipped: K+V > {args.max_gib:g} GiB")
    gen = torch.Generator(device="cuda").manual_seed(args.seed + 7919 * batch + context)
    k_cont, v_cont, k_cache, v_cache, table = build_caches(batch, context, hkv, d, bs, dtype, gen)
    q = torch.randn(batch, hq, d, generator=gen, device="cuda", dtype=dtype)  # (B, Hq, D)
    unused = torch.empty(batch, hkv, d, device="cuda", dtype=dtype)  # this step's K/V: already cached
    meta = decode_meta(batch, context, table)
    scale = d ** -0.5
    g = hq // hkv
    q_grouped = q.view(batch, hkv, g, d)  # (B, Hkv, G, D): query heads of one KV head as G query rows

    def ours() -> torch.Tensor:
        return backend.forward(q, unused, unused, k_cache, v_cache, meta, scale)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q_grouped, k_cont, v_cont, scale=scale)  # (B, Hkv, G, D)

    diff = (ours().float() - sdpa().reshape(batch, hq, d).float()).abs().max().item()
    ours_us, ours_how = time_us(ours, args.iters, args.warmup, args.eager)
    sdpa_us, sdpa_how = time_us(sdpa, args.iters, args.warmup, args.eager)
    note = "" if ours_how == sdpa_how else f"timed: paged {ours_how}, sdpa {sdpa_how}"
    from kernels_cupy.kernels import heads_per_cta, plan_decode

    split = plan_decode(batch, hq, heads_per_cta(hq, hkv, d), context,
                        torch.cuda.get_device_properties(0).multi_processor_count, mode=args.split).split
    return Row(batch, context, kv_bytes, ours_us, split, sdpa_us, diff, note)


def fmt_row(r: Row, peak: float | None) -> str:
    def bw(us: float | None) -> str:
        if us is None:
            return f"{'':>9} {'':>6}"
        gbps = r.kv_bytes / (us * 1e-6) / 1e9
        pct = f"{100 * gbps / peak:5.1f}%" if peak else "   n/a"
        return f"{gbps:9.0f} {pct}"

    mib = r.kv_bytes / 2**20
    if r.ours_us is None or r.sdpa_us is None:
        return f"{r.batch:>5} {r.context:>7} {mib:>10.1f}  {r.note}"
    return (f"{r.batch:>5} {r.context:>7} {mib:>10.1f} {r.ours_us:>9.1f} {bw(r.ours_us)} {'yes' if r.split else 'no':>5}"
            f" {r.sdpa_us:>9.1f} {bw(r.sdpa_us)} {r.sdpa_us / r.ours_us:>7.2f} {r.max_diff:>9.2e}  {r.note}").rstrip()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    require_cuda()
    from kernels_cupy.cupy_backend import CupyAttentionBackend

    torch.manual_seed(args.seed)
    name = torch.cuda.get_device_name(0)
    peak = args.peak_gbps if args.peak_gbps is not None else default_peak(name)
    backend = CupyAttentionBackend(split=args.split)
    print(f"device: {name}; peak {peak if peak else 'unknown (pass --peak-gbps)'} GB/s; "
          f"Hq={args.heads} Hkv={args.kv_heads} D={args.head_dim} BS={args.block_size} {args.dtype}; "
          f"{'eager' if args.eager else 'CUDA graph'} x{args.iters}; torch {torch.__version__}")
    print("GB/s = bytes of K and V read / time. speedup = sdpa time / paged time.")
    print(f"{'batch':>5} {'context':>7} {'KV MiB':>10} {'paged us':>9} {'GB/s':>9} {'%peak':>6} {'split':>5}"
          f" {'sdpa us':>9} {'GB/s':>9} {'%peak':>6} {'speedup':>7} {'max|diff|':>9}")
    for batch in (int(b) for b in args.batches.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            print(fmt_row(measure(args, backend, batch, context), peak), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
