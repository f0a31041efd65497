"""kvgate workers: the engine (model, paged KV cache, scheduler, sampler) and, in ``workers.process``, the worker
process around it (which the engine never imports: ``tests/test_workers_layering.py``).

``LLM`` and the engine pull in torch; they are imported on first use so that light modules of this package
(the engine core, sampling params) stay importable without it.
"""

from typing import Any

from workers.core.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "LLMEngine"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from workers.llm import LLM

        return LLM
    if name == "LLMEngine":
        from workers.engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
