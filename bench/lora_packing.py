"""A 16-row decode step's LoRA deltas with the adapters' tensors as separately allocated against packed as the
worker keeps them (workers/lora/adapter.py's _packed: one buffer an adapter, on transparent huge pages, in the
order a step reads it), alternated in one process, the same bits asserted.

Why: a decode step reads every resident adapter's weights once, from memory (78 MB for 8 rank-16 bf16 adapters
on smollm2's 30 layers). As ~2,000 small tensors an adapter on 4 KiB pages, that is a TLB miss (a nested page walk
in a VM) every 4 KiB, where the hardware prefetchers also stop.

    .venv/bin/python bench/lora_packing.py [--rounds 6] [--threads 2]

The step: `lora_add` on every projection (qkv, o, gate_up, down) of 30 layers of smollm2's shapes, 8 random
rank-16 bf16 adapters x 2 rows each (16 rows). Prints each layout's best and median over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from peer_servers import cpu_line  # noqa: E402

from kernels_cupy.cpu.qgemm import load_qgemm  # noqa: E402
from workers.lora.adapter import LoraAdapter, LoraProj, LoraSlice, _packed  # noqa: E402
from workers.lora.batch import LoraBatch  # noqa: E402

HIDDEN, INTER, KV, RANK, LAYERS, ADAPTERS = 576, 1536, 192, 16, 30, 8
# kvgate's projection -> (input width, its targets' output widths)
PROJS = {"qkv_proj": (HIDDEN, [HIDDEN, KV, KV]), "o_proj": (HIDDEN, [HIDDEN]),
         "gate_up_proj": (HIDDEN, [INTER, INTER]), "down_proj": (INTER, [HIDDEN])}

Adapter = list[dict[str, LoraProj]]  # per layer: projection -> its pairs


def random_adapter(g: torch.Generator) -> Adapter:
    """One adapter's weights as load_adapter builds them before packing: a tensor per A and per B."""
    layers = []
    for _ in range(LAYERS):
        layer = {}
        for proj, (k, outs) in PROJS.items():
            a = (torch.randn(len(outs) * RANK, k, generator=g) * 0.05).to(torch.bfloat16)
            slices, lo = [], 0
            for t, o in enumerate(outs):
                b = (torch.randn(o, RANK, generator=g) * 0.05).to(torch.bfloat16)
                slices.append(LoraSlice(lo, lo + o, t * RANK, (t + 1) * RANK, b))
                lo += o
            layer[proj] = LoraProj(a, tuple(slices))
        layers.append(layer)
    return layers


def step(batch: LoraBatch, xs: dict[str, torch.Tensor], ys: dict[str, torch.Tensor]) -> float:
    """Seconds of one decode step's lora_add calls, through the engine's own LoraBatch.add."""
    t = time.perf_counter()
    for li in range(LAYERS):
        for proj in PROJS:
            batch.add(li, proj, xs[proj], ys[proj])
    return time.perf_counter() - t


def batch_of(adapters: list[Adapter], qg: object) -> LoraBatch:
    """The step's groups: adapter i on rows 2i and 2i + 1, scale 2."""
    return LoraBatch([(LoraAdapter(f"a{i}", RANK, 2.0, tuple(ad), 0), torch.tensor([2 * i, 2 * i + 1]))
                      for i, ad in enumerate(adapters)], qg)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    qg = load_qgemm()
    if qg is None:
        raise SystemExit("the quantized GEMM module did not build: no lora_add to time")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    allocated = [random_adapter(g) for _ in range(ADAPTERS)]
    layouts = {"separate tensors": batch_of(allocated, qg),
               "packed (the worker's)": batch_of([_packed(ad) for ad in allocated], qg)}
    xs = {p: torch.randn(16, k, generator=g) for p, (k, _) in PROJS.items()}
    times: dict[str, list[float]] = {name: [] for name in layouts}
    outs: dict[str, dict[str, torch.Tensor]] = {}
    for r in range(args.rounds):
        for name in (list(layouts) if r % 2 == 0 else list(layouts)[::-1]):
            ys = {p: torch.zeros(16, sum(outs_)) for p, (_, outs_) in PROJS.items()}
            times[name].append(step(layouts[name], xs, ys))
            outs[name] = ys
    first = next(iter(outs.values()))
    if any(not torch.equal(o[p], first[p]) for o in outs.values() for p in PROJS):
        raise SystemExit("the layouts gave different bits")
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        thp = f.read().strip()
    print(f"CPU: {cpu_line()}; THP: {thp}; {args.threads} threads; {args.rounds} rounds alternated; bits equal\n")
    print("| adapters' layout | best ms | median ms |")
    print("|---|---:|---:|")
    for name, ts in times.items():
        print(f"| {name} | {min(ts) * 1e3:.2f} | {statistics.median(ts) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
