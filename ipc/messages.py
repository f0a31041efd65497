"""Typed, versioned messages exchanged between the gateway and its workers.

Every message is a frozen, slotted dataclass holding only plain msgpack-able values (str, int, float, bool,
None, lists, str-keyed dicts), so the codec can map it to a msgpack array without pickle and validate it field
by field on the way back. The wire layout (a type tag, then the fields in declaration order) lives in
``ipc.codec``; bump ``PROTOCOL_VERSION`` whenever a field is added, removed, reordered or retyped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ipc.sampling import SamplingParams

# Sent in Hello; the gateway refuses a worker that speaks another version rather than misreading its frames.
PROTOCOL_VERSION = 12  # 2: RequestOutputMsg.timings, StepOutputs.num_batched_tokens; 3: step progress and
# request ids in Stats, the token budget in Hello; 4: Generate.sampling is a typed SamplingParams (was a dict);
# 5: speculative-decoding counters in Stats; 6: Refused; 7: RequestOutputMsg.error_code; 8: prompt logprobs
# (SamplingParams.prompt_logprobs, RequestOutputMsg.prompt_logprobs); 9: Generate.priority; 10: prompt logprobs
# travel chunk by chunk (outputs with no token carry them; a version-9 gateway would keep only the last chunk);
# 11: Generate.lora (the LoRA adapter a request runs with); 12: Stats.max_num_batched_tokens (a worker sizes its
# steps again while idle), SamplingParams.logit_bias

# Per generated token: (logprob of the sampled token, [(token_id, logprob), ...] for the top-N alternatives).
TokenLogprobs = tuple[float, list[tuple[int, float]]]
# Per prompt token after the first: (its logprob, its rank in the distribution (1 = the argmax), top-N).
PromptLogprob = tuple[float, int, list[tuple[int, float]]]


# --------------------------------------------------------------------------------------------------
# gateway -> worker
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Generate:
    """Start a request. The worker never sees tenant names: only an opaque cache salt and a weight."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams  # validated when the frame is decoded
    cache_salt: str | None  # mixed into the first KV block hash so tenants never share cached prefixes
    weight: float  # weighted-fair-queuing share of the tenant
    deadline: float | None  # unix seconds; the worker may finish the request with a timeout after it
    trace_context: dict[str, str] | None  # W3C traceparent/tracestate, propagated as-is
    priority: int = 0  # vLLM's: lower runs sooner (the worker's priority scheduling policy)
    lora: str | None = None  # a LoRA adapter under the worker's --lora-dir (None: the base model)


@dataclass(frozen=True, slots=True)
class Abort:
    """Stop requests and free their blocks. Idempotent: unknown or finished ids are ignored."""

    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class Drain:
    """Finish running requests but accept no new ones (graceful scale-down)."""


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Exit now; running requests are dropped (the gateway has already failed or rerouted them)."""


# --------------------------------------------------------------------------------------------------
# worker -> gateway
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    """First message of a worker: who it is and what it can hold. protocol_version stays the first field
    in every future version so a receiver can always read it before anything else."""

    protocol_version: int
    worker_id: str
    pid: int
    model: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    vocab_size: int
    eos_token_ids: list[int]
    max_num_seqs: int
    max_num_batched_tokens: int  # the step's token budget: set by the operator or sized to the machine at start


@dataclass(frozen=True, slots=True)
class EngineTimings:
    """Where a finished request spent its time on the worker, in seconds since it arrived there. Offsets on the
    worker's clock, so the gateway can place them on its own timeline without the two clocks agreeing."""

    scheduled: float | None  # first admitted to a batch (queue time); None if it never ran
    first_token: float | None  # prefill ends here
    finished: float
    preempted: list[float]  # one offset per preemption


@dataclass(frozen=True, slots=True)
class RequestOutputMsg:
    """What one request produced in one engine step (an element of StepOutputs, not a frame of its own)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None  # None while running; else an OpenAI-style reason ("stop", "length", ...)
    num_cached_tokens: int  # prompt tokens served from the prefix cache (for usage accounting)
    logprobs: list[TokenLogprobs] | None  # one entry per new token when requested
    error: str | None
    timings: EngineTimings | None  # on the request's last output only
    # With error: the OpenAI error code it maps to ("context_length_exceeded": the prompt can never fit;
    # "invalid_request": its grammar cannot be compiled; "grammar_busy": no compile slot in time, retry)
    error_code: str | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token after the first, chunk by chunk as the
    # prefill computes them (each step's output of the request carries its chunk's, an output with no token
    # only those), in prompt order, each position once; the output of the first generated token ends them
    prompt_logprobs: list[PromptLogprob] | None = None


@dataclass(frozen=True, slots=True)
class StepOutputs:
    """All request outputs of one engine step, batched into one frame to keep per-token overhead low."""

    outputs: list[RequestOutputMsg]
    num_batched_tokens: int  # tokens the step computed (prompt chunks and decodes), for iteration metrics


@dataclass(frozen=True, slots=True)
class Stats:
    """Periodic heartbeat; also the router's load signal. Counters are cumulative since worker start.

    Sent by the worker's I/O thread every interval whatever the engine is doing, so silence means the process
    is frozen, not busy. The engine figures are the snapshot taken at the last step boundary; ``step_elapsed``
    is live, so the gateway can tell a slow step (heartbeats arrive, the step runs long) from a hung one (the
    same step past the step timeout)."""

    worker_id: str
    running: int
    waiting: int
    kv_usage: float  # fraction of KV blocks in use, 0..1
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    prefix_queries: int
    prefix_hits: int
    prompt_tokens_total: int
    generation_tokens_total: int
    timestamp: float  # unix seconds on the worker
    steps_done: int  # engine steps completed since start
    step_elapsed: float | None  # seconds the current step has run; None between steps
    request_ids: list[str]  # every request the engine holds (running, waiting, preempted): reconciliation
    # speculative decoding, cumulative (vLLM's spec_decode counters; zeros when it is off)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)  # accepted tokens by draft position
    # the step's token budget now: Hello's, until the worker sizes its steps again (workers.process.step_sizing)
    max_num_batched_tokens: int = 0


@dataclass(frozen=True, slots=True)
class RequestError:
    """A request failed on the worker before or outside a step (e.g. rejected at admission)."""

    request_id: str
    message: str
    code: str  # machine-readable, e.g. "prompt_too_long"; the gateway maps it to an HTTP status


@dataclass(frozen=True, slots=True)
class Goodbye:
    """Sent by a worker that leaves on purpose, so the gateway need not wait for missed heartbeats."""

    worker_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Refused:
    """The gateway will not take this worker (its key may not serve the worker id it claims): why, for its log.
    Sent only over the refused peer's own connection; the worker exits."""

    reason: str


GatewayToWorker = Generate | Abort | Drain | Shutdown | Refused
WorkerToGateway = Hello | StepOutputs | Stats | RequestError | Goodbye
Message = GatewayToWorker | WorkerToGateway
