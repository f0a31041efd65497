"""The engine end to end on a GPU: greedy tokens against the CPU ``none`` mode and transformers, determinism on
the device, and output tok/s against transformers ``generate`` at concurrency 1/16/64.

Models: random weights of smollm2's and a ~1.1B Llama's shapes (bench/random_llama.py says why not the real
smollm2). Three parts, each a flag:

- ``--make-expectation FILE`` (CPU, here): greedy tokens and top-5 logprobs of the probes under ``none``.
- ``--check FILE`` (GPU): the same probes on ``cuda`` fp32: tokens against the expectation and against
  transformers fp32 on the same GPU; then, in fp32 and in bf16, each probe alone (cold), again (prefix hit),
  beside 12 other requests, and chunked at 16 tokens: tokens and logprobs compared with ``==`` against the cold
  run (the determinism rule).
- ``--throughput`` (GPU): c requests of ``--prompt-len`` random tokens, ``--output-len`` greedy tokens each
  (ignore_eos), through kvgate's engine and through transformers ``generate`` (one batch of c), same weights and
  dtype; wall time, output tok/s and kvgate's median decode-step time.

``python bench/gpu_e2e.py --check bench/data/gpu_expect_smollm2.json --throughput --json OUT.json``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.random_llama import EOS, SHAPES, checksum, hf_config_dict, random_prompts, state_dict  # noqa: E402
from workers.config import CacheConfig, EngineConfig, ModelConfig  # noqa: E402
from workers.core.sampling_params import SamplingParams  # noqa: E402
from workers.core.scheduler_config import SchedulerConfig  # noqa: E402
from workers.engine import LLMEngine  # noqa: E402
from workers.engine_build import build_model, engine_from_model  # noqa: E402
from workers.models.llama import LlamaConfig  # noqa: E402

PROBE_LENS = (20, 37, 64, 100)
PROBE_TOKENS = 24
Result = dict[str, Any]


def engine(shape: str, sd: dict[str, torch.Tensor], device: str, dtype: str, *, batched_tokens: int = 512,
           max_seqs: int = 64, kv_tokens: int = 32768, gpu_share: float = 0.3, eager: bool = False) -> LLMEngine:
    cfg = EngineConfig(ModelConfig(shape, device, dtype, None, 0, None, "none", eager),
                       CacheConfig(16, kv_tokens, gpu_share, True), SchedulerConfig(max_seqs, batched_tokens))
    model, max_len = build_model(LlamaConfig.from_hf(hf_config_dict(shape)), sd, cfg)
    eng = engine_from_model(model, cfg, max_len)
    eng.warm_up()
    return eng


def run(eng: LLMEngine, prompts: dict[str, list[int]], n: int, logprobs: int | None = None,
        late: dict[str, list[int]] | None = None) -> tuple[dict[str, list[int]], dict[str, list[Any]], list[Any]]:
    """Step until idle. ``late`` requests join after two steps (so they meet running ones). Returns tokens,
    logprobs and (batched tokens, seconds) per step."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    for rid, ids in prompts.items():
        eng.add_request(rid, ids, params)
    toks: dict[str, list[int]] = {}
    lps: dict[str, list[Any]] = {}
    steps: list[Any] = []
    while eng.has_unfinished() or late:
        if late and len(steps) == 2:
            for rid, ids in late.items():
                eng.add_request(rid, ids, params)
            late = None
        t0 = time.perf_counter()
        outs = eng.step()
        steps.append((eng.last_num_batched_tokens, time.perf_counter() - t0))
        for o in outs:
            if o.error:
                raise RuntimeError(f"{o.request_id}: {o.error}")
            toks.setdefault(o.request_id, []).extend(o.new_token_ids)
            lps.setdefault(o.request_id, []).extend(o.logprobs or [])
    return toks, lps, steps


def probes(vocab: int) -> dict[str, list[int]]:
    return {f"probe{i}": random_prompts(1, n, vocab, seed=100 + i)[0] for i, n in enumerate(PROBE_LENS)}


def make_expectation(path: Path, shape: str) -> None:
    sd = state_dict(shape)
    eng = engine(shape, sd, "cpu", "float32")
    toks, lps, _ = run(eng, probes(SHAPES[shape]["vocab_size"]), PROBE_TOKENS, logprobs=5)
    path.write_text(json.dumps({"shape": shape, "checksum": checksum(sd), "tokens": toks, "logprobs": lps,
                                "made_with": "CPU, quantization none, fp32, float32 KV"}) + "\n")
    print(f"wrote {path}: {', '.join(f'{k}: {v[:8]}...' for k, v in toks.items())}")


def hf_model(shape: str, sd: dict[str, torch.Tensor], dtype: torch.dtype, device: str) -> Any:
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    with torch.device(device):
        m = LlamaForCausalLM(HFConfig(**hf_config_dict(shape)))
    missing, unexpected = m.load_state_dict(sd, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    m.tie_weights()
    return m.to(dtype).eval()


def hf_greedy(m: Any, prompts: list[list[int]], n: int) -> tuple[list[list[int]], float]:
    """One batch of equal-length prompts (no padding); returns the new tokens and the wall seconds."""
    ids = torch.tensor(prompts, device=m.device)
    sync(m.device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0, eos_token_id=EOS)
    sync(m.device)
    return out[:, ids.shape[1]:].tolist(), time.perf_counter() - t0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check(path: Path, device: str) -> Result:
    want = json.loads(path.read_text())
    shape = want["shape"]
    sd = state_dict(shape)
    res: Result = {"shape": shape, "weights_match_expectation": checksum(sd) == want["checksum"]}
    p = probes(SHAPES[shape]["vocab_size"])
    eng = engine(shape, sd, device, "float32")
    cold: dict[str, Any] = {}
    for rid, ids in p.items():  # each alone on a cold cache
        t, lp, _ = run(eng, {rid: ids}, PROBE_TOKENS, logprobs=5)
        cold[rid] = (t[rid], lp[rid])
    res["vs_cpu_none"] = {rid: f"{common_prefix(cold[rid][0], want['tokens'][rid])}/{PROBE_TOKENS}" for rid in p}
    res["vs_cpu_none_max_logprob_diff"] = max(abs(a[0] - b[0]) for rid in p
                                              for a, b in zip(cold[rid][1], want["logprobs"][rid]))
    hf = hf_model(shape, sd, torch.float32, device)
    res["vs_transformers_fp32"] = {rid: f"{common_prefix(cold[rid][0], hf_greedy(hf, [ids], PROBE_TOKENS)[0][0])}"
                                        f"/{PROBE_TOKENS}" for rid, ids in p.items()}
    del hf, eng
    res["determinism"] = determinism(shape, sd, device, "float32", p)
    res["determinism_bfloat16"] = determinism(shape, sd, device, "bfloat16", p)
    return res


def determinism(shape: str, sd: dict[str, torch.Tensor], device: str, dtype: str,
                p: dict[str, list[int]]) -> Result:
    """Each probe alone on a cold cache, then again (prefix hit), beside 12 other requests that joined first,
    and all probes together chunked at 16 tokens: tokens and logprobs compared with == against the cold run."""
    eng = engine(shape, sd, device, dtype)
    cold: dict[str, Any] = {}
    for rid, ids in p.items():
        t, lp, _ = run(eng, {rid: ids}, PROBE_TOKENS, logprobs=5)
        cold[rid] = (t[rid], lp[rid])
    others = {f"other{i}": ids for i, ids in enumerate(random_prompts(12, 48, SHAPES[shape]["vocab_size"], 7))}
    ways: dict[str, tuple[dict[str, list[int]], dict[str, list[Any]]]] = {}
    t, lp = {}, {}
    for rid, ids in p.items():  # again, alone: every full block of the prompt is a prefix-cache hit
        a, b, _ = run(eng, {rid: ids}, PROBE_TOKENS, logprobs=5)
        t.update(a), lp.update(b)
    ways["prefix_hit"] = (t, lp)
    a, b, _ = run(eng, others, PROBE_TOKENS, logprobs=5, late={f"{k}x": v for k, v in p.items()})
    ways["beside_12_others"] = ({k[:-1]: v for k, v in a.items() if k.endswith("x")},
                                {k[:-1]: v for k, v in b.items() if k.endswith("x")})
    del eng
    chunked = engine(shape, sd, device, dtype, batched_tokens=16)
    a, b, _ = run(chunked, p, PROBE_TOKENS, logprobs=5)
    ways["chunked_16_together"] = (a, b)
    return {way: {"tokens_equal": sum(t[r] == cold[r][0] for r in p),
                  "logprobs_bit_equal": sum(lp[r] == cold[r][1] for r in p),
                  "max_logprob_diff": max(abs(x[0] - y[0]) for r in p for x, y in zip(lp[r], cold[r][1])),
                  "of": len(p)} for way, (t, lp) in ways.items()}


@contextlib.contextmanager
def batch_variant(on: bool) -> Iterator[None]:
    """The engine as it was before the determinism rule reached the GPU (for the cost of the rule, measured in
    the same call): cuBLAS on the step's own row count, torch's RMSNorm, attention split per step ("auto")."""
    if not on:
        yield
        return
    import workers.engine_build as eb
    import workers.models.loader as ld
    from kernels_cupy.cupy_backend import CupyAttentionBackend

    saved = eb.default_backend, ld._batch_invariant_cuda
    eb.default_backend = lambda device: CupyAttentionBackend(split="auto")  # type: ignore[assignment]
    ld._batch_invariant_cuda = lambda model, device: None  # type: ignore[assignment]
    try:
        yield
    finally:
        eb.default_backend, ld._batch_invariant_cuda = saved


def throughput(shape: str, dtype: torch.dtype, concurrency: list[int], prompt_len: int, output_len: int,
               device: str, engines: list[str]) -> Result:
    name = str(dtype).removeprefix("torch.")
    sd = state_dict(shape, device=device)
    vocab = SHAPES[shape]["vocab_size"]
    rows: list[Result] = []
    for label in engines:  # kvgate: CUDA graphs; -eager: every step eager; -variant: the batch-variant path
        t0 = time.perf_counter()
        with batch_variant(label.endswith("-variant")):
            eng = engine(shape, sd, device, name, batched_tokens=2048, max_seqs=max(concurrency),
                         eager=label.endswith("-eager"))
        print(f"{shape} {label}: engine ready in {time.perf_counter() - t0:.1f} s (graphs captured, warmed up)")
        for c in concurrency:
            prompts = {f"c{c}-{i}": ids for i, ids in enumerate(random_prompts(c, prompt_len, vocab, seed=c))}
            t0 = time.perf_counter()
            toks, _, steps = run(eng, prompts, output_len)
            wall = time.perf_counter() - t0
            decode = [dt for n, dt in steps if n <= c]
            rows.append({"c": c, "engine": label, "wall_s": wall, "out_tok_s": sum(map(len, toks.values())) / wall,
                         "decode_step_ms_median": 1e3 * statistics.median(decode) if decode else None,
                         "steps": len(steps)})
        del eng
    hf = hf_model(shape, sd, dtype, device)
    hf_greedy(hf, random_prompts(2, 16, vocab, seed=1), 4)  # warm-up
    for c in concurrency:
        out, wall = hf_greedy(hf, random_prompts(c, prompt_len, vocab, seed=c), output_len)
        rows.append({"c": c, "engine": "transformers", "wall_s": wall, "out_tok_s": sum(map(len, out)) / wall})
    del hf
    return {"shape": shape, "dtype": name, "prompt_len": prompt_len, "output_len": output_len, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--make-expectation", type=Path)
    ap.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    ap.add_argument("--check", type=Path)
    ap.add_argument("--throughput", action="store_true")
    ap.add_argument("--throughput-shapes", default="smollm2,llama1b")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--engines", default="kvgate,kvgate-eager",
                    help="kvgate (CUDA graphs), kvgate-eager, kvgate-variant (batch-variant GEMMs/norm/attention)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script's own logic")
    a = ap.parse_args(argv)
    if a.make_expectation:
        make_expectation(a.make_expectation, a.shape)
        return
    gpu = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    report: Result = {"device": gpu, "torch": torch.__version__}
    if a.check:
        report["check"] = check(a.check, a.device)
        print(json.dumps(report["check"], indent=1), flush=True)
    if a.throughput:
        report["throughput"] = []
        for shape in a.throughput_shapes.split(","):
            r = throughput(shape, getattr(torch, a.dtype), [int(c) for c in a.concurrency.split(",")],
                           a.prompt_len, a.output_len, a.device, a.engines.split(","))
            report["throughput"].append(r)
            for row in r["rows"]:
                print(f"{shape:8} {r['dtype']:9} c{row['c']:<3} {row['engine']:12} {row['out_tok_s']:9.1f} tok/s "
                      f"wall {row['wall_s']:6.2f} s  step {row.get('decode_step_ms_median') or 0:6.2f} ms",
                      flush=True)
            if a.json:
                a.json.write_text(json.dumps(report, indent=1))
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
