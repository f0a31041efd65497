"""The Batch API's objects in OpenAI's shapes (the ``openai`` SDK's ``FileObject`` and ``Batch``), its ids, and the
lines of a batch's output and error files.

An output file line: ``{"id": "batch_req_…", "custom_id", "response": {"status_code": 200, "request_id", "body"},
"error": null}``, the body being what the line's route would have answered. An error file line has ``"error":
{"code", "message"}``; when the line was answered with an HTTP error (a body its route refused, a timeout) its
``response`` carries that status and OpenAI-shaped error body too, else (it never ran: the batch expired, its
attempts ran out) ``response`` is null, as in OpenAI's own expired lines.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from gateway.base.errors import APIError
from tenancy.batch_store import BatchRecord
from tenancy.files_store import FileRecord


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def line_request_id(batch_id: str, line: int) -> str:
    """The line's request id (the worker's, the ledger's, the output line's ``id``): the same on every attempt,
    so the ledger (keyed by it) can never bill a line twice, and ``batch_req_<batch>_`` marks its rows."""
    return f"batch_req_{batch_id.removeprefix('batch_')}_{line}"


def file_object(r: FileRecord) -> dict[str, Any]:
    return {"id": r.id, "object": "file", "bytes": r.size_bytes, "created_at": int(r.created_at),
            "filename": r.filename, "purpose": r.purpose, "status": "processed", "expires_at": None,
            "status_details": None}


def _ts(t: float | None) -> int | None:
    return None if t is None else int(t)


def batch_object(r: BatchRecord, served: str) -> dict[str, Any]:
    """The OpenAI Batch object; ``model``: what its file's lines name (``served``, the base model's name, for
    batches stored before the model was)."""
    return {
        "id": r.id, "object": "batch", "endpoint": r.endpoint, "model": r.model or served,
        "errors": {"object": "list", "data": r.errors} if r.errors else None,
        "input_file_id": r.input_file_id, "completion_window": r.completion_window, "status": r.status,
        "output_file_id": r.output_file_id, "error_file_id": r.error_file_id, "created_at": int(r.created_at),
        "in_progress_at": _ts(r.in_progress_at), "expires_at": _ts(r.expires_at),
        "finalizing_at": _ts(r.finalizing_at), "completed_at": _ts(r.completed_at), "failed_at": _ts(r.failed_at),
        "expired_at": _ts(r.expired_at), "cancelling_at": _ts(r.cancelling_at), "cancelled_at": _ts(r.cancelled_at),
        "request_counts": {"total": r.total, "completed": r.completed, "failed": r.failed},
        "usage": {"input_tokens": r.prompt_tokens, "input_tokens_details": {"cached_tokens": r.cached_tokens},
                  "output_tokens": r.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": r.prompt_tokens + r.completion_tokens},
        "metadata": r.metadata,
    }


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def success_line(request_id: str, custom_id: str, body: dict[str, Any]) -> str:
    return _json({"id": request_id, "custom_id": custom_id,
                  "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None})


def failure_line(request_id: str, custom_id: str, err: APIError) -> str:
    """A line its route answered with an error."""
    return _json({"id": request_id, "custom_id": custom_id,
                  "response": {"status_code": err.status, "request_id": request_id, "body": err.body()},
                  "error": {"code": err.code or err.err_type, "message": err.message}})


def unrun_line(request_id: str, custom_id: str, code: str, message: str) -> str:
    """A line that got no answer (the batch expired before it ran; its attempts ran out)."""
    return _json({"id": request_id, "custom_id": custom_id, "response": None,
                  "error": {"code": code, "message": message}})
