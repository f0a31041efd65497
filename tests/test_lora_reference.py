"""LoRA against its reference: transformers + peft on the same tiny base and the same random adapter, greedy,
token-identical and the sampled tokens' logprobs close, in ``none`` mode, for attention-only, MLP-only and all
targets (q/k/v fused into qkv_proj and gate/up into gate_up_proj on kvgate's side). Plus the offline API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.lora_support import ALL, ATTN, MLP, lora_engine, make_adapter, peft_model
from tests.tiny import hf_greedy, hf_model, random_prompts, run_all
from workers.core.sampling_params import SamplingParams

N = 10
GREEDY = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def hf() -> Any:
    return hf_model(seed=0)


def _ref_logprobs(model: Any, prompt: list[int], tokens: list[int]) -> list[float]:
    """The reference's logprob of each generated token, teacher-forced in one forward."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0].float()  # (L, V)
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


@pytest.mark.parametrize("targets", [ATTN, MLP, ALL], ids=["attention", "mlp", "all"])
def test_greedy_matches_transformers_peft(hf: Any, tmp_path: Path, targets: list[str]) -> None:
    make_adapter(hf, tmp_path / "a", targets, r=8, alpha=16, seed=1)
    # rank 64 and rsLoRA scaling on the same targets, beside it in the same steps
    make_adapter(hf, tmp_path / "b", targets, r=64, alpha=8, seed=2, std=0.04, use_rslora=True)
    prompts = random_prompts(3, 5, 40, seed=4)
    eng = lora_engine(hf, tmp_path, max_num_batched_tokens=24)  # chunked prefills beside decodes
    for name in ("a", "b"):
        for i, p in enumerate(prompts):
            eng.add_request(f"{name}{i}", p, GREEDY, lora=name)
    out = _run_with_logprobs(eng)
    for name in ("a", "b"):
        ref = peft_model(hf, tmp_path / name)
        changed = 0
        for i, p in enumerate(prompts):
            tokens, lps = out[f"{name}{i}"]
            expected = hf_greedy(ref, p, N)
            assert tokens == expected, f"adapter {name} prompt {i}"
            changed += expected != hf_greedy(hf, p, N)
            torch.testing.assert_close(torch.tensor(lps), torch.tensor(_ref_logprobs(ref, p, tokens)),
                                       atol=2e-4, rtol=0)
        assert changed, f"adapter {name} must change some answer, or this proves nothing"


def _run_with_logprobs(eng: Any) -> dict[str, tuple[list[int], list[float]]]:
    out: dict[str, tuple[list[int], list[float]]] = {}
    for _ in range(10_000):
        if not eng.has_unfinished():
            return out
        for o in eng.step():
            toks, lps = out.setdefault(o.request_id, ([], []))
            toks.extend(o.new_token_ids)
            lps.extend(lp for lp, _ in o.logprobs or [])
    raise RuntimeError("engine did not finish")


def test_base_rows_are_the_base_model(hf: Any, tmp_path: Path) -> None:
    make_adapter(hf, tmp_path / "a", ALL, seed=3)
    p = random_prompts(1, 20, 20, seed=5)[0]
    eng = lora_engine(hf, tmp_path)
    eng.add_request("base", p, GREEDY)
    eng.add_request("lora", p, GREEDY, lora="a")
    out = run_all(eng)
    assert out["base"] == hf_greedy(hf, p, N)
    assert out["lora"] == hf_greedy(peft_model(hf, tmp_path / "a"), p, N)


@pytest.mark.slow
def test_offline_llm_generate_with_lora(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    from tests.tiny_model_dir import make_tiny_model_dir
    from workers.llm import LLM

    base = make_tiny_model_dir(tmp_path / "base")
    hf = LlamaForCausalLM.from_pretrained(str(base)).eval()
    make_adapter(hf, tmp_path / "loras" / "mine", ATTN, seed=6)
    llm = LLM(str(base), quantization="none", lora_dir=str(tmp_path / "loras"), kv_cache_tokens=2048)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    got = llm.generate([prompt, prompt, prompt], params, lora=[None, "mine", "nope"])
    assert got[0].token_ids == hf_greedy(hf, prompt, 6)
    assert got[1].token_ids == hf_greedy(peft_model(hf, tmp_path / "loras" / "mine"), prompt, 6)
    assert got[2].token_ids == [] and got[2].error is not None and "unknown LoRA adapter 'nope'" in got[2].error
    assert [o.token_ids for o in llm.generate([prompt], params, lora="mine")] == [got[1].token_ids]
