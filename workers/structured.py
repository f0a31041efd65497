"""Structured outputs on the worker: a grammar per request (llguidance), its token mask applied to that
request's logits row before sampling, the matcher advanced with each sampled token.

The request carries its grammar as ``SamplingParams.structured``, a JSON string (the gateway builds it from
OpenAI's ``response_format`` or vLLM's ``guided_*``): ``{"type": "json_schema", "schema": {...}}``,
``{"type": "json_object"}``, ``{"type": "regex", "pattern": "..."}`` or ``{"type": "choice", "choices": [...]}``.

Why llguidance (bench/RESULTS.md, "Structured outputs: grammar engine"): its compile is lazy (ms for a moderate
schema, so a compile bound is rarely reached), its mask plus apply is the cheapest at batch 1 and 16 on our CPU,
and it depends on nothing (xgrammar pulls triton). EOS is in the mask only when the grammar may end.

Compiling happens when the request is added (``LLMEngine.add_request`` -> ``prepare``), cached by the spec's
canonical JSON, in a helper thread with a time bound: past it the request is refused (ValueError -> a 4xx),
never left to stall the steps. The sampler is wrapped (``enable``), so the runner and sampler are unchanged.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any, Protocol

import torch

from workers.core.outputs import SampledToken
from workers.core.request import Request
from workers.core.sampling_params import SamplingParams

COMPILE_TIMEOUT_S = 5.0
_CACHE_SIZE = 256
_KINDS = ("json_schema", "json_object", "regex", "choice")


class StructuredError(ValueError):
    """A grammar spec the engine cannot serve (bad JSON, an unsupported schema feature, too slow to compile)."""


class InnerSampler(Protocol):
    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[SampledToken]: ...
    def release(self, request_id: str) -> None: ...


def _spec(text: str) -> dict[str, Any]:
    try:
        spec = json.loads(text)
    except ValueError:
        raise StructuredError("structured output spec is not JSON") from None
    if not isinstance(spec, dict) or spec.get("type") not in _KINDS:
        raise StructuredError(f"structured output type must be one of {_KINDS}")
    return spec


def canonical(text: str) -> str:
    """The cache key: equal specs written differently (whitespace, top-level key order) share one compiled
    grammar. Nested key order is kept: a schema's property order is the order the output is generated in."""
    spec = _spec(text)
    return json.dumps({k: spec[k] for k in sorted(spec)}, separators=(",", ":"))


def grammar_for(spec_text: str) -> str:
    """The llguidance grammar (a JSON string) for a spec; schema problems raise StructuredError."""
    import llguidance

    spec = _spec(spec_text)
    kind = spec["type"]
    # Compact JSON: the model need not spend tokens on whitespace, and a random model cannot pad forever.
    defaults: Any = {"whitespace_flexible": False}
    try:
        if kind == "json_schema":
            schema = spec.get("schema")
            if not isinstance(schema, (dict, bool)):
                raise StructuredError("json_schema needs a 'schema' object")
            return str(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=defaults))
        if kind == "json_object":
            return str(llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=defaults))
        if kind == "regex":
            pattern = spec.get("pattern")
            if not isinstance(pattern, str):
                raise StructuredError("regex needs a 'pattern' string")
            return str(llguidance.LLMatcher.grammar_from_regex(pattern))
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise StructuredError("choice needs a non-empty list of strings")
        return str(llguidance.LLMatcher.grammar_from_regex("|".join(f"({re.escape(c)})" for c in choices)))
    except (ValueError, TypeError, RuntimeError) as e:
        if isinstance(e, StructuredError):
            raise
        raise StructuredError(f"unsupported {kind}: {e}") from None


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, ceil(V/32)) int32 words, bit j of word w = token 32*w + j allowed -> (R, V) bool. Plain tensor ops:
    llguidance.torch's apply is a torch.compile kernel, whose first call compiles for seconds in the worker."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: the sign bit still lands in bit 0
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


class StructuredOutputs:
    """Grammar cache, per-request matchers, and the masking around a sampler."""

    def __init__(self, tokenizer: Any, vocab_size: int, compile_timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self._tokenizer_source = tokenizer  # an HF tokenizer or its directory: loaded at first use
        self._llg_tokenizer: Any = None
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self._grammars: OrderedDict[str, str] = OrderedDict()
        self._matchers: dict[str, Any] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")

    def _tokenizer(self) -> Any:
        if self._llg_tokenizer is None:
            import llguidance.hf

            tok = self._tokenizer_source
            if isinstance(tok, (str, Path)):
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(tok)
            self._llg_tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=self.vocab_size)
        return self._llg_tokenizer

    def _compile(self, key: str) -> str:
        import llguidance

        grammar = grammar_for(key)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer())
        if is_error:
            raise StructuredError(f"unsupported schema: {'; '.join(messages)}")
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar)  # builds the lexer: the costly part
        if matcher.is_error():
            raise StructuredError(f"unsupported schema: {matcher.get_error()}")
        return grammar

    def compiled(self, spec_text: str) -> str:
        key = canonical(spec_text)
        if key in self._grammars:
            self._grammars.move_to_end(key)
            return self._grammars[key]
        future = self._pool.submit(self._compile, key)
        try:
            grammar = future.result(timeout=self.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            raise StructuredError(f"the schema did not compile within {self.compile_timeout_s:g} s: "
                                  "simplify it (fewer alternatives, bounded repetition)") from None
        self._grammars[key] = grammar
        if len(self._grammars) > _CACHE_SIZE:
            self._grammars.popitem(last=False)
        return grammar

    def prepare(self, request_id: str, params: SamplingParams) -> None:
        """At add_request: compile (or hit the cache) and create the request's matcher; refusals raise."""
        if params.structured is None:
            return
        import llguidance

        self._matchers[request_id] = llguidance.LLMatcher(self._tokenizer(), self.compiled(params.structured))

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def mask(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        rows = [(i, self._matchers[r.request_id]) for i, r in enumerate(reqs) if r.request_id in self._matchers]
        if not rows:
            return logits
        import llguidance.torch as lt

        bitmask = lt.allocate_token_bitmask(len(rows), self.vocab_size)
        for j, (_, m) in enumerate(rows):
            lt.fill_next_token_bitmask(m, bitmask, j)
        index = torch.tensor([i for i, _ in rows], dtype=torch.int64, device=logits.device)
        out = logits.clone()  # never write into the caller's tensor
        allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[-1])
        out[index] = out[index].masked_fill(~allowed, float("-inf"))
        return out

    def advance(self, reqs: list[Request], tokens: list[SampledToken]) -> None:
        for r, t in zip(reqs, tokens):
            m = self._matchers.get(r.request_id)
            if m is not None and not m.is_stopped():
                m.consume_token(t.token_id)


class StructuredSampler:
    """The runner's sampler with grammar masks around it: mask -> sample -> advance."""

    def __init__(self, inner: InnerSampler, outputs: StructuredOutputs) -> None:
        self.inner, self.outputs = inner, outputs

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[SampledToken]:
        tokens = self.inner.sample(self.outputs.mask(logits, reqs), reqs)
        self.outputs.advance(reqs, tokens)
        return tokens

    def release(self, request_id: str) -> None:
        self.outputs.release(request_id)
        self.inner.release(request_id)

    def __getattr__(self, name: str) -> Any:  # vocab_size, device, ...: the inner sampler's
        return getattr(self.inner, name)


def enable(engine: Any, tokenizer: Any) -> StructuredOutputs:
    """Give an engine structured outputs (tokenizer: an HF tokenizer or its directory, loaded lazily)."""
    outputs = StructuredOutputs(tokenizer, engine.vocab_size)
    runner = engine.runner
    runner.sampler = StructuredSampler(runner.sampler, outputs)
    engine.structured = outputs
    return outputs


def prepare(engine: Any, request_id: str, params: SamplingParams) -> None:
    """The engine's add_request hook: a structured request on an engine without support is refused."""
    if params.structured is None:
        return
    outputs: StructuredOutputs | None = getattr(engine, "structured", None)
    if outputs is None:
        raise StructuredError("this worker has no structured-output support (no tokenizer)")
    outputs.prepare(request_id, params)
