"""A GGUF's own quantized blocks for our fused linear layers, read straight from the file (memory-mapped by
``common.gguf_index``), so a quantized mode runs the very weights llama.cpp runs instead of re-quantizing the
fp32 weights that transformers de-quantized."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from common.gguf_index import Tensor, read_tensors
from workers.models.llama import LlamaConfig
from workers.models.quant import GGUF_LAYOUTS, BlockWeight, from_gguf


def rope_row_order(n: int, heads: int) -> torch.Tensor:  # (n,) int64
    """GGUF stores q/k rows permuted for llama.cpp's rope (pairs interleaved per head); transformers'
    ``_reverse_permute_weights`` undoes it: HF row r is GGUF row ``order[r]``. Rows are whole, so the
    blocks (which run along the input dimension) survive the permutation untouched."""
    return torch.arange(n).reshape(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)


class _Reader:
    def __init__(self, path: Path) -> None:
        self.tensors: dict[str, Tensor] = read_tensors(path)  # not GGUFReader: seconds decoding the metadata

    def block(self, name: str, heads: int | None = None) -> BlockWeight | None:
        t = self.tensors.get(name)
        if t is None or t.tensor_type.name not in GGUF_LAYOUTS:
            return None
        k, n = (int(x) for x in t.shape)  # GGUF lists dims innermost first: (K, N)
        w = from_gguf(t.data, t.tensor_type.name, n, k)
        return w if heads is None else w.rows(rope_row_order(n, heads))

    def fused(self, names: list[str], heads: list[int | None]) -> BlockWeight | None:
        parts = [self.block(n, h) for n, h in zip(names, heads)]
        if any(p is None for p in parts) or len({p.bits for p in parts if p is not None}) != 1:
            return None  # a part without a mapping, or mixed formats: quantized from fp32 instead
        return BlockWeight.cat([p for p in parts if p is not None])


def gguf_linear_blocks(path: Path, cfg: LlamaConfig) -> dict[str, BlockWeight]:
    """Our module names (``layers.3.mlp.gate_up_proj``, ``lm_head``) -> the GGUF's blocks. Layers whose
    tensors have no block mapping (K-quants, f16, ...) are absent."""
    r = _Reader(path)
    out: dict[str, BlockWeight | None] = {}
    for i in range(cfg.num_hidden_layers):
        b = f"blk.{i}."
        out[f"layers.{i}.self_attn.qkv_proj"] = r.fused(
            [b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"],
            [cfg.num_attention_heads, cfg.num_key_value_heads, None])
        out[f"layers.{i}.self_attn.o_proj"] = r.block(b + "attn_output.weight")
        out[f"layers.{i}.mlp.gate_up_proj"] = r.fused([b + "ffn_gate.weight", b + "ffn_up.weight"], [None, None])
        out[f"layers.{i}.mlp.down_proj"] = r.block(b + "ffn_down.weight")
    # A tied head is the embedding table itself (GGUF then has no output.weight).
    out["lm_head"] = r.block("output.weight") if "output.weight" in r.tensors else r.block("token_embd.weight")
    return {k: v for k, v in out.items() if v is not None}


def layer_bits(blocks: dict[str, BlockWeight]) -> int | None:
    """The block width most decoder layers use (the head is often kept wider), or None without blocks."""
    counts = Counter(w.bits for name, w in blocks.items() if name != "lm_head")
    return counts.most_common(1)[0][0] if counts else None
