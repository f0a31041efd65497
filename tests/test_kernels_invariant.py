"""The CUDA path's batch-invariant pieces, checked without a GPU.

- Attention, mode "invariant" (kernels_cupy/cupy_backend.py): every query row runs as a decode row
  (``as_decode_rows``) with split-K at a fixed partition size. Through the NumPy emulation of the kernels
  (tests/kernel_emulate.py, the same launch plans the GPU runs): correct against the torch reference, and a
  row's output bits are the same whether it came in a long chunk, a short chunk after a cached prefix, or as a
  decode token beside other sequences.
- Linear layers (workers/models/cuda_linear.py): every GEMM on row tiles of one height, so a row's bits do not
  depend on how many rows share the call (on CPU torch here; the GPU run is bench/gpu_e2e.py --check).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels_cupy.interface import AttentionMetadata, as_decode_rows
from kernels_cupy.torch_ref import TorchAttentionBackend
from tests.kernel_cases import Case, build_case
from tests.kernel_emulate import EmulatedAttentionBackend
from workers.models.cuda_linear import TiledLinear, tile_linears

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _written(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = case.k_cache.clone(), case.v_cache.clone()
    TorchAttentionBackend().write_kv(case.key, case.value, k, v, case.meta)
    return k, v


def _chunk(meta: AttentionMetadata, seq: int, start: int, end: int) -> AttentionMetadata:
    """Sequence ``seq``'s query rows [start, end) of its context alone, as a step that computed only them."""
    table = meta.block_tables[seq:seq + 1]
    q = end - start
    return AttentionMetadata(meta.slot_mapping[:q], torch.tensor([0, q], dtype=torch.int32),
                             torch.tensor([end], dtype=torch.int32), table, (q,), (end,), int(q == 1), end)


def test_as_decode_rows_gives_each_row_its_own_context() -> None:
    case = build_case([(9, 1), (12, 4), (5, 5)], num_q_heads=2, num_kv_heads=2, head_dim=32, block_size=4, seed=1)
    rows = as_decode_rows(case.meta, 4)
    assert rows.num_decodes == rows.num_seqs == 10
    assert rows.seq_lens_cpu == (9, 9, 10, 11, 12, 1, 2, 3, 4, 5)
    assert rows.seq_lens.tolist() == list(rows.seq_lens_cpu)
    assert rows.query_start_loc.tolist() == list(range(11))
    nb = rows.block_tables.shape[1]  # cut to the blocks of the longest context (12 tokens: 3 of 4)
    assert nb == 3 and torch.equal(rows.block_tables[1:5], case.meta.block_tables[1:2, :nb].expand(4, -1))
    assert torch.equal(rows.block_tables[0], case.meta.block_tables[0, :nb])
    decodes = build_case([(9, 1), (3, 1)], num_q_heads=2, num_kv_heads=2, head_dim=32, block_size=4, seed=1)
    assert as_decode_rows(decodes.meta, 4) is decodes.meta  # nothing to expand


@pytest.mark.parametrize("dtype", list(TOL), ids=["fp32", "fp16", "bf16"])
def test_invariant_mode_matches_the_reference(dtype: torch.dtype) -> None:
    seqs = [(17, 1), (40, 1), (33, 5), (20, 20), (48, 9)]
    case = build_case(seqs, num_q_heads=6, num_kv_heads=2, head_dim=32, block_size=4, dtype=dtype,
                      share=[(4, 2, 4)], fused_qkv=True, seed=2)
    k, v = _written(case)
    emu = EmulatedAttentionBackend(split="invariant", partition_size=16)
    got = emu.forward(case.query, case.key, case.value, k, v, case.meta, case.scale)
    want = TorchAttentionBackend().forward(case.query, case.key, case.value, k, v, case.meta, case.scale)
    assert emu.last_plan is not None
    assert [lc.role for lc in emu.last_plan.launches] == ["decode_split", "decode_reduce"]
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_rows_bits_do_not_depend_on_its_chunk(dtype: torch.dtype) -> None:
    # One 45-token prompt, its K/V all in the cache; rows 40..44 computed as: the whole prompt in one chunk, a
    # chunk of 5 after 40 cached tokens (a prefix hit), chunks of 16, and row 44 as a decode beside others.
    case = build_case([(45, 45), (30, 1)], num_q_heads=6, num_kv_heads=2, head_dim=32, block_size=4,
                      dtype=dtype, seed=3)
    k, v = _written(case)
    emu = EmulatedAttentionBackend(split="invariant", partition_size=16)

    def rows(start: int, end: int) -> torch.Tensor:  # (end - start, Hq, D)
        return emu.forward(case.query[start:end], case.key, case.value, k, v, _chunk(case.meta, 0, start, end),
                           case.scale)

    whole = rows(0, 45)
    assert torch.equal(rows(40, 45), whole[40:45])
    assert torch.equal(rows(32, 45), whole[32:45])
    assert torch.equal(torch.cat([rows(s, min(s + 16, 45)) for s in range(0, 45, 16)]), whole)
    # Row 44 as a decode token (one query row), first alone, then beside a second sequence's decode row.
    assert torch.equal(rows(44, 45), whole[44:45])
    pair = dataclasses.replace(
        case.meta, slot_mapping=case.meta.slot_mapping[:2], query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([45, 30], dtype=torch.int32), query_lens_cpu=(1, 1), seq_lens_cpu=(45, 30),
        num_decodes=2)
    q_pair = torch.stack([case.query[44], case.query[45]])  # (2, Hq, D)
    both = emu.forward(q_pair, case.key, case.value, k, v, pair, case.scale)
    assert torch.equal(both[0:1], whole[44:45])


# ------------------------------------------------------------------------------------------- linears

def test_tiled_linear_equals_its_layer_and_keeps_the_parameters() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96, bias=True), nn.Linear(96, 32, bias=False))
    weight = model[0].weight
    assert tile_linears(model, row_tile=8) == 2
    assert isinstance(model[0], TiledLinear) and model[0].weight is weight  # same parameter, not a copy
    for t in (0, 1, 7, 8, 9, 37):
        x = torch.randn(t, 64)
        got = model(x)
        want = F.linear(F.linear(x, weight, model[0].bias), model[1].weight)
        assert got.shape == (t, 32)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_tiled_linear_rows_do_not_depend_on_the_row_count() -> None:
    torch.manual_seed(1)
    layer = TiledLinear(nn.Linear(576, 1536, bias=False), row_tile=16)
    probe = torch.randn(3, 576)
    alone = layer(probe)  # (3, 1536): one tile, 13 padding rows
    for t in (3, 16, 17, 40):
        x = torch.randn(t, 576)
        x[:3] = probe  # same rows at the same place in their tile, other rows and counts differ
        assert torch.equal(layer(x)[:3], alone), t


def test_decode_rows_are_built_once_a_step() -> None:
    from kernels_cupy.interface import DecodeRows

    case = build_case([(9, 1), (12, 4)], num_q_heads=2, num_kv_heads=2, head_dim=32, block_size=4, seed=1)
    other = build_case([(9, 1), (12, 4)], num_q_heads=2, num_kv_heads=2, head_dim=32, block_size=4, seed=1)
    rows = DecodeRows()
    first = rows.of(case.meta, 4)
    assert rows.of(case.meta, 4) is first  # every layer of the step: the same view, not rebuilt
    again = rows.of(other.meta, 4)  # the next step's metadata: built anew, equal here
    assert again is not first and again.seq_lens_cpu == first.seq_lens_cpu
    assert torch.equal(again.block_tables, as_decode_rows(other.meta, 4).block_tables)
