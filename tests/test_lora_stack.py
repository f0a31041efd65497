"""LoRA rows inside the C++ decode stack (kernels_cupy/cpu/decode_stack.cpp, workers/models/decode_stack.py)
against the model's module path (the stack switched off, as KVGATE_DECODE_STACK=0 does): steps that mix base
rows with rows of four adapters (ranks 4, 16, 8; one saved in bf16, kept at 16 bits), decodes beside prefill
chunks, must give bit-identical logits at every step, the same tokens and logprobs, and the same KV caches. The
stack calls lora_add after each projection with the module path's arguments, so anything short of equality is a
bug (a near miss flips int8 activation codes in the next layer and grows)."""

from __future__ import annotations

import gc
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels_cupy.cpu.stack import load_stack
from tests.cpu_support import built
from tests.lora_support import lora_engine, three_adapters
from tests.tiny import hf_model, random_prompts
from workers.core.sampling_params import SamplingParams
from workers.engine import LLMEngine
from workers.lora.adapter import load_adapter
from workers.lora.batch import LoraBatch
from workers.models.decode_stack import DecodeStack
from workers.models.llama import LlamaConfig, LlamaForCausalLM

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
NAMES = [None, "attn", "mlp", "all", "all16", None, "attn", "all16"]  # two rows of most adapters, two base rows


@pytest.fixture(scope="module")
def stack_kernel() -> Any:
    return built(load_stack(), "the decode stack")


@pytest.fixture(scope="module")
def hf() -> Any:
    return hf_model(seed=0)


@pytest.fixture(scope="module")
def loras(hf: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The standard three, and "all" re-saved in bf16 as "all16" (the registry keeps it at 16 bits)."""
    from safetensors.torch import load_file, save_file

    d = three_adapters(hf, tmp_path_factory.mktemp("loras"))
    shutil.copytree(d / "all", d / "all16")
    weights = d / "all16" / "adapter_model.safetensors"
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in load_file(str(weights)).items()}, str(weights))
    return d


class Run:
    """One engine's record: logits of every step, each request's tokens and logprobs, and the stack's calls."""

    def __init__(self) -> None:
        self.logits: list[torch.Tensor] = []
        self.answers: dict[str, tuple[list[int], list[Any]]] = {}
        self.lora_calls: list[tuple[int, int, int]] = []  # per stack call with LoRA rows: (T, groups, LoRA rows)


def _spy(model: LlamaForCausalLM, run: Run, use_stack: bool) -> None:
    """Record the model's logits, and (with the stack) its calls that carried LoRA groups; or switch it off."""
    if use_stack:
        stack = model.decode_stack()
        assert stack is not None
        inner = stack.forward

        def counted(x: torch.Tensor, *args: Any) -> torch.Tensor:
            handles, rows = args[-1]
            if handles:
                run.lora_calls.append((x.shape[0], len(handles), sum(len(r) for r in rows)))
            return inner(x, *args)

        setattr(stack, "forward", counted)
    else:
        model._stack = None  # decode_stack() answers None: every step runs the module path
    forward = model.forward

    def logits(*a: Any, **k: Any) -> torch.Tensor:
        out = forward(*a, **k)
        run.logits.append(out.clone())
        return out

    model.forward = logits  # type: ignore[method-assign]


def _loaded(eng: LLMEngine) -> None:
    """Wait out the adapter loads started beside the engine, so a request joins at the same step in every run."""
    reg = eng.loras
    assert reg is not None
    for _ in range(6000):
        if not reg.loads_in_flight:
            return
        time.sleep(0.01)
    raise RuntimeError("an adapter load did not end")


def _serve(eng: LLMEngine, use_stack: bool, prompts: list[list[int]]) -> Run:
    """Requests arriving every other step (so steps mix decodes, prefill chunks, base and adapter rows)."""
    run = Run()
    _spy(eng.runner.model, run, use_stack)  # type: ignore[attr-defined]
    pending = [(f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, NAMES))]
    for step in range(10_000):
        if pending and step % 2 == 0:
            rid, p, n = pending.pop(0)
            eng.add_request(rid, p, PARAMS, lora=n)
            _loaded(eng)
        if not pending and not eng.has_unfinished():
            return run
        for o in eng.step():
            toks, lps = run.answers.get(o.request_id, ([], []))
            run.answers[o.request_id] = (toks + o.new_token_ids, lps + list(o.logprobs or []))
    raise RuntimeError("engine did not finish")


@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
def test_lora_rows_in_the_stack_get_the_module_paths_bits(stack_kernel: Any, hf: Any, loras: Path,
                                                          mode: str) -> None:
    prompts = random_prompts(len(NAMES), 3, 40, seed=21)
    engines = [lora_engine(hf, loras, quantization=mode, max_num_batched_tokens=24) for _ in range(2)]
    got, want = _serve(engines[0], True, prompts), _serve(engines[1], False, prompts)
    # The stack ran steps with several adapters beside base rows, and prefill chunks with LoRA rows.
    assert any(groups >= 2 and n_lora < t for t, groups, n_lora in got.lora_calls)
    assert any(n_lora > groups for _, groups, n_lora in got.lora_calls)
    assert not want.lora_calls
    assert len(got.logits) == len(want.logits)
    for i, (g, w) in enumerate(zip(got.logits, want.logits)):
        assert torch.equal(g, w), f"step {i}: logits differ"
    assert got.answers == want.answers
    caches = [eng.runner.kv_caches for eng in engines]  # type: ignore[attr-defined]
    for (ka, va), (kb, vb) in zip(*caches):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert len({tuple(got.answers[f"r{i}"][0]) for i in range(5)}) > 1  # the adapters change the answers


def test_an_adapters_handle_is_built_once_and_goes_with_it(stack_kernel: Any, hf: Any, loras: Path) -> None:
    eng = lora_engine(hf, loras)
    model: LlamaForCausalLM = eng.runner.model  # type: ignore[attr-defined]
    stack = model.decode_stack()
    assert stack is not None
    adapter = load_adapter(loras / "all16", "all16", LlamaConfig.from_hf(hf.config.to_dict()))
    rows = torch.tensor([0, 2], dtype=torch.int64)
    first, again = stack.lora([(adapter, rows)]), stack.lora([(adapter, rows)])
    assert first is not None and again is not None and first[0][0] is again[0][0] and again[1] == [rows]
    assert first[0][0].num_layers() == model.cfg.num_hidden_layers
    del adapter, first, again
    gc.collect()
    assert not stack._adapters  # an evicted adapter's weights are not kept alive by its handle


def test_lora_without_the_cpu_kernel_stays_on_the_module_path(hf: Any, loras: Path) -> None:
    # Without lora_add the module path runs torch's F.linear, which the stack does not reproduce.
    adapter = load_adapter(loras / "attn", "attn", LlamaConfig.from_hf(hf.config.to_dict()))
    batch = LoraBatch.build({"attn": [0]}, {"attn": adapter}, None, torch.device("cpu"))
    assert batch is not None and batch.stack_groups() is None


def test_stack_checks_a_lora_adapters_layout(stack_kernel: Any) -> None:
    with pytest.raises(RuntimeError, match="4 projections"):
        stack_kernel.LoraAdapter(1.0, [None] * 3, [[]] * 3, [[]] * 3)
    w = torch.zeros(4, 8)
    with pytest.raises(RuntimeError, match="for each B"):
        stack_kernel.LoraAdapter(1.0, [w, None, None, None], [[w], [], [], []], [[0, 4], [], [], []])
    assert DecodeStack is not None
