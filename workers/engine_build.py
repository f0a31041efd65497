"""Building an engine from its config: resolve the model's files (a GGUF converts once), load and quantize the
model, size the KV cache to the device, pick the attention backend, wrap runner and scheduler in an
``LLMEngine`` and warm it up. ``workers.engine`` is the engine itself, once built."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from common.startup import StartupProgress
from kernels_cupy.interface import AttentionBackend
from workers import structured
from workers.config import CacheConfig, EngineConfig
from workers.core.block_manager import BlockManager
from workers.core.scheduler import Scheduler
from workers.engine import LLMEngine
from workers.lora import LoraRegistry
from workers.model_runner import ModelRunner, kv_cache_bytes_per_block
from workers.models.linear import BlockLinear
from workers.models.llama import LlamaConfig, LlamaForCausalLM

log = logging.getLogger("workers.engine")  # the engine's start-up lines keep their logger
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_DTYPES = {**_DTYPES, "int8": torch.int8}  # int8: codes + per-row scales (kernels_cupy.kv_quant)


def num_kv_blocks(cache: CacheConfig, device: torch.device, bytes_per_block: int) -> int:
    """CPU: the configured byte budget (kv_cache_bytes) or else token budget. CUDA: a share of the free memory
    after the weights loaded. Bytes are counted in the cache's own dtype (int8 with its scales)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return max(1, int(free * cache.gpu_memory_utilization) // bytes_per_block)
    if cache.kv_cache_bytes is not None:
        return max(1, cache.kv_cache_bytes // bytes_per_block)
    return cache.kv_cache_tokens // cache.block_size


def default_backend(device: torch.device) -> AttentionBackend:
    if device.type == "cuda":
        from kernels_cupy import cuda_backend_or_reference  # CuPy kernels, or the reference (logged)

        return cuda_backend_or_reference(device)
    from kernels_cupy.cpu import cpu_backend_or_reference

    return cpu_backend_or_reference()  # type: ignore[no-any-return]


def resolve_kv_dtype(cfg: EngineConfig, model: LlamaForCausalLM, device: torch.device) -> torch.dtype:
    """``kv_cache_dtype`` as a torch dtype. ``auto``: the model's dtype, except for a block-quantized model in
    float32 on the CPU, which caches fp16 rows: the CPU kernels widen them exactly (F16C), decode attention reads
    half the bytes (it is bound by them), and a token budget holds twice the tokens. Quality gate with it
    (bench/RESULTS.md): int4 + fp16 KV 100% top-1 agreement with fp32 of the same weights, perplexity -0.006%.
    ``none`` (the exact fp32 reference mode) keeps an fp32 cache."""
    if cfg.cache.kv_cache_dtype != "auto":
        return _KV_DTYPES[cfg.cache.kv_cache_dtype]
    if device.type == "cpu" and cfg.model.dtype == "float32" and any(isinstance(m, BlockLinear)
                                                                     for m in model.modules()):
        return torch.float16
    return _KV_DTYPES[cfg.model.dtype]


MAX_GRAPH_BATCH = 512  # the largest captured decode batch; larger decode steps run eagerly


def engine_from_model(model: LlamaForCausalLM, cfg: EngineConfig, max_len: int) -> LLMEngine:
    """Wrap an already built model (tests use tiny random ones) in a full engine."""
    device = next(model.parameters()).device
    kv_dtype = resolve_kv_dtype(cfg, model, device)
    block_bytes = kv_cache_bytes_per_block(model, cfg.cache.block_size, kv_dtype)
    nb = num_kv_blocks(cfg.cache, device, block_bytes)
    loras = (None if cfg.lora.lora_dir is None
             else LoraRegistry(Path(cfg.lora.lora_dir), model.cfg, cfg.max_cpu_loras, device))
    runner = ModelRunner(model, nb, cfg.cache.block_size, default_backend(device), device, kv_dtype,
                         cfg.model.seed, loras)
    bm = BlockManager(nb, cfg.cache.block_size, cfg.cache.enable_prefix_caching)
    # A lone request must always fit in the cache, so the context limit is capped by the KV capacity.
    max_model_len = min(max_len, nb * cfg.cache.block_size)
    if device.type == "cuda" and not cfg.model.enforce_eager:
        runner.enable_cuda_graphs(max_model_len, min(cfg.scheduler.max_num_seqs, MAX_GRAPH_BATCH))
    log.info("KV cache: %d blocks of %d tokens, %s, %.1f MiB; max_model_len %d", nb, cfg.cache.block_size,
             str(kv_dtype).removeprefix("torch."), nb * block_bytes / 2**20, max_model_len)
    return LLMEngine(runner, Scheduler(cfg.scheduler, bm), model.cfg.vocab_size, model.cfg.eos_token_ids,
                     max_model_len, loras)


def resolve_max_model_len(llama_cfg: LlamaConfig, requested: int | None) -> int:
    """The context limit before the KV cache caps it: the requested one, else the model's own. A model with a
    sliding window (Mistral 7B v0.1) is capped at it: sliding-window attention is not implemented, and a context
    that fits the window sees exactly what full attention sees, so within it the output is the model's own."""
    max_len = requested or llama_cfg.max_position_embeddings
    if max_len > llama_cfg.max_position_embeddings:
        raise ValueError(f"max_model_len {max_len} exceeds the model's {llama_cfg.max_position_embeddings}")
    window = llama_cfg.sliding_window
    if window is None or max_len <= window:
        return max_len
    if requested is not None:
        raise ValueError(f"max_model_len {requested} exceeds the model's sliding_window {window}; sliding-window "
                         f"attention is not implemented, so the context is limited to the window: use "
                         f"--max-model-len {window} or less")
    log.info("max_model_len capped at the model's sliding_window %d (sliding-window attention is not "
             "implemented; within the window it equals full attention)", window)
    return window


def build_model(llama_cfg: LlamaConfig, state_dict: dict[str, torch.Tensor] | None,
                cfg: EngineConfig, gguf: Path | None = None) -> tuple[LlamaForCausalLM, int]:
    """The model with ``cfg.model.quantization`` applied (``gguf``: the source file, whose own quantized
    blocks the quantized modes keep)."""
    from workers.models.loader import apply_quantization, build_model as _build

    if cfg.model.num_threads:
        torch.set_num_threads(cfg.model.num_threads)
    max_len = resolve_max_model_len(llama_cfg, cfg.model.max_model_len)
    model = _build(llama_cfg, state_dict, max_len, _DTYPES[cfg.model.dtype], torch.device(cfg.model.device))
    log.info("linear layers: %s", apply_quantization(model, cfg.model, gguf))
    return model, max_len


def engine_from_config(cfg: EngineConfig, progress: StartupProgress | None = None) -> tuple[LLMEngine, Path]:
    """Resolve, load, wrap and warm up the configured model; returns the engine and the model's directory."""
    from workers.model_files import gguf_source, resolve
    from workers.models.loader import load_state_dict, read_config

    progress = progress or StartupProgress("engine")
    with progress.step(f"resolving model {cfg.model.model} (a GGUF converts once)"):
        files = resolve(cfg.model.model)
    with progress.step("loading weights"):
        llama_cfg = LlamaConfig.from_hf(read_config(files.directory))
        state_dict = load_state_dict(files.directory)
    with progress.step(f"building the model ({cfg.model.dtype}, {cfg.model.device})"):
        model, max_len = build_model(llama_cfg, state_dict, cfg, gguf_source(cfg.model.model))
    with progress.step("allocating the KV cache and loading attention kernels"):
        engine = engine_from_model(model, cfg, max_len)
    with progress.step("warming up"):
        engine.warm_up()
    structured.enable(engine, files.directory)  # the grammar engine loads the tokenizer at first use
    return engine, files.directory
