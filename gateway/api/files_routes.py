"""OpenAI's Files API as far as the Batch API needs it: ``POST /v1/files`` (multipart: ``file`` and ``purpose``,
which must be ``batch``), ``GET /v1/files``, ``GET`` and ``DELETE /v1/files/{id}``, ``GET /v1/files/{id}/content``.

An upload is checked whole before it is stored (``gateway.batches.jsonl``: every line a request to one endpoint of
the served model, custom_ids unique; the first bad line is a 400 naming it), so a batch over a stored file starts
from a good one. Uploads get their own size limit (``--max-file-bytes``, far above ``--max-body-bytes``):
``UploadConnection`` builds their request with it. The multipart parse and the check run in threads. Files belong
to one tenant: another tenant's id is the same 404 as an unknown one.
"""

from __future__ import annotations

import io
import logging
import time
from typing import IO, Any

import trio
from quart import Response, request
from hypercorn.typing import ASGISendCallable
from quart.wrappers import Request
from quart_trio import QuartTrio
from quart_trio.asgi import TrioASGIHTTPConnection
from werkzeug.exceptions import RequestEntityTooLarge
from werkzeug.formparser import FormDataParser
from werkzeug.http import parse_options_header

from gateway.api.context import app_state, authorize
from gateway.api.http_json import READ_IN_HANDLER_KEY, body_read, json_response
from gateway.base.errors import APIError, bad_request, model_not_allowed
from gateway.batches.jsonl import parse_batch_file
from gateway.batches.objects import file_object, new_file_id
from tenancy.files_store import FileRecord

log = logging.getLogger("kvgate.gateway.batches")

FILES_PATH = "/v1/files"
UPLOAD_LIMIT_KEY = "KVGATE_UPLOAD_LIMIT"  # app.config: the body limit of an upload (file + multipart framing)
MULTIPART_ALLOWANCE = 64 * 1024  # the framing and the purpose field around the file's bytes
# werkzeug's decoder applies its memory bound to its buffer, file parts included: each 64 KiB read plus the tail it
# keeps back (a line break that may begin the boundary). At 64 KiB a JSONL file over 64 KiB was refused whenever a
# read ended just after one of its line breaks; this bound lets every read through and still caps a text field.
FORM_MEMORY = 64 * 1024 + 4096
MAX_FILENAME_CHARS = 255
MAX_LIST_LIMIT = 10_000  # OpenAI's (and its default)
PURPOSES = ("batch", "batch_output")  # uploaded input files; a batch's output and error files


class UploadConnection(TrioASGIHTTPConnection):
    """Quart fixes a request's body limit when it builds the request (``MAX_CONTENT_LENGTH``: --max-body-bytes), so
    an upload's larger limit must be given then; every other request keeps the small one."""

    def _create_request_from_scope(self, send: ASGISendCallable) -> Request:
        req = super()._create_request_from_scope(send)
        limit = self.app.config.get(UPLOAD_LIMIT_KEY)
        if limit is not None and req.method == "POST" and req.path == FILES_PATH:
            req.body = req.body_class(req.content_length, limit)  # nothing has been read into it yet
            req.max_content_length = limit
        return req


def read_in_handler(app: QuartTrio, path: str) -> None:
    """POST ``path`` is an upload whose handler authorizes before it reads the body (http_json.read_body_first)."""
    app.config[READ_IN_HANDLER_KEY] = frozenset({*app.config.get(READ_IN_HANDLER_KEY, ()), ("POST", path)})


def register(app: QuartTrio, max_file_bytes: int) -> None:
    app.asgi_http_class = UploadConnection
    app.config[UPLOAD_LIMIT_KEY] = max_file_bytes + MULTIPART_ALLOWANCE
    read_in_handler(app, FILES_PATH)
    app.add_url_rule(FILES_PATH, view_func=upload_file, methods=["POST"])
    app.add_url_rule(FILES_PATH, view_func=list_files, methods=["GET"])
    app.add_url_rule(f"{FILES_PATH}/<file_id>", view_func=retrieve_file, methods=["GET"])
    app.add_url_rule(f"{FILES_PATH}/<file_id>", view_func=delete_file, methods=["DELETE"])
    app.add_url_rule(f"{FILES_PATH}/<file_id>/content", view_func=file_content, methods=["GET"])


def not_found(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {file_id}", code="not_found", param="file_id")


def check_query(allowed: set[str]) -> None:
    unknown = sorted(set(request.args) - allowed)
    if unknown:
        raise bad_request(f"Unrecognized query parameter: {unknown[0]}", param=unknown[0],
                          code="unrecognized_argument")


def list_limit(default: int, maximum: int) -> int:
    raw = request.args.get("limit", str(default))
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= maximum:
        raise bad_request(f"'limit' must be an integer in [1, {maximum}]", param="limit")
    return int(raw)


def page_body(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def _in_memory(*_: Any, **__: Any) -> IO[bytes]:
    return io.BytesIO()  # the file is read whole right after: no temporary file on disk


def _read_form(raw: bytes, content_type: str) -> tuple[str | None, tuple[str, bytes] | None]:
    """(purpose, (filename, bytes)) of a multipart upload; 400 for anything else in it."""
    mimetype, options = parse_options_header(content_type)
    if mimetype != "multipart/form-data":
        raise bad_request("the body must be multipart/form-data with a 'file' and a 'purpose'")
    parser = FormDataParser(stream_factory=_in_memory, max_form_memory_size=FORM_MEMORY, max_form_parts=16)
    try:
        _, form, files = parser.parse(io.BytesIO(raw), mimetype, len(raw), options)
    except RequestEntityTooLarge:
        raise bad_request("the form has too many parts or too large a field") from None
    unknown = sorted((set(form) - {"purpose"}) | (set(files) - {"file"}))
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {unknown[0][:64]}", param=unknown[0][:64],
                          code="unrecognized_argument")
    upload = files.get("file")
    if upload is None:
        return form.get("purpose"), None
    return form.get("purpose"), (_filename(upload.filename), upload.stream.read())


def _filename(given: str | None) -> str:
    """The name as given, made storable: no control characters (PostgreSQL refuses NUL), valid UTF-8, bounded."""
    name = "".join(c for c in (given or "") if c >= " " and c != "\x7f")
    name = name.encode("utf-8", "replace").decode("utf-8")[:MAX_FILENAME_CHARS]
    return name or "upload.jsonl"


async def upload_file() -> Response:
    principal = await authorize()
    state = app_state()
    cfg = state.config
    # Bounded by UploadConnection's limit (413 past it); not cached: the form's bytes are copied out in the thread.
    raw = await request.get_data(cache=False, as_text=False, parse_form_data=False)
    body_read()
    purpose, upload = await trio.to_thread.run_sync(_read_form, raw, request.headers.get("Content-Type", ""))
    del raw
    if purpose is None:
        raise bad_request("'purpose' is required", param="purpose")
    if purpose != "batch":
        raise bad_request("'purpose' must be 'batch': this gateway keeps files for the Batch API only",
                          param="purpose")
    if upload is None:
        raise bad_request("'file' is required", param="file")
    filename, data = upload
    if len(data) > cfg.batch.max_file_bytes:
        raise APIError(413, f"the file has {len(data)} bytes; at most {cfg.batch.max_file_bytes} are accepted",
                       code="file_too_large", param="file")
    parsed = await trio.to_thread.run_sync(parse_batch_file, data, cfg.model_name, cfg.batch.max_file_lines)
    if not principal.allows_model(parsed.model):  # the model every line names, the base or an adapter
        raise model_not_allowed(parsed.model, param="file")
    record = FileRecord(new_file_id(), principal.tenant_id, time.time(), filename, "batch", len(data),
                        len(parsed.lines), parsed.endpoint, parsed.model)
    await state.tenancy.batches.put_file(record, data)
    log.info("file uploaded", extra={"fields": {"event": "file_uploaded", "file_id": record.id,
                                                "tenant_id": record.tenant_id, "bytes": record.size_bytes,
                                                "lines": record.line_count}})
    return json_response(file_object(record))


async def list_files() -> Response:
    principal = await authorize()
    check_query({"limit", "order", "after", "purpose"})
    limit = list_limit(MAX_LIST_LIMIT, MAX_LIST_LIMIT)
    order = request.args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("'order' must be 'asc' or 'desc'", param="order")
    after, purpose = request.args.get("after"), request.args.get("purpose")
    if purpose is not None and purpose not in PURPOSES:
        return json_response(page_body([], False))  # a purpose this gateway never stores: none of its files
    found = await app_state().tenancy.batches.file_page(principal.tenant_id, limit, "asc" if order == "asc" else
                                                        "desc", after, purpose)
    if found is None:
        raise bad_request(f"No file with id '{after}' to list after.", param="after")
    return json_response(page_body([file_object(r) for r in found[0]], found[1]))


async def retrieve_file(file_id: str) -> Response:
    principal = await authorize()
    check_query(set())
    record = await app_state().tenancy.batches.file(principal.tenant_id, file_id)
    if record is None:
        raise not_found(file_id)
    return json_response(file_object(record))


async def delete_file(file_id: str) -> Response:
    principal = await authorize()
    check_query(set())
    if not await app_state().tenancy.batches.delete_file(principal.tenant_id, file_id):
        raise not_found(file_id)
    return json_response({"id": file_id, "object": "file", "deleted": True})


async def file_content(file_id: str) -> Response:
    principal = await authorize()
    check_query(set())
    content = await app_state().tenancy.batches.file_content(principal.tenant_id, file_id)
    if content is None:
        raise not_found(file_id)
    return Response(content, content_type="application/octet-stream")
