"""Tiny random-weight Llama models built in the test itself, with a transformers twin as the oracle."""

from __future__ import annotations

from typing import Any

import torch

from workers.config import CacheConfig, EngineConfig, ModelConfig
from workers.core.scheduler_config import SchedulerConfig
from workers.engine import LLMEngine
from workers.engine_build import build_model, engine_from_model
from workers.models.llama import LlamaConfig

VOCAB = 512
EOS = 3


def hf_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig as HFLlamaConfig

    kw: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                              initializer_range=0.3, bos_token_id=1, eos_token_id=EOS)
    kw.update(overrides)
    return HFLlamaConfig(**kw)


def hf_model(seed: int = 0, **overrides: Any) -> Any:
    """A transformers Llama with random weights (large init so greedy choices are not near-ties)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(hf_config(**overrides)).eval()


def tiny_engine(hf: Any, *, block_size: int = 4, kv_cache_tokens: int = 4096, max_num_seqs: int = 32,
                max_num_batched_tokens: int = 64, prefix: bool = True, seed: int = 0,
                max_model_len: int | None = None) -> LLMEngine:
    cfg = EngineConfig(ModelConfig("tiny", "cpu", "float32", max_model_len, seed),
                       CacheConfig(block_size, kv_cache_tokens, 0.9, prefix),
                       SchedulerConfig(max_num_seqs, max_num_batched_tokens))
    llama_cfg = LlamaConfig.from_hf(hf.config.to_dict())
    model, max_len = build_model(llama_cfg, dict(hf.state_dict()), cfg)
    return engine_from_model(model, cfg, max_len)


def run_all(engine: LLMEngine) -> dict[str, list[int]]:
    """Step until idle; collect each request's tokens. Guards against a scheduler that never finishes."""
    out: dict[str, list[int]] = {}
    for _ in range(100_000):
        if not engine.has_unfinished():
            return out
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise RuntimeError("engine did not finish")


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)
    return list(out[0, len(prompt):].tolist())


def random_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(4, VOCAB, (L,), generator=g).tolist() for L in lens]
