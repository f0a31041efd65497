"""The C++ decode stack (kernels_cupy/cpu/decode_stack.cpp, workers/models/decode_stack.py) against the model's
module path: the same engine run twice, once with the stack and once without, must produce bit-identical
logits at every step, the same greedy tokens and the same KV caches (the stack calls the same kernels in the
same order, and every CPU kernel is built without FMA contraction, so no compile flag rounds differently), and
the stack must really have run the decode steps. Bitwise, because a near miss is not harmless: in int4 a
difference of 1e-6 flips int8 activation codes and reached 0.06 in the logits within a few steps."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import kernels_cupy.cpu as cpu_kernels
from kernels_cupy.cpu.fused import load_fused
from kernels_cupy.cpu.qgemm import load_qgemm
from kernels_cupy.cpu.stack import load_stack
from tests.cpu_support import built
from tests.tiny import hf_model, random_prompts, run_all
from workers.config import CacheConfig, EngineConfig, ModelConfig
from workers.core.sampling_params import SamplingParams
from workers.core.scheduler_config import SchedulerConfig
from workers.core.spec_decode import SpeculativeConfig
from workers.engine import LLMEngine
from workers.engine_build import build_model, engine_from_model
from workers.models.decode_stack import DecodeStack
from workers.models.llama import LlamaConfig, LlamaForCausalLM

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def stack_kernel() -> Any:
    return built(load_stack(), "the decode stack")


def _engine(hf: Any, quantization: str, kv_dtype: str = "auto") -> LLMEngine:
    cfg = EngineConfig(ModelConfig("tiny", "cpu", "float32", None, 0, quantization=quantization),
                       CacheConfig(4, 4096, 0.9, False, kv_cache_dtype=kv_dtype), SchedulerConfig(8, 64))
    model, max_len = build_model(LlamaConfig.from_hf(hf.config.to_dict()), dict(hf.state_dict()), cfg)
    return engine_from_model(model, cfg, max_len)


def _model(eng: LLMEngine) -> LlamaForCausalLM:
    model: LlamaForCausalLM = eng.runner.model  # type: ignore[attr-defined]
    return model


def _record(eng: LLMEngine, use_stack: bool, prompts: list[list[int]] | None = None,
            multi: list[int] | None = None) -> tuple[list[torch.Tensor], dict[str, list[int]], int]:
    """Run four requests of different lengths; the logits of every step, the tokens, and stack calls made
    (``multi`` collects the calls where some sequence had several query rows: speculative verify steps)."""
    model = _model(eng)
    calls = 0
    if use_stack:
        stack = model.decode_stack()
        assert stack is not None
        inner = stack.forward

        def counted(x: torch.Tensor, positions: torch.Tensor, kv: Any, meta: Any, tables: Any,
                    *lora: Any) -> torch.Tensor:
            nonlocal calls
            calls += 1
            if multi is not None and x.shape[0] > meta.num_seqs:
                multi.append(x.shape[0])
            return inner(x, positions, kv, meta, tables, *lora)

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
    for i, p in enumerate(prompts or random_prompts(4, 3, 40, seed=5)):
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


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_speculative_verify_steps_run_in_the_stack(stack_kernel: Any, quantization: str) -> None:
    # Prompts that repeat themselves, so the n-gram proposer drafts and verify steps (1 + K rows a sequence)
    # happen; the backend runs those rows as decode rows, and so does the stack: still bit-identical.
    hf = hf_model(seed=4)
    prompts = [p * 3 for p in random_prompts(3, 6, 12, seed=6)]
    spec = SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=10_000, acceptance_threshold=0.0)
    engines = [_engine(hf, quantization), _engine(hf, quantization)]
    for eng in engines:
        eng.scheduler.config = dataclasses.replace(eng.scheduler.config, speculative=spec)
    multi: list[int] = []
    got, tokens_a, _ = _record(engines[0], True, prompts, multi)
    want, tokens_b, _ = _record(engines[1], False, prompts)
    assert multi  # verify steps ran in the stack
    assert tokens_a == tokens_b and len(got) == len(want)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16", "int8"])
def test_stack_runs_over_bf16_fp16_and_int8_caches(stack_kernel: Any, kv_dtype: str) -> None:
    # The kernels write and read these caches (write_kv rounds as kv_quant does): the stack runs every decode
    # step and matches the module path bit for bit, logits, tokens and cache bytes.
    hf = hf_model(seed=2)
    eng_a, eng_b = _engine(hf, "int4", kv_dtype=kv_dtype), _engine(hf, "int4", kv_dtype=kv_dtype)
    got, tokens_a, calls = _record(eng_a, use_stack=True)
    want, tokens_b, _ = _record(eng_b, use_stack=False)
    assert calls >= 9 and tokens_a == tokens_b and len(got) == len(want)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    for (ka, va), (kb, vb) in zip(eng_a.runner.kv_caches, eng_b.runner.kv_caches):  # type: ignore[attr-defined]
        assert ka.dtype == getattr(torch, kv_dtype) and torch.equal(ka, kb) and torch.equal(va, vb)


def test_stack_leaves_steps_it_cannot_run_to_the_modules(stack_kernel: Any, monkeypatch: Any) -> None:
    # A KV cache dtype the stack's kernels do not read (every CPU cache dtype has a C++ path now, so fp16 is
    # taken away from the stack's list here): the stack must not run, and the engine still decodes (through
    # the modules).
    import workers.models.decode_stack as ds

    monkeypatch.setattr(ds, "KERNEL_CACHE_DTYPES", tuple(d for d in ds.KERNEL_CACHE_DTYPES if d != torch.float16))
    eng = _engine(hf_model(seed=2), "int8", kv_dtype="float16")
    _, tokens, calls = _record(eng, use_stack=True)
    assert calls == 0
    assert all(len(t) == GREEDY.max_tokens for t in tokens.values())


def test_stack_refuses_a_model_it_cannot_run(stack_kernel: Any) -> None:
    eng = _engine(hf_model(seed=3), "none")
    model = _model(eng)
    wide = torch.nn.Linear(model.cfg.intermediate_size, model.cfg.hidden_size).double()  # fp64: no C++ path
    setattr(model.layers[0].mlp, "down_proj", wide)
    assert DecodeStack.build(stack_kernel, model.layers, 4, 4, 16, 1e-5) is None
    with pytest.raises(RuntimeError, match="26 tensors"):
        stack_kernel.Stack([None] * 25, [0] * 4, [16] * 4, [0] * 4, 4, 4, 16, 1e-5)


def test_the_stack_is_bound_to_the_kernel_modules_own_tables(stack_kernel: Any) -> None:
    """The stack runs the GEMM, attention and fused-ops modules' functions (kernel_api.h): bind checks that each
    capsule is the table it names, and a wrong one changes nothing (the stack still runs as the modules do)."""
    gemm, attention, fused = load_qgemm(), cpu_kernels.load(), load_fused()
    assert gemm is not None and attention is not None and fused is not None
    with pytest.raises(RuntimeError, match="kernel_api.Gemm"):
        stack_kernel.bind(fused.api(), attention.api(), gemm.api())  # the right capsules in the wrong places
    with pytest.raises(RuntimeError, match="kernel_api.Fused"):
        stack_kernel.bind(gemm.api(), attention.api(), attention.api())
    hf = hf_model(seed=4)
    got, tokens_a, calls = _record(_engine(hf, "int4"), use_stack=True)
    want, tokens_b, _ = _record(_engine(hf, "int4"), use_stack=False)
    assert calls > 0 and tokens_a == tokens_b and len(got) == len(want)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
