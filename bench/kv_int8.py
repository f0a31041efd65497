"""Decode speed with an fp32, bf16 and int8 KV cache at a long context, in one invocation (ratios only within it).

Per KV dtype and batch size: B sequences, each with a CTX-token context already in the paged cache (random
contents: speed does not depend on them), then (a) the decode attention alone, every layer's cache through
the CPU backend (the C++ kernel), and (b) the whole model's decode step (B new tokens, one per sequence).
Repetitions go round-robin over the dtypes (after one warm-up round); the median of --reps is reported.

    .venv/bin/python bench/kv_int8.py [--ctx 2048] [--batches 1,16] [--kv float32,bfloat16,int8] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from kernels_cupy.cpu import cpu_backend_or_reference
from kernels_cupy.interface import AttentionMetadata
from kernels_cupy.kv_quant import row_width, to_cache
from workers.config import EngineConfig, ModelConfig
from workers.engine_build import build_model
from workers.model_files import gguf_source, resolve
from workers.models.llama import LlamaConfig, LlamaForCausalLM
from workers.models.loader import load_state_dict, read_config

BS = 16


def caches(model: LlamaForCausalLM, nb: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    c = model.cfg
    g = torch.Generator().manual_seed(0)

    def one() -> torch.Tensor:  # (NB, BS, Hkv, D[+4]), filled block by block to keep the fp32 peak small
        t = torch.empty(nb, BS, c.num_key_value_heads, row_width(c.head_dim, dtype), dtype=dtype)
        for i in range(0, nb, 256):
            t[i:i + 256] = to_cache(torch.randn(min(256, nb - i), BS, c.num_key_value_heads, c.head_dim,
                                                generator=g), dtype)
        return t

    return [(one(), one()) for _ in range(c.num_hidden_layers)]


def decode_meta(batch: int, ctx: int) -> AttentionMetadata:
    per = -(-(ctx + 1) // BS)
    tables = torch.arange(batch * per, dtype=torch.int32).view(batch, per)  # (B, blocks) disjoint
    slots = tables[:, ctx // BS].long() * BS + ctx % BS  # (B,) where each new token goes
    lens = (ctx + 1,) * batch
    return AttentionMetadata(slot_mapping=slots, query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
                             query_lens_cpu=(1,) * batch, seq_lens_cpu=lens, num_decodes=batch,
                             max_seq_len=ctx + 1)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--quantization", default="int8", help="linear layers (the KV cache is what varies)")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--kv", default="float32,bfloat16,int8")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    files = resolve(a.model)
    cfg = EngineConfig(ModelConfig(a.model, quantization=a.quantization, max_model_len=a.ctx + 8))
    model, _ = build_model(LlamaConfig.from_hf(read_config(files.directory)), load_state_dict(files.directory),
                           cfg, gguf_source(a.model))
    backend = cpu_backend_or_reference()  # the C++ decode kernel, or the reference where it is not built
    c = model.cfg
    for batch in (int(b) for b in a.batches.split(",")):
        meta = decode_meta(batch, a.ctx)
        nb = int(meta.block_tables.numel())
        ids = torch.randint(0, c.vocab_size, (batch,))
        pos = torch.full((batch,), a.ctx, dtype=torch.int64)
        rows = torch.arange(batch)
        q = torch.randn(batch, c.num_attention_heads, c.head_dim)
        kvs = {kv: caches(model, nb, getattr(torch, kv)) for kv in a.kv.split(",")}
        times: dict[str, tuple[list[float], list[float]]] = {kv: ([], []) for kv in kvs}
        for rep in range(a.reps + 1):  # round-robin over dtypes, so load from elsewhere hits them alike
            for kv, kvc in kvs.items():
                attn = timed(lambda: [backend._decode(q, k, v, meta, c.head_dim ** -0.5) for k, v in kvc])
                step = timed(lambda: model(ids, pos, kvc, meta, backend, rows))
                if rep:  # the first round warms up
                    times[kv][0].append(attn)
                    times[kv][1].append(step)
        for kv, kvc in kvs.items():
            attn, step = statistics.median(times[kv][0]), statistics.median(times[kv][1])
            kv_mib = sum(k.numel() * k.element_size() * 2 for k, _ in kvc) / 2**20
            print(json.dumps({"kv": kv, "batch": batch, "ctx": a.ctx, "weights": a.quantization,
                              "kv_cache_mib": round(kv_mib, 1), "attention_ms": round(attn * 1e3, 2),
                              "step_ms": round(step * 1e3, 2), "decode_tok_s": round(batch / step, 2)}),
                  flush=True)
        del kvs

if __name__ == "__main__":
    main()
