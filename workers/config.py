"""Engine configuration: one frozen dataclass of sub-configs, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.engine_flags import DTYPES as _DTYPES
from common.engine_flags import KV_CACHE_DTYPES as KV_CACHE_DTYPES
from common.engine_flags import QUANTIZATIONS as _QUANTIZATIONS
from workers.core.scheduler_config import SchedulerConfig

_BLOCK_MODES = _QUANTIZATIONS[2:]


@dataclass(frozen=True)
class ModelConfig:
    model: str = "smollm2"
    device: str = "cpu"
    dtype: str = "float32"  # fp32 on the CPU by default; bf16 selectable
    max_model_len: int | None = None  # None: the model's own limit, capped by the KV cache
    seed: int = 0  # for requests that carry no seed of their own
    num_threads: int | None = None  # torch intra-op threads on the CPU (None: torch's default)
    # Linear layers: "none" (fp32, token-identical to transformers: what the golden test pins), "int8" /
    # "int4" (GGUF-style blocks, 12-bit activations, the C++ kernel), "int8-a8" / "int4-a8" (8-bit
    # activations: faster, lower agreement with fp32), "auto" (the rule in workers.models.linear; "none" off the
    # CPU or below fp32). The offline LLM, `kvgate worker` and `kvgate serve` default to "auto"; this engine
    # config stays "none" so engine-level tests on tiny models keep their exact fp32 oracles.
    quantization: str = "none"
    # CUDA: no CUDA graphs, every step eager (vLLM's --enforce-eager); graphs replay pure decode steps
    # (workers/cuda_graphs.py). Ignored on the CPU.
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.quantization not in _QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {_QUANTIZATIONS}, got {self.quantization!r}")
        if self.quantization in _BLOCK_MODES and self.device != "cpu":
            raise ValueError(f"quantization {self.quantization} runs on the CPU only; use 'none' (or 'auto') on CUDA")
        if self.quantization in _BLOCK_MODES and self.dtype != "float32":
            raise ValueError(f"quantization {self.quantization} computes in float32; got dtype {self.dtype!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_tokens: int = 32768  # CPU: KV capacity as a token budget
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of free memory the KV cache may take
    enable_prefix_caching: bool = True
    # "auto": the model's dtype, but fp16 for a block-quantized float32 model on the CPU
    # (engine_build.resolve_kv_dtype).
    # "bfloat16": half the bytes per cached token; decode attention on a CPU is
    # bound by reading the cache, so this trades a little precision for speed and capacity. "int8": symmetric
    # int8 per token and KV head with an fp32 scale per row (kernels_cupy.kv_quant; CPU only), ~1/4 the bytes.
    kv_cache_dtype: str = "auto"
    # CPU: KV capacity as bytes instead of tokens (None: kv_cache_tokens); the blocks that fit follow the KV
    # dtype, so int8 gets ~3.8x the blocks of fp32 from the same budget.
    kv_cache_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        # Powers of two keep slot arithmetic cheap; the CUDA backend checks the sizes its kernels support.
        if not 1 <= self.block_size <= 256 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two in [1, 256], got {self.block_size}")
        if self.kv_cache_tokens < self.block_size:
            raise ValueError(f"kv_cache_tokens must be >= block_size, got {self.kv_cache_tokens}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (workers/lora/): served by name from ``lora_dir`` (one PEFT directory each, loaded on first
    use); at most ``max_cpu_loras`` kept loaded, least recently used evicted first (None: the scheduler's
    ``max_loras``, the adapters one step may run). No lora_dir: requests naming an adapter are refused."""

    lora_dir: str | None = None
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_cpu_loras is not None and self.max_cpu_loras < 1:
            raise ValueError(f"max_cpu_loras must be >= 1, got {self.max_cpu_loras}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    @property
    def max_cpu_loras(self) -> int:
        return self.lora.max_cpu_loras or self.scheduler.max_loras

    def __post_init__(self) -> None:
        # A step's adapters must all be resident at once, so the resident set holds at least a step's worth.
        if self.max_cpu_loras < self.scheduler.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.scheduler.max_loras})")
        # The int8 cache has a CPU kernel and a torch reference; the CUDA kernels read fp32/bf16/fp16 only.
        if self.cache.kv_cache_dtype == "int8" and self.model.device != "cpu":
            raise ValueError("kv_cache_dtype int8 runs on the CPU only; use auto, bfloat16 or float16 on CUDA")
