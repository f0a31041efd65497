"""The Quart (quart-trio) application: OpenAI routes over the worker pool.

Every handler is: auth -> read and parse the body (400/413 on anything malformed) -> validate and tokenize
(``gateway.protocol``) -> ``pool.submit`` (503 when nobody can take it) -> answer (JSON) or stream (SSE).
Errors of any kind leave as OpenAI-shaped JSON; nothing about a prompt or a completion is ever logged.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from gateway import metrics
from gateway.config import GatewayConfig
from gateway.errors import APIError, bad_request, error_body
from gateway.generation import OutputAssembler
from gateway.handle import RequestFailed
from gateway.pool import WorkerPool, unix_deadline
from gateway.protocol import GenerationRequest, check_fields, parse_chat, parse_completion
from gateway.responses import ResponseBuilder
from gateway.streaming import StreamProducer, complete, failure_to_api_error
from gateway.tokenizer import ChatTemplateError, GatewayTokenizer, InvalidText

log = logging.getLogger("kvgate.gateway")

VERSION = "0.1.0"
PARSE_IN_THREAD_BYTES = 64 * 1024  # tokenizing more than this would stall every other request on the loop
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


@dataclass
class GatewayState:
    config: GatewayConfig
    tokenizer: GatewayTokenizer
    pool: WorkerPool
    # Keys the per-tenant cache salt; one secret per deployment so gateways behind a balancer agree.
    salt_secret: bytes = field(default_factory=lambda: os.environb.get(b"KVGATE_SALT_SECRET") or os.urandom(32))
    created: int = field(default_factory=lambda: int(time.time()))

    def cache_salt(self, api_key: str | None) -> str:
        # Until tenancy lands every caller of one key is one tenant; without keys everyone shares a cache.
        return hmac.new(self.salt_secret, (api_key or "").encode(), hashlib.sha256).hexdigest()[:32]


def _json_response(body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(body, separators=(",", ":")), status=status, headers=headers,
                    content_type="application/json")


def _api_error_response(e: APIError) -> Response:
    return _json_response(e.body(), e.status, e.headers())


async def _read_json() -> Any:
    raw = await request.get_data(cache=False)  # raises 413 past MAX_CONTENT_LENGTH
    assert isinstance(raw, bytes)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("request body is not valid UTF-8") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise bad_request("request body nests too deeply") from None
    except ValueError as e:  # JSONDecodeError and our constant rejection
        raise bad_request(f"request body is not valid JSON: {e.__class__.__name__}") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def create_app(state: GatewayState) -> QuartTrio:
    app = QuartTrio("kvgate")
    cfg = state.config
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_body_bytes
    app.config["RESPONSE_TIMEOUT"] = None  # streams set it too; a long completion must not be cut at 60 s
    app.config["BODY_TIMEOUT"] = 60
    pool, tok = state.pool, state.tokenizer

    def authorize() -> str | None:
        if cfg.api_key is None:
            return None
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), cfg.api_key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        return key.strip()

    def check_model(body: Any) -> None:
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        model = body.get("model")
        if model is None:
            raise bad_request("'model' is required", param="model")
        if not isinstance(model, str):
            raise bad_request("'model' must be a string", param="model")
        if model != cfg.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")

    async def generate(kind: str) -> Response:
        api_key = authorize()
        raw_size = request.content_length or 0
        body = await _read_json()
        check_model(body)
        parse = parse_chat if kind == "chat" else parse_completion
        max_len = pool.max_model_len
        if raw_size > PARSE_IN_THREAD_BYTES:
            req: GenerationRequest = await trio.to_thread.run_sync(parse, body, tok, max_len)
        else:
            req = parse(body, tok, max_len)
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        timeout = cfg.timing.request_timeout
        try:
            handle = await pool.submit(request_id, req.prompt_ids, req.sampling, state.cache_salt(api_key),
                                       unix_deadline(timeout))
        except RequestFailed as e:
            raise failure_to_api_error(e) from None
        asm = OutputAssembler(tok, req.stop, req.logprobs)
        builder = ResponseBuilder(request_id, cfg.model_name, int(time.time()), req, tok)
        if not req.stream:
            return _json_response(await complete(pool, handle, asm, builder, timeout))
        producer = StreamProducer(pool, handle, asm, builder, timeout, cfg.timing.sse_ping_interval)
        try:
            app.nursery.start_soon(producer.run)
        except BaseException:
            pool.release(handle)
            raise
        response = Response(producer.body(), status=200, content_type="text/event-stream", headers=SSE_HEADERS)
        response.timeout = None  # Quart's RESPONSE_TIMEOUT would end the stream after 60 s
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await generate("chat")

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await generate("completion")

    @app.get("/health")
    async def health() -> Response:
        return _json_response({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        if not pool.ready:
            raise APIError(503, "no worker is ready", code="not_ready", retry_after=pool.retry_after())
        return _json_response({"status": "ready", "workers": sorted(pool.workers)})

    @app.get("/version")
    async def version() -> Response:
        return _json_response({"version": VERSION})

    @app.get("/v1/models")
    async def models() -> Response:
        authorize()
        entry = {"id": cfg.model_name, "object": "model", "created": state.created, "owned_by": "kvgate",
                 "root": cfg.model, "parent": None, "max_model_len": pool.max_model_len}
        return _json_response({"object": "list", "data": [entry]})

    @app.post("/tokenize")
    async def tokenize() -> Response:
        authorize()
        body = check_fields(await _read_json(), {"model": _any, "prompt": _any, "messages": _any,
                                                 "add_generation_prompt": _any})
        if "model" in body:
            check_model(body)
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
        return _json_response({"tokens": ids, "count": len(ids), "max_model_len": pool.max_model_len})

    @app.post("/detokenize")
    async def detokenize() -> Response:
        authorize()
        body = check_fields(await _read_json(), {"model": _any, "tokens": _any})
        if "model" in body:
            check_model(body)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < tok.vocab_size for t in ids):
            raise bad_request(f"'tokens' must be an array of token ids in [0, {tok.vocab_size})", param="tokens")
        return _json_response({"prompt": tok.decode(ids)})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(pool, cfg.model_name), content_type=metrics.CONTENT_TYPE)

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
        return _json_response(error_body("internal server error", "server_error", None, "internal_error"), 500)

    return app


def _any(_: Any) -> bool:
    return True
