"""csrc/lora.cu without a GPU: a NumPy emulation of lora_shrink and lora_expand that walks their thread mapping and
summation order (warp per shrink output, lanes striding over `in`, warp_sum's xor tree; thread per expand column,
one chain over the rank), fed the very tables, arguments and grids kernels_cupy/lora_cuda.py builds for a launch
(CPU tensors carry addresses too: the records' pointers resolve against the adapters' weights). Checked against
workers/lora/batch.py's Python loop (fp32, tight) and for batch invariance: a row's emulated bits are the same
alone as beside other rows and adapters, in every dtype.

The FMA is emulated in float64 (the product is exact there, the sum rounds to 53 bits, then to fp32): a double
rounding that may differ from the GPU's single one in rare ties; the checks here never compare it to a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from kernels_cupy import lora_cuda as L
from kernels_cupy.kernels import NUM_WARPS, THREADS, WARP
from tests.kernel_emulate import LANE, round_to, shfl_xor
from workers.lora.adapter import LoraAdapter, LoraProj, LoraSlice
from workers.lora.batch import LoraBatch

F32 = np.float32
DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
Mem = dict[int, np.ndarray]  # device address -> the flat fp32 weights there


def modules(h: int, q: int, kv: int, i: int) -> dict[str, tuple[str, int, int, int]]:
    """PEFT module -> (kvgate projection, lo, hi, in), as workers.lora.adapter.targets."""
    return {"q_proj": ("qkv_proj", 0, q, h), "k_proj": ("qkv_proj", q, q + kv, h),
            "v_proj": ("qkv_proj", q + kv, q + 2 * kv, h), "o_proj": ("o_proj", 0, h, q),
            "gate_proj": ("gate_up_proj", 0, i, h), "up_proj": ("gate_up_proj", i, 2 * i, h),
            "down_proj": ("down_proj", 0, h, i)}


def random_adapter(name: str, r: int, targets: Sequence[str], dims: tuple[int, int, int, int], layers: int,
                   seed: int, scale: float = 2.0, device: str = "cpu") -> LoraAdapter:
    """A LoraAdapter laid out as load_adapter builds one (each projection's A stacked, B per slice)."""
    g = torch.Generator().manual_seed(seed)
    mods = modules(*dims)
    built: list[dict[str, LoraProj]] = []
    for _ in range(layers):
        by_proj: dict[str, list[str]] = {}
        for t in targets:
            by_proj.setdefault(mods[t][0], []).append(t)
        layer = {}
        for proj, ms in by_proj.items():
            a = torch.cat([torch.randn(r, mods[m][3], generator=g) * 0.2 for m in ms]).to(device).contiguous()
            slices = tuple(LoraSlice(mods[m][1], mods[m][2], j * r, (j + 1) * r,
                                     (torch.randn(mods[m][2] - mods[m][1], r, generator=g) * 0.2).to(device))
                           for j, m in enumerate(ms))
            layer[proj] = LoraProj(a, slices)
        built.append(layer)
    return LoraAdapter(name, r, scale, tuple(built), 0)


def proj_sizes(dims: tuple[int, int, int, int]) -> dict[str, tuple[int, int]]:
    """projection -> (in, out)."""
    h, q, kv, i = dims
    return {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h), "gate_up_proj": (h, 2 * i), "down_proj": (i, h)}


def memory(adapters: Sequence[LoraAdapter]) -> Mem:
    return {int(t.data_ptr()): t.numpy().ravel() for ad in adapters for layer in ad.layers for p in layer.values()
            for t in (p.a, *p.bs)}


def fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(F32)


def warp_sum(x: np.ndarray) -> np.ndarray:  # common.cuh warp_sum: xor offsets 16, 8, 4, 2, 1
    off = WARP // 2
    while off > 0:
        x = (x + shfl_xor(x, off)).astype(F32)
        off //= 2
    return x


def emulate_shrink(grid: L.Grid, block: int, mem: Mem, x: np.ndarray, row_map: np.ndarray, meta: np.ndarray,
                   h: np.ndarray, n_in: int, r_cap: int) -> None:
    """lora_shrink<T> over flat buffers: x (T*in,) fp32 values of T, row_map (n*2,), meta (G*REC,), h (n*r_cap,)."""
    assert block == THREADS and grid[2] == 1
    for i in range(grid[0]):
        row, g = int(row_map[2 * i]), int(row_map[2 * i + 1])
        rec = meta[g * L.REC:(g + 1) * L.REC]
        for c in range(grid[1]):
            for warp in range(NUM_WARPS):
                k = c * NUM_WARPS + warp
                if k >= rec[1]:
                    continue
                a = mem[int(rec[0])]
                acc = np.zeros(WARP, F32)  # (32,) one chain per lane
                for j0 in range(0, n_in, WARP):
                    j = j0 + LANE
                    ok = j < n_in
                    jj = np.where(ok, j, 0)
                    acc = np.where(ok, fma(x[row * n_in + jj], a[k * n_in + jj], acc), acc)
                h[i * r_cap + k] = warp_sum(acc)[0]


def emulate_expand(grid: L.Grid, block: int, mem: Mem, y: np.ndarray, row_map: np.ndarray, meta: np.ndarray,
                   h: np.ndarray, out: int, r_cap: int, dtype: str) -> None:
    """lora_expand<T> over flat buffers: y (T*out,) fp32 values of T, updated with T's roundings."""
    assert block == THREADS and grid[2] == 1
    for i in range(grid[0]):
        row, g = int(row_map[2 * i]), int(row_map[2 * i + 1])
        rec = meta[g * L.REC:(g + 1) * L.REC]
        if rec[1] == 0:
            continue
        scale = np.array([rec[2]], np.int64).astype(np.int32).view(F32)[0]
        for c in range(grid[1]):
            o = c * THREADS + np.arange(THREADS)  # (THREADS,) a column per thread
            for s in range(int(rec[3])):
                b_addr, lo, hi, r_lo, r_hi = (int(v) for v in rec[4 + 5 * s:9 + 5 * s])
                cols = o[(o >= lo) & (o < hi) & (o < out)]
                r, b = r_hi - r_lo, mem[b_addr]
                acc = np.zeros(len(cols), F32)
                for k in range(r):
                    acc = fma(b[(cols - lo) * r + k], np.full(len(cols), h[i * r_cap + r_lo + k], F32), acc)
                d = round_to((acc * scale).astype(F32), dtype)
                y[row * out + cols] = round_to((y[row * out + cols] + d).astype(F32), dtype)


def emulate_add(batch: LoraBatch, rows: Sequence[Sequence[int]], layer: int, proj: str, x: torch.Tensor,
                y: torch.Tensor) -> None:
    """lora_cuda.launch_add, with the emulation in the kernels' place: the same tables, grids and arguments."""
    step = L.pack_step([(a, r) for (a, _), r in zip(batch.groups, rows)], torch.device("cpu"))
    if step.n == 0 or not step.targeted[layer][L.proj_index(proj)]:
        return
    assert L.check_operands(x, y) is None
    h = torch.full((step.n, step.r_cap), float("nan"))  # (n, r_cap): unwritten entries must never be read
    mem, dtype = memory([a for a, _ in batch.groups]), DTYPES[x.dtype]
    xf, yf = x.float().numpy().ravel(), y.float().numpy().ravel().copy()
    args = L.shrink_args(step, layer, proj, x, h)
    check_kinds("lora_shrink", args)
    grid, block = L.shrink_geometry(step.n, step.r_cap)
    row_map, meta, hf = flat_args(args[1:4])
    emulate_shrink(grid, block, mem, xf, row_map, meta, hf, int(args[4]), int(args[5]))
    args = L.expand_args(step, layer, proj, y, h)
    check_kinds("lora_expand", args)
    grid, block = L.expand_geometry(step.n, y.shape[1])
    row_map, meta, hf = flat_args(args[1:4])
    emulate_expand(grid, block, mem, yf, row_map, meta, hf, int(args[4]), int(args[5]), dtype)
    y.copy_(torch.from_numpy(yf).view(y.shape))  # exact: every value is already one of y's dtype


def flat_args(ts: Sequence[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    a, b, c = (t.numpy().ravel() for t in ts)  # views: the shrink's h store lands in the tensor
    return a, b, c


def check_kinds(kernel: str, args: Sequence[Any]) -> None:
    want = {"ptr": torch.Tensor, "i32": np.int32, "i64": np.int64, "f32": np.float32}
    assert [type(a) for a in args] == [want[k] for k in L.SIGNATURES[kernel]], kernel


DIMS = (40, 40, 16, 72)  # hidden, q, kv, intermediate: in = 40 leaves a partial lane stride
LAYERS = 2


@pytest.fixture(scope="module")
def adapters() -> dict[str, LoraAdapter]:
    ads = [random_adapter("attn", 4, ATTN, DIMS, LAYERS, 1), random_adapter("mlp", 16, MLP, DIMS, LAYERS, 2, 0.5),
           random_adapter("all", 8, ATTN + MLP, DIMS, LAYERS, 3)]
    return {a.name: a for a in ads}


ROWS = {"attn": [0, 3], "mlp": [5], "all": [1, 2, 6, 8, 9]}  # rows 4 and 7: the base


def test_emulation_matches_the_python_loop_in_fp32(adapters: dict[str, LoraAdapter]) -> None:
    batch = LoraBatch.build(ROWS, adapters, None, torch.device("cpu"))
    assert batch is not None
    g = torch.Generator().manual_seed(5)
    for layer in range(LAYERS):
        for proj, (n_in, n_out) in proj_sizes(DIMS).items():
            x, y = torch.randn(10, n_in, generator=g), torch.randn(10, n_out, generator=g)
            y_emu, y_ref = y.clone(), y.clone()
            emulate_add(batch, list(ROWS.values()), layer, proj, x, y_emu)
            batch.add(layer, proj, x, y_ref)  # no kernel: the F.linear loop, fp32
            torch.testing.assert_close(y_emu, y_ref, atol=1e-5, rtol=1e-5)
            assert torch.equal(y_emu[[4, 7]], y[[4, 7]]), "base rows must be untouched"
            assert not torch.equal(y_emu, y)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES.values()))
def test_a_rows_bits_do_not_depend_on_its_company(adapters: dict[str, LoraAdapter], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(6)
    for proj, (n_in, n_out) in proj_sizes(DIMS).items():
        x = torch.randn(10, n_in, generator=g).to(dtype)
        y = torch.randn(10, n_out, generator=g).to(dtype)
        mixed = y.clone()
        batch = LoraBatch.build(ROWS, adapters, None, torch.device("cpu"))
        assert batch is not None
        emulate_add(batch, list(ROWS.values()), 1, proj, x, mixed)
        for name, rows in ROWS.items():
            for r in rows:  # the row alone: a one-row batch, x and y holding just that row
                alone = y[r:r + 1].clone()
                solo = LoraBatch.build({name: [0]}, adapters, None, torch.device("cpu"))
                assert solo is not None
                emulate_add(solo, [[0]], 1, proj, x[r:r + 1].contiguous(), alone)
                assert torch.equal(alone[0], mixed[r]), (proj, name, r)


def test_tables_and_geometry() -> None:
    ad = random_adapter("all", 8, ATTN + MLP, DIMS, 1, 4, scale=0.25)
    only_o = random_adapter("o", 2, ["o_proj"], DIMS, 1, 5)
    step = L.pack_step([(ad, [3, 1]), (only_o, [0])], torch.device("cpu"))
    assert step.row_map.tolist() == [[3, 0], [1, 0], [0, 1]] and step.meta.shape == (1, 4, 2, L.REC)
    assert step.r_cap == 24 and step.targeted == ((True, True, True, True),)
    qkv = step.meta[0, L.proj_index("qkv_proj")]
    assert qkv[0, 1:4].tolist() == [24, L.scale_bits(0.25), 3] and qkv[1].eq(0).all()
    assert qkv[0, 4 + 5:9 + 5].tolist()[1:] == [40, 56, 8, 16]  # k_proj: columns [q, q + kv), its rank's rows
    assert L.adapter_table(ad) is L.adapter_table(ad)  # kept, not rebuilt per step
    assert L.shrink_geometry(3, 24) == ((3, 24 // NUM_WARPS, 1), THREADS)
    assert L.expand_geometry(3, 129) == ((3, 2, 1), THREADS)
    assert L.check_operands(torch.zeros(2, 3), torch.zeros(2, 4, dtype=torch.float16)) is not None
    assert L.EXPRESSIONS == ("lora_shrink<float>", "lora_shrink<half_t>", "lora_shrink<bf16_t>",
                             "lora_expand<float>", "lora_expand<half_t>", "lora_expand<bf16_t>")
