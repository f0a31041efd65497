"""Issue 25's goal on the CPU: 8 LoRA adapters of rank 16 over 16 concurrent streams against the same load on the
base model, and the LRU swap-in time.

Offline, through ``workers.llm.LLM("smollm2", lora_dir=...)``: 16 prompts of random tokens (fixed seed), greedy,
``ignore_eos``, every prompt gets exactly ``--output-tokens`` tokens; prefix caching off so repeated runs compute
the same work. Adapters are random PEFT adapters built by peft on the real base model (as tests/lora_support.py
builds them), rank 16, targets q/k/v/o/gate/up/down, saved in ``--adapter-dtype`` (bf16 by default: PEFT saves the
training dtype, and most fine-tunes train in bf16); stream i runs adapter ``i % 8`` (two streams each). Runs
alternate in one process (base, lora, lora-fp32, base-module, lora-module per round; best of ``--rounds``):
``lora-fp32`` runs the same adapters re-saved in fp32 (the same values: what a 16-bit adapter cost before it kept
its width);
``base-module`` and ``lora-module`` are the base and LoRA loads with the C++ decode stack switched off for the run
(the model's per-layer module path; LoRA steps took it always before the stack ran LoRA rows), so the ratios split
into "module path instead of the stack" and "the LoRA deltas themselves".

Swap-in: a second engine with ``max_loras = max_cpu_loras = 2``, requests for the 8 adapters in turn (each one
must be read from disk, evicting the least recently used) and then the same adapter again (resident): the time of
``add_request`` (which starts the load beside the engine and returns) and to the first token, miss against hit, and the
registry's own load time.

Run: ``.venv/bin/python bench/lora_serving.py [--rounds 3] [--swaps 16]``; prints markdown.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.lora_support import ALL, make_adapter  # noqa: E402
from workers.core.sampling_params import SamplingParams  # noqa: E402
from workers.llm import LLM  # noqa: E402
from workers.model_files import resolve  # noqa: E402
from workers.model_runner import ModelRunner  # noqa: E402
from workers.models.llama import LlamaForCausalLM  # noqa: E402

MODEL = "smollm2"
VARIANTS = ("base", "lora", "lora-fp32", "base-module", "lora-module")


def cpu_line() -> str:
    """``lscpu``'s model name and a summary of the SIMD flags that matter to the CPU kernels."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}
    flags = set(fields.get("Flags", "").split())
    simd = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
                        "amx_int8", "amx_bf16") if f in flags]
    return (f"{fields.get('Model name', 'unknown')} (family {fields.get('CPU family', '?')}, model "
            f"{fields.get('Model', '?')}), {fields.get('CPU(s)', '?')} CPUs; flags: {' '.join(simd)}")


def resave(src: Path, dst: Path, dtype: str) -> None:
    """``src``'s adapter at ``dst`` with every weight converted to ``dtype`` (the config as it is)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    if src != dst:
        shutil.copytree(src, dst)
    weights = dst / "adapter_model.safetensors"
    save_file({k: v.to(getattr(torch, dtype)).contiguous() for k, v in load_file(str(weights)).items()},
              str(weights))


def build_adapters(root: Path, n: int, rank: int, dtype: str) -> list[str]:
    """``n`` random PEFT adapters of the base model under ``root`` saved in ``dtype`` (names a0..), and the same
    values in fp32 (w0..); the a-names."""
    import torch
    from transformers import LlamaForCausalLM as HFLlama

    hf = HFLlama.from_pretrained(str(resolve(MODEL).directory), torch_dtype=torch.float32)
    hf.eval()  # type: ignore[no-untyped-call]
    names = [f"a{i}" for i in range(n)]
    for i, name in enumerate(names):
        make_adapter(hf, root / name, ALL, r=rank, alpha=2.0 * rank, seed=100 + i, std=0.02)
        resave(root / name, root / name, dtype)
        resave(root / name, root / f"w{i}", "float32")
    return names


def base_model(llm: LLM) -> LlamaForCausalLM:
    runner = llm.engine.runner
    assert isinstance(runner, ModelRunner)
    return runner.model


def prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def run_once(llm: LLM, ps: Sequence[list[int]], loras: Sequence[str | None], out_tokens: int,
             module_path: bool) -> tuple[float, int]:
    """(seconds, output tokens) of one generate call; ``module_path`` turns the C++ decode stack off for it."""
    model = base_model(llm)
    saved = model._stack
    if module_path:
        model._stack = None  # decode_stack() then answers None: every step runs the per-layer module path
    try:
        params = SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(list(ps), params, lora=list(loras))
        dt = time.perf_counter() - t
    finally:
        model._stack = saved
    bad = [o.error for o in outs if o.error]
    if bad:
        raise RuntimeError(f"{len(bad)} prompts failed: {bad[0]}")
    return dt, sum(len(o.token_ids) for o in outs)


def throughput(lora_dir: Path, names: list[str], args: argparse.Namespace) -> dict[str, list[float]]:
    llm = LLM(MODEL, lora_dir=str(lora_dir), max_loras=len(names), max_cpu_loras=2 * len(names),
              enable_prefix_caching=False, max_num_seqs=args.streams, seed=0)
    ps = prompts(args.streams, args.prompt_tokens, args.seed, base_model(llm).cfg.vocab_size)
    per_stream = [names[i % len(names)] for i in range(args.streams)]
    plan: dict[str, tuple[list[str | None], bool]] = {
        "base": ([None] * args.streams, False), "lora": (list(per_stream), False),
        "lora-fp32": ([n.replace("a", "w") for n in per_stream], False), "base-module": ([None] * args.streams, True),
        "lora-module": (list(per_stream), True)}
    # Warm-up: the stack is built on its first decode step and the adapters are read once (both kept after).
    for v in VARIANTS:
        run_once(llm, ps[:4], plan[v][0][:4], 4, plan[v][1])
    tps: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for v in VARIANTS:
            dt, n = run_once(llm, ps, plan[v][0], args.output_tokens, plan[v][1])
            tps[v].append(n / dt)
            print(f"round {r + 1} {v}: {n} tokens in {dt:.2f}s, {n / dt:.1f} tok/s", file=sys.stderr, flush=True)
    return tps


def swap_in(lora_dir: Path, names: list[str], args: argparse.Namespace) -> dict[str, float]:
    """Median ms of add_request and of the time to the first token, for an adapter read from disk (miss) and one
    resident (hit), and the registry's own mean load time."""
    if len(names) <= 2:
        raise SystemExit("the swap-in measurement needs more than 2 adapters (2 are kept resident)")
    llm = LLM(MODEL, lora_dir=str(lora_dir), max_loras=2, max_cpu_loras=2, enable_prefix_caching=False, seed=0)
    reg = llm.engine.loras
    assert reg is not None
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    [p] = prompts(1, 16, args.seed + 1, base_model(llm).cfg.vocab_size)
    times: dict[str, list[tuple[float, float]]] = {"miss": [], "hit": []}
    ids = iter(range(10**9))

    def one(name: str) -> tuple[float, float]:
        t = time.perf_counter()
        llm.engine.add_request(f"s{next(ids)}", p, params, lora=name)
        added = time.perf_counter()
        while llm.engine.has_unfinished():
            llm.engine.step()
        return (added - t) * 1e3, (time.perf_counter() - t) * 1e3

    one(names[0])  # warm-up: the first step of an engine pays one-off costs
    loads0, secs0 = reg.loads, reg.load_seconds
    for i in range(args.swaps):
        name = names[(i + 1) % len(names)]  # a cycle of 8 over 2 resident slots: always a miss
        before = reg.loads
        times["miss"].append(one(name))
        assert reg.loads == before + 1, "expected a load"
        times["hit"].append(one(name))  # the same adapter again: resident
        assert reg.loads == before + 1, "expected no load"
    loads = reg.loads - loads0
    for kind, xs in times.items():
        print(f"swap-in {kind}: add_request ms {[round(a, 1) for a, _ in xs]}, to first token ms "
              f"{[round(b, 1) for _, b in xs]}", file=sys.stderr)
    return {"add_miss": statistics.median(a for a, _ in times["miss"]),
            "add_hit": statistics.median(a for a, _ in times["hit"]),
            "ttft_miss": statistics.median(b for _, b in times["miss"]),
            "ttft_hit": statistics.median(b for _, b in times["hit"]),
            "load": (reg.load_seconds - secs0) / max(loads, 1) * 1e3, "loads": float(loads)}


def report(tps: dict[str, list[float]], swap: dict[str, float], args: argparse.Namespace, cmd: str) -> None:
    print(f"\nCPU: {cpu_line()}\n\nCommand: `{cmd}`\n")
    if tps:
        report_throughput(tps, args)
    if swap:
        report_swap(swap, args)


def report_throughput(tps: dict[str, list[float]], args: argparse.Namespace) -> None:
    best = {v: max(x) for v, x in tps.items()}
    mid = {v: statistics.median(x) for v, x in tps.items()}  # beside the best: how far the rounds spread
    print(f"{args.streams} streams, {args.prompt_tokens}-token random prompts, {args.output_tokens} greedy tokens "
          f"each (ignore_eos), prefix caching off; {args.adapters} adapters of rank {args.rank} (q,k,v,o,gate,up,down) "
          f"over the streams (stream i runs adapter i mod {args.adapters}); best of {args.rounds} alternating "
          "rounds.\n")
    print("| load | output tok/s (best) | median | all rounds | vs base (best) | vs base (median) |")
    print("|---|---:|---:|---|---:|---:|")
    label = {"base": "base model", "lora": f"{args.adapters} adapters, rank {args.rank}, {args.adapter_dtype}",
             "lora-fp32": f"the same {args.adapters} adapters re-saved in fp32",
             "base-module": "base model, module path forced (no C++ stack)",
             "lora-module": f"{args.adapters} adapters, {args.adapter_dtype}, module path forced (no C++ stack)"}
    for v in VARIANTS:
        runs = ", ".join(f"{x:.1f}" for x in tps[v])
        print(f"| {label[v]} | {best[v]:.1f} | {mid[v]:.1f} | {runs} | {best[v] / best['base']:.2f}x | "
              f"{mid[v] / mid['base']:.2f}x |")
    print(f"\nLoRA / base: {best['lora'] / best['base']:.2f}x best to best, {mid['lora'] / mid['base']:.2f}x median to "
          f"median (goal >= 0.8x); module path / stack on the base: "
          f"{best['base-module'] / best['base']:.2f}x; LoRA / base on the module path: "
          f"{best['lora-module'] / best['base-module']:.2f}x; LoRA in the stack / LoRA on the module path: "
          f"{best['lora'] / best['lora-module']:.2f}x\n")


def report_swap(swap: dict[str, float], args: argparse.Namespace) -> None:
    print(f"Swap-in (max_loras = max_cpu_loras = 2, {int(swap['loads'])} loads of a rank-{args.rank} adapter, "
          "medians):\n")
    print("| | add_request ms | to first token ms (16-token prompt) |")
    print("|---|---:|---:|")
    print(f"| adapter read from disk (LRU miss) | {swap['add_miss']:.1f} | {swap['ttft_miss']:.1f} |")
    print(f"| adapter resident (hit) | {swap['add_hit']:.2f} | {swap['ttft_hit']:.1f} |")
    print(f"\nregistry load time (read, check, map): {swap['load']:.1f} ms mean")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--swaps", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--adapter-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--parts", default="throughput,swap", help="what to measure: throughput, swap or both")
    args = ap.parse_args()
    cmd = ".venv/bin/python bench/lora_serving.py " + " ".join(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="kvgate-lora-bench-") as tmp:
        root = Path(tmp)
        t = time.perf_counter()
        names = build_adapters(root, args.adapters, args.rank, args.adapter_dtype)
        print(f"built {len(names)} adapters in {time.perf_counter() - t:.1f}s", file=sys.stderr, flush=True)
        parts = set(args.parts.split(","))
        tps = throughput(root, names, args) if "throughput" in parts else {}
        swap = swap_in(root, names, args) if "swap" in parts else {}
    report(tps, swap, args, cmd.strip())


if __name__ == "__main__":
    main()
