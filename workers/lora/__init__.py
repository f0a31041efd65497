"""Multi-LoRA serving, engine side: PEFT adapters read and checked against the base model (``adapter``), the
worker's resident set with LRU eviction (``registry``), and a step's per-row deltas (``batch``)."""

from workers.lora.adapter import MAX_RANK, LoraAdapter, load_adapter
from workers.lora.batch import LoraBatch
from workers.lora.registry import LoraRegistry, UnknownLora

__all__ = ["MAX_RANK", "LoraAdapter", "LoraBatch", "LoraRegistry", "UnknownLora", "load_adapter"]
