"""Structured outputs on the worker: a grammar per request (llguidance), its token mask applied to that
request's logits row before sampling, the matcher advanced with each sampled token.

The request carries its grammar as ``SamplingParams.structured``, a JSON string (the gateway builds it from
OpenAI's ``response_format`` or vLLM's ``guided_*``): ``{"type": "json_schema", "schema": {...}}``,
``{"type": "json_object"}``, ``{"type": "regex", "pattern": "..."}``, ``{"type": "choice", "choices": [...]}`` or
``{"type": "lark", "grammar": "..."}`` (llguidance's Lark syntax; what tool calling sends).

Why llguidance (bench/RESULTS.md, "Structured outputs: grammar engine"): its compile is lazy (ms for a moderate
schema, so a compile bound is rarely reached), its mask plus apply is the cheapest at batch 1 and 16 on our CPU,
and it depends on nothing (xgrammar pulls triton). EOS is in the mask only when the grammar may end.

Compiles never run on the engine thread. ``prepare`` (from ``LLMEngine.add_request``) checks the spec's shape
(a malformed one raises StructuredError, a 4xx) and either installs a copy of a cached matcher at once or queues
the compile (the matcher's lexer build and its first mask) for a compile thread; the engine parks the request
and ``collect``s at each step: a compiled one joins the scheduler, one whose compile failed or took longer than
``compile_timeout_s`` is refused with the reason. The first compile also starts the tokenizer's one-time load
(seconds, in a thread of its own); compiles start, and their bound counts, only once it has ended. The lexer
build drops the GIL, and llguidance's own limits (lexer fuel, Earley items per step) bound a compile and each
step's mask; a compile that runs past the bound anyway keeps its thread (threads cannot be killed) but no
longer counts against the pool, so later compiles still start (at most ``MAX_OVERDUE`` threads more). Compiled
matchers are cached by the spec's canonical JSON; a request gets a ``deep_copy`` (microseconds: the lexer and
its lazily built states are shared). The sampler is wrapped (``enable``), so the runner and sampler are
unchanged.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import torch

from workers import grammar_tokenizer
from workers.core.outputs import SampledToken
from workers.grammar_compile import (Compile, Compiler, StructuredError, Waiter, failed_internally, in_thread,
                                     refusal)
from workers.core.request import Request
from workers.core.sampling_params import SamplingParams

log = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 5.0
COMPILE_THREADS = 2  # compiles at once; the lexer build runs outside the GIL
IDLE_POLL_S = 0.01  # an engine with only parked requests waits this long for a compile, then looks at its inbox
_CACHE_SIZE = 256
_KINDS = ("json_schema", "json_object", "regex", "choice", "lark")


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


def _check_fields(spec: dict[str, Any]) -> None:
    """The spec's fields have the right shapes (cheap: no grammar is built)."""
    kind = spec["type"]
    if kind == "json_schema" and not isinstance(spec.get("schema"), (dict, bool)):
        raise StructuredError("json_schema needs a 'schema' object")
    if kind == "regex" and not isinstance(spec.get("pattern"), str):
        raise StructuredError("regex needs a 'pattern' string")
    if kind == "lark" and not isinstance(spec.get("grammar"), str):
        raise StructuredError("lark needs a 'grammar' string")
    if kind == "choice":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise StructuredError("choice needs a non-empty list of strings")


def canonical(text: str) -> str:
    """The cache key: equal specs written differently (whitespace, top-level key order) share one compiled
    grammar. Nested key order is kept: a schema's property order is the order the output is generated in.
    A spec whose fields have the wrong shapes raises StructuredError."""
    spec = _spec(text)
    _check_fields(spec)
    return json.dumps({k: spec[k] for k in sorted(spec)}, separators=(",", ":"))


def grammar_for(spec_text: str) -> str:
    """The llguidance grammar (a JSON string) for a spec; schema problems raise StructuredError."""
    import llguidance

    spec = _spec(spec_text)
    _check_fields(spec)
    kind = spec["type"]
    # Compact JSON: the model need not spend tokens on whitespace, and a random model cannot pad forever.
    defaults: Any = {"whitespace_flexible": False}
    try:
        if kind == "json_schema":
            return str(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec["schema"]), defaults=defaults))
        if kind == "json_object":
            return str(llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=defaults))
        if kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(spec["pattern"]))
        if kind == "lark":  # tool calling's grammar (gateway.pipeline.tools), %json bodies inside
            return str(llguidance.LLMatcher.grammar_from_lark(spec["grammar"]))
        choices = spec["choices"]
        return str(llguidance.LLMatcher.grammar_from_regex("|".join(f"({re.escape(c)})" for c in choices)))
    except (ValueError, TypeError, RuntimeError) as e:
        if isinstance(e, StructuredError):
            raise
        raise StructuredError(f"unsupported {kind}: {e}") from None


def new_bitmask(rows: int, vocab_size: int, pin: bool = False) -> torch.Tensor:
    """(rows, ceil(V/32)) int32, all allowed. What llguidance.torch does, without importing it: its module
    defines a torch.compile kernel, and importing torch._dynamo for it takes seconds (measured 2.4 s here)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=pin)


def fill_bitmask(matcher: Any, bitmask: torch.Tensor, row: int) -> None:
    """The matcher's next-token mask into ``bitmask[row]`` (a contiguous CPU int32 row, as from new_bitmask)."""
    v = bitmask[row]
    matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, ceil(V/32)) int32 words, bit j of word w = token 32*w + j allowed -> (R, V) bool. Plain tensor ops:
    llguidance.torch's apply is a torch.compile kernel, whose first call compiles for seconds in the worker."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: the sign bit still lands in bit 0
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


class StructuredOutputs:
    """Grammar cache, compiles off the engine thread, per-request matchers, and the masking around a sampler."""

    def __init__(self, tokenizer: Any, vocab_size: int, compile_timeout_s: float = COMPILE_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._tokenizer_source = tokenizer  # an HF tokenizer or its directory: loaded for the first compile
        self._tokenizer_load: concurrent.futures.Future[Any] | None = None  # the llguidance tokenizer
        self._tokenizer_ready_at: float | None = None  # on ``clock``, seen by the engine thread
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self._clock = clock
        self._compiles: OrderedDict[str, Compile] = OrderedDict()  # by canonical spec; LRU over done ones
        self._waiting: dict[str, Waiter] = {}  # request id -> the compile it is parked on
        self._matchers: dict[str, Any] = {}
        # late-bound so a test can replace _build on the instance
        self._compiler = Compiler(lambda key: self._build(key), COMPILE_THREADS, compile_timeout_s, clock)

    def _load_tokenizer(self) -> Any:
        """In a thread, once: ~0.7 s from a model directory (``workers.grammar_tokenizer``), seconds where
        transformers must build it; some of it in native calls that hold the GIL."""
        return grammar_tokenizer.load(self._tokenizer_source, self.vocab_size)

    def _tokenizer_ready(self) -> bool:
        """Starts the tokenizer's load at the first compile; True once it has ended (loaded or failed: then
        each compile fails with its error)."""
        if self._tokenizer_load is None:
            self._tokenizer_load = in_thread(self._load_tokenizer, "grammar-tokenizer")
        if not self._tokenizer_load.done():
            return False
        if self._tokenizer_ready_at is None:
            self._tokenizer_ready_at = self._clock()
        return True

    def _build(self, key: str) -> Any:
        """In a compile thread (started once the tokenizer is loaded): the spec's matcher, ready to be copied,
        or StructuredError."""
        import llguidance

        if self._tokenizer_load is None:
            raise RuntimeError("a compile started before the tokenizer's load")
        matcher = llguidance.LLMatcher(self._tokenizer_load.result(), grammar_for(key))  # the GIL is dropped
        if not matcher.is_error():
            # The first mask builds the start state's lexer states lazily: here, not in the first step (the
            # copies share them); it also surfaces a grammar too complex for one step's limits.
            fill_bitmask(matcher, new_bitmask(1, self.vocab_size), 0)
        if matcher.is_error():
            raise StructuredError(f"unsupported {_spec(key)['type']}: {matcher.get_error()}")
        return matcher

    def _pump(self) -> None:
        if self._tokenizer_ready():  # no compile starts before: its bound would count the one-time load
            self._compiler.pump()

    def _compile_for(self, key: str) -> Compile:
        """The compile for a canonical spec: cached (done or in flight), or a new one queued."""
        job = self._compiles.get(key)
        if job is not None and not job.future.cancelled() and not failed_internally(job):
            self._compiles.move_to_end(key)
            return job
        job = self._compiles[key] = Compile(key)
        self._compiles.move_to_end(key)
        self._evict()
        self._compiler.submit(job)
        self._pump()
        return job

    def _evict(self) -> None:
        while len(self._compiles) > _CACHE_SIZE:
            oldest_done = next((k for k, j in self._compiles.items() if j.future.done()), None)
            if oldest_done is None:
                return  # all in flight: they leave once done
            del self._compiles[oldest_done]

    def prepare(self, request_id: str, params: SamplingParams) -> bool:
        """At add_request. False: ready (no grammar, or a cached matcher installed). True: its compile is
        pending; ``collect`` says when it is ready or refused. A malformed spec raises StructuredError."""
        if params.structured is None:
            return False
        job = self._compile_for(canonical(params.structured))
        if job.future.done() and refusal(job.future) is None:
            self._matchers[request_id] = job.future.result().deep_copy()
            return False
        job.want()
        self._waiting[request_id] = Waiter(job, self._clock())
        return True

    def _deadline(self, w: Waiter) -> float | None:
        """When a parked request is refused as too slow: the bound counts from its arrival or from the end of
        the tokenizer's one-time load, whichever is later (that load is not the schema's doing)."""
        if self._tokenizer_ready_at is None:
            return None
        return max(w.added, self._tokenizer_ready_at) + self.compile_timeout_s

    def collect(self) -> tuple[list[str], list[tuple[str, str, str]]]:
        """Never blocks. Returns the parked requests now ready (their matchers installed) and those refused,
        with an error code and why (their compile failed or did not finish within the bound), each in the order
        they came."""
        self._pump()
        now = self._clock()
        ready: list[str] = []
        refused: list[tuple[str, str, str]] = []
        for rid, w in list(self._waiting.items()):
            deadline = self._deadline(w)
            if w.compile.future.done():
                why = refusal(w.compile.future)
                if why is None:
                    self._matchers[rid] = w.compile.future.result().deep_copy()
                    ready.append(rid)
                else:
                    refused.append((rid, *why))
            elif deadline is not None and now >= deadline:
                refused.append((rid, *self._too_slow(w.compile)))
            else:
                continue
            self._unpark(rid)
        if refused:
            self._pump()  # a compile that just went overdue frees its slot for the queue
        return ready, refused

    def _too_slow(self, job: Compile) -> tuple[str, str]:
        """(error code, why): never started is "doesn't fit now" (a 503 to retry); too slow to compile is the
        schema's fault (a 400)."""
        if job.started is None:
            return "grammar_busy", (f"the grammar compiler was busy with other schemas for "
                                    f"{self.compile_timeout_s:g} s; retry later")
        return "invalid_request", (f"the schema did not compile within {self.compile_timeout_s:g} s: simplify it "
                                   "(fewer alternatives, bounded repetition)")

    def _unpark(self, request_id: str) -> None:
        w = self._waiting.pop(request_id)
        if w.compile.unwant() and w.compile.future.cancel():  # still queued and nobody wants it now
            if self._compiles.get(w.compile.key) is w.compile:
                del self._compiles[w.compile.key]

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def compiling(self, request_id: str) -> bool:
        """Whether the request is parked here, its grammar not compiled yet (``collect`` has not released it)."""
        return request_id in self._waiting

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` (or the first parked request's deadline) until a pending compile or the
        tokenizer's load ends: for an engine that has nothing else to do, instead of spinning."""
        if not self._waiting:
            return
        deadlines = [d for w in self._waiting.values() if (d := self._deadline(w)) is not None]
        if deadlines:
            timeout = max(0.0, min(timeout, min(deadlines) - self._clock()))
        futures = {w.compile.future for w in self._waiting.values()}
        if self._tokenizer_load is not None and not self._tokenizer_load.done():
            futures.add(self._tokenizer_load)
        concurrent.futures.wait(futures, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def compiled(self, spec_text: str) -> Any:
        """The compiled (template) matcher for a spec, blocking until its compile ends: for tests and tools;
        the engine never waits for a compile."""
        job = self._compile_for(canonical(spec_text))
        job.want()
        try:
            while not job.future.done():
                self._pump()
                concurrent.futures.wait([job.future], 0.05)
        finally:
            job.unwant()
        why = refusal(job.future)
        if why is not None:
            raise StructuredError(why[1])
        return job.future.result()

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        if request_id in self._waiting:
            self._unpark(request_id)

    def mask(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        rows = [(i, self._matchers[r.request_id]) for i, r in enumerate(reqs) if r.request_id in self._matchers]
        if not rows:
            return logits
        bitmask = new_bitmask(len(rows), self.vocab_size, pin=logits.device.type == "cuda")
        for j, (_, m) in enumerate(rows):
            fill_bitmask(m, bitmask, j)
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


def enable(engine: Any, tokenizer: Any, compile_timeout_s: float = COMPILE_TIMEOUT_S,
           clock: Callable[[], float] = time.monotonic) -> StructuredOutputs:
    """Give an engine structured outputs (tokenizer: an HF tokenizer or its directory, loaded lazily by the
    first compile). ``clock`` times the compile bound (tests pass a fake one)."""
    outputs = StructuredOutputs(tokenizer, engine.vocab_size, compile_timeout_s, clock)
    engine.use_structured(outputs)
    return outputs


def prepare(engine: Any, request_id: str, params: SamplingParams) -> bool:
    """The engine's add_request hook. True: the request waits for its grammar (``StructuredOutputs.collect``);
    False: it can be scheduled now. A malformed spec, or one on an engine without support, raises."""
    if params.structured is None:
        return False
    outputs: StructuredOutputs | None = getattr(engine, "structured", None)
    if outputs is None:
        raise StructuredError("this worker has no structured-output support (no tokenizer)")
    return outputs.prepare(request_id, params)
