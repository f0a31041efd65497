"""The Quart (quart-trio) application: OpenAI routes over the worker pool.

Every handler is: auth -> read and parse the body (400/413 on anything malformed) -> validate and tokenize
(``gateway.protocol``) -> ``pool.submit`` (503 when nobody can take it) -> answer (JSON) or stream (SSE).
Errors of any kind leave as OpenAI-shaped JSON; nothing about a prompt or a completion is ever logged.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import trio
from quart import Response, g, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from gateway import metrics, openapi
from gateway.admin import create_admin_blueprint, op_error
from gateway.admission import RequestAccount
from gateway.auth import Principal
from gateway.errors import APIError, bad_request, error_body
from gateway.generation import OutputAssembler
from gateway.handle import RequestFailed
from gateway.http_json import close_if_body_unread, json_response, read_body_first, read_json
from gateway.pool import unix_deadline
from gateway.protocol import GenerationRequest, check_fields, parse_chat, parse_completion
from gateway.responses import ResponseBuilder
from gateway.state import GatewayState
from gateway.streaming import StreamProducer, complete, failure_to_api_error
from gateway.tokenizer import ChatTemplateError, InvalidText
from gateway.tracing import RequestTrace
from gateway.web import create_web_blueprint
from tenancy.admin_ops import AdminOpError, LocalAdmin

log = logging.getLogger("kvgate.gateway")

VERSION = "0.1.0"
PARSE_IN_THREAD_BYTES = 64 * 1024  # tokenizing more than this would stall every other request on the loop
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


def _api_error_response(e: APIError) -> Response:
    return json_response(e.body(), e.status, e.headers())


def _client_addr() -> str:
    # The peer of this connection. Behind a proxy that is the proxy: trusting X-Forwarded-For is a
    # deployment decision (not made here), since any client can send one.
    remote = request.scope.get("client")
    return str(remote[0]) if remote else "unknown"


def create_app(state: GatewayState) -> QuartTrio:
    app = QuartTrio("kvgate")
    cfg = state.config
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_body_bytes
    app.config["RESPONSE_TIMEOUT"] = None  # streams set it too; a long completion must not be cut at 60 s
    app.config["BODY_TIMEOUT"] = 60
    pool, tok = state.pool, state.tokenizer

    ten = state.tenancy
    admin_ops = LocalAdmin(ten.store)
    gm = state.metrics

    async def authorize() -> Principal:
        try:
            principal = await ten.auth.authenticate(request.headers.get("Authorization"), _client_addr())
        except APIError as e:
            if e.status == 403:  # the key is fine, its tenant is suspended: a refusal, not a failed login
                gm.rejected.labels("", e.code or "forbidden").inc()
            else:
                gm.auth_failures.labels(e.code or "unknown").inc()
            raise
        g.principal = principal
        return principal

    def check_model(body: Any, principal: Principal) -> None:
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        model = body.get("model")
        if model is None:
            raise bad_request("'model' is required", param="model")
        if not isinstance(model, str):
            raise bad_request("'model' must be a string", param="model")
        if model != cfg.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")
        if not principal.allows_model(model):
            raise APIError(403, f"Your API key is not allowed to use the model `{model}`.",
                           code="model_not_allowed", param="model")

    async def generate(kind: str) -> Response:
        """The two generation routes, each request traced from here to its end (see gateway.tracing)."""
        rt = state.tracing.start_request(request.method, request.path)
        status: int | None = None  # None: cancelled (the client left before any response)
        try:
            response = await run_generation(kind, rt)
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

    async def admit(kind: str, rt: RequestTrace) -> tuple[Principal, GenerationRequest, str]:
        with rt.phase("auth"):
            principal = await authorize()
        with rt.phase("tokenize"):
            raw_size = request.content_length or 0
            body = await read_json()
            check_model(body, principal)
            parse = parse_chat if kind == "chat" else parse_completion
            args = (body, tok, pool.max_model_len, principal.quota.max_tokens_per_request)
            if raw_size > PARSE_IN_THREAD_BYTES:
                req: GenerationRequest = await trio.to_thread.run_sync(parse, *args)
            else:
                req = parse(*args)
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        with rt.phase("quota"):
            try:
                g.ratelimit_headers = await ten.quota.admit(principal, request_id, len(req.prompt_ids),
                                                            req.max_tokens)
            except APIError as e:
                g.ratelimit_headers = {}  # the denial carries its own x-ratelimit headers: no second look
                gm.rejected.labels(principal.tenant_name, e.code or "refused").inc()
                raise
        return principal, req, request_id

    async def run_generation(kind: str, rt: RequestTrace) -> Response:
        principal, req, request_id = await admit(kind, rt)
        g.admitted = True  # from here the request's account logs its end
        # Decoding costs time on the event loop, so only for a tenant that opted in to text logging.
        account = RequestAccount(ten.quota, ten.ledger, gm, principal, request_id, cfg.model_name,
                                 len(req.prompt_ids), rt, req.stream,
                                 prompt_text=tok.decode(req.prompt_ids) if principal.log_text else None)
        asm = OutputAssembler(tok, req.stop, req.logprobs)
        timeout = cfg.timing.request_timeout
        try:
            with rt.phase("queue") as span:
                handle = await pool.submit(request_id, req.prompt_ids, req.sampling, principal.cache_salt,
                                           unix_deadline(timeout), principal.weight, rt.context_for(span))
        except BaseException as e:
            account.end(asm, "not_submitted")  # gives the reservation back; no ledger row: nothing ran
            if isinstance(e, RequestFailed):
                raise failure_to_api_error(e) from None
            raise
        # From here `complete` or the stream producer owns the handle and ends the account on every path.
        account.worker = handle.worker_id
        builder = ResponseBuilder(request_id, cfg.model_name, int(time.time()), req, tok)
        if not req.stream:
            return json_response(await complete(pool, handle, asm, builder, timeout, account))
        producer = StreamProducer(pool, handle, asm, builder, timeout, cfg.timing.sse_ping_interval, account)
        return start_stream(producer, principal.tenant_name)

    def start_stream(producer: StreamProducer, tenant: str) -> Response:
        async def run_stream() -> None:
            # Runs in the app-wide nursery: an exception escaping here would cancel every stream in flight
            # (the producer contains its own; this is the last line for its cleanup and the gauge).
            streams = gm.streams.labels(tenant)
            streams.inc()
            try:
                await producer.run()
            except Exception:
                log.exception("stream %s: unhandled error after its producer ended", producer.handle.request_id)
            finally:
                streams.dec()

        try:
            app.nursery.start_soon(run_stream)  # from here the producer owns the handle and the account
        except BaseException:
            producer.pool.release(producer.handle)
            producer.account.end(producer.asm, "cancelled")
            raise
        response = Response(producer.body(), status=200, content_type="text/event-stream", headers=SSE_HEADERS)
        response.timeout = None  # Quart's RESPONSE_TIMEOUT would end the stream after 60 s
        return response

    @app.after_request
    async def add_ratelimit_headers(response: Response) -> Response:
        headers: dict[str, str] | None = getattr(g, "ratelimit_headers", None)
        principal: Principal | None = getattr(g, "principal", None)
        if headers is None and principal is not None:
            headers = await ten.quota.headers(principal.scopes)
        for name, value in (headers or {}).items():
            response.headers.setdefault(name, value)
        route = request.url_rule.rule if request.url_rule is not None else "unmatched"
        gm.requests.labels(route, str(response.status_code), principal.tenant_name if principal else "").inc()
        if response.status_code >= 400 and request.path in GENERATION_ROUTES and not getattr(g, "admitted", False):
            # Refused before any work (auth, quota, validation): the request-finished line never comes.
            log.info("request refused", extra={"fields": {
                "event": "request_refused", "path": request.path, "http_status": response.status_code,
                "tenant_id": principal.tenant_id if principal else None,
                "key_id": principal.key_id if principal else None}})
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await generate("chat")

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await generate("completion")

    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        if not pool.ready:
            raise APIError(503, "no worker is ready", code="not_ready", retry_after=pool.retry_after())
        return json_response({"status": "ready", "workers": sorted(pool.workers)})

    @app.get("/version")
    async def version() -> Response:
        return json_response({"version": VERSION})

    @app.get("/v1/models")
    async def models() -> Response:
        principal = await authorize()
        entry = {"id": cfg.model_name, "object": "model", "created": state.created, "owned_by": "kvgate",
                 "root": cfg.model, "parent": None, "max_model_len": pool.max_model_len}
        data = [entry] if principal.allows_model(cfg.model_name) else []
        return json_response({"object": "list", "data": data})

    @app.get("/v1/usage")
    async def own_usage() -> Response:
        """The calling tenant's own usage (never another's): the admin API's shape for one tenant, with
        ``since`` (unix seconds, ISO date/time or 7d/24h) and ``by`` (day, model, key)."""
        principal = await authorize()
        unknown = sorted(set(request.args) - {"since", "by"})
        if unknown:
            raise bad_request(f"unknown query parameter(s) {', '.join(unknown)}", param=unknown[0])
        try:
            body = await trio.to_thread.run_sync(admin_ops.usage, principal.tenant_id, request.args.get("since"),
                                                 request.args.get("by"))
        except AdminOpError as e:
            raise op_error(e) from None
        return json_response({**body, "tenant": principal.tenant_name})

    @app.post("/tokenize")
    async def tokenize() -> Response:
        principal = await authorize()
        body = check_fields(await read_json(), {"model": _any, "prompt": _any, "messages": _any,
                                                 "add_generation_prompt": _any})
        if "model" in body:
            check_model(body, principal)
        try:
            if isinstance(body.get("prompt"), str) and "messages" not in body:
                ids = tok.encode(body["prompt"])
            elif "messages" in body and "prompt" not in body:
                req = parse_chat({"model": cfg.model_name, "messages": body["messages"]}, tok, None)
                ids = req.prompt_ids
            else:
                raise bad_request("give exactly one of 'prompt' (a string) or 'messages'")
        except (InvalidText, ChatTemplateError) as e:
            raise bad_request(str(e)) from None
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": pool.max_model_len})

    @app.post("/detokenize")
    async def detokenize() -> Response:
        principal = await authorize()
        body = check_fields(await read_json(), {"model": _any, "tokens": _any})
        if "model" in body:
            check_model(body, principal)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < tok.vocab_size for t in ids):
            raise bad_request(f"'tokens' must be an array of token ids in [0, {tok.vocab_size})", param="tokens")
        return json_response({"prompt": tok.decode(ids)})

    @app.get("/metrics")
    async def prometheus() -> Response:
        text = metrics.render(pool, cfg.model_name, cfg.observability.gpu_hour_cost, gm.billed_tokens)
        text += metrics.queues(ten.ledger.queued, ten.quota.queued)
        return Response(text + gm.render(), content_type=metrics.CONTENT_TYPE)

    app.register_blueprint(create_admin_blueprint(ten.store, cfg.tenancy.admin_token, ten.auth.invalidate))
    app.add_url_rule("/openapi.json", "openapi", openapi.route(cfg.model_name), methods=["GET"])  # for fuzzers, SDKs
    app.before_request(read_body_first)  # a keep-alive connection must not wedge on an unread body
    app.after_request(close_if_body_unread)
    app.register_blueprint(create_web_blueprint(state))  # pages, security headers, CORS, /admin/workers

    @app.errorhandler(APIError)
    async def on_api_error(e: APIError) -> Response:
        return _api_error_response(e)

    @app.errorhandler(HTTPException)
    async def on_http_error(e: HTTPException) -> Response:
        status = e.code or 500
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
        message = "request body too large" if status == 413 else (e.description or e.name)
        return _api_error_response(APIError(status, message, code=code))

    @app.errorhandler(Exception)
    async def on_unexpected(e: Exception) -> Response:
        log.exception("unhandled %s in %s", type(e).__name__, request.path)
        return json_response(error_body("internal server error", "server_error", None, "internal_error"), 500)

    return app


def _any(_: Any) -> bool:
    return True
