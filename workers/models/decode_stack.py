"""Steps through the C++ layer stack (``kernels_cupy/cpu/decode_stack.cpp``).

The module path calls ~12 modules and kernels per decoder layer; for a single stream of SmolLM2 that
dispatch (~4 ms a step) was a third of the step. The stack runs the same kernels in the same order from
C++ and returns what the last layer's MLP gave, so the model's final norm and head run as before.
It runs a step only where it computes what the module path would (anything else takes the module path):
every query row attends as a decode row, as the CPU backend runs every row it can (decodes, and prefill or
speculative verify chunks of any length, over a cached prefix or not: ``kernels_cupy.cpu.backend.step_rows``),
fp32 activations, fp32/bf16/int8 KV caches, the CPU attention kernel, and projections that are block linears
or fixed-order fp32 linears (``DenseLinear``): the same kernels the module path calls, so both give the same bits
for any number of rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kernels_cupy.cpu.backend import KERNEL_CACHE_DTYPES, CpuAttentionBackend, step_rows
from kernels_cupy.interface import AttentionMetadata
from workers.models.linear import BlockLinear, DenseLinear


def _linear_spec(m: nn.Module) -> tuple[int, int, list[torch.Tensor | None]] | None:
    """(bits, act_bits, [codes, d, m, mt, bias, dense]) for the C++ side, or None where it cannot run the layer
    as the module path does (a BlockLinear without its kernel, a plain nn.Linear: torch's BLAS, whose
    arithmetic the stack does not reproduce)."""
    if isinstance(m, BlockLinear) and m.dense is None:
        return m.bits, m.act_bits, [m.codes, m.d, m.m, m.mt, m.bias, None]
    if isinstance(m, DenseLinear) and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu":
        bias = None if m.bias is None else m.bias.detach()
        return 0, 16, [None, None, None, None, bias, m.weight.detach()]
    return None


def _parts(layer: Any) -> tuple[list[torch.Tensor], list[nn.Module]]:
    """A DecoderLayer's two norm weights and four projections, in the order decode_stack.cpp takes them."""
    attn, mlp = layer.self_attn, layer.mlp
    norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    return norms, [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]


class DecodeStack:
    """The model's decoder layers as one C++ object holding references to their weights (no copies)."""

    def __init__(self, kernel: Any, layers: nn.ModuleList, hq: int, hkv: int, head_dim: int, eps: float) -> None:
        tensors: list[torch.Tensor | None] = []
        bits: list[int] = []
        act_bits: list[int] = []
        for layer in layers:
            norms, projs = _parts(layer)
            tensors += [w.detach() for w in norms]
            for proj in projs:
                spec = _linear_spec(proj)
                if spec is None:
                    raise ValueError(f"no decode-stack path for {type(proj).__name__}")
                bits.append(spec[0])
                act_bits.append(spec[1])
                tensors += spec[2]
        self._stack = kernel.Stack(tensors, bits, act_bits, hq, hkv, head_dim, eps)
        self.scale = head_dim ** -0.5

    @staticmethod
    def build(kernel: Any | None, layers: nn.ModuleList, hq: int, hkv: int, head_dim: int,
              eps: float) -> DecodeStack | None:
        """The stack, or None where the kernel is missing or a layer has no C++ path (its dtype, its kind)."""
        if kernel is None:
            return None
        for layer in layers:
            norms, projs = _parts(layer)
            if any(w.dtype != torch.float32 or w.device.type != "cpu" for w in norms):
                return None
            if any(_linear_spec(p) is None for p in projs):
                return None
        return DecodeStack(kernel, layers, hq, hkv, head_dim, eps)

    @staticmethod
    def runs(x: torch.Tensor, meta: AttentionMetadata, backend: Any,
             kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether this step is one the stack computes exactly as the module path would: the CPU backend, which
        runs every query row as a decode row (decodes, prefill and verify chunks of any length, cached prefix or
        not), fp32 activations, a KV cache the kernels write and read (fp32, bf16, fp16, int8)."""
        if not (isinstance(backend, CpuAttentionBackend) and x.dtype == torch.float32 and x.device.type == "cpu"
                and x.shape[0] > 0):
            return False
        return all(k.dtype in KERNEL_CACHE_DTYPES and v.dtype == k.dtype for k, v in kv_caches)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x (T, H): the residual stream, updated in place; returns the last layer's MLP output (T, H)."""
        # Each query row as a decode row, exactly the rows the CPU backend attends: (T, nb) tables, (T,) lengths.
        block_tables, seq_lens = step_rows(meta, kv_caches[0][0].shape[1])
        out: torch.Tensor = self._stack.forward(
            x, [k for k, _ in kv_caches], [v for _, v in kv_caches], block_tables, seq_lens,
            meta.slot_mapping, positions, tables[0], tables[1], self.scale)
        return out
