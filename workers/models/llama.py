"""Llama-family decoder (SmolLM2, Llama 2/3, Mistral; Qwen2 via attention_bias) over flattened tokens.

Every tensor of a step is flat over tokens: (T, hidden) with T the sum of all scheduled tokens, so no padding
ever reaches the matmuls. q/k/v and gate/up are fused into single matmuls. Attention goes through the
backend interface, reading and writing the paged KV cache. Logits are computed only for sampled rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from kernels_cupy.interface import AttentionBackend, AttentionMetadata
from workers.models.decode_stack import NO_LORA, DecodeStack, StackLora
from workers.models.fused import REFERENCE, FusedOps, rms_norm_ref


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2; Llama with attention_bias)
    o_proj_bias: bool = False  # bias on the output projection too (Llama with attention_bias, not Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    sliding_window: int | None = None  # Mistral's window; not implemented: max_model_len is capped at it instead

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaConfig:
        """From a transformers config dict (config.json or PretrainedConfig.to_dict())."""
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = None if rope.get("rope_type", rope.get("type", "default")) == "default" else dict(rope)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=float(theta), rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)) or cfg.get("model_type") == "qwen2",
            o_proj_bias=bool(cfg.get("attention_bias", False)) and cfg.get("model_type") != "qwen2",
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids,
            sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
        )


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:  # (D/2,) fp32
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
    s = cfg.rope_scaling
    if s is None:
        return inv
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return inv / float(s["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv, s)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


def _llama3_inv_freq(inv: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp in between.
    factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = ~(wavelen < old_len / hi) & ~(wavelen > old_len / lo)
    return torch.where(is_mid, mid, scaled)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, H) -> (T, H)
        return rms_norm_ref(x, None, self.weight, self.eps)


class RowDeltas(Protocol):
    """A step's per-row additions to projection outputs (``workers.lora.LoraBatch``: LoRA adapters' rows)."""

    def add(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> None: ...

    def stack_groups(self) -> Sequence[tuple[Any, torch.Tensor]] | None:
        """(adapter, rows (n,) int64) per group for the C++ decode stack, or None where it cannot add them."""
        ...


@dataclass
class StepCtx:
    """What every layer of one step shares: the fused ops, positions, the rope tables and, on the reference
    path only, the step's cos/sin rows (looked up once per step, not per layer)."""

    ops: FusedOps
    positions: torch.Tensor  # (T,)
    tables: tuple[torch.Tensor, torch.Tensor]  # cos, sin: (max_len, D) fp32
    rows: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin: (T, 1, D) in the model dtype, or None
    kv: tuple[torch.Tensor, torch.Tensor] = field(default=(torch.empty(0), torch.empty(0)))
    lora: RowDeltas | None = None  # the step's LoRA rows, or None (no row uses an adapter)
    layer: int = 0  # the decoder layer running now (which of an adapter's layers applies)


def project(m: nn.Module, x: torch.Tensor, step: StepCtx | None, name: str) -> torch.Tensor:
    """m(x) for a projection, plus the step's LoRA deltas on their rows: (T, in) -> (T, out)."""
    y: torch.Tensor = m(x)
    if step is not None and step.lora is not None:
        step.lora.add(step.layer, name, x, y)
    return y


class Rotary(nn.Module):
    """cos/sin tables for every position up to the model's length, looked up by position per token."""

    cos: torch.Tensor  # (max_len, D)
    sin: torch.Tensor  # (max_len, D)

    def __init__(self, cfg: LlamaConfig, max_len: int) -> None:
        super().__init__()
        # On the CPU even inside a meta-device build (loader._uninitialized, which makes these tables again after
        # the load): arange on meta is decomposed through torch._dynamo, a ~2 s import in every worker's start.
        freqs = torch.arange(max_len, dtype=torch.float32, device="cpu")[:, None] * rope_inv_freq(cfg)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)  # (max_len, D)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's cos/sin rows (T, 1, D), for the reference path, shared by every layer."""
        return self.cos[positions][:, None, :].to(dtype), self.sin[positions][:, None, :].to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.hq + 2 * self.hkv) * self.d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.hq * self.d, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.scale = self.d ** -0.5

    def forward(self, x: torch.Tensor, step: StepCtx, meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:  # (T, H) -> (T, H)
        t, kv = x.shape[0], step.kv
        qkv = project(self.qkv_proj, x, step, "qkv_proj")  # (T, (Hq + 2 Hkv) D): q, k rotated in place, one call
        step.ops.rope_qk_(qkv, self.hq + self.hkv, self.d, step.tables, step.positions, step.rows)
        q, k, v = torch.split(qkv, [self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q, k, v = q.view(t, self.hq, self.d), k.view(t, self.hkv, self.d), v.view(t, self.hkv, self.d)
        backend.write_kv(k, v, kv[0], kv[1], meta)
        o = backend.forward(q, k, v, kv[0], kv[1], meta, self.scale)  # (T, Hq, D)
        return project(self.o_proj, o.reshape(t, self.hq * self.d), step, "o_proj")


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: FusedOps = REFERENCE,
                step: StepCtx | None = None) -> torch.Tensor:  # (T, H) -> (T, H)
        gate_up = project(self.gate_up_proj, x, step, "gate_up_proj")  # (T, 2 I)
        return project(self.down_proj, ops.silu_mul(gate_up), step, "down_proj")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, step: StepCtx, meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        """x: the residual stream, updated in place (x += delta, the previous layer's MLP output, then
        x += attention); returns this layer's MLP output, which the next layer (or the final norm) adds."""
        n1, n2, ops = self.input_layernorm, self.post_attention_layernorm, step.ops
        a = self.self_attn(ops.rms_norm(x, delta, n1.weight, n1.eps), step, meta, backend)
        out: torch.Tensor = self.mlp(ops.rms_norm(x, a, n2.weight, n2.eps), ops, step)
        return out


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig, max_len: int) -> None:
        super().__init__()
        self.cfg = cfg
        # nn.Embedding's own init, except on the meta device (a model whose weights are loaded next): there torch
        # decomposes normal_ through torch._dynamo, a ~2 s import in every worker's start, for nothing
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size)  # (V, H)
        if not weight.is_meta:
            nn.init.normal_(weight)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(cfg, max_len)
        self.ops = REFERENCE  # the fused C++ ops are set by the loader where they were built
        self.stack_kernel: Any | None = None  # the decode-stack module, set by the loader where it was built
        self._stack: DecodeStack | None | bool = False  # False: not built yet (on the first decode step,
        # when quantization has swapped the linears; weights are referenced, so later in-place loads are seen)

    def decode_stack(self) -> DecodeStack | None:
        """The C++ layer stack for decode and verify steps, built once, or None where it cannot run this model."""
        if self._stack is False:
            c = self.cfg
            self._stack = DecodeStack.build(self.stack_kernel, self.layers, c.num_attention_heads,
                                            c.num_key_value_heads, c.head_dim, c.rms_norm_eps)
        return self._stack if isinstance(self._stack, DecodeStack) else None

    def _stack_step(self, x: torch.Tensor, meta: AttentionMetadata, backend: AttentionBackend,
                    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                    lora: RowDeltas | None) -> tuple[DecodeStack, StackLora] | None:
        """The C++ stack and the step's LoRA groups as it takes them, where it runs this step as the module path
        would (its LoRA rows included: it adds their deltas with the module path's kernel), else None."""
        groups = None if lora is None else lora.stack_groups()
        stack = self.decode_stack() if lora is None or groups is not None else None
        if stack is None or not stack.runs(x, meta, backend, kv_caches):
            return None
        args = NO_LORA if groups is None else stack.lora(groups)
        return None if args is None else (stack, args)

    def forward(
        self,
        input_ids: torch.Tensor,  # (T,) int64
        positions: torch.Tensor,  # (T,) int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (K, V), each (NB, BS, Hkv, D)
        meta: AttentionMetadata,
        backend: AttentionBackend,
        logits_indices: torch.Tensor,  # (S,) int64: rows whose next token is sampled
        lora: RowDeltas | None = None,  # the step's LoRA rows (None: every row runs the base model)
    ) -> torch.Tensor:  # (S, vocab) fp32
        x = self.embed_tokens(input_ids)  # (T, H): a fresh tensor, the residual stream updated in place
        tables = (self.rotary.cos, self.rotary.sin)
        rows = None if self.ops.usable(x) else self.rotary(positions, x.dtype)
        delta: torch.Tensor | None = None
        # Steps with LoRA rows run in the C++ stack too; either path gives every row the same bits, since the stack
        # runs the module path's kernels, lora_add's included, in its order (tests/test_lora_stack.py).
        stacked = None if rows is not None else self._stack_step(x, meta, backend, kv_caches, lora)
        if stacked is not None:
            delta = stacked[0].forward(x, positions, kv_caches, meta, tables, stacked[1])
        else:
            step = StepCtx(self.ops, positions, tables, rows, lora=lora)
            for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
                step.kv, step.layer = kv, i
                delta = layer(x, delta, step, meta, backend)
        x, delta = x[logits_indices], None if delta is None else delta[logits_indices]
        x = self.ops.rms_norm(x, delta, self.norm.weight, self.norm.eps)  # (S, H): only sampled rows
        logits: torch.Tensor = self.lm_head(x)
        return logits.float()
