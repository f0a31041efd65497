"""Batch-invariant linear layers on CUDA: every GEMM runs on row tiles of one fixed height.

cuBLAS picks its kernel (tiling, split-K) from the problem's shape, so the same row summed its products in a
different order when its step had 1, 13 or 512 rows, and a request's logprobs moved with what shared its step
(bench/RESULTS.md: 0/4 bit-equal on a prefix hit, beside other requests, chunked). Here a layer's input is padded
to a multiple of ``ROW_TILE`` rows and multiplied one tile at a time, so every call cuBLAS sees has the same
shape (ROW_TILE, in) x (in, out) and the same 16-byte-aligned operands: the same kernel, and for each output
element the same order of products, whatever the step holds. Rows never mix in a GEMM, so a row's bits depend
on its own input alone (tests/test_cuda_linear.py; on a GPU, bench/gpu_e2e.py --check).

Cost: a decode step of fewer rows computes a whole tile. A decode GEMM is bound by reading the weights, which is
the same for 1 or 128 rows on an H100 (bf16 ridge point ~300 rows), so the padding is nearly free; a prefill
chunk of N rows makes ceil(N / ROW_TILE) calls instead of one.
"""

from __future__ import annotations

import torch
from torch import nn

ROW_TILE = 128


class TiledLinear(nn.Module):
    """y = x @ W^T (+ b), (T, in) -> (T, out) in W's dtype, on row tiles of ``ROW_TILE``. Holds the nn.Linear's
    own parameters (a tied head stays tied)."""

    def __init__(self, old: nn.Linear, row_tile: int = ROW_TILE) -> None:
        super().__init__()
        self.in_features, self.out_features = old.in_features, old.out_features
        self.weight = old.weight  # (out, in)
        self.bias = old.bias  # (out,) or None
        self.row_tile = row_tile

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out)
        t, tile = x.shape[0], self.row_tile
        padded = -(-t // tile) * tile
        if padded == 0:
            return x.new_empty((0, self.out_features))
        xp = x.new_zeros((padded, self.in_features))  # (P, in): the tile's spare rows are zeros
        xp[:t] = x
        out = x.new_empty((padded, self.out_features))  # (P, out)
        wt = self.weight.detach().t()  # (in, out) view: cuBLAS reads W transposed, no copy
        bias = None if self.bias is None else self.bias.detach()
        for lo in range(0, padded, tile):
            if bias is None:
                torch.mm(xp[lo:lo + tile], wt, out=out[lo:lo + tile])
            else:
                torch.addmm(bias, xp[lo:lo + tile], wt, out=out[lo:lo + tile])
        return out[:t]

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, row_tile={self.row_tile}"


def tile_linears(model: nn.Module, row_tile: int = ROW_TILE) -> int:
    """Every nn.Linear of ``model`` -> :class:`TiledLinear`, in place; returns how many."""
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, TiledLinear(model.get_submodule(name), row_tile))  # type: ignore[arg-type]
    return len(names)
