"""LoRA adapters saved at 16 bits keep their width on the CPU (workers/lora/adapter.py): half the bytes a step
reads, and the bits of the same weights held in fp32 (the C++ kernels widen each weight exactly)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.lora_support import ATTN, MLP, lora_engine, make_adapter
from tests.tiny import hf_model, random_prompts
from workers.core.sampling_params import SamplingParams
from workers.lora.adapter import WEIGHTS_FILE, load_adapter, stored_dtype
from workers.models.decode_stack import STACK_PROJS
from workers.models.llama import LlamaConfig


def _resave(src: Path, dst: Path, dtype: torch.dtype) -> Path:
    """``src``'s adapter with every weight converted to ``dtype`` (the config copied as it is)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    save_file({k: v.to(dtype).contiguous() for k, v in load_file(str(src / WEIGHTS_FILE)).items()},
              str(dst / WEIGHTS_FILE))
    return dst


@pytest.fixture(scope="module")
def hf() -> Any:
    return hf_model(seed=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_16bit_adapter_answers_with_the_bits_of_its_fp32_copy(hf: Any, tmp_path: Path, dtype: torch.dtype) -> None:
    made = make_adapter(hf, tmp_path / "made", ATTN + MLP, r=8, seed=4)
    half = _resave(made, tmp_path / "loras" / "half", dtype)
    _resave(half, tmp_path / "loras" / "wide", torch.float32)  # the same values, widened exactly
    base = LlamaConfig.from_hf(hf.config.to_dict())
    a16, a32 = (load_adapter(tmp_path / "loras" / n, n, base) for n in ("half", "wide"))
    p16, p32 = a16.layers[0]["qkv_proj"], a32.layers[0]["qkv_proj"]
    assert p16.a.dtype == dtype and p16.bs[0].dtype == dtype and p32.a.dtype == torch.float32
    assert torch.equal(p16.a.float(), p32.a) and a16.nbytes * 2 == a32.nbytes
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    for mode in ("none", "int4"):
        answers = []
        for name in ("half", "wide"):
            eng = lora_engine(hf, tmp_path / "loras", quantization=mode)
            prompts = random_prompts(3, 5, 40, seed=9)
            for i, p in enumerate(prompts):  # together: the mixed-batch path
                eng.add_request(f"r{i}", p, params, None, 1.0, None, 0, name if i != 1 else None)
            eng.add_request("base0", prompts[0], params)  # r0's prompt on the base model
            out: dict[str, tuple[list[int], list[Any]]] = {}
            while eng.has_unfinished():
                for o in eng.step():
                    toks, lps = out.get(o.request_id, ([], []))
                    out[o.request_id] = (toks + o.new_token_ids, lps + list(o.logprobs or []))
            answers.append(out)
        assert answers[0] == answers[1], mode
        assert answers[0]["r0"] != answers[0]["base0"]  # the adapter does change the answer


def test_the_stored_width_rule() -> None:
    bf, f16, f32 = torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.float16), torch.zeros(2)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert stored_dtype({"a": bf, "b": bf}, cpu) == torch.bfloat16
    assert stored_dtype({"a": f16}, cpu) == torch.float16
    assert stored_dtype({"a": bf, "b": f16}, cpu) == torch.float32  # mixed: fp32
    assert stored_dtype({"a": f32}, cpu) == torch.float32
    assert stored_dtype({"a": bf}, cuda) == torch.float32  # the CUDA kernels read fp32


def test_an_adapter_is_one_aligned_buffer_read_in_step_order(hf: Any, tmp_path: Path) -> None:
    """On the CPU every A and B of an adapter is a view into one buffer starting on a huge-page boundary, laid
    out as a step reads them (layer by layer; qkv, o, gate_up, down; each A then its slices' B), holding the
    file's values exactly (adapter.py's _packed)."""
    from safetensors.torch import load_file

    made = make_adapter(hf, tmp_path / "loras" / "all", ATTN + MLP, r=8, seed=5)
    sd = load_file(str(made / WEIGHTS_FILE))
    ad = load_adapter(made, "all", LlamaConfig.from_hf(hf.config.to_dict()))
    views = [t for layer in ad.layers for proj in STACK_PROJS for t in (layer[proj].a, *layer[proj].bs)]
    base = views[0].untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == base and v.is_contiguous() for v in views)  # one buffer
    assert views[0].data_ptr() % (2 << 20) == 0  # starts on a huge page
    starts = [v.data_ptr() for v in views]
    assert starts == sorted(starts) and all(s % 64 == 0 for s in starts)  # in read order, cache-line aligned
    assert all(a.data_ptr() + a.nbytes <= b.data_ptr() for a, b in zip(views, views[1:]))  # none overlap
    q_a = sd[next(k for k in sd if "layers.0.self_attn.q_proj.lora_A" in k)]
    down_b = sd[next(k for k in sd if "layers.1.mlp.down_proj.lora_B" in k)]
    assert torch.equal(ad.layers[0]["qkv_proj"].a[:8], q_a.to(ad.layers[0]["qkv_proj"].a.dtype))
    assert torch.equal(ad.layers[1]["down_proj"].bs[0], down_b.to(ad.layers[1]["down_proj"].bs[0].dtype))
