"""Model runner batch layout: decodes first, no padding, logits only for rows that are sampled."""

from __future__ import annotations

import torch

from tests.tiny import hf_model, random_prompts, run_all, tiny_engine
from workers.core.sampling_params import SamplingParams
from workers.model_runner import ModelRunner


def test_prepare_layout_and_logits_rows() -> None:
    eng = tiny_engine(hf_model(seed=2), block_size=4, max_num_batched_tokens=20)
    p = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    eng.add_request("a", list(range(10, 16)), p)  # 6 tokens
    eng.add_request("b", list(range(20, 50)), p)  # 30 tokens: chunked
    eng.step()  # a: 6 (samples), b: 14 of 30 (does not sample)
    plan = eng.scheduler.schedule()  # a decodes 1, b continues with 16 = rest of its prompt
    runner = eng.runner
    assert isinstance(runner, ModelRunner)
    inputs = runner.prepare(plan)
    assert inputs.meta.query_lens_cpu == (1, 16) and inputs.meta.num_decodes == 1
    assert inputs.input_ids.shape == (17,)  # no padding anywhere
    assert inputs.positions.tolist() == [6] + list(range(14, 30))
    assert inputs.logits_indices.tolist() == [0, 16]  # a's decode row and b's last prompt row
    assert [s.request.request_id for s in inputs.sampled] == ["a", "b"]
    bt = eng.scheduler.bm.block_table("a")
    assert inputs.meta.slot_mapping[0].item() == bt[6 // 4] * 4 + 6 % 4


def test_mid_prompt_chunks_compute_no_logits() -> None:
    eng = tiny_engine(hf_model(seed=2), block_size=4, max_num_batched_tokens=8)
    eng.add_request("b", list(range(20, 50)), SamplingParams(max_tokens=2, temperature=0.0))
    plan = eng.scheduler.schedule()
    runner = eng.runner
    assert isinstance(runner, ModelRunner)
    assert runner.prepare(plan).logits_indices.numel() == 0
    assert eng.step() == []  # a chunk that does not reach the end of the prompt reports nothing


def test_bfloat16_engine_runs_and_mostly_agrees_with_fp32() -> None:
    from workers.config import CacheConfig, EngineConfig, ModelConfig
    from workers.core.scheduler_config import SchedulerConfig
    from workers.engine_build import build_model, engine_from_model
    from workers.models.llama import LlamaConfig

    hf = hf_model(seed=5)
    cfg = EngineConfig(ModelConfig("tiny", dtype="bfloat16"), CacheConfig(4, 2048), SchedulerConfig(8, 64))
    model, max_len = build_model(LlamaConfig.from_hf(hf.config.to_dict()), dict(hf.state_dict()), cfg)
    assert model.embed_tokens.weight.dtype == torch.bfloat16 and model.rotary.cos.dtype == torch.float32
    bf = engine_from_model(model, cfg, max_len)
    fp = tiny_engine(hf)
    prompts = random_prompts(3, 8, 20, seed=6)
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for e in (bf, fp):
        for i, pr in enumerate(prompts):
            e.add_request(f"r{i}", pr, p)
    a, b = run_all(bf), run_all(fp)
    assert all(len(v) == 6 for v in a.values())
    assert sum(x[0] == y[0] for x, y in zip(a.values(), b.values())) >= 2  # first tokens mostly agree


def test_bf16_kv_cache_under_fp32_model() -> None:
    """A bf16 cache halves decode's memory traffic; outputs stay close to fp32 and a prefix hit replays
    exactly the cold run (the uncached prefill path rounds K/V to the cache dtype too)."""
    from workers.config import CacheConfig, EngineConfig, ModelConfig
    from workers.core.scheduler_config import SchedulerConfig
    from workers.engine_build import build_model, engine_from_model
    from workers.models.llama import LlamaConfig

    hf = hf_model(seed=6)
    cfg = EngineConfig(ModelConfig("tiny"), CacheConfig(4, 2048, kv_cache_dtype="bfloat16"), SchedulerConfig(8, 64))
    model, max_len = build_model(LlamaConfig.from_hf(hf.config.to_dict()), dict(hf.state_dict()), cfg)
    eng = engine_from_model(model, cfg, max_len)
    runner = eng.runner
    assert isinstance(runner, ModelRunner) and runner.kv_caches[0][0].dtype == torch.bfloat16
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = random_prompts(1, 40, 40, seed=7)[0]
    eng.add_request("cold", prompt, p)
    cold = run_all(eng)["cold"]
    eng.add_request("warm", prompt, p)
    assert run_all(eng)["warm"] == cold and eng.stats().prefix_hits >= 36
    fp = tiny_engine(hf)
    fp.add_request("fp", prompt, p)
    assert run_all(fp)["fp"][:2] == cold[:2]
