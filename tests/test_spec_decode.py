"""Speculative decoding through the engine on tiny random Llamas (and smollm2): greedy output token-identical
with and without it (mixed drafting / non-drafting batches, preemption, prefix caching, penalties, logprobs),
and sampled output distributed as without it (a chi-square test against the model's exact distribution).

A random model rarely repeats itself, so most tests draft with an oracle: the reference continuation with
every third draft corrupted, so both full acceptances and rejections at every position happen."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from tests.tiny import VOCAB, hf_model, random_prompts, run_all, tiny_engine
from workers.core import spec_decode
from workers.core.sampling_params import SamplingParams
from workers.core.spec_decode import SpeculativeConfig
from workers.engine import LLMEngine

ALWAYS = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=10_000, acceptance_threshold=0.0)
Proposer = Callable[[Sequence[int], int, int, int], list[int]]


@pytest.fixture(scope="module", autouse=True)
def one_thread():  # type: ignore[no-untyped-def]
    """Tiny tensors: on a shared 2-core machine, torch's thread pool costs 10x more than it saves."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def hf():  # type: ignore[no-untyped-def]
    return hf_model(seed=0)


def with_spec(eng: LLMEngine, cfg: SpeculativeConfig | None = ALWAYS) -> LLMEngine:
    eng.scheduler.config = dataclasses.replace(eng.scheduler.config, speculative=cfg)
    return eng


def run(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    return run_all(eng)


def oracle(prompts: list[list[int]], ref: dict[str, list[int]], skip_odd: bool = True) -> Proposer:
    """Drafts the reference continuation; every third call corrupts one position; odd requests never draft."""
    calls = [0]

    def propose(tokens: Sequence[int], _min_n: int, _max_n: int, k: int) -> list[int]:
        i = next(i for i, p in enumerate(prompts) if list(tokens[:len(p)]) == p)
        if skip_odd and i % 2:
            return []
        done = len(tokens) - len(prompts[i])
        draft = ref[f"r{i}"][done:done + k]
        calls[0] += 1
        if calls[0] % 3 == 0 and draft:
            j = calls[0] % len(draft)
            draft[j] = (draft[j] + 1) % VOCAB
        return draft

    return propose


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("case", ["mixed", "preemption", "prefix_cache", "penalties", "chunked"])
def test_greedy_identical_with_oracle_drafts(hf, monkeypatch, case: str) -> None:  # type: ignore[no-untyped-def]
    prompts = random_prompts(6, 5, 40, seed=1)
    kw: dict[str, Any] = {"max_num_batched_tokens": 64}
    params = GREEDY
    if case == "preemption":
        kw["kv_cache_tokens"] = 96  # 24 blocks of 4 for 6 requests of up to 64 tokens: preemptions
    if case == "prefix_cache":
        prompts = [prompts[0][:24] + p for p in prompts]  # a shared 24-token (6-block) head
    if case == "penalties":
        params = dataclasses.replace(GREEDY, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2,
                                     min_tokens=6, ignore_eos=False, stop_token_ids=[7, 9])
    if case == "chunked":
        kw["max_num_batched_tokens"] = 12  # drafts compete with prefill chunks for a small budget
    base = tiny_engine(hf, **kw)
    ref = run(base, prompts, params)
    monkeypatch.setattr(spec_decode, "propose_ngram", oracle(prompts, ref))
    eng = with_spec(tiny_engine(hf, **kw))
    out = run(eng, prompts, params)
    assert out == ref
    st = eng.stats()
    assert st.spec_num_drafts > 0 and 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens
    assert st.spec_accepted_per_pos[0] >= st.spec_accepted_per_pos[-1] > 0
    assert st.num_free_blocks == st.num_total_blocks
    if case == "preemption":
        assert st.num_preemptions > 0 and base.stats().num_preemptions > 0
    if case == "prefix_cache":  # a second turn reuses blocks whose K/V came from verified drafts
        assert st.prefix_hits > 0
        turn2 = [p + ref[f"r{i}"] for i, p in enumerate(prompts)]
        ref2 = {k: v for k, v in run(base, turn2, params).items()}
        monkeypatch.setattr(spec_decode, "propose_ngram", oracle(turn2, ref2))
        hits = eng.stats().prefix_hits
        assert run(eng, turn2, params) == ref2 and eng.stats().prefix_hits - hits >= sum(map(len, turn2)) // 2


def test_greedy_identical_with_ngram_drafts_and_logprobs(hf) -> None:  # type: ignore[no-untyped-def]
    """The real proposer on prompts that repeat themselves; logprobs of drafted tokens equal the plain ones."""
    prompts = [p * 3 for p in random_prompts(4, 6, 12, seed=4)]
    params = dataclasses.replace(GREEDY, max_tokens=40, logprobs=2)
    ref_eng = tiny_engine(hf)
    eng = with_spec(tiny_engine(hf))
    for e in (ref_eng, eng):
        for i, p in enumerate(prompts):
            e.add_request(f"r{i}", p, params)
    ref: dict[str, list[Any]] = {}
    got: dict[str, list[Any]] = {}
    for e, acc in ((ref_eng, ref), (eng, got)):
        while e.has_unfinished():
            for o in e.step():
                acc.setdefault(o.request_id, []).extend(zip(o.new_token_ids, o.logprobs or []))
    assert [[t for t, _ in v] for v in got.values()] == [[t for t, _ in v] for v in ref.values()]
    for rid in ref:
        for (_, (lp_a, top_a)), (_, (lp_b, top_b)) in zip(ref[rid], got[rid]):
            assert lp_a == pytest.approx(lp_b, abs=1e-4) and [t for t, _ in top_a] == [t for t, _ in top_b]
    assert eng.stats().spec_num_drafts > 0


# ---- sampled: the distribution ---------------------------------------------------------------------
SMALL_V = 4
PROMPT = [0, 2, 1, 2, 0]
TEMP = 2.0
N = 3000


def exact_joint(hf: Any, n_tokens: int) -> dict[tuple[int, ...], float]:
    """P(first n_tokens tokens) under temperature TEMP, by enumerating contexts with the transformers twin."""
    probs: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(n_tokens):
        nxt: dict[tuple[int, ...], float] = {}
        for ctx, p in probs.items():
            with torch.no_grad():
                logits = hf(torch.tensor([PROMPT + list(ctx)])).logits[0, -1].double()
            dist = torch.softmax(logits / TEMP, dim=-1).tolist()
            nxt.update({ctx + (t,): p * q for t, q in enumerate(dist)})
        probs = nxt
    return probs


def chi_square_p(counts: Counter[tuple[int, ...]], exact: dict[tuple[int, ...], float], n: int) -> float:
    """Goodness of fit; outcomes expected fewer than 5 times are pooled into one bin."""
    stat, bins, rest_obs, rest_exp = 0.0, 0, 0, 0.0
    for k, p in exact.items():
        e = n * p
        if e < 5:
            rest_obs, rest_exp = rest_obs + counts[k], rest_exp + e
            continue
        stat += (counts[k] - e) ** 2 / e
        bins += 1
    if rest_exp > 0:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        bins += 1
    return float(torch.special.gammaincc(torch.tensor((bins - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def sample_first_tokens(hf: Any, spec: bool, monkeypatch: Any) -> Counter[tuple[int, ...]]:
    # Drafts: fixed-pattern tokens, so every position sees both accepted and rejected drafts.
    monkeypatch.setattr(spec_decode, "propose_ngram",
                        lambda toks, _a, _b, k: [(sum(toks) + j) % SMALL_V for j in range(k)])
    eng = tiny_engine(hf, max_num_seqs=256, max_num_batched_tokens=2048, kv_cache_tokens=16384)
    with_spec(eng, ALWAYS if spec else None)
    for i in range(N):
        eng.add_request(f"s{i}", PROMPT, SamplingParams(max_tokens=3, temperature=TEMP, seed=i, ignore_eos=True))
    out = run_all(eng)
    if spec:
        st = eng.stats()
        assert st.spec_num_drafts >= N and 0 < st.spec_num_accepted_tokens < st.spec_num_draft_tokens
    return Counter(tuple(v) for v in out.values())


@pytest.mark.parametrize("spec", [False, True])
def test_sampled_distribution_is_the_models(monkeypatch, spec: bool) -> None:  # type: ignore[no-untyped-def]
    hf = hf_model(seed=7, vocab_size=SMALL_V, initializer_range=0.5)
    exact = exact_joint(hf, 3)
    assert max(exact.values()) < 0.5  # a spread distribution: drafts get rejected as well as accepted
    p = chi_square_p(sample_first_tokens(hf, spec, monkeypatch), exact, N)
    assert p > 1e-3, f"chi-square p = {p:.2g}: the sampled tokens are not the model's distribution"


# ---- smollm2 ---------------------------------------------------------------------------------------
PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, trimmed the wick, polished the "
           "great lens, and wrote the weather in a leather logbook that his grandfather had started.")


@pytest.mark.slow
def test_smollm2_greedy_identical_and_drafts_accepted() -> None:
    from tests.golden_prompts import GOLDEN_CHATS
    from workers.llm import LLM

    chats = [[{"role": "user", "content": f"Repeat the following passage exactly:\n\n{PASSAGE}"}],
             GOLDEN_CHATS[0], GOLDEN_CHATS[5]]
    params = SamplingParams(max_tokens=40, temperature=0.0)
    llm = LLM("smollm2", max_num_batched_tokens=64, kv_cache_tokens=4096, quantization="none")
    ref = [o.token_ids for o in llm.chat(chats, params)]
    llm.engine.scheduler.config = dataclasses.replace(
        llm.engine.scheduler.config, speculative=SpeculativeConfig(num_speculative_tokens=4))
    llm.engine.reset_counters()
    got = [o.token_ids for o in llm.chat(chats, params)]
    assert got == ref
    st = llm.stats()
    assert st.spec_num_accepted_tokens >= 10 and st.spec_num_accepted_tokens / st.spec_num_draft_tokens > 0.3
    assert math.isfinite(st.kv_usage)
