"""SamplingParams validation and the sampler's behaviour."""

from __future__ import annotations

import math

import pytest
import torch

from ipc.codec import decode, encode
from ipc.messages import Generate
from tests.tiny import hf_model, random_prompts, run_all, tiny_engine
from workers.core.request import Request
from workers.core.sampling_params import SamplingParams
from workers.sampler import Sampler


@pytest.mark.parametrize("kw", [
    {"max_tokens": 0}, {"max_tokens": -5}, {"temperature": -0.1}, {"temperature": float("nan")},
    {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2}, {"min_p": 1.1}, {"presence_penalty": 3.0},
    {"frequency_penalty": -2.5}, {"repetition_penalty": 0.0}, {"min_tokens": -1},
    {"min_tokens": 5, "max_tokens": 2}, {"logprobs": 21}, {"seed": -1}, {"stop_token_ids": [-3]},
    {"max_tokens": "10"}, {"temperature": True}, {"ignore_eos": 1}, {"top_k": 2.5},
])
def test_invalid_params_raise_value_error(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kw)  # type: ignore[arg-type]


def test_params_round_trip_the_wire() -> None:
    p = SamplingParams(max_tokens=5, temperature=0.7, stop_token_ids=[1, 2], seed=3, logprobs=2)
    msg = decode(encode(Generate("r", [1], p, None, 1.0, None, None)))
    assert isinstance(msg, Generate) and msg.sampling == p and msg.sampling.stop_token_ids == (1, 2)


def _req(rid: str, **kw: object) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(**kw), eos_token_ids=frozenset({0}),  # type: ignore[arg-type]
                   max_total_tokens=100)


def _sample(logits: torch.Tensor, reqs: list[Request], seed: int = 0) -> list[int]:
    return [t.token_id for t in Sampler(logits.shape[1], torch.device("cpu"), seed).sample(logits, reqs)]


def test_top_k_top_p_min_p_restrict_support() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(200, 1)
    for kw, allowed in (({"top_k": 2}, {0, 1}), ({"top_p": 0.7}, {0, 1}), ({"top_p": 0.4}, {0}),
                        ({"min_p": 0.5}, {0, 1}), ({"min_p": 0.2}, {0, 1, 2})):
        reqs = [_req(f"r{i}", temperature=1.0, **kw) for i in range(200)]
        got = set(_sample(logits, reqs))
        assert got == allowed, (kw, got)


def test_temperature_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = torch.log(probs).repeat(3000, 1)
    toks = _sample(logits, [_req(f"r{i}", temperature=1.0) for i in range(3000)])
    freq = torch.bincount(torch.tensor(toks), minlength=3).float() / 3000
    assert torch.allclose(freq, probs, atol=0.04), freq


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.9, 1.0]])
    r = _req("a", temperature=0.0, presence_penalty=0.5)
    r.output_token_ids = [1]
    assert _sample(logits, [r]) == [2]
    r = _req("b", temperature=0.0, repetition_penalty=2.0)  # prompt [1, 2, 3] all penalised
    assert _sample(logits, [r]) == [1]  # 2.0/2 = 1.0 still beats 1.9/2 and 1.0/2
    assert _sample(torch.tensor([[1.5, 2.0, 1.9, 1.0]]), [r]) == [0]  # unpenalised 1.5 now wins
    r = _req("c", temperature=0.0, frequency_penalty=0.2)
    r.output_token_ids = [1, 1]
    assert _sample(logits, [r]) == [2]


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[5.0, 0.0, 4.0, 1.0]])  # EOS (0) then stop id 2 are the top choices
    r = _req("a", temperature=0.0, min_tokens=1, stop_token_ids=[2])
    assert _sample(logits, [r]) == [3]
    r.output_token_ids = [3]
    assert _sample(logits, [r]) == [0]


def test_logprobs_are_raw_and_sorted() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    [tok] = Sampler(4, torch.device("cpu")).sample(logits, [_req("a", temperature=0.0, logprobs=2)])
    assert tok.token_id == 1 and tok.logprobs is not None
    lp, top = tok.logprobs
    ref = torch.log_softmax(logits[0], -1)
    assert math.isclose(lp, float(ref[1]), rel_tol=1e-6)
    assert [t for t, _ in top] == [1, 2] and top[0][1] >= top[1][1]


def test_seeded_request_is_independent_of_its_batch() -> None:
    hf = hf_model(seed=1)
    prompts = random_prompts(17, 5, 40, seed=3)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = tiny_engine(hf)
    alone.add_request("target", prompts[0], seeded)
    solo = run_all(alone)["target"]
    crowd = tiny_engine(hf, max_num_batched_tokens=48)
    for i, p in enumerate(prompts[1:]):
        crowd.add_request(f"o{i}", p, SamplingParams(max_tokens=20, temperature=0.9, ignore_eos=True,
                                                     seed=None if i % 2 else i))
    crowd.add_request("target", prompts[0], seeded)
    assert run_all(crowd)["target"] == solo
    # A different seed must give a different sequence, or the check above proves nothing.
    other = tiny_engine(hf)
    other.add_request("target", prompts[0], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95,
                                                           seed=99, ignore_eos=True))
    assert run_all(other)["target"] != solo


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (32, 49152), (5, 49157)])
def test_argmax_rows_is_torchs_argmax(shape: tuple[int, int]) -> None:
    """The CPU kernel greedy rows take (fused_ops.cpp, argmax_rows) gives torch.argmax's indices: random rows of
    any width (tails past the 8-lane loop included), and the edge cases: ties (the first wins), a row of -inf,
    NaN (the first NaN wins, as torch ranks NaN above everything), +0 against -0 (equal: the first), +inf."""
    from kernels_cupy.cpu.fused import load_fused
    from workers.sampler import argmax_rows

    if load_fused() is None:
        pytest.skip("no C++ toolchain: argmax_rows is torch.argmax itself")
    g = torch.Generator().manual_seed(shape[1])
    x = torch.randn(*shape, generator=g)
    assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1))
    e = torch.randn(7, 1000, generator=g)
    e[0] = float("-inf")
    e[1, 5] = e[1, 900] = float("nan")
    e[2, 3] = e[2, 600] = 100.0
    e[3] = 0.0
    e[3, 0] = e[3, 10] = -0.0
    e[4, 999] = float("nan")
    e[5] = float("inf")
    e[6, 997] = float("nan")  # in the scalar tail of a row whose width is not a multiple of 8
    e6 = e[:, :998].contiguous()
    for t in (e, e6, e[:, 1:]):  # e[:, 1:]: rows of a stride other than their width
        assert torch.equal(argmax_rows(t), torch.argmax(t, dim=-1)), t
