"""CUDA graphs of the decode step (workers/cuda_graphs.py): the pure bucket and step rules everywhere, and on a
GPU the graphs against eager steps of the same engine config: the same greedy tokens and the same logprobs bit
for bit (a graph runs the eager step's batch-invariant arithmetic), for batches that pad up to a bucket, contexts
that cross a split-K partition, and sequences joining and leaving between steps."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kernels_cupy.interface import AttentionMetadata
from tests.tiny import hf_model, random_prompts
from workers.cuda_graphs import bucket_of, buckets_for, is_pure_decode


def _meta(query_lens: tuple[int, ...]) -> AttentionMetadata:
    n = len(query_lens)
    z = torch.zeros(n, dtype=torch.int32)
    return AttentionMetadata(z.long(), z, z, z[:, None], query_lens, query_lens, sum(q == 1 for q in query_lens),
                             max(query_lens))


def test_buckets_cover_every_batch_up_to_the_largest() -> None:
    assert buckets_for(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert buckets_for(20) == (1, 2, 4, 8, 16, 20)
    assert buckets_for(1) == (1,)
    for n in range(1, 301):
        b = bucket_of(n, buckets_for(300))
        assert b is not None and b >= n and (n == b or bucket_of(n, (b,)) == b)
    assert bucket_of(65, buckets_for(64)) is None


def test_only_pure_decode_steps_replay() -> None:
    assert is_pure_decode(_meta((1, 1, 1)), 3, 3)
    assert not is_pure_decode(_meta((1, 1, 5)), 7, 3)  # a prefill chunk
    assert not is_pure_decode(_meta((1, 1)), 2, 3)  # a prompt-logprob row
    assert not is_pure_decode(_meta((1, 1)), 2, 1)  # a row not sampled


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
                               reason="needs CUDA and cupy")


def _engine(eager: bool, dtype: str = "float32"):  # type: ignore[no-untyped-def]
    from workers.config import CacheConfig, EngineConfig, ModelConfig
    from workers.core.scheduler_config import SchedulerConfig
    from workers.engine_build import build_model, engine_from_model
    from workers.models.llama import LlamaConfig

    hf = hf_model(seed=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=128, intermediate_size=256)
    cfg = EngineConfig(ModelConfig("tiny", "cuda", dtype, 2048, 0, None, "none", eager),
                       CacheConfig(16, 65536, 0.05, True), SchedulerConfig(16, 256))
    model, max_len = build_model(LlamaConfig.from_hf(hf.config.to_dict()), dict(hf.state_dict()), cfg)
    return engine_from_model(model, cfg, max_len)


def _serve(engine) -> dict[str, tuple[list[int], list[float]]]:  # type: ignore[no-untyped-def]
    from workers.core.sampling_params import SamplingParams

    out: dict[str, tuple[list[int], list[float]]] = {}
    # 11 sequences (pads to 16, then fewer as they finish), staggered arrivals, contexts up to ~700 tokens
    prompts = random_prompts(11, 3, 600, seed=5)
    pending = {f"r{i}": p for i, p in enumerate(prompts)}
    steps = 0
    while pending or engine.has_unfinished():
        if pending and steps % 3 == 0:
            rid, ids = pending.popitem()
            engine.add_request(rid, ids, SamplingParams(max_tokens=int(rid[1:]) * 3 + 5, temperature=0.0,
                                                        ignore_eos=True, logprobs=0))
        for o in engine.step():
            toks, lps = out.setdefault(o.request_id, ([], []))
            toks.extend(o.new_token_ids)
            lps.extend(lp for lp, _ in o.logprobs or [])
        steps += 1
    return out


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_match_eager_steps(dtype: str) -> None:
    graphs, eager = _engine(eager=False, dtype=dtype), _engine(eager=True, dtype=dtype)
    assert graphs.runner.graphs is not None and eager.runner.graphs is None
    got, want = _serve(graphs), _serve(eager)
    assert graphs.runner.graphs.replays > 20  # the decode steps did replay
    assert set(got) == set(want)
    for rid in want:
        assert got[rid][0] == want[rid][0], rid
        assert got[rid][1] == want[rid][1], rid  # bit for bit: the determinism rule holds across graphs
