"""Golden test on the default model: our engine's greedy output equals transformers' generate, token for
token, for 8 varied chat prompts submitted together with a budget small enough to force chunked prefill."""

from __future__ import annotations

import pytest
import torch

from tests.golden_prompts import GOLDEN_CHATS
from workers.core.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():  # type: ignore[no-untyped-def]
    from workers.llm import LLM

    return LLM("smollm2", max_num_batched_tokens=48, kv_cache_tokens=8192, quantization="none")  # fp32 = transformers


def test_greedy_matches_transformers_token_for_token(llm) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    from workers.model_files import resolve

    outs = llm.chat(GOLDEN_CHATS, SamplingParams(max_tokens=64, temperature=0.0))
    longest = max(len(o.prompt_token_ids) for o in outs)
    assert longest > 48, "the budget must be smaller than a prompt, or no prefill is chunked"
    hf = AutoModelForCausalLM.from_pretrained(resolve("smollm2").directory, dtype=torch.float32).eval()
    for o in outs:
        ids = torch.tensor([o.prompt_token_ids])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False)
        expected = ref[0, ids.shape[1]:].tolist()
        assert o.token_ids == expected, f"diverged at token {_first_diff(o.token_ids, expected)}"
        assert o.finish_reason == ("stop" if len(expected) < 64 else "length")
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks


def test_text_and_chat_template(llm) -> None:  # type: ignore[no-untyped-def]
    [o] = llm.chat([[{"role": "user", "content": "What is the capital of France?"}]],
                   SamplingParams(max_tokens=16, temperature=0.0))
    assert "Paris" in o.text
    prompt = llm.tokenizer.decode(o.prompt_token_ids)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")


def test_prefix_cache_on_default_model(llm) -> None:  # type: ignore[no-untyped-def]
    system = "You are a meticulous assistant. " * 40  # a long shared system prompt
    convs = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
             for q in ("Name a color.", "Name a fruit.")]
    p = SamplingParams(max_tokens=4, temperature=0.0)
    first = llm.chat(convs[:1], p, cache_salt="tenant-a")[0]
    second = llm.chat(convs[1:], p, cache_salt="tenant-a")[0]
    other = llm.chat(convs[1:], p, cache_salt="tenant-b")[0]
    assert len(first.prompt_token_ids) > 256
    assert second.num_cached_tokens >= 240 and other.num_cached_tokens == 0
    assert other.token_ids == second.token_ids


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
