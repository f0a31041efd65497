"""The Batch API's part of the OpenAPI document (``gateway.api.openapi`` merges it into ``paths``): the Files
operations it needs (an upload is a multipart body) and the Batches ones.

The create body lists every field ``gateway.api.batch_routes`` accepts, with ``additionalProperties: false`` as
elsewhere; the upload's form has exactly its two parts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Json = dict[str, Any]

_STR: Json = {"type": "string"}
_ENDPOINT: Json = {"type": "string", "enum": ["/v1/chat/completions", "/v1/completions"]}
_UPLOAD: Json = {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"], "additionalProperties": False, "properties": {
        "file": {"type": "string", "format": "binary",
                 "description": "JSONL, one request a line: {custom_id, method: POST, url, body}; every url the same "
                                "endpoint, every body.model the served model, custom_ids unique (the first bad line "
                                "is a 400 naming it)"},
        "purpose": {"type": "string", "enum": ["batch"]}}}}}}
_CREATE: Json = {"type": "object", "required": ["input_file_id", "endpoint", "completion_window"],
                 "additionalProperties": False, "properties": {
                     "input_file_id": _STR, "endpoint": _ENDPOINT,
                     "completion_window": {"type": "string", "enum": ["24h"]},
                     "metadata": {"type": "object", "maxProperties": 16, "nullable": True,
                                  "additionalProperties": {"type": "string", "maxLength": 512}}}}


def batches_paths(op: Callable[..., Json], body: Callable[..., Json], param: Callable[..., Json],
                  auth: list[Json]) -> Json:
    """The nine operations; ``op``, ``body`` and ``param`` are ``gateway.api.openapi``'s builders."""
    fid, bid = param("file_id"), param("batch_id")
    after, limit = param("after", "query"), param("limit", "query", {"type": "integer", "minimum": 1,
                                                                     "maximum": 10_000})
    return {
        "/v1/files": {
            "post": op("Upload a batch input file (checked line by line)", auth, body=_UPLOAD),
            "get": op("The caller's files", auth, params=[
                after, limit, param("order", "query", {"type": "string", "enum": ["asc", "desc"]}),
                param("purpose", "query")])},
        "/v1/files/{file_id}": {
            "get": op("A file of the caller's tenant", auth, params=[fid]),
            "delete": op("Delete a file", auth, params=[fid])},
        "/v1/files/{file_id}/content": {"get": op("A file's bytes (JSONL)", auth, params=[fid],
                                                  media="application/octet-stream")},
        "/v1/batches": {
            "post": op("Create a batch over an uploaded file (status validating)", auth, body=body(_CREATE)),
            "get": op("The caller's batches, newest first", auth, params=[
                after, param("limit", "query", {"type": "integer", "minimum": 1, "maximum": 100})])},
        "/v1/batches/{batch_id}": {"get": op("A batch of the caller's tenant", auth, params=[bid])},
        "/v1/batches/{batch_id}/cancel": {"post": op(
            "Cancel a batch: lines in flight finish, then it is cancelled", auth, params=[bid],
            body=body({"type": "object", "additionalProperties": False, "properties": {}}, required=False))},
    }
