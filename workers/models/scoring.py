"""Logits for every position of one token sequence, through the real model and a real paged KV cache: the
quality gate's tool (perplexity and top-1 agreement per quantization mode, logit tolerances in tests)."""

from __future__ import annotations

import torch

from kernels_cupy.interface import AttentionBackend, AttentionMetadata
from kernels_cupy.kv_quant import row_width
from workers.models.llama import LlamaForCausalLM


@torch.inference_mode()
def sequence_logits(model: LlamaForCausalLM, ids: list[int], backend: AttentionBackend,
                    chunk: int = 256, block_size: int = 16,
                    kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:  # (len(ids), V) fp32
    """Row t holds the logits that predict token t + 1. The sequence is prefilled in chunks (the path
    serving takes; chunk 1 is decode), its blocks laid out in order so slot = position, in a cache of
    ``kv_dtype`` (int8: kernels_cupy.kv_quant)."""
    c = model.cfg
    n = len(ids)
    nb = -(-n // block_size)
    shape = (nb, block_size, c.num_key_value_heads, row_width(c.head_dim, kv_dtype))  # (NB, BS, Hkv, D[+4])
    kv = [(torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype)) for _ in range(c.num_hidden_layers)]
    table = torch.arange(nb, dtype=torch.int32)[None, :]  # (1, NB)
    out = []
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        pos = torch.arange(s, e)  # (q,) int64, also the slots
        meta = AttentionMetadata(slot_mapping=pos, query_start_loc=torch.tensor([0, e - s], dtype=torch.int32),
                                 seq_lens=torch.tensor([e], dtype=torch.int32), block_tables=table,
                                 query_lens_cpu=(e - s,), seq_lens_cpu=(e,), num_decodes=int(e - s == 1),
                                 max_seq_len=e)
        out.append(model(torch.tensor(ids[s:e]), pos, kv, meta, backend, torch.arange(e - s)))
    return torch.cat(out)
