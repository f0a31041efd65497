"""Multi-LoRA through the engine on a real GPU: base rows and three adapters in one mixed, chunked batch give
every request the bits it gets served alone (the determinism rule on CUDA: tiled GEMMs, the row kernel, the
invariant attention and csrc/lora.cu), in fp32 and bf16; and fp32 greedy tokens equal the CPU engine's, also for
a head size the CUDA attention kernels do not cover (reference attention, CUDA graphs refused).

Skipped unless torch sees CUDA and CuPy imports (tests/test_lora_batch.py is the same check on the CPU).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.lora_support import lora_engine, three_adapters
from tests.tiny import hf_model, random_prompts
from workers.core.sampling_params import SamplingParams
from workers.engine import LLMEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
                       reason="needs CUDA and cupy"),
]

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
NAMES = [None, "attn", "mlp", "all", "all", None, "attn", "mlp"]
Answer = tuple[list[int], list[Any]]


def _base(wide: bool, tmp: Path) -> tuple[Any, Path]:
    model = hf_model(seed=0, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                     num_key_value_heads=2) if wide else hf_model(seed=0)
    return model, three_adapters(model, tmp)


@pytest.fixture(scope="module")
def covered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """A tiny base model with head_dim 32 (the CUDA attention kernels cover it) and three adapters over it."""
    return _base(True, tmp_path_factory.mktemp("lora32"))


@pytest.fixture(scope="module")
def uncovered(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """head_dim 16: a layout the kernels do not cover, so the torch reference attention runs and CUDA graphs are
    refused (padding rows would write slot -1 through its index_copy_)."""
    return _base(False, tmp_path_factory.mktemp("lora16"))


def _serve(eng: LLMEngine, requests: list[tuple[str, list[int], str | None]], stagger: bool) -> dict[str, Answer]:
    pending = list(requests)
    got: dict[str, Answer] = {}
    for step in range(10_000):  # arrivals mid-run: requests share steps with changing company
        if pending and (not stagger or step % 2 == 0):
            rid, prompt, name = pending.pop(0)
            eng.add_request(rid, prompt, PARAMS, None, 1.0, None, 0, name)
            if not stagger:
                continue
        if not pending and not eng.has_unfinished():
            return got
        for o in eng.step():
            toks, lps = got.get(o.request_id, ([], []))
            got[o.request_id] = (toks + o.new_token_ids, lps + list(o.logprobs or []))
    raise RuntimeError("engine did not finish")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixed_lora_batch_on_cuda_equals_each_served_alone(covered: tuple[Any, Path], dtype: str) -> None:
    hf, loras = covered
    prompts = random_prompts(8, 3, 60, seed=11)
    requests = [(f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, NAMES))]
    mixed = _serve(lora_engine(hf, loras, max_num_batched_tokens=40, device="cuda", dtype=dtype), requests, True)
    for rid, prompt, name in requests:
        alone = _serve(lora_engine(hf, loras, device="cuda", dtype=dtype), [(rid, prompt, name)], False)
        assert mixed[rid] == alone[rid], f"{rid} (adapter {name}) differs from itself served alone"
    assert len({tuple(mixed[f"r{i}"][0]) for i in range(4)}) > 1  # the adapters do change the answers


@pytest.mark.parametrize("layout", ["covered", "uncovered"])
def test_cuda_lora_tokens_equal_the_cpu_engines(layout: str, request: pytest.FixtureRequest) -> None:
    hf, loras = request.getfixturevalue(layout)
    prompts = random_prompts(8, 3, 60, seed=11)
    requests = [(f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, NAMES))]
    gpu = _serve(lora_engine(hf, loras, device="cuda"), requests, True)
    cpu = _serve(lora_engine(hf, loras), requests, True)
    for rid, _, _ in requests:
        assert gpu[rid][0] == cpu[rid][0], rid
