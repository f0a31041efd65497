"""The Responses API's part of the OpenAPI document (``gateway.api.openapi`` merges it into ``paths``).

The create body lists every field ``gateway.responses.request`` accepts, with ``additionalProperties: false`` as
elsewhere; tools are function tools (no hosted tools), and ``include`` names only what has nothing to add here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tenancy.tiers import SERVICE_TIERS

Json = dict[str, Any]

_STR: Json = {"type": "string"}
_BOOL: Json = {"type": "boolean"}
_NUM: Json = {"type": "number"}
_INPUT_TEXT: Json = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
                     "properties": {"type": {"type": "string", "enum": ["input_text"]}, "text": _STR}}
_OUTPUT_TEXT: Json = {"type": "object", "required": ["type", "text"], "additionalProperties": False,
                      "properties": {"type": {"type": "string", "enum": ["output_text"]}, "text": _STR,
                                     "annotations": {"type": "array", "maxItems": 0}, "logprobs": {"type": "array"}}}
_MESSAGE: Json = {
    "type": "object", "required": ["role", "content"], "additionalProperties": False,
    "description": "a message; user, system and developer content parts are input_text, assistant ones "
                   "output_text",
    "properties": {
        "type": {"type": "string", "enum": ["message"]},
        "role": {"type": "string", "enum": ["user", "system", "developer", "assistant"]},
        "content": {"oneOf": [_STR, {"type": "array", "items": {"oneOf": [_INPUT_TEXT, _OUTPUT_TEXT]}}]},
        "id": {"type": "string", "minLength": 1, "maxLength": 128},
        "status": {"type": "string", "enum": ["in_progress", "completed", "incomplete"]}}}
_STATUS: Json = {"type": "string", "enum": ["in_progress", "completed", "incomplete"]}
_FUNCTION_CALL: Json = {
    "type": "object", "required": ["type", "call_id", "name", "arguments"], "additionalProperties": False,
    "description": "an earlier answer's call", "properties": {
        "type": {"type": "string", "enum": ["function_call"]}, "id": _STR, "call_id": _STR, "name": _STR,
        "arguments": _STR, "status": _STATUS}}
_FUNCTION_CALL_OUTPUT: Json = {
    "type": "object", "required": ["type", "call_id", "output"], "additionalProperties": False,
    "description": "a call's result", "properties": {
        "type": {"type": "string", "enum": ["function_call_output"]}, "id": _STR, "call_id": _STR,
        "output": {"oneOf": [_STR, {"type": "array", "items": _INPUT_TEXT}]}, "status": _STATUS}}
_TOOL: Json = {"type": "object", "required": ["type", "name"], "additionalProperties": False, "properties": {
    "type": {"type": "string", "enum": ["function"]}, "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
    "description": _STR, "parameters": {"type": "object"}, "strict": {"type": "boolean", "default": True}}}
_TOOL_CHOICE: Json = {"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]}, {
    "type": "object", "required": ["type", "name"], "additionalProperties": False,
    "properties": {"type": {"type": "string", "enum": ["function"]}, "name": _STR}}]}
_INCLUDE: Json = {"type": "array", "items": {"type": "string", "enum": [
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
    "reasoning.encrypted_content"]}}
_FORMAT: Json = {"type": "object", "required": ["type"], "properties": {
    "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
    "name": _STR, "schema": {"type": "object"}, "strict": _BOOL, "description": _STR}}


def _create(model: Json) -> Json:
    return {"type": "object", "required": ["model", "input"], "additionalProperties": False, "properties": {
        "model": model,
        "input": {"oneOf": [_STR, {"type": "array", "minItems": 1, "items": {
            "oneOf": [_MESSAGE, _FUNCTION_CALL, _FUNCTION_CALL_OUTPUT]}}]},
        "instructions": _STR, "max_output_tokens": {"type": "integer", "minimum": 1}, "temperature": _NUM,
        "top_p": _NUM, "user": _STR,
        "metadata": {"type": "object", "maxProperties": 16, "additionalProperties": {"type": "string",
                                                                                     "maxLength": 512}},
        "store": {"type": "boolean", "default": True, "description": "keep the response for retrieval and "
                                                                      "previous_response_id (until the "
                                                                      "gateway's retention passes)"},
        "stream": {"type": "boolean", "description": "typed server-sent events (response.created ... "
                                                     "response.completed)"},
        "previous_response_id": {"type": "string", "minLength": 1, "description": "continue the conversation "
                                                                                  "of a stored response"},
        "text": {"type": "object", "additionalProperties": False, "properties": {
            "format": _FORMAT, "verbosity": {"type": "string", "enum": ["medium"]}}},
        "truncation": {"type": "string", "enum": ["disabled"]}, "parallel_tool_calls": _BOOL,
        "service_tier": {"type": "string", "enum": list(SERVICE_TIERS)},
        "prompt_cache_key": {"type": "string", "minLength": 1},
        "tool_choice": _TOOL_CHOICE, "tools": {"type": "array", "maxItems": 128, "items": _TOOL},
        "include": _INCLUDE}}


def responses_paths(model: Json, op: Callable[..., Json], body: Callable[..., Json], param: Callable[..., Json],
                    auth: list[Json]) -> Json:
    """The four operations; ``op``, ``body`` and ``param`` are ``gateway.api.openapi``'s builders."""
    rid = param("response_id")
    items_params = [rid, param("limit", "query", {"type": "integer", "minimum": 1, "maximum": 100}),
                    param("order", "query", {"type": "string", "enum": ["asc", "desc"]}), param("after", "query")]
    return {
        "/v1/responses": {"post": op("Create a model response (typed SSE events with stream: true)", auth,
                                     body=body(_create(model)), stream=True)},
        "/v1/responses/{response_id}": {
            "get": op("A stored response of the caller's tenant", auth, params=[rid]),
            "delete": op("Delete a stored response", auth, params=[rid])},
        "/v1/responses/{response_id}/input_items": {"get": op("The input items of a stored response", auth,
                                                              params=items_params)},
    }
