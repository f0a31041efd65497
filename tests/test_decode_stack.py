"""The C++ decode stack (kernels_cupy/cpu/decode_stack.cpp, workers/models/decode_stack.py) against the model's
module path: the same engine run twice, once with the stack and once without, must produce bit-identical
logits at every step, the same greedy tokens and the same KV caches (the stack calls the same kernels in the
same order, and every CPU kernel is built without FMA contraction, so no compile flag rounds differently), and
the stack must really have run the decode steps. Bitwise, because a near miss is not harmless: in int4 a
difference of 1e-6 flips int8 activation codes and reached 0.06 in the logits within a few steps."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from kernels_cupy.cpu.stack import load_stack
from tests.tiny import hf_model, random_prompts, run_all
from workers.config import CacheConfig, EngineConfig, ModelConfig
from workers.core.sampling_params import SamplingParams
from workers.core.scheduler import SchedulerConfig
from workers.engine import LLMEngine, build_model, engine_from_model
from workers.models.decode_stack import DecodeStack
from workers.models.llama import LlamaConfig, LlamaForCausalLM

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def stack_kernel() -> Any:
    mod = load_stack()
    if mod is None:
        if os.environ.get("KVGATE_CPU_KERNEL") == "0":
            pytest.skip("CPU kernels switched off with KVGATE_CPU_KERNEL=0")
        pytest.fail("the decode stack failed to build on a machine that has the toolchain")
    return mod


def _engine(hf: Any, quantization: str, kv_dtype: str = "auto") -> LLMEngine:
    cfg = EngineConfig(ModelConfig("tiny", "cpu", "float32", None, 0, quantization=quantization),
                       CacheConfig(4, 4096, 0.9, False, kv_cache_dtype=kv_dtype), SchedulerConfig(8, 64))
    model, max_len = build_model(LlamaConfig.from_hf(hf.config.to_dict()), dict(hf.state_dict()), cfg)
    return engine_from_model(model, cfg, max_len)


def _model(eng: LLMEngine) -> LlamaForCausalLM:
    model: LlamaForCausalLM = eng.runner.model  # type: ignore[attr-defined]
    return model


def _record(eng: LLMEngine, use_stack: bool) -> tuple[list[torch.Tensor], dict[str, list[int]], int]:
    """Run four requests of different lengths; the logits of every step, the tokens, and stack calls made."""
    model = _model(eng)
    calls = 0
    if use_stack:
        stack = model.decode_stack()
        assert stack is not None
        inner = stack.forward

        def counted(*a: Any, **k: Any) -> torch.Tensor:
            nonlocal calls
            calls += 1
            return inner(*a, **k)

        stack.forward = counted  # type: ignore[method-assign]
    else:
        model._stack = None
    logits: list[torch.Tensor] = []
    forward = model.forward

    def spy(*a: Any, **k: Any) -> torch.Tensor:
        out = forward(*a, **k)
        logits.append(out.clone())
        return out

    model.forward = spy  # type: ignore[method-assign]
    for i, p in enumerate(random_prompts(4, 3, 40, seed=5)):
        eng.add_request(f"r{i}", p, GREEDY)
    return logits, run_all(eng), calls


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True, "num_key_value_heads": 2}])
def test_stack_matches_the_module_path(stack_kernel: Any, quantization: str, overrides: dict[str, Any]) -> None:
    hf = hf_model(seed=1, **overrides)
    eng_a, eng_b = _engine(hf, quantization), _engine(hf, quantization)
    got, tokens_a, calls = _record(eng_a, use_stack=True)
    want, tokens_b, _ = _record(eng_b, use_stack=False)
    assert calls >= 9  # every step after the prompts' prefill is a decode-only step of the stack
    assert tokens_a == tokens_b
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    caches_a, caches_b = eng_a.runner.kv_caches, eng_b.runner.kv_caches  # type: ignore[attr-defined]
    for (ka, va), (kb, vb) in zip(caches_a, caches_b):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_stack_leaves_steps_it_cannot_run_to_the_modules(stack_kernel: Any) -> None:
    # An int8 KV cache is written by the reference path's quantizer: the stack must not run, and the engine
    # still decodes (through the modules).
    eng = _engine(hf_model(seed=2), "int8", kv_dtype="int8")
    _, tokens, calls = _record(eng, use_stack=True)
    assert calls == 0
    assert all(len(t) == GREEDY.max_tokens for t in tokens.values())


def test_stack_refuses_a_model_it_cannot_run(stack_kernel: Any) -> None:
    eng = _engine(hf_model(seed=3), "none")
    model = _model(eng)
    wide = torch.nn.Linear(model.cfg.intermediate_size, model.cfg.hidden_size).double()  # fp64: no C++ path
    setattr(model.layers[0].mlp, "down_proj", wide)
    assert DecodeStack.build(stack_kernel, model.layers, 4, 4, 16, 1e-5) is None
    with pytest.raises(RuntimeError, match="22 tensors"):
        stack_kernel.Stack([None] * 21, [0] * 4, 4, 4, 16, 1e-5)
