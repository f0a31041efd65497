"""The CUDA kernels' index mapping, emulated in NumPy (tests/kernel_emulate.py), against the torch reference.

The emulation walks the same grid, warps, lanes, tiles, shuffles and online-softmax recurrences as the .cu
files, and runs the same launch plans (kernels_cupy/kernels.py) as the CuPy backend, so these tests pin the
kernels' arithmetic, argument order and split-K logic on a machine without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels_cupy import kernels as K
from tests.kernel_cases import Case, build_case, dense_reference
from tests.kernel_emulate import EmulatedAttentionBackend, round_to
from kernels_cupy.torch_ref import TorchAttentionBackend

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # atol = rtol, per dtype
DTYPES = list(TOL)
DTYPE_IDS = ["fp32", "fp16", "bf16"]
HEADS = [(2, 2), (6, 2)]  # (Hq, Hkv): GQA ratio 1 and 3
DECODE_CONTEXTS = [(1, 1), (15, 1), (16, 1), (17, 1), (40, 1), (33, 1)]


def run_both(case: Case, emu: EmulatedAttentionBackend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(emulated, reference) outputs and the emulated cache after write_kv, both backends from the same state."""
    ref = TorchAttentionBackend()
    kr, vr = case.k_cache.clone(), case.v_cache.clone()
    ref.write_kv(case.key, case.value, kr, vr, case.meta)
    ke, ve = case.k_cache.clone(), case.v_cache.clone()
    emu.write_kv(case.key, case.value, ke, ve, case.meta)
    assert torch.equal(ke, kr) and torch.equal(ve, vr)
    want = ref.forward(case.query, case.key, case.value, kr, vr, case.meta, case.scale)
    got = emu.forward(case.query, case.key, case.value, ke, ve, case.meta, case.scale)
    return got, want, ke


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


# ----------------------------------------------------------------------------------- reshape_and_cache

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("fused", [False, True], ids=["contiguous", "fused-qkv-views"])
def test_reshape_and_cache_writes_the_reference_slots(dtype: torch.dtype, fused: bool) -> None:
    case = build_case([(5, 1), (20, 20), (37, 3)], num_q_heads=6, num_kv_heads=2, head_dim=32, block_size=4,
                      dtype=dtype, fused_qkv=fused, seed=1)
    assert fused == (not case.key.is_contiguous())
    run_both(case, EmulatedAttentionBackend())  # asserts bit-equal caches


def test_reshape_and_cache_skips_padding_slots() -> None:
    case = build_case([(9, 4), (6, 2)], num_q_heads=2, num_kv_heads=2, head_dim=32, block_size=4, seed=2)
    slots = case.meta.slot_mapping.clone()
    slots[[1, 4]] = -1  # padded tokens: must not be written anywhere
    meta = type(case.meta)(**{**case.meta.__dict__, "slot_mapping": slots})
    k, v = case.k_cache.clone(), case.v_cache.clone()
    EmulatedAttentionBackend().write_kv(case.key, case.value, k, v, meta)
    keep = slots >= 0
    want_k, want_v = case.k_cache.clone(), case.v_cache.clone()
    TorchAttentionBackend().write_kv(case.key[keep], case.value[keep], want_k, want_v,
                                     type(meta)(**{**meta.__dict__, "slot_mapping": slots[keep]}))
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


# ------------------------------------------------------------------------------------------- decode

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads", HEADS, ids=["mha", "gqa3"])
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("split", ["never", "always"])
def test_decode_many_lengths_shared_blocks(dtype: torch.dtype, heads: tuple[int, int], block_size: int,
                                           split: str) -> None:
    hq, hkv = heads
    # Sequence 4 (40 tokens) shares its first 32 tokens' blocks with sequence 5 (33), as a prefix hit does.
    case = build_case(DECODE_CONTEXTS, num_q_heads=hq, num_kv_heads=hkv, head_dim=32, block_size=block_size,
                      dtype=dtype, share=[(4, 5, 32 // block_size)], seed=3)
    assert case.meta.block_tables[4, 0] == case.meta.block_tables[5, 0]
    emu = EmulatedAttentionBackend(split=split, partition_size=16)
    got, want, _ = run_both(case, emu)
    assert emu.last_plan is not None and emu.last_plan.decode is not None
    assert emu.last_plan.decode.split == (split == "always")
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_decode_head_dim_64_gqa3_like_smollm2(dtype: torch.dtype) -> None:
    # D = 64 in 16-bit: 4 K vectors of 8 elements per lane, 2 output dims per lane (D = 32 has 2 and 1).
    case = build_case([(1, 1), (17, 1), (50, 1)], num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                      dtype=dtype, seed=4, fused_qkv=True)
    got, want, _ = run_both(case, EmulatedAttentionBackend())
    assert_close(got, want, dtype)


def test_split_k_auto_for_few_long_sequences() -> None:
    # Partitions of 16 tokens: a context of 100 spans 7 of them, 17 spans 2, and 1 leaves 6 CTAs idle in z.
    case = build_case([(100, 1), (17, 1), (1, 1)], num_q_heads=6, num_kv_heads=2, head_dim=32, block_size=16,
                      seed=5)
    emu = EmulatedAttentionBackend(sm_count=4, partition_size=16)
    got, want, _ = run_both(case, emu)
    assert emu.last_plan is not None and emu.last_plan.decode is not None
    assert emu.last_plan.decode.split and emu.last_plan.decode.grid == (2, 3, 7)
    assert [lc.role for lc in emu.last_plan.launches] == ["decode_split", "decode_reduce"]
    assert_close(got, want, torch.float32)


# ------------------------------------------------------------------------------------------ prefill

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads", HEADS, ids=["mha", "gqa3"])
@pytest.mark.parametrize("block_size", [16, 4])
def test_mixed_batch_chunks_with_cached_prefix(dtype: torch.dtype, heads: tuple[int, int], block_size: int) -> None:
    hq, hkv = heads
    seqs = [(17, 1), (1, 1), (40, 1),  # decodes first
            (33, 5),  # a chunk after 28 cached tokens (ends inside a block)
            (20, 20),  # a first chunk: nothing cached, plain causal
            (48, 9),  # a chunk whose cached prefix is shared with sequence 3 (prefix-cache hit)
            (16, 16), (19, 2)]
    case = build_case(seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=32, block_size=block_size, dtype=dtype,
                      share=[(5, 3, 16 // block_size), (2, 0, 16 // block_size)], fused_qkv=True, seed=6)
    emu = EmulatedAttentionBackend()
    got, want, _ = run_both(case, emu)
    assert emu.last_plan is not None
    assert [lc.role for lc in emu.last_plan.launches] == ["decode", "prefill"]
    assert_close(got, want, dtype)


def test_prefill_only_batch_block_size_1_and_32() -> None:
    # No leading decode: the one-token sequence at the end goes through the prefill kernel.
    for bs in (1, 32):
        case = build_case([(7, 3), (70, 30), (33, 33), (12, 1)], num_q_heads=6, num_kv_heads=2, head_dim=32,
                          block_size=bs, seed=7)
        assert case.meta.num_decodes == 0
        got, want, _ = run_both(case, EmulatedAttentionBackend())
        assert_close(got, want, torch.float32)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("split", ["never", "always"])
def test_16bit_cache_under_an_fp32_model(cache_dtype: torch.dtype, split: str) -> None:
    # The query stays fp32 (only K/V are rounded, as they are stored), so both sides agree to fp32 precision.
    fp32 = build_case([(1, 1), (40, 1), (33, 5), (20, 20)], num_q_heads=6, num_kv_heads=2, head_dim=32,
                      block_size=16, fused_qkv=True, seed=9)
    case = Case(fp32.query, fp32.key, fp32.value, fp32.k_cache.to(cache_dtype), fp32.v_cache.to(cache_dtype),
                fp32.meta, fp32.full_k, fp32.full_v, fp32.scale)
    got, want, cache = run_both(case, EmulatedAttentionBackend(split=split, partition_size=16))
    assert got.dtype == torch.float32 and cache.dtype == cache_dtype
    assert_close(got, want, torch.float32)


# ------------------------------------------------------------------------ masking and independence

@pytest.mark.parametrize("split", ["never", "always"])
def test_never_reads_unwritten_or_foreign_slots(split: str) -> None:
    # Every slot no sequence owns holds NaN (so do the tails of partly filled blocks): one read of them would
    # turn an output NaN. Checked against the dense float64 reference, as the paged reference reads padding.
    seqs = [(1, 1), (15, 1), (17, 1), (40, 1), (21, 4), (9, 9)]
    case = build_case(seqs, num_q_heads=6, num_kv_heads=2, head_dim=32, block_size=16, fill=float("nan"),
                      share=[(3, 4, 1)], seed=8)
    emu = EmulatedAttentionBackend(split=split, partition_size=16)
    k, v = case.k_cache.clone(), case.v_cache.clone()
    emu.write_kv(case.key, case.value, k, v, case.meta)
    got = emu.forward(case.query, case.key, case.value, k, v, case.meta, case.scale)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), dense_reference(case), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------- plans

def test_heads_per_cta_divides_the_gqa_group() -> None:
    assert K.heads_per_cta(9, 3, 64) == 3  # SmolLM2
    assert K.heads_per_cta(32, 8, 128) == 4  # Llama 3 8B: 4 accumulators x 4 dims per lane
    assert K.heads_per_cta(28, 4, 128) == 1  # Qwen2 7B, GQA 7: 7 > 4, and 7 is prime
    assert K.heads_per_cta(64, 8, 64) == 8
    assert K.heads_per_cta(16, 16, 256) == 1
    with pytest.raises(ValueError):
        K.heads_per_cta(9, 2, 64)


def test_split_k_decision() -> None:
    sms = 132
    # One long sequence, 8 CTAs: split into 64 partitions of 512.
    p = K.plan_decode(1, 32, 4, 32768, sms)
    assert p.split and p.grid == (8, 1, 64)
    # 256 sequences x 8 CTAs fill the GPU many times over: no split even at 32k.
    assert not K.plan_decode(256, 32, 4, 32768, sms).split
    # Short contexts never split.
    assert not K.plan_decode(1, 32, 4, 512, sms).split
    assert K.plan_decode(4, 32, 4, 100, sms, mode="always").grid == (8, 4, 1)
    with pytest.raises(ValueError):
        K.plan_decode(1, 32, 4, 1000, sms, partition_size=100)  # not a multiple of the 16-token tile


def test_launch_rejects_argument_types_that_do_not_match_the_kernel() -> None:
    good = K.plan_write_kv(3, 2, 64, (128, 64), (128, 64))
    bad_args = good.args[:5] + (K.Scalar("i64", 2),) + good.args[6:]
    with pytest.raises(ValueError, match="reshape_and_cache"):
        K.Launch(good.role, good.grid, good.block, bad_args)
    with pytest.raises(ValueError):
        K.KernelConfig("float16", 80, 16, 1)  # head_dim the kernels do not cover


def test_emulated_stores_round_like_torch() -> None:
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32) * 100
    for dt, name in ((torch.float16, "float16"), (torch.bfloat16, "bfloat16")):
        assert np.array_equal(round_to(x, name), torch.from_numpy(x).to(dt).float().numpy())
