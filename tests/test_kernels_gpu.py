"""The CuPy backend against the torch reference on a real GPU: batch sizes, contexts from 1 to 32k, head
layouts, dtypes, split-K on and off, shared blocks, chunks with cached prefixes, foreign streams.

Skipped unless torch sees CUDA and CuPy imports. Tolerances (atol = rtol) per dtype: fp32 1e-4, fp16 2e-3,
bf16 2e-2; both sides accumulate in fp32, so the gap is the output rounding plus summation order.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from tests.kernel_cases import Case, build_case, dense_reference
from kernels_cupy.torch_ref import TorchAttentionBackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
                       reason="needs CUDA and cupy"),
]

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = list(TOL)
DTYPE_IDS = ["fp32", "fp16", "bf16"]
# (Hq, Hkv, D): SmolLM2-135M, Llama-3-8B, plain MHA, GQA 8 with the widest head.
HEADS = [(9, 3, 64), (32, 8, 128), (16, 16, 64), (16, 2, 256)]
HEAD_IDS = ["smollm2", "llama3", "mha", "gqa8-d256"]


def backend(split: str = "auto", partition_size: int = 512):  # type: ignore[no-untyped-def]
    from kernels_cupy.cupy_backend import CupyAttentionBackend

    return CupyAttentionBackend(split=split, partition_size=partition_size)


def compare(case: Case, be, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    ref = TorchAttentionBackend()
    kr, vr = case.k_cache.clone(), case.v_cache.clone()
    ref.write_kv(case.key, case.value, kr, vr, case.meta)
    kg, vg = case.k_cache.clone(), case.v_cache.clone()
    be.write_kv(case.key, case.value, kg, vg, case.meta)
    assert torch.equal(kg, kr) and torch.equal(vg, vr), "reshape_and_cache differs from index_copy_"
    want = ref.forward(case.query, case.key, case.value, kr, vr, case.meta, case.scale)
    got = be.forward(case.query, case.key, case.value, kg, vg, case.meta, case.scale)
    torch.cuda.synchronize()
    assert got.shape == want.shape and got.dtype == want.dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def decode_contexts(batch: int, longest: int, seed: int) -> list[tuple[int, int]]:
    """batch decodes with lengths spread over [1, longest], always including 1, 16, 17 and longest."""
    rng = random.Random(seed)
    fixed = [n for n in (longest, 1, 16, 17) if n <= longest][:batch]
    return [(n, 1) for n in fixed + [rng.randint(1, longest) for _ in range(batch - len(fixed))]]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("batch,longest", [(1, 1), (1, 17), (1, 32768), (3, 8192), (8, 2048), (64, 1024),
                                           (256, 300)])
@pytest.mark.parametrize("split", ["auto", "never", "always"])
def test_decode_grid(dtype: torch.dtype, heads: tuple[int, int, int], batch: int, longest: int, split: str) -> None:
    hq, hkv, d = heads
    seqs = decode_contexts(batch, longest, seed=batch + longest)
    share = [(1, 0, 1)] if batch > 1 and min(seqs[0][0], seqs[1][0]) > 16 else []
    case = build_case(seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=16, dtype=dtype,
                      device="cuda", share=share, fused_qkv=True, seed=batch)
    compare(case, backend(split), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("block_size", [16, 32, 1])
@pytest.mark.parametrize("split", ["auto", "invariant"])  # prefill kernel; every row a decode row (the engine's)
def test_mixed_batch_with_cached_prefix_chunks(dtype: torch.dtype, heads: tuple[int, int, int],
                                               block_size: int, split: str) -> None:
    hq, hkv, d = heads
    seqs = [(4096, 1), (1, 1), (33, 1),  # decodes
            (700, 256),  # chunk over a 444-token cached prefix
            (512, 512),  # first chunk, nothing cached
            (4100, 37),  # long cached prefix, chunk ends mid-block
            (1000, 300),  # shares its first blocks with sequence 3 (prefix-cache hit)
            (2, 2), (18, 3)]
    share = [(6, 3, 256 // block_size), (2, 5, 1)] if block_size > 1 else [(6, 3, 256)]
    case = build_case(seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=block_size, dtype=dtype,
                      device="cuda", share=share, fused_qkv=True, seed=block_size)
    compare(case, backend(split), dtype)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("split", ["never", "always"])
def test_16bit_cache_under_an_fp32_model(cache_dtype: torch.dtype, split: str) -> None:
    # Query and output stay fp32; only the stored K/V are rounded, identically on both sides.
    fp32 = build_case([(8192, 1), (1, 1), (100, 1), (700, 256), (64, 64)], num_q_heads=32, num_kv_heads=8,
                      head_dim=128, block_size=16, device="cuda", fused_qkv=True, seed=13)
    case = Case(fp32.query, fp32.key, fp32.value, fp32.k_cache.to(cache_dtype), fp32.v_cache.to(cache_dtype),
                fp32.meta, fp32.full_k, fp32.full_v, fp32.scale)
    compare(case, backend(split), torch.float32)


@pytest.mark.parametrize("split", ["never", "always", "invariant"])
def test_never_reads_unwritten_slots(split: str) -> None:
    seqs = [(1, 1), (15, 1), (17, 1), (5000, 1), (300, 40), (64, 64)]
    case = build_case(seqs, num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, device="cuda",
                      fill=float("nan"), share=[(3, 4, 10)], seed=11)
    be = backend(split, partition_size=256)
    k, v = case.k_cache.clone(), case.v_cache.clone()
    be.write_kv(case.key, case.value, k, v, case.meta)
    got = be.forward(case.query, case.key, case.value, k, v, case.meta, case.scale)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), dense_reference(case), atol=1e-4, rtol=1e-4)


def test_runs_on_torchs_current_stream_and_compiles_once() -> None:
    case = build_case([(3000, 1), (40, 1), (77, 20)], num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                      dtype=torch.float16, device="cuda", seed=12)
    be = backend()
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    torch.cuda.synchronize()
    with torch.cuda.stream(side):  # everything, including the consumer, on a non-default stream
        for _ in range(3):
            k, v = case.k_cache.clone(), case.v_cache.clone()
            be.write_kv(case.key, case.value, k, v, case.meta)
            got = be.forward(case.query, case.key, case.value, k, v, case.meta, case.scale)
            result = got.float().cpu()
    ref = TorchAttentionBackend()
    k, v = case.k_cache.clone(), case.v_cache.clone()
    ref.write_kv(case.key, case.value, k, v, case.meta)
    want = ref.forward(case.query, case.key, case.value, k, v, case.meta, case.scale)
    torch.testing.assert_close(result, want.float().cpu(), atol=2e-3, rtol=2e-3)
    assert len(be._modules) == 3  # one module per source file for this layout, reused across calls


def test_uncovered_head_dim_falls_back_to_the_reference() -> None:
    case = build_case([(20, 1), (9, 4)], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4, device="cuda")
    compare(case, backend(), torch.float32)
