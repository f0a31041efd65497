"""The gateway's OpenAPI 3.0 document, served at ``GET /openapi.json``.

Written by hand to match the routes (``tests/test_gateway_openapi.py`` checks it against the app's url_map both
ways: nothing served undocumented, nothing documented that is not served). Bodies list every field the parsers
accept, with ``additionalProperties: false``, because the gateway refuses unknown fields. Every error, from any
route, is OpenAI's shape (``Error``), so fuzzers can check refusals against it. The browser pages and their static
files (``BROWSER_ROUTES``) are not part of the API and are left out on purpose.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from quart import Response

from gateway.api.openapi_batches import batches_paths
from gateway.api.openapi_responses import responses_paths
from gateway.pipeline.protocol import MAX_CACHE_KEY_CHARS, MAX_N, MAX_SEQUENCES
from ipc.sampling import MAX_LOGIT_BIAS
from tenancy.tiers import SERVICE_TIERS, TIER_NAMES

Json = dict[str, Any]

VERSION = "0.1.0"
BROWSER_ROUTES = frozenset({"/", "/playground", "/usage", "/operator", "/assets/<path:filename>"})
TENANT_AUTH: list[Json] = [{"apiKey": []}]
ADMIN_AUTH: list[Json] = [{"adminToken": []}]
NOTHING: list[Json] = []  # security: no credentials

_INT = {"type": "integer"}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}
_STR = {"type": "string"}
_TIER = {"type": "string", "enum": list(TIER_NAMES)}
_OBJECT = {"type": "object"}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_STOP = {"oneOf": [_STR, {"type": "array", "items": _STR, "maxItems": 16}]}
_TEXT_PART = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
              "properties": {"type": {"type": "string", "enum": ["text"]}, "text": _STR}}
_CONTENT = {"oneOf": [_STR, {"type": "array", "items": _TEXT_PART}]}
_TOOL_CALL = {"type": "object", "required": ["function"], "additionalProperties": False, "properties": {
    "id": _STR, "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
        "name": _STR, "arguments": {"type": "string", "description": "a JSON object, as the call returned it"}}}}}
_NULL_ONLY = {"nullable": True, "enum": [None], "description": "sent back by SDKs; must be null"}
_MESSAGE = {"oneOf": [
    {"type": "object", "required": ["role", "content"], "additionalProperties": False, "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user"]}, "content": _CONTENT, "name": _STR}},
    {"type": "object", "required": ["role"], "additionalProperties": False, "properties": {
        "role": {"type": "string", "enum": ["assistant"]}, "content": {**_CONTENT, "nullable": True}, "name": _STR,
        "tool_calls": {"type": "array", "items": _TOOL_CALL}, "refusal": _NULL_ONLY, "audio": _NULL_ONLY,
        "function_call": _NULL_ONLY, "annotations": {"type": "array", "maxItems": 0}}},
    {"type": "object", "required": ["role", "content", "tool_call_id"], "additionalProperties": False,
     "properties": {"role": {"type": "string", "enum": ["tool"]}, "content": _CONTENT, "tool_call_id": _STR,
                    "name": _STR}}]}
_FUNCTION_TOOL = {"type": "object", "required": ["type", "function"], "additionalProperties": False, "properties": {
    "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": _STR,
        "parameters": {"type": "object", "description": "a JSON Schema of an object: the call's arguments hold to "
                                                        "it (the grammar enforces it, strict or not)"},
        "strict": _BOOL}}}}
_TOOL_CHOICE = {"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]}, {
    "type": "object", "required": ["type", "function"], "additionalProperties": False, "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "required": ["name"], "additionalProperties": False,
                     "properties": {"name": _STR}}}}]}
_PROMPT_LOGPROBS = {"type": "integer", "minimum": 0, "maximum": 20,
                    "description": "vLLM's: the prompt's logprobs with this many alternatives (no prefix-cache hit)"}

_SAMPLING = {
    "temperature": _NUM, "top_p": _NUM, "top_k": _INT, "min_p": _NUM, "seed": _INT, "presence_penalty": _NUM,
    "frequency_penalty": _NUM, "repetition_penalty": _NUM, "min_tokens": _INT, "ignore_eos": _BOOL,
    "stop_token_ids": _TOKEN_IDS,
}
_N = {"type": "integer", "minimum": 1, "maximum": MAX_N, "default": 1,
      "description": "choices to return, each sampled on its own (with a seed, choice i uses seed + i); usage "
                     "counts the prompt once and every choice's completion tokens"}
_BEST_OF = {"type": "integer", "minimum": 1, "maximum": MAX_N,
            "description": "sequences to generate (default n, at least n); the n with the highest cumulative "
                           "logprob are returned; above n it cannot stream; usage counts every sequence"}
_SERVICE_TIER = {"type": "string", "enum": list(SERVICE_TIERS),
                 "description": "OpenAI's: 'flex' runs the request in the batch tier, 'default' in standard; "
                                "'auto' and 'priority' keep the tenant's tier (never above it); a request that sets "
                                "it is told the tier it ran in"}
_COMMON = {
    "model": _STR, "stream": _BOOL, "max_tokens": {"type": "integer", "minimum": 1}, "stop": _STOP,
    "n": _N, "user": _STR,
    "service_tier": _SERVICE_TIER,
    "prompt_cache_key": {"type": "string", "minLength": 1, "maxLength": MAX_CACHE_KEY_CHARS,
                         "description": "OpenAI's: requests of a tenant that share it go to the worker the last one "
                                        "went to (while it has room), where their common prefix is cached"},
    "logit_bias": {"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                   "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                   "description": "token id (a decimal string) -> bias added to its logit before sampling; "
                                  "logprobs stay the model's"},
    "priority": {"type": "integer", "minimum": -(2**31 - 1), "maximum": 2**31 - 1, "default": 0,
                 "description": "vLLM's: lower runs sooner (workers under --scheduling-policy priority, the default; "
                                "fcfs refuses values other than 0); counted from the tenant's tier's priority: "
                                "it may place a request later, never earlier (a negative value counts as 0)"},
    "stream_options": {"type": "object", "additionalProperties": False, "properties": {"include_usage": _BOOL}},
    **_SAMPLING,
    # structured outputs (gateway/pipeline/response_format.py): at most one of these four
    "response_format": {"type": "object", "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "required": ["name"], "properties": {
            "name": _STR, "description": _STR, "schema": _OBJECT, "strict": _BOOL}}}},
    "guided_json": {"oneOf": [_OBJECT, _STR]}, "guided_choice": {"type": "array", "items": _STR, "minItems": 1},
    "guided_regex": _STR,
}
_CHAT = {"type": "object", "required": ["model", "messages"], "additionalProperties": False, "properties": {
    **_COMMON, "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
    "max_completion_tokens": {"type": "integer", "minimum": 1}, "logprobs": _BOOL,
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    "tools": {"type": "array", "minItems": 1, "maxItems": 128, "items": _FUNCTION_TOOL}, "tool_choice": _TOOL_CHOICE,
    "parallel_tool_calls": _BOOL, "prompt_logprobs": _PROMPT_LOGPROBS,
    "store": {"type": "boolean", "enum": [False], "description": "OpenAI's; chat completions are not stored here "
                                                                 "(the Responses API stores what it answers)"}}}
_COMPLETION = {"type": "object", "required": ["model", "prompt"], "additionalProperties": False, "properties": {
    **_COMMON, "prompt": {"oneOf": [_STR, _TOKEN_IDS, {"type": "array", "minItems": 1, "maxItems": MAX_SEQUENCES,
                                                      "items": {"oneOf": [_STR, _TOKEN_IDS]}}],
                          "description": "a prompt, or a list of prompts (strings or token-id arrays): each gets its "
                                         "n choices, indexed prompt * n + choice; prompts x best_of at most "
                                         f"{MAX_SEQUENCES}; usage counts every prompt"},
    "logprobs": {"type": "integer", "minimum": 0, "maximum": 20}, "echo": _BOOL, "best_of": _BEST_OF,
    "prompt_logprobs": _PROMPT_LOGPROBS}}
_QUOTA = {"type": "object", "additionalProperties": False, "properties": {
    **{f: {"type": "integer", "minimum": 1, "nullable": True} for f in
       ("rpm", "tpm", "max_concurrent", "token_budget", "max_tokens_per_request", "max_prompt_tokens")},
    "budget_period": {"type": "string", "enum": ["day", "month"], "nullable": True},
    "allowed_models": {"type": "array", "items": _STR, "minItems": 1, "nullable": True}}}


# One server-sent event, as SSE tooling (schemathesis among them) parses and checks a stream: event by event, each
# an object with its data line(s) and its event name ("message" when the server sends none, as on chat streams).
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "event": _STR, "data": {"type": "string", "description": "a JSON object (a chunk, or a typed Responses event), "
                                                             "or [DONE] at the end of a chat or completion stream"}}}
_ERROR_RESPONSE = {"description": "an OpenAI-shaped error",
                   "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


_ADAPTER_UPLOAD: dict[str, Any] = {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["name", "adapter_config.json", "adapter_model.safetensors"],
    "additionalProperties": False, "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"},
        "adapter_config.json": {"type": "string", "format": "binary"},
        "adapter_model.safetensors": {"type": "string", "format": "binary"}}}}}}


def _with_model(schema: Json, model: Json) -> Json:
    return {**schema, "properties": {**schema["properties"], "model": model}}


def _body(schema: Json, required: bool = True) -> Json:
    return {"required": required, "content": {"application/json": {"schema": schema}}}


def _fields(required: tuple[str, ...] = (), **props: Json) -> Json:
    return {"type": "object", "additionalProperties": False, "required": list(required), "properties": props}


def _param(name: str, where: str = "path", schema: Json | None = None) -> Json:
    return {"name": name, "in": where, "required": where == "path", "schema": schema or _STR}


def _op(summary: str, security: list[Json], *, body: Json | None = None, params: list[Json] | None = None,
        ok: str = "200", media: str = "application/json", stream: bool = False) -> Json:
    content: Json = {media: {"schema": _OBJECT if media == "application/json" else _STR}}
    if stream:
        content["text/event-stream"] = {"schema": _SSE_EVENT}
    op: Json = {"summary": summary, "security": security,
                "responses": {ok: {"description": "success", "content": content}, "default": _ERROR_RESPONSE}}
    if body is not None:
        op["requestBody"] = body
    if params:
        op["parameters"] = params
    return op


def _api_paths(model: Json) -> Json:
    ref, key = _param("ref"), _param("key_id")
    chat, completion = _with_model(_CHAT, model), _with_model(_COMPLETION, model)
    since_by = [_param("since", "query"), _param("by", "query", {"type": "string", "enum": ["day", "model", "key", "adapter"]})]
    return {
        "/v1/chat/completions": {"post": _op("Chat completion (SSE with stream: true)", TENANT_AUTH,
                                             body=_body(chat), stream=True)},
        "/v1/completions": {"post": _op("Text completion (SSE with stream: true)", TENANT_AUTH,
                                        body=_body(completion), stream=True)},
        **responses_paths(model, _op, _body, _param, TENANT_AUTH),
        **batches_paths(_op, _body, _param, TENANT_AUTH),
        "/v1/models": {"get": _op("The served model and the LoRA adapters the key may use", TENANT_AUTH)},
        "/v1/models/{model}": {"get": _op("One model the key may use (404 for any other)", TENANT_AUTH,
                                          params=[_param("model")])},
        "/v1/load_lora_adapter": {"post": _op("Register a LoRA adapter (vLLM's shape; tenant: its owner)", ADMIN_AUTH,
                                              body=_body(_fields(("lora_name", "lora_path"), lora_name=_STR,
                                                                 lora_path=_STR, tenant=_STR)))},
        "/v1/unload_lora_adapter": {"post": _op("Unregister a LoRA adapter", ADMIN_AUTH, body=_body(_fields(
            ("lora_name",), lora_name=_STR, lora_int_id={"type": "integer"})))},
        "/admin/adapters": {"get": _op("Registered LoRA adapters", ADMIN_AUTH, params=[_param("tenant", "query")])},
        "/v1/adapters": {
            "post": _op("Upload the caller's own LoRA adapter (PEFT files; checked against the base model)",
                        TENANT_AUTH, body=_ADAPTER_UPLOAD),
            "get": _op("The caller's own and the global LoRA adapters", TENANT_AUTH)},
        "/v1/adapters/{name}": {"delete": _op("Delete the caller's own LoRA adapter", TENANT_AUTH,
                                              params=[_param("name")])},
        "/v1/usage": {"get": _op("The caller's own tenant usage", TENANT_AUTH, params=since_by)},
        "/tokenize": {"post": _op("Token ids of a prompt or chat", TENANT_AUTH, body=_body(_fields(
            model=_STR, prompt=_STR, messages={"type": "array", "items": _MESSAGE}, add_generation_prompt=_BOOL)))},
        "/detokenize": {"post": _op("Text of token ids", TENANT_AUTH,
                                    body=_body(_fields(("tokens",), model=_STR, tokens=_TOKEN_IDS)))},
        "/health": {"get": _op("The process answers", NOTHING)},
        "/ready": {"get": _op("At least one worker is ready (else 503)", NOTHING)},
        "/version": {"get": _op("Gateway version", NOTHING)},
        "/metrics": {"get": _op("Prometheus exposition", NOTHING, media="text/plain")},
        "/openapi.json": {"get": _op("This document", NOTHING)},
        "/admin/tenants": {
            "get": _op("List tenants", ADMIN_AUTH),
            "post": _op("Create a tenant", ADMIN_AUTH, ok="201",
                        body=_body(_fields(("name",), name=_STR, weight={"type": "number", "minimum": 0,
                                                                         "exclusiveMinimum": True}, tier=_TIER)))},
        "/admin/tenants/{ref}": {
            "get": _op("Show a tenant with its keys and quota", ADMIN_AUTH, params=[ref]),
            "patch": _op("Change a tenant's weight, log_text or tier (one field)", ADMIN_AUTH, params=[ref],
                         body=_body(_fields(weight=_NUM, log_text=_BOOL, tier=_TIER))),
            "delete": _op("Delete a tenant (its usage rows stay)", ADMIN_AUTH, params=[ref])},
        "/admin/tenants/{ref}/suspend": {"post": _op("Suspend a tenant", ADMIN_AUTH, params=[ref],
                                                     body=_body(_fields(), required=False))},
        "/admin/tenants/{ref}/resume": {"post": _op("Resume a tenant", ADMIN_AUTH, params=[ref],
                                                    body=_body(_fields(), required=False))},
        "/admin/tenants/{ref}/keys": {
            "get": _op("List a tenant's keys", ADMIN_AUTH, params=[ref]),
            "post": _op("Create a key (shown once)", ADMIN_AUTH, ok="201", params=[ref], body=_body(_fields(
                label=_STR, expires_at=_NUM, expires_in_days=_NUM), required=False))},
        "/admin/tenants/{ref}/quota": {
            "get": _op("A tenant's (or key's) quota", ADMIN_AUTH, params=[ref, _param("key_id", "query")]),
            "put": _op("Merge fields into a quota (null clears)", ADMIN_AUTH, params=[ref, _param("key_id", "query")],
                       body=_body(_QUOTA))},
        "/admin/keys": {"get": _op("List keys", ADMIN_AUTH, params=[_param("tenant", "query")])},
        "/admin/keys/{key_id}/revoke": {"post": _op("Revoke a key", ADMIN_AUTH, params=[key],
                                                    body=_body(_fields(), required=False))},
        "/admin/usage": {"get": _op("Usage totals", ADMIN_AUTH, params=[_param("tenant", "query"), *since_by])},
        "/admin/tiers": {"get": _op("The tiers a tenant can be on: priority and capacity share", ADMIN_AUTH)},
        "/admin/workers": {"get": _op("Live workers: Hello and last Stats", ADMIN_AUTH)},
        "/admin/workers/{worker_id}/drain": {"post": _op(
            "Drain a worker: no new requests, it finishes its own and is restarted", ADMIN_AUTH, ok="202",
            params=[_param("worker_id")],
            body=_body(_fields(timeout={"type": "number", "minimum": 0, "maximum": 3600}), required=False))},
    }


def document(model_name: str | None = None) -> Json:
    """The whole document; with ``model_name`` the generation routes' ``model`` is that name only."""
    error = _fields(("message", "type", "param", "code"), message=_STR, type=_STR,
                    param={"type": "string", "nullable": True}, code={"type": "string", "nullable": True})
    return {
        "openapi": "3.0.3",
        "info": {"title": "kvgate", "version": VERSION,
                 "description": "OpenAI-compatible multi-tenant LLM gateway (tenant API, admin API, operations)."},
        "paths": _api_paths(_STR if model_name is None else {"type": "string", "enum": [model_name]}),
        "components": {
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer", "description": "a tenant key, kvg-…"},
                                "adminToken": {"type": "http", "scheme": "bearer",
                                               "description": "the gateway's --admin-token"}},
            "schemas": {"Error": {"type": "object", "required": ["error"], "additionalProperties": False,
                                  "properties": {"error": error}}}},
    }


def route(model_name: str) -> Callable[[], Awaitable[Response]]:
    """The ``GET /openapi.json`` handler of a gateway serving ``model_name`` (the one value ``model`` may take, so
    generated requests reach the model instead of a 404). Built once: the routes do not change at run time."""
    body = json.dumps(document(model_name), separators=(",", ":"))

    async def openapi_json() -> Response:
        return Response(body, content_type="application/json")

    return openapi_json
