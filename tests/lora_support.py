"""Random PEFT LoRA adapters for tiny test models (built by peft itself, saved as PEFT saves them), an engine
serving them, and the transformers + peft twin as the oracle."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from workers.config import CacheConfig, EngineConfig, LoraConfig, ModelConfig
from workers.core.scheduler_config import SchedulerConfig
from workers.engine import LLMEngine
from workers.engine_build import build_model, engine_from_model
from workers.models.llama import LlamaConfig

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
ALL = ATTN + MLP


def make_adapter(hf: Any, path: Path, targets: list[str], r: int = 8, alpha: float = 16.0, seed: int = 0,
                 std: float = 0.1, **extra: Any) -> Path:
    """A PEFT adapter of ``hf`` saved at ``path``, with random A and B (peft starts B at zero, which would make
    every adapter the base model)."""
    import copy

    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    cfg = PeftLoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, **extra)
    peft = get_peft_model(copy.deepcopy(hf), cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    peft.save_pretrained(str(path))
    return path


def peft_model(hf: Any, path: Path) -> Any:
    import copy

    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(hf), str(path)).eval()


def lora_engine(hf: Any, lora_dir: Path | None, *, block_size: int = 4, max_num_batched_tokens: int = 64,
                max_loras: int = 8, max_cpu_loras: int | None = None, quantization: str = "none",
                max_num_seqs: int = 32, device: str = "cpu", dtype: str = "float32") -> LLMEngine:
    cfg = EngineConfig(ModelConfig("tiny", device, dtype, None, 0, quantization=quantization),
                       CacheConfig(block_size, 4096, 0.05 if device == "cuda" else 0.9, True),
                       SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_loras=max_loras),
                       LoraConfig(None if lora_dir is None else str(lora_dir), max_cpu_loras))
    model, max_len = build_model(LlamaConfig.from_hf(hf.config.to_dict()), dict(hf.state_dict()), cfg)
    return engine_from_model(model, cfg, max_len)


def three_adapters(hf: Any, d: Path) -> Path:
    """The tests' standard set in ``d``: "attn" (rank 4), "mlp" (rank 16, alpha 8) and "all" (rank 8)."""
    make_adapter(hf, d / "attn", ATTN, r=4, seed=1)
    make_adapter(hf, d / "mlp", MLP, r=16, alpha=8, seed=2)
    make_adapter(hf, d / "all", ALL, r=8, seed=3)
    return d



def broken_copies(good: Path, d: Path) -> None:
    """Copies of the adapter ``good`` under ``d``, each broken one way: "truncated" (half its safetensors file),
    "rank" (its config says r = 128), "shapes" (q_proj's A made for a base model of hidden size 32, where the tiny
    model's is 64)."""
    from safetensors.torch import load_file, save_file

    from common.peft_config import CONFIG_FILE, WEIGHTS_FILE

    shutil.copytree(good, d / "truncated")
    data = (d / "truncated" / WEIGHTS_FILE).read_bytes()
    (d / "truncated" / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    shutil.copytree(good, d / "rank")
    cfg = json.loads((d / "rank" / CONFIG_FILE).read_text())
    (d / "rank" / CONFIG_FILE).write_text(json.dumps({**cfg, "r": 128}))
    shutil.copytree(good, d / "shapes")
    sd = load_file(str(d / "shapes" / WEIGHTS_FILE))
    key = next(k for k in sd if "q_proj.lora_A" in k)
    sd[key] = sd[key][:, :32].contiguous()
    save_file(sd, str(d / "shapes" / WEIGHTS_FILE))
