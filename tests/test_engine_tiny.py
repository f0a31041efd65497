"""End-to-end engine behaviour on tiny random Llamas, with transformers as the oracle."""

from __future__ import annotations

import pytest

from tests.tiny import EOS, hf_greedy, hf_model, random_prompts, run_all, tiny_engine
from workers.core.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf():  # type: ignore[no-untyped-def]
    return hf_model(seed=0)


def test_batched_chunked_greedy_matches_transformers(hf) -> None:  # type: ignore[no-untyped-def]
    prompts = random_prompts(6, 5, 70, seed=1)
    eng = tiny_engine(hf, max_num_batched_tokens=24)  # forces chunked prefill mixed with decodes
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, GREEDY)
    out = run_all(eng)
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == hf_greedy(hf, p, 12), f"request {i} diverged"


def test_gqa_and_qwen_bias_and_tied_embeddings() -> None:
    hf = hf_model(seed=3, num_attention_heads=6, num_key_value_heads=2, hidden_size=48, tie_word_embeddings=True,
                  attention_bias=True)
    prompts = random_prompts(3, 3, 30, seed=2)
    eng = tiny_engine(hf, block_size=8)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, GREEDY)
    out = run_all(eng)
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == hf_greedy(hf, p, 12)


def test_llama3_rope_scaling_matches_transformers() -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    hf = hf_model(seed=4, rope_scaling=scaling, rope_theta=500000.0)
    p = random_prompts(1, 90, 90, seed=5)[0]
    eng = tiny_engine(hf)
    eng.add_request("r", p, GREEDY)
    assert run_all(eng)["r"] == hf_greedy(hf, p, 12)


def test_prefix_cache_hits_within_salt_only(hf) -> None:  # type: ignore[no-untyped-def]
    shared = random_prompts(1, 256, 256, seed=7)[0]
    a, b = shared + [10, 11, 12], shared + [20, 21]
    eng = tiny_engine(hf, block_size=16)
    eng.add_request("a", a, GREEDY, cache_salt="tenant-1")
    run_all(eng)
    cached: dict[str, int] = {}
    for rid, prompt, salt in (("b", b, "tenant-1"), ("c", b, "tenant-2")):
        eng.add_request(rid, prompt, GREEDY, cache_salt=salt)
        while eng.has_unfinished():
            for o in eng.step():
                cached[o.request_id] = o.num_cached_tokens
    assert cached["b"] >= 240
    assert cached["c"] == 0
    st = eng.stats()
    assert st.prefix_hits == cached["b"]
    assert st.prefix_queries == len(a) + 2 * len(b)


def test_prefix_hit_output_equals_cold_output(hf) -> None:  # type: ignore[no-untyped-def]
    p = random_prompts(1, 100, 100, seed=8)[0]
    eng = tiny_engine(hf)
    eng.add_request("cold", p, GREEDY)
    cold = run_all(eng)["cold"]
    eng.add_request("warm", p, GREEDY)
    assert run_all(eng)["warm"] == cold
    assert eng.stats().prefix_hits >= 96


def test_preemption_keeps_greedy_output_and_frees_every_block(hf) -> None:  # type: ignore[no-untyped-def]
    prompts = random_prompts(8, 20, 40, seed=9)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = tiny_engine(hf)
    for i, p in enumerate(prompts):
        roomy.add_request(f"r{i}", p, params)
    expected = run_all(roomy)
    # About two sequences' worth of KV: prompts up to 40 + 24 new tokens = 64 tokens each.
    tight = tiny_engine(hf, block_size=4, kv_cache_tokens=136)
    for i, p in enumerate(prompts):
        tight.add_request(f"r{i}", p, params)
    got = run_all(tight)
    st = tight.stats()
    assert st.num_preemptions > 0, "the test must actually preempt"
    assert got == expected
    assert st.num_free_blocks == st.num_total_blocks and st.num_running == 0 and st.num_waiting == 0


def test_abort_frees_blocks_at_once_and_reports_abort(hf) -> None:  # type: ignore[no-untyped-def]
    eng = tiny_engine(hf)
    eng.add_request("x", random_prompts(1, 40, 40)[0], SamplingParams(max_tokens=100, temperature=0.0))
    eng.add_request("y", random_prompts(1, 10, 10)[0], SamplingParams(max_tokens=100, temperature=0.0))
    eng.step()
    eng.step()
    assert eng.stats().num_free_blocks < eng.stats().num_total_blocks
    eng.abort(["x", "y", "y", "never-existed"])  # idempotent, unknown ids ignored
    st = eng.stats()
    assert st.num_free_blocks == st.num_total_blocks and st.num_running == 0
    outs = eng.step()
    assert sorted((o.request_id, o.finish_reason) for o in outs) == [("x", "abort"), ("y", "abort")]
    assert not eng.has_unfinished()


def test_prompt_that_can_never_fit_finishes_with_reason(hf) -> None:  # type: ignore[no-untyped-def]
    eng = tiny_engine(hf, kv_cache_tokens=64, block_size=4)
    eng.add_request("big", list(range(4, 200)), GREEDY)
    eng.add_request("ok", list(range(4, 20)), GREEDY)
    outs: dict[str, object] = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    big, ok = outs["big"], outs["ok"]
    assert big.finish_reason == "length" and big.new_token_ids == [] and "196 tokens" in big.error  # type: ignore[attr-defined]
    assert big.error_code == "context_length_exceeded"  # type: ignore[attr-defined]
    assert ok.finish_reason == "length" and ok.error is None  # type: ignore[attr-defined]


def test_generation_stops_at_context_limit(hf) -> None:  # type: ignore[no-untyped-def]
    eng = tiny_engine(hf, max_model_len=20)
    eng.add_request("r", list(range(4, 14)), SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))
    assert len(run_all(eng)["r"]) == 10


def test_eos_stops_unless_ignored_and_min_tokens(hf) -> None:  # type: ignore[no-untyped-def]
    eng = tiny_engine(hf)
    # Make EOS the greedy choice: stop_token_ids of whatever comes first works the same way.
    p = random_prompts(1, 10, 10, seed=11)[0]
    eng.add_request("probe", p, GREEDY)
    first = run_all(eng)["probe"][0]
    for rid, params in (("stop", SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[first])),
                        ("min", SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[first], min_tokens=3))):
        eng.add_request(rid, p, params)
    out = run_all(eng)
    assert out["stop"] == [first]
    assert len(out["min"]) >= 3 and first not in out["min"][:3]
    assert EOS not in out["min"][:3]


@pytest.mark.parametrize("bad", [[], [-1], [10**6], ["a"], [True]])
def test_bad_prompts_raise_value_error(hf, bad) -> None:  # type: ignore[no-untyped-def]
    eng = tiny_engine(hf)
    with pytest.raises(ValueError):
        eng.add_request("r", bad, GREEDY)


def test_duplicate_request_id_rejected(hf) -> None:  # type: ignore[no-untyped-def]
    eng = tiny_engine(hf)
    eng.add_request("r", [5, 6], GREEDY)
    with pytest.raises(ValueError, match="duplicate"):
        eng.add_request("r", [5, 6], GREEDY)


def test_sequences_of_one_prompt_share_one_prefill() -> None:
    """n sequences of one prompt sent together (the gateway's n): the prompt is computed once, the others start
    from the cache, and each answer is what the prompt gets alone."""
    from tests.test_determinism import _tiny, drain, engine
    from workers.core.sampling_params import SamplingParams

    model, max_len = _tiny("int4")
    prompt = list(range(100, 300))  # 200 tokens: 12 full blocks of 16
    params = [SamplingParams(max_tokens=8, temperature=0.8, seed=i, ignore_eos=True) for i in range(4)]
    alone = {f"s{i}": drain(engine(model, max_len, "int4"), [(f"s{i}", prompt, p)])[f"s{i}"][0]
             for i, p in enumerate(params)}
    eng = engine(model, max_len, "int4")
    for i, p in enumerate(params):
        eng.add_request(f"s{i}", prompt, p, cache_salt="tenant")
    steps: list[int] = []
    together: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            together.setdefault(o.request_id, []).extend(o.new_token_ids)
        steps.append(eng.last_num_batched_tokens)
    assert together == alone
    assert eng.stats().prefix_hits == 3 * 192  # the three others hit every full block of the first
    assert sum(steps) == 200 + 3 * 8 + 4 * 7  # prompt once, 8 tokens each for the others, then 7 decodes each
