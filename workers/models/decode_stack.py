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

LoRA rows run here too: a step's adapter groups (``workers.lora.LoraBatch``) reach the C++ side as one handle per
adapter (its weights by reference, built once per adapter load and cached here while the adapter lives) and the
group's rows; after each projection the stack calls ``lora_add`` with the arguments the module path passes it, so a
row's bits do not depend on the path (tests/test_lora_stack.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from kernels_cupy.cpu.backend import KERNEL_CACHE_DTYPES, CpuAttentionBackend, step_rows
from kernels_cupy.interface import AttentionMetadata
from workers.models.linear import BlockLinear, DenseLinear


def _linear_spec(m: nn.Module) -> tuple[int, int, bool, list[torch.Tensor | None]] | None:
    """(bits, act_bits, wlanes, [codes, d, m, mt, bias, dense]) for the C++ side, or None where it cannot run the layer
    as the module path does (a BlockLinear without its kernel, a plain nn.Linear: torch's BLAS, whose
    arithmetic the stack does not reproduce)."""
    if isinstance(m, BlockLinear) and m.dense is None:
        return m.bits, m.act_bits, m.wlanes, [m.codes, m.d, m.m, m.mt, m.bias, None]
    if isinstance(m, DenseLinear) and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu":
        bias = None if m.bias is None else m.bias.detach()
        return 0, 16, False, [None, None, None, None, bias, m.weight.detach()]
    return None


# decode_stack.cpp's Proj order: an adapter's weights are listed per layer in this order.
STACK_PROJS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# The step's LoRA groups as the C++ forward takes them: one LoraAdapter handle and one rows tensor (n,) int64 each.
StackLora = tuple[list[Any], list[torch.Tensor]]
NO_LORA: StackLora = ([], [])
# An adapter's weights as decode_stack.cpp's LoraAdapter takes them: per layer and projection its stacked A (None:
# not targeted), its slices' B and their (lo, hi, rlo, rhi) columns.
AdapterWeights = tuple[list[torch.Tensor | None], list[list[torch.Tensor]], list[list[int]]]


def _adapter_weights(adapter: Any) -> AdapterWeights | None:
    """A ``workers.lora.LoraAdapter``'s stacked A, slice B's and slice columns per layer and projection (in
    STACK_PROJS order), or None where a weight is not on the CPU (the C++ side reads host memory only)."""
    a: list[torch.Tensor | None] = []
    b: list[list[torch.Tensor]] = []
    cols: list[list[int]] = []
    for layer in adapter.layers:
        for name in STACK_PROJS:
            p = layer.get(name)
            a.append(None if p is None else p.a)
            b.append([] if p is None else p.bs)
            cols.append([] if p is None else p.cols)
    if any(w.device.type != "cpu" for w in a if w is not None) or any(w.device.type != "cpu" for bs in b for w in bs):
        return None
    return a, b, cols


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
        wlanes: list[int] = []
        for layer in layers:
            norms, projs = _parts(layer)
            tensors += [w.detach() for w in norms]
            for proj in projs:
                spec = _linear_spec(proj)
                if spec is None:
                    raise ValueError(f"no decode-stack path for {type(proj).__name__}")
                bits.append(spec[0])
                act_bits.append(spec[1])
                wlanes.append(int(spec[2]))
                tensors += spec[3]
        self._stack = kernel.Stack(tensors, bits, act_bits, wlanes, hq, hkv, head_dim, eps)
        self._kernel = kernel
        self._num_layers = len(layers)
        self.scale = head_dim ** -0.5
        # id(adapter) -> (a weak reference to it, its C++ LoraAdapter or None: the stack cannot run it). The entry
        # goes when the adapter does (the registry evicted it), so the handle never keeps its weights alive.
        self._adapters: dict[int, tuple[weakref.ref[Any], Any | None]] = {}

    def _handle(self, adapter: Any) -> Any | None:
        """The adapter's C++ handle, built at its first step here and kept while the adapter lives."""
        key = id(adapter)
        entry = self._adapters.get(key)
        if entry is not None and entry[0]() is adapter:
            return entry[1]
        weights = _adapter_weights(adapter) if len(adapter.layers) == self._num_layers else None
        handle = None if weights is None else self._kernel.LoraAdapter(float(adapter.scale), *weights)
        cache = self._adapters

        def forget(ref: weakref.ref[Any]) -> None:
            if cache.get(key, (None, None))[0] is ref:
                del cache[key]

        cache[key] = (weakref.ref(adapter, forget), handle)
        return handle

    def lora(self, groups: Sequence[tuple[Any, torch.Tensor]]) -> StackLora | None:
        """The step's LoRA groups ((adapter, rows (n,) int64) each, ``LoraBatch.stack_groups``) as the C++ forward
        takes them, or None where some adapter cannot run here (the step then takes the module path)."""
        handles: list[Any] = []
        for adapter, _ in groups:
            handle = self._handle(adapter)
            if handle is None:
                return None
            handles.append(handle)
        return handles, [rows for _, rows in groups]

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
                meta: AttentionMetadata, tables: tuple[torch.Tensor, torch.Tensor],
                lora: StackLora = NO_LORA) -> torch.Tensor:
        """x (T, H): the residual stream, updated in place; returns the last layer's MLP output (T, H). ``lora``:
        the step's adapter groups from ``self.lora`` (none by default)."""
        # Each query row as a decode row, exactly the rows the CPU backend attends: (T, nb) tables, (T,) lengths.
        block_tables, seq_lens = step_rows(meta, kv_caches[0][0].shape[1])
        out: torch.Tensor = self._stack.forward(
            x, [k for k, _ in kv_caches], [v for _, v in kv_caches], block_tables, seq_lens,
            meta.slot_mapping, positions, tables[0], tables[1], self.scale, lora[0], lora[1])
        return out
