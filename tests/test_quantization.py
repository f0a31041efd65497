"""Quantized linears (``--quantization int8|int4``): block formats against gguf's own reference code, the C++
kernel against its exact arithmetic on every instruction-set path this CPU has, and whole tiny models in each
mode against their reference (the fp32 model with the de-quantized weights) within a stated logit tolerance.

Tolerances, and why:
- kernel vs its exact arithmetic (int8 activations, exact int32 block dots): 1e-5 of the output scale; only
  fp32 summation order differs.
- a quantized model vs its reference: RMS logit difference <= 2% and max <= 10% of the reference logits'
  standard deviation. The only approximation is int8 activations per block of 32 (rounding error <= 1/254
  of the block's largest value), which compounds through the layers; the tiny models below land at ~1.1%
  RMS and ~5.5% max (measured over 70 positions x 512 logits).
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels_cupy.cpu.qgemm import load_qgemm
from kernels_cupy.torch_ref import TorchAttentionBackend
from tests.cpu_support import built, results_per_isa
from tests.tiny import hf_model
from workers.config import CacheConfig, EngineConfig, ModelConfig
from workers.core.scheduler_config import SchedulerConfig
from workers.engine_build import build_model
from workers.models.gguf_blocks import rope_row_order
from workers.models.linear import BlockLinear, quantize_linears, resolve_mode
from workers.models.llama import LlamaConfig
from workers.models.quant import BlockWeight, dequantize, fake_quantize_activations, from_gguf, quantize
from workers.models.scoring import sequence_logits

RMS_TOLERANCE, MAX_TOLERANCE = 0.02, 0.10  # of the reference logits' std, see the module docstring


@pytest.fixture(scope="module")
def kernel():  # type: ignore[no-untyped-def]
    return built(load_qgemm(), "the quantized GEMM kernel")


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_dequantize_as_gguf_does(type_name: str) -> None:
    import gguf.quants
    from gguf import GGMLQuantizationType

    w = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    qtype = GGMLQuantizationType[type_name]
    raw = gguf.quants.quantize(w, qtype)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    got = dequantize(from_gguf(raw, type_name, 6, 96))
    assert torch.equal(got, expected)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_error_is_within_half_a_step(bits: int) -> None:
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(bits))
    q = quantize(w, bits)
    err = (dequantize(q) - w).abs().reshape(16, 4, 32).amax(-1)  # (N, NB)
    # Scales and minimums are stored at fp16 (as GGUF does): half a step, plus their own rounding (relative
    # 2^-11) times the largest code (15 or 127) and the minimum.
    m = torch.zeros_like(q.d) if q.m is None else q.m.abs()
    bound = q.d * 0.5 + 2.0 ** -11 * (q.d * (15 if bits == 4 else 127) + m)
    assert bool((err <= bound + 1e-6).all())
    for t in (q.d, q.m):
        assert t is None or torch.equal(t, t.half().float())  # what the kernel reads as fp16 is exact


def test_rope_row_order_is_transformers_reverse_permutation() -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    for n, heads in ((576, 9), (192, 3), (64, 4)):
        rows = np.arange(n)[:, None].astype(np.float32)
        expected = LlamaTensorProcessor(config={})._reverse_permute_weights(rows, heads)[:, 0]
        assert rope_row_order(n, heads).tolist() == expected.astype(int).tolist()


def _exact(x: torch.Tensor, w: BlockWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's arithmetic in fp64: int8 activations per block of 32 against the exact weights."""
    out = fake_quantize_activations(x).double() @ dequantize(w).double().T
    return (out + (0 if bias is None else bias.double())).float()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (3, 17, 96), (4, 64, 576), (9, 33, 160), (37, 8, 32)])
def test_kernel_matches_its_exact_arithmetic(kernel, bits: int, m: int, n: int, k: int) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(m * 1000 + n + k + bits)
    w = quantize(torch.randn(n, k, generator=g) * 0.1, bits)
    x = torch.randn(m, k, generator=g)
    x[0, :32] = 0.0  # an all-zero block: scale 0 must not divide by zero
    bias = torch.randn(n, generator=g)
    wmt = None if w.m is None else w.m.half().t().contiguous()  # what BlockLinear keeps beside m
    for b in (None, bias):
        ref = _exact(x, w, b)
        for mt in (None, wmt):  # min terms per column, or eight columns at a time from the transposed mins
            got = kernel.qlinear(x, w.codes, w.d, w.m, b, bits, mt)
            assert (got - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("m", [1, 6, 16])
def test_min_terms_of_a_column_do_not_depend_on_its_tile(kernel, m: int) -> None:  # type: ignore[no-untyped-def]
    """With wmt, columns go in tiles of eight and a split of N that leaves fewer takes a per-column path with
    the same arithmetic: a column's value is bit-identical whether its tile was whole or not, and whatever the
    thread count (the decode stack and the module path split N differently and must agree bit for bit)."""
    g = torch.Generator().manual_seed(m)
    k = 32 * 131  # more blocks than one chunk of the min-term tile (128) and an odd count: every branch
    w = quantize(torch.randn(24, k, generator=g) * 0.1, 4)
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(24, generator=g)

    def run(n: int) -> torch.Tensor:  # the first n columns only
        mt = w.m[:n].half().t().contiguous()
        return kernel.qlinear(x, w.codes[:n].contiguous(), w.d[:n], w.m[:n], bias[:n], 4, mt)

    whole = run(24)  # three full tiles
    for n in (13, 5):  # a full tile and a tail of 5; a tail only
        assert torch.equal(run(n), whole[:, :n]), n
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(run(24), whole)
    finally:
        torch.set_num_threads(threads)


_ISA_CHECK = """
import torch
from kernels_cupy.cpu.qgemm import load_qgemm
from workers.models.quant import quantize
mod = load_qgemm()
g = torch.Generator().manual_seed(0)
x = torch.randn(5, 96, generator=g)
outs = []
for bits in (4, 8):
    w = quantize(torch.randn(19, 96, generator=g), bits)
    outs.append(mod.qlinear(x, w.codes, w.d, w.m, None, bits))
    if bits == 4:  # the transposed minimums' path (min_terms8 and, for 19 columns, min_terms1)
        outs.append(mod.qlinear(x, w.codes, w.d, w.m, None, bits, w.m.half().t().contiguous()))
torch.save(torch.cat(outs, 1), __import__("sys").argv[1])
print(mod.isa())
"""


def test_every_isa_path_agrees(kernel, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The scalar path, AVX2 and (where the CPU has it) VNNI give the same results; each runs in its own
    process because the path is chosen once per process."""
    results = results_per_isa(_ISA_CHECK, "KVGATE_QGEMM_ISA", ("scalar", "avx2", "best"), tmp_path)
    ref = results["scalar"]
    for isa, got in results.items():
        assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item(), isa


@pytest.mark.parametrize("act_bits", [8, 16])
def test_block_linear_runs_one_arithmetic_for_every_chunk_length(kernel, act_bits: int) -> None:  # type: ignore[no-untyped-def]
    """No row-count switch (there was one: fp32 GEMM from 96 rows): a row's output is the same bits whether it
    runs alone (decode), in a short chunk or in a long prefill chunk."""
    g = torch.Generator().manual_seed(5)
    w, bias = quantize(torch.randn(24, 64, generator=g), 4), torch.randn(24, generator=g)
    layer = BlockLinear(w, bias, kernel, act_bits)
    x = torch.randn(200, 64, generator=g)
    whole = layer(x)
    assert torch.equal(layer(x[7:8]), whole[7:8])
    assert torch.equal(layer(x[3:19]), whole[3:19])
    if act_bits == 8:
        torch.testing.assert_close(whole, _exact(x, w, bias), rtol=1e-5, atol=1e-5)


def test_block_linear_falls_back_to_its_reference_without_the_kernel() -> None:
    w = quantize(torch.randn(24, 64), 4)
    bias = torch.randn(24)
    layer = BlockLinear(w, bias, kernel=None)
    x = torch.randn(3, 64)
    assert torch.equal(layer(x), F.linear(x, dequantize(w), bias))


def _tiny(mode: str, kernel, seed: int = 0, **hf_overrides: object):  # type: ignore[no-untyped-def]
    hf = hf_model(seed, initializer_range=0.05, **hf_overrides)
    cfg = EngineConfig(ModelConfig("tiny"), CacheConfig(4, 4096), SchedulerConfig(8, 64))
    model, _ = build_model(LlamaConfig.from_hf(hf.config.to_dict()), dict(hf.state_dict()), cfg)
    quantize_linears(model, mode, {}, kernel)
    return model


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True}, {"attention_bias": True}])
def test_quantized_model_matches_its_reference(kernel, mode: str, overrides: dict[str, object]) -> None:  # type: ignore[no-untyped-def]
    ids = torch.randint(4, 512, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    quant = _tiny(mode, kernel, **overrides)
    ref = _tiny(mode, None, **overrides)  # same blocks, run as fp32 de-quantized weights
    for layer in quant.modules():
        if isinstance(layer, BlockLinear):
            assert layer.dense is None  # the kernel really runs
    backend = TorchAttentionBackend()
    got = sequence_logits(quant, ids, backend, chunk=32)
    want = sequence_logits(ref, ids, backend, chunk=32)
    diff, scale = got - want, want.std().item()
    assert diff.pow(2).mean().sqrt().item() <= RMS_TOLERANCE * scale
    assert diff.abs().max().item() <= MAX_TOLERANCE * scale


def test_mode_none_leaves_the_model_alone(kernel) -> None:  # type: ignore[no-untyped-def]
    model = _tiny("none", kernel)
    assert not any(isinstance(m, BlockLinear) for m in model.modules())


def test_auto_rule() -> None:
    class Fake:
        def __init__(self, isa: str) -> None:
            self._isa = isa

        def isa(self) -> str:
            return self._isa

    assert resolve_mode("auto", None, 4) == "none"  # no kernel
    assert resolve_mode("auto", Fake("scalar"), 4) == "none"  # no SIMD path: fp32 BLAS is faster
    assert resolve_mode("auto", Fake("avx2"), 4) == "int4"  # a Q4 GGUF runs its own blocks
    assert resolve_mode("auto", Fake("avx512-vnni"), 8) == "int8"
    assert resolve_mode("auto", Fake("avx2"), None) == "int8"  # fp32 checkpoint: near-lossless
    assert resolve_mode("int4", None, None) == "int4"
    with pytest.raises(ValueError):
        resolve_mode("fp8", None, None)


def test_config_validates_quantization() -> None:
    with pytest.raises(ValueError):
        ModelConfig(quantization="int3")
    with pytest.raises(ValueError):
        ModelConfig(quantization="int8", dtype="bfloat16")
    with pytest.raises(ValueError):
        ModelConfig(quantization="int4", device="cuda")
    assert ModelConfig().quantization == "none"
    assert ModelConfig(quantization="auto", device="cuda").quantization == "auto"  # resolves to none there


def test_auto_is_the_default_for_the_offline_llm_and_the_worker() -> None:
    import argparse
    import inspect

    from workers.llm import LLM
    from workers.process.worker_args import add_engine_args, engine_config

    assert inspect.signature(LLM).parameters["quantization"].default == "auto"
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args([])).model.quantization == "auto"  # `kvgate serve` passes none by default



def test_layers_not_in_whole_blocks_stay_fp32(kernel) -> None:  # type: ignore[no-untyped-def]
    model = _tiny("int4", kernel, hidden_size=48, intermediate_size=96)  # 48 % 32 != 0: q/k/v, gate/up, head
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if n.endswith(("proj", "lm_head"))}
    assert kinds["layers.0.mlp.down_proj"] == "BlockLinear"  # 96 inputs: three blocks
    # The rest run fp32 through the fixed-order kernel.
    assert kinds["layers.0.self_attn.qkv_proj"] == "DenseLinear" and kinds["lm_head"] == "DenseLinear"
