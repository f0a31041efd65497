"""Quality gate on the default model: per quantization mode, perplexity over the shipped text
(bench/data/quality_text.txt, 2,910 tokens) and top-1 agreement of every position's argmax with fp32 (``none``).
Prefill runs in chunks of --chunk tokens, as serving does.

    .venv/bin/python bench/quality.py [--modes none,int8,int4,int8-a8,int4-a8] [--kv float32,int8] [--chunk 256]

``--kv`` adds KV cache dtypes (each mode runs with each; int8 is kernels_cupy.kv_quant: per token and head
scales); agreement is against the first mode with the first KV dtype.

Thresholds (stated in bench/RESULTS.md): the 16-bit-activation modes (int8, int4: ``auto``'s) >= 99% top-1
agreement with fp32 of the same weights and perplexity within 0.2% of it (int4 on a Q4 GGUF runs exactly the
weights ``none`` runs, the GGUF de-quantized); the ``-a8`` modes (llama.cpp's numerics) within 1% and >= 95%.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from workers.config import EngineConfig, ModelConfig
from workers.engine_build import build_model, default_backend
from workers.model_files import gguf_source, resolve
from workers.models.loader import load_state_dict, read_config
from workers.models.llama import LlamaConfig
from workers.models.scoring import sequence_logits

TEXT = Path(__file__).with_name("data") / "quality_text.txt"


def text_ids(model: str) -> list[int]:
    """The shipped quality text as the model's token ids."""
    from transformers import AutoTokenizer

    ids: list[int] = AutoTokenizer.from_pretrained(resolve(model).directory).encode(TEXT.read_text())
    return ids


@functools.lru_cache(maxsize=1)
def _weights(model: str) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """The model's config and state dict, read once for every mode built from them."""
    directory = resolve(model).directory
    return LlamaConfig.from_hf(read_config(directory)), load_state_dict(directory)


def mode_model(model: str, mode: str, max_model_len: int) -> Any:
    """The model built as the engine builds it under --quantization mode."""
    llama_cfg, sd = _weights(model)
    cfg = EngineConfig(ModelConfig(model, quantization=mode, max_model_len=max_model_len))
    built, _ = build_model(llama_cfg, dict(sd), cfg, gguf_source(model))  # a dict of its own: the cached one is shared
    return built


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--modes", default="none,int8,int4,int8-a8,int4-a8")
    ap.add_argument("--kv", default="float32", help="KV cache dtypes, comma-separated (float32, bfloat16, int8)")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ids = text_ids(a.model)
    target = torch.tensor(ids[1:])
    base: torch.Tensor | None = None
    for mode in a.modes.split(","):
        model = mode_model(a.model, mode, len(ids) + 1)
        for kv in a.kv.split(","):
            t0 = time.perf_counter()
            logits = sequence_logits(model, ids, default_backend(torch.device("cpu")), chunk=a.chunk,
                                     kv_dtype=getattr(torch, kv))[:-1]
            secs = time.perf_counter() - t0
            ppl = math.exp(F.cross_entropy(logits, target).item())
            top1 = logits.argmax(-1)
            base = top1 if base is None else base
            agree = (top1 == base).float().mean().item()
            print(json.dumps({"mode": mode, "kv": kv, "tokens": len(ids), "chunk": a.chunk,
                              "perplexity": round(ppl, 4), "top1_agreement_vs_first": round(agree, 4),
                              "seconds": round(secs, 2)}), flush=True)


if __name__ == "__main__":
    main()
