"""The two OpenAI generation routes (``/v1/chat/completions``, ``/v1/completions``).

Every request is: auth -> read and parse the body (400/413 on anything malformed) -> validate and tokenize
(``gateway.pipeline.protocol``) -> quota -> ``pool.submit``, once per sequence (503 when nobody can take it) ->
answer (JSON) or stream (SSE). Each request is traced from here to its end (see ``gateway.telemetry.tracing``).
The steps are separate functions (``traced``, ``tokenize``, ``reserve``, ``submit``, ``start_stream``) because the
Responses API (``gateway.api.responses_routes``) runs the same ones around its own translation and events.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio
from quart import Response, g, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from gateway.api.context import app_state, authorize, check_model, current_trio_app
from gateway.api.http_json import json_response, read_json
from gateway.base.errors import APIError
from gateway.base.handle import RequestFailed
from gateway.base.principal import Principal
from gateway.fleet.pool import unix_deadline
from gateway.pipeline.admission import RequestAccount
from gateway.pipeline.choices import Choices, prompt_text, submit_all
from gateway.pipeline.protocol import GenerationRequest, parse_chat, parse_completion
from gateway.pipeline.responses import ResponseBuilder
from gateway.pipeline.streaming import Account, SSEBody, StreamProducer, complete, failure_to_api_error
from gateway.pipeline.tiering import route_submission
from gateway.pipeline.tokenizer import GatewayTokenizer
from gateway.telemetry.tracing import RequestTrace
from tenancy.models import LoraAdapterRecord

log = logging.getLogger("kvgate.gateway")
Parser = Callable[[Any, GatewayTokenizer, int | None, int | None], GenerationRequest]  # parse_chat, parse_completion

PARSE_IN_THREAD_BYTES = 64 * 1024  # tokenizing more than this would stall every other request on the loop
# Fields that make parsing build a grammar (llguidance checks every schema: ~0.2 s for a 100k-value enum, more for
# a hostile one): such a body parses in a thread whatever its size, so no other request waits on the loop for it.
GRAMMAR_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "tools")
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")  # what the refusal log names
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


def register(app: QuartTrio) -> None:
    app.add_url_rule("/v1/chat/completions", view_func=chat_completions, methods=["POST"])
    app.add_url_rule("/v1/completions", view_func=completions, methods=["POST"])


async def chat_completions() -> Response:
    return await generate("chat")


async def completions() -> Response:
    return await generate("completion")


async def generate(kind: str) -> Response:
    return await traced(lambda rt: run_generation(kind, rt))


async def traced(run: Callable[[RequestTrace], Awaitable[Response]]) -> Response:
    """Run a generation route's handler inside its request trace (ended with the HTTP status, on every path)."""
    rt = app_state().tracing.start_request(request.method, request.path)
    status: int | None = None  # None: cancelled (the client left before any response)
    try:
        response = await run(rt)
        status = response.status_code
        return response
    except (APIError, HTTPException) as e:
        status = e.status if isinstance(e, APIError) else e.code
        raise
    except Exception:
        status = 500
        raise
    finally:
        rt.http_done(status)


async def admit(kind: str, rt: RequestTrace) -> tuple[Principal, GenerationRequest, str, LoraAdapterRecord | None]:
    with rt.phase("auth"):
        principal = await authorize()
    with rt.phase("tokenize"):
        body = await read_json()
        adapter = await check_model(body, principal)
        req = await tokenize(parse_chat if kind == "chat" else parse_completion, body, principal)
    request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    g.request_id = request_id  # the x-request-id header, refusals by quota included
    await reserve(principal, req, request_id, rt)
    return principal, req, request_id, adapter


async def tokenize(parse: Parser, body: Any, principal: Principal) -> GenerationRequest:
    """``parse`` (validate and tokenize) ``body``; in a thread when the request was large or carries a grammar."""
    state = app_state()
    args = (body, state.tokenizer, state.pool.max_model_len, principal.quota.max_tokens_per_request)
    if (request.content_length or 0) > PARSE_IN_THREAD_BYTES or parses_a_grammar(body):
        return await trio.to_thread.run_sync(parse, *args)
    return parse(*args)


def parses_a_grammar(body: Any) -> bool:
    return isinstance(body, dict) and any(body.get(k) for k in GRAMMAR_FIELDS)


async def reserve(principal: Principal, req: GenerationRequest, request_id: str, rt: RequestTrace) -> None:
    """Admission: the principal's rate limits, slots and budget for ``req`` (sets the x-ratelimit headers)."""
    state = app_state()
    with rt.phase("quota"):
        try:
            g.ratelimit_headers = await state.tenancy.quota.admit(principal, request_id, req.prompt_tokens,
                                                                  req.max_tokens, req.sequences)
        except APIError as e:
            g.ratelimit_headers = {}  # the denial carries its own x-ratelimit headers: no second look
            state.metrics.rejected.labels(principal.tenant_name, e.code or "refused").inc()
            raise


async def run_generation(kind: str, rt: RequestTrace) -> Response:
    cfg, tok = app_state().config, app_state().tokenizer
    principal, req, request_id, adapter = await admit(kind, rt)
    choices, account = await submit(principal, req, request_id, rt, adapter)
    # vLLM's convention: the response names the model asked for (the adapter, when it is one)
    builder = ResponseBuilder(request_id, served_name(adapter), int(time.time()), req, tok, account.tier)
    timeout = cfg.timing.request_timeout
    if not req.stream:
        return json_response(await complete(choices, builder, timeout, account))
    producer = StreamProducer(choices, builder, timeout, cfg.timing.sse_ping_interval,
                              cfg.timing.stream_stall_timeout, account)
    return start_stream(producer, principal.tenant_name)


def served_name(adapter: LoraAdapterRecord | None) -> str:
    """What a response's ``model`` says: the adapter the request named, else the served model."""
    return app_state().config.model_name if adapter is None else adapter.name


async def submit(principal: Principal, req: GenerationRequest, request_id: str, rt: RequestTrace,
                 adapter: LoraAdapterRecord | None = None) -> tuple[Choices, RequestAccount]:
    """Open the admitted request's account and queue its sequences on workers (with ``adapter``'s LoRA, when the
    request named one). On return the caller owns both (``complete`` or a stream producer ends them on every
    path); on failure they are already ended."""
    state = app_state()
    cfg, tok, pool, ten = state.config, state.tokenizer, state.pool, state.tenancy
    g.admitted = True  # from here the request's account logs its end
    sub = route_submission(principal.tier, req.priority, cfg.engine.values.get("scheduling_policy"),
                           req.service_tier)
    # Decoding costs time on the event loop, so only for a tenant that opted in to text logging.
    account = RequestAccount(ten.quota, ten.ledger, state.metrics, principal, request_id, cfg.model_name,
                             req.prompt_tokens, rt, req.stream, tier=sub.tier,
                             prompt_text=prompt_text(req, tok) if principal.log_text else None,
                             adapter=None if adapter is None else adapter.name)
    choices = Choices(pool, request_id, req.n, req.best_of, len(req.prompts()))
    timeout = cfg.timing.request_timeout
    try:
        with rt.phase("queue") as span:
            await submit_all(pool, choices, req, tok, principal.cache_salt, unix_deadline(timeout), principal.weight,
                             rt.context_for(span), tier=sub.tier, priority=sub.priority, adapter=adapter)
    except BaseException as e:
        choices.release_all()  # those already queued are aborted on their workers
        account.end(choices, "not_submitted")  # gives the reservation back; no ledger row: nothing ran
        if isinstance(e, RequestFailed):
            raise failure_to_api_error(e) from None
        raise
    account.worker = choices.worker_id
    return choices, account


class Producer(Protocol):
    """A stream's task side (``StreamProducer``, ``gateway.responses.run.ResponsesStream``)."""

    choices: Choices
    account: Account

    async def run(self) -> None: ...

    def body(self) -> SSEBody: ...


def start_stream(producer: Producer, tenant: str) -> Response:
    streams = app_state().metrics.streams.labels(tenant)

    async def run_stream() -> None:
        # Runs in the app-wide nursery: an exception escaping here would cancel every stream in flight
        # (the producer contains its own; this is the last line for its cleanup and the gauge).
        streams.inc()
        try:
            await producer.run()
        except Exception:
            log.exception("stream %s: unhandled error after its producer ended", producer.choices.request_id)
        finally:
            streams.dec()

    try:
        current_trio_app().nursery.start_soon(run_stream)  # from here the producer owns the sequences and the account
    except BaseException:
        producer.choices.release_all()
        producer.account.end(producer.choices, "cancelled")
        raise
    response = Response(producer.body(), status=200, content_type="text/event-stream", headers=SSE_HEADERS)
    response.timeout = None  # Quart's RESPONSE_TIMEOUT would end the stream after 60 s
    return response
