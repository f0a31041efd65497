"""One question, one answer: a request's tokens and logprobs are bit-identical whatever else happens in the
engine: served cold or on a prefix-cache hit, prefilled in chunks of 16 or 512 tokens, preempted and recomputed,
sharing its steps with a random mix of other requests arriving at other times, verified with n-gram drafts, on
1 or 2 threads. In every quantization mode, on a tiny random model and on smollm2. The prompt's own logprobs
(``prompt_logprobs``) likewise.

Each scenario runs the same probe requests and compares them with torch.equal-strict equality (tokens and every
logprob float) against the probes served one at a time on a fresh engine. The probes are long enough (up to 150
prompt tokens, batches over 96 rows) that any arithmetic switching on the number of rows in a step would show.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.tiny import VOCAB, hf_model
from workers.config import CacheConfig, EngineConfig, ModelConfig
from workers.core.sampling_params import SamplingParams
from workers.core.scheduler_config import SchedulerConfig
from workers.core.spec_decode import SpeculativeConfig
from workers.engine import LLMEngine
from workers.engine_build import build_model, engine_from_model
from workers.models.llama import LlamaConfig, LlamaForCausalLM

MODES = ["none", "int8", "int4", "int8-a8", "int4-a8"]
# Drafts on every step whatever the batch, so verify steps really run beside other rows.
NGRAM = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=10_000, acceptance_threshold=0.0)
Answer = tuple[list[int], list[Any], list[Any]]  # tokens, logprobs per token, prompt logprobs


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def engine(model: LlamaForCausalLM, max_len: int, mode: str, *, batched: int = 512, kv_tokens: int = 8192,
           spec: SpeculativeConfig | None = None, block: int = 16) -> LLMEngine:
    cfg = EngineConfig(ModelConfig("probe", quantization=mode), CacheConfig(block, kv_tokens),
                       SchedulerConfig(32, batched, spec))
    return engine_from_model(model, cfg, max_len)


def drain(eng: LLMEngine, pending: list[tuple[str, list[int], SamplingParams]] | None = None,
          every: int = 3) -> dict[str, Answer]:
    """Step until idle, adding ``pending`` requests one every ``every`` steps (arrivals mid-run)."""
    pending = list(pending or [])
    out: dict[str, Answer] = {}
    for step in range(200_000):
        if pending and step % every == 0:
            eng.add_request(*pending.pop(0))
        if not pending and not eng.has_unfinished():
            return out
        for o in eng.step():
            assert o.error is None, o.error
            toks, lps, prompt_lps = out.setdefault(o.request_id, ([], [], []))
            toks.extend(o.new_token_ids)
            lps.extend(o.logprobs or [])
            prompt_lps.extend(o.prompt_logprobs or [])
    raise RuntimeError("engine did not finish")


def probe_params(i: int) -> SamplingParams:
    if i == 0:  # a seeded draw: the same seed gives the same tokens wherever it runs
        return SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True, logprobs=2)
    # the last probe also scores its prompt (never from the prefix cache: computed, chunked like the others)
    return SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=3,
                          prompt_logprobs=3 if i == 2 else None)


def others(rng: random.Random, vocab: int, n: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Other tenants' traffic: random lengths, sampling settings and output lengths."""
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randrange(1, 200))]
        params = SamplingParams(max_tokens=rng.randrange(1, 40), temperature=rng.choice([0.0, 0.7, 1.3]),
                                seed=rng.randrange(1000), ignore_eos=True)
        reqs.append((f"other{i}", prompt, params))
    return reqs


def check_scenarios(model: LlamaForCausalLM, max_len: int, mode: str, probes: list[list[int]], vocab: int,
                    spec: bool = True) -> None:
    reqs = [(f"probe{i}", p, probe_params(i)) for i, p in enumerate(probes)]
    greedy = reqs[1:]  # seeded sampling under drafts is distributed as without them, but not the same draws

    cold = engine(model, max_len, mode)
    want: dict[str, Answer] = {}
    for r in reqs:  # one at a time, each on a cache that holds nothing of it
        cold.add_request(*r)
        want.update(drain(cold))
    assert len(want["probe2"][2]) == len(probes[2]) - 1  # a logprob for every prompt token after the first
    for r in reqs:  # the same engine again: every prompt now hits the prefix cache
        cold.add_request(*r)
    assert drain(cold) == want, "prefix-cache hit"
    assert cold.stats().prefix_hits > 0

    for batched in (16, 64):
        got = drain(engine(model, max_len, mode, batched=batched), reqs, every=1)
        assert {k: got[k] for k in want} == want, f"chunks of {batched}"

    rng = random.Random(mode)
    mix = others(rng, vocab, 10) + reqs
    rng.shuffle(mix)
    got = drain(engine(model, max_len, mode), mix, every=2)
    assert {k: got[k] for k in want} == want, "beside other requests"

    # A cache of 480 tokens: requests admitted together outgrow it as they decode, and some are preempted.
    tight = engine(model, max_len, mode, kv_tokens=480, batched=256)
    long_outputs = [(r, p, dataclasses.replace(s, max_tokens=60)) for r, p, s in others(rng, vocab, 6)]
    got = drain(tight, long_outputs + reqs, every=1)
    assert {k: got[k] for k in want} == want, "preempted and recomputed"
    assert tight.stats().num_preemptions > 0

    torch.set_num_threads(1)
    got = drain(engine(model, max_len, mode), reqs, every=1)
    torch.set_num_threads(2)
    assert got == want, "one thread"

    if spec:
        got = drain(engine(model, max_len, mode, spec=NGRAM), greedy + others(rng, vocab, 4), every=1)
        assert {k: got[k] for k, *_ in greedy} == {k: want[k] for k, *_ in greedy}, "n-gram drafts"


def _tiny(mode: str) -> tuple[LlamaForCausalLM, int]:
    hf = hf_model(seed=3)
    cfg = EngineConfig(ModelConfig("tiny", quantization=mode))
    return build_model(LlamaConfig.from_hf(hf.config.to_dict()), dict(hf.state_dict()), cfg)


@pytest.mark.parametrize("mode", MODES)
def test_tiny_model_answers_do_not_depend_on_the_engine(mode: str) -> None:
    model, max_len = _tiny(mode)
    g = torch.Generator().manual_seed(11)
    # Repeated n-grams, so drafts are proposed and (partly) accepted.
    probes = [(torch.randint(4, VOCAB, (n,), generator=g).tolist() * 3)[:3 * n] for n in (7, 50, 33)]
    check_scenarios(model, max_len, mode, probes, VOCAB)


@pytest.fixture(scope="module")
def smollm2_files() -> Any:
    from workers.model_files import gguf_source, resolve
    from workers.models.loader import load_state_dict, read_config

    files = resolve("smollm2")
    return LlamaConfig.from_hf(read_config(files.directory)), load_state_dict(files.directory), gguf_source("smollm2")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["auto", "none"])
def test_smollm2_answers_do_not_depend_on_the_engine(smollm2_files: Any, mode: str) -> None:
    from transformers import AutoTokenizer

    from workers.model_files import resolve

    llama_cfg, sd, gguf = smollm2_files
    cfg = EngineConfig(dataclasses.replace(ModelConfig("smollm2"), quantization=mode, max_model_len=2048))
    model, max_len = build_model(llama_cfg, sd, cfg, gguf)
    tok = AutoTokenizer.from_pretrained(resolve("smollm2").directory)
    questions = ["What is the capital of France?", "How many legs does a spider have?",
                 "Write a haiku about the sea."]
    probes = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           return_dict=False))
              for q in questions]
    check_scenarios(model, max_len, mode, probes, llama_cfg.vocab_size, spec=mode == "auto")
