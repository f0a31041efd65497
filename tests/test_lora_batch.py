"""LoRA rows among other rows: a mixed batch of base + 3 adapters gives every request exactly (tokens and every
logprob, ==) what it gets served alone, in every base linear mode; base rows served alone and the mixed steps
both run the C++ decode stack (tests/test_lora_stack.py pins the stack against the module path with LoRA rows).
Prefix-cache isolation between adapters and the base, the resident set (LRU, pins), unknown adapters."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.lora_support import lora_engine, three_adapters
from tests.tiny import hf_model, random_prompts
from workers.core.outputs import StepOutput
from workers.core.sampling_params import SamplingParams
from workers.engine import LLMEngine
from workers.models.decode_stack import DecodeStack

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
Answer = tuple[list[int], list[Any], int]  # tokens, logprobs, cached prompt tokens


@pytest.fixture(scope="module")
def hf() -> Any:
    return hf_model(seed=0)


@pytest.fixture(scope="module")
def loras(hf: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return three_adapters(hf, tmp_path_factory.mktemp("loras"))

def drain(eng: LLMEngine) -> dict[str, Answer]:
    out: dict[str, Answer] = {}
    for _ in range(10_000):
        if not eng.has_unfinished():
            return out
        for o in eng.step():
            _collect(out, o)
    raise RuntimeError("engine did not finish")


def _collect(out: dict[str, Answer], o: StepOutput) -> None:
    toks, lps, _ = out.get(o.request_id, ([], [], 0))
    out[o.request_id] = (toks + o.new_token_ids, lps + list(o.logprobs or []), o.num_cached_tokens)


@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
def test_mixed_batch_equals_each_served_alone(hf: Any, loras: Path, mode: str, monkeypatch: Any) -> None:
    stack_steps = [0]
    forward = DecodeStack.forward

    def counted(self: DecodeStack, *args: Any) -> Any:
        stack_steps[0] += 1
        return forward(self, *args)

    monkeypatch.setattr(DecodeStack, "forward", counted)
    prompts = random_prompts(8, 3, 60, seed=11)
    names = [None, "attn", "mlp", "all", "all", None, "attn", "mlp"]
    mixed = lora_engine(hf, loras, quantization=mode, max_num_batched_tokens=40)  # chunks beside decodes
    pending = [(f"r{i}", p, PARAMS, None, 1.0, None, 0, n) for i, (p, n) in enumerate(zip(prompts, names))]
    got: dict[str, Answer] = {}
    for step in range(10_000):  # arrivals mid-run: every request shares steps with changing company
        if pending and step % 2 == 0:
            mixed.add_request(*pending.pop(0))
        if not pending and not mixed.has_unfinished():
            break
        for o in mixed.step():
            _collect(got, o)
    stack_steps[0] = 0
    alone = lora_engine(hf, loras, quantization=mode)
    assert alone.runner.model.decode_stack() is not None, "base rows alone must run the C++ stack here"
    for i, (p, n) in enumerate(zip(prompts, names)):
        fresh = lora_engine(hf, loras, quantization=mode) if i else alone
        fresh.add_request("solo", p, PARAMS, lora=n)
        solo = drain(fresh)["solo"]
        if n is None:  # the base model alone runs every step in the C++ stack
            assert stack_steps[0] > 0
        stack_steps[0] = 0
        assert got[f"r{i}"][:2] == solo[:2], f"request {i} (adapter {n}) differs from itself served alone"
    assert len({tuple(got[f"r{i}"][0]) for i in (1, 2, 3)} | {tuple(got["r0"][0])}) > 1


def test_prefix_cache_is_never_shared_across_adapters(hf: Any, loras: Path) -> None:
    eng = lora_engine(hf, loras, block_size=4)
    prompt = random_prompts(1, 30, 30, seed=12)[0]
    answers: dict[str, Answer] = {}
    for i, name in enumerate([None, "attn", "all", "attn", None, "all"]):
        eng.add_request(f"q{i}", prompt, PARAMS, lora=name)
        answers[f"q{i}"] = drain(eng)[f"q{i}"]
    assert [answers[f"q{i}"][2] for i in range(3)] == [0, 0, 0]  # first under each: cold
    assert all(answers[f"q{i}"][2] > 0 for i in (3, 4, 5))  # again under the same adapter: a hit
    for cold, hit in ((0, 4), (1, 3), (2, 5)):
        assert answers[f"q{cold}"][:2] == answers[f"q{hit}"][:2]


def test_resident_adapters_are_bounded_lru_and_pinned_while_used(hf: Any, loras: Path) -> None:
    eng = lora_engine(hf, loras, max_loras=1, max_cpu_loras=2)
    reg = eng.loras
    assert reg is not None
    prompt = [5, 6, 7, 8, 9]
    for name in ("attn", "mlp", "all"):
        eng.add_request(name, prompt, PARAMS, lora=name)  # all three in flight: pinned, the bound is exceeded
    assert sorted(reg.loading) == ["all", "attn", "mlp"] and reg.resident == []  # read beside the engine
    for _ in range(1000):  # let the three loads end, then one step makes them resident together
        if not reg.loads_in_flight:
            break
        time.sleep(0.01)
    eng.step()
    assert sorted(reg.resident) == ["all", "attn", "mlp"] and reg.loading == []
    drain(eng)
    assert len(reg.resident) == 2 and reg.loads == 3  # back under the bound once nobody uses them
    eng.add_request("again", prompt, PARAMS, lora=reg.resident[-1])
    drain(eng)
    assert reg.loads == 3  # a resident adapter is not read again


def test_unknown_adapter_finishes_with_a_clear_error(hf: Any, loras: Path) -> None:
    eng = lora_engine(hf, loras)
    for rid, name in (("x", "nope"), ("y", "../loras"), ("z", ".hidden")):
        eng.add_request(rid, [5, 6, 7], PARAMS, lora=name)
    eng.add_request("ok", [5, 6, 7], PARAMS)
    outs = {o.request_id: o for o in eng.step()}
    for rid in ("x", "y", "z"):
        assert outs[rid].error_code == "model_not_found" and outs[rid].finish_reason is not None
        assert outs[rid].error is not None and "LoRA adapter" in outs[rid].error
    assert eng.loras is not None and eng.loras.resident == []
    drain(eng)
    no_dir = lora_engine(hf, None)
    no_dir.add_request("w", [5, 6, 7], PARAMS, lora="attn")
    (out,) = no_dir.step()
    assert out.error_code == "model_not_found" and "no lora_dir" in (out.error or "")


def test_the_cpu_kernel_gives_the_python_loops_bits(hf: Any, loras: Path) -> None:
    """``lora_add`` (one C++ call a projection, adapter groups on the threads) against the Python loop it replaced
    (flinear per group and slice, then the scale and the add): the same bits on every projection and layer, for
    groups of 1-5 rows of three adapters (ranks 4, 8, 16, each its own targets) among base rows, at 1 and 2
    threads."""
    import torch

    from kernels_cupy.cpu.qgemm import load_qgemm
    from tests.cpu_support import built
    from workers.lora.adapter import load_adapter
    from workers.lora.batch import LoraBatch
    from workers.models.llama import LlamaConfig

    kernel = built(load_qgemm(), "the quantized GEMM kernel")
    base = LlamaConfig.from_hf(hf.config.to_dict())
    adapters = [load_adapter(loras / n, n, base) for n in ("attn", "mlp", "all")]
    rows = {"attn": [0, 3], "mlp": [5], "all": [1, 2, 6, 8, 9]}  # rows 4 and 7: the base
    g = torch.Generator().manual_seed(7)
    sizes = {"qkv_proj": (base.hidden_size, base.num_attention_heads * base.head_dim
                          + 2 * base.num_key_value_heads * base.head_dim),
             "o_proj": (base.num_attention_heads * base.head_dim, base.hidden_size),
             "gate_up_proj": (base.hidden_size, 2 * base.intermediate_size),
             "down_proj": (base.intermediate_size, base.hidden_size)}
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            fused = LoraBatch.build(rows, {a.name: a for a in adapters}, kernel, torch.device("cpu"))
            loop = LoraBatch.build(rows, {a.name: a for a in adapters}, kernel, torch.device("cpu"))
            assert fused is not None and loop is not None and fused._fused
            loop._fused = False
            for layer in range(base.num_hidden_layers):
                for proj, (n_in, n_out) in sizes.items():
                    x = torch.randn(10, n_in, generator=g)
                    y = torch.randn(10, n_out, generator=g)
                    y_fused, y_loop = y.clone(), y.clone()
                    fused.add(layer, proj, x, y_fused)
                    loop.add(layer, proj, x, y_loop)
                    assert torch.equal(y_fused, y_loop), (t, layer, proj)
                    assert torch.equal(y_fused[[4, 7]], y[[4, 7]])  # base rows untouched
                    assert not torch.equal(y_fused, y)
    finally:
        torch.set_num_threads(threads)
