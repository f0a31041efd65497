"""Random-weight Llama models of real shapes, reproducible on any machine without a model hub.

The GPU machine cannot receive smollm2's GGUF (94 MiB; a device call carries 64 MiB at most), so the GPU checks run
models of smollm2's and TinyLlama-1.1B's exact shapes with weights drawn from a seeded CPU generator: CPU
``torch.randn`` with an explicit generator draws the same numbers on every machine and torch version we use, so a
token list computed here (CPU, ``none``) is an expectation there. ``checksum`` guards that assumption: it travels
with the expectation and is compared before any token is.

Weights: N(0, std) for every matrix (std 0.2: peaked logits, so greedy choices are rarely near-ties and rounding
differences between devices rarely flip them), RMSNorm weights 1 + N(0, 0.05).
"""

from __future__ import annotations

from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    # SmolLM2-135M-Instruct's config.json (the default model)
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                    rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True),
    # TinyLlama-1.1B (Llama 2 architecture, GQA 32/4): a ~1B model whose decode is not launch-bound alone
    "llama1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                    num_attention_heads=32, num_key_value_heads=4, head_dim=64, rope_theta=10000.0,
                    rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=False),
}
EOS = 2


def hf_config_dict(shape: str) -> dict[str, Any]:
    """A transformers LlamaConfig dict (also what workers.models.llama.LlamaConfig.from_hf reads)."""
    return dict(SHAPES[shape], bos_token_id=1, eos_token_id=EOS, model_type="llama", attention_bias=False,
                mlp_bias=False, hidden_act="silu")


def _matrices(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    c = SHAPES[shape]
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [(p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)),
                (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    out.append(("model.norm.weight", (h,)))
    if not c["tie_word_embeddings"]:
        out.append(("lm_head.weight", (c["vocab_size"], h)))
    return out


def state_dict(shape: str, seed: int = 0, std: float = 0.2, device: str = "cpu") -> dict[str, torch.Tensor]:
    """transformers-named fp32 weights. ``device="cpu"`` is the reproducible draw; ``"cuda"`` draws on the GPU
    (fast, for throughput runs only: other numbers)."""
    g = torch.Generator(device=device).manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for name, dims in _matrices(shape):
        w = torch.randn(dims, generator=g, device=device)
        sd[name] = 1.0 + 0.05 * w if len(dims) == 1 else w * std
    return sd


def checksum(sd: dict[str, torch.Tensor]) -> list[float]:
    """A few exact sums that differ if the draw differs (compared with ==, they are float64 sums of fp32)."""
    names = sorted(sd)
    return [float(sd[n].double().sum()) for n in (names[0], names[len(names) // 2], names[-1])]


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Prompt token ids in [3, vocab): no BOS/EOS/pad, so nothing ends early."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]
