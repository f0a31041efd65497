"""Tenants' own LoRA adapters, with their API keys (operators use adapter_routes.py's admin paths):

    POST   /v1/adapters         multipart/form-data: name, adapter_config.json, adapter_model.safetensors
                                -> the adapter + {rank, target_modules}
    GET    /v1/adapters         -> {"object": "list", "data": [adapter]}: the caller's own and the global ones
    DELETE /v1/adapters/{name}  -> {"id", "object": "lora_adapter", "deleted": true}: the caller's own upload only

An upload is written part by part into a temporary directory inside ``--lora-dir`` (a dot name: neither workers nor
the operator path can name it), checked there by the operator path's torch-free check (tenancy/lora_check.py),
renamed into place (the same filesystem: atomic, so no worker ever sees half an adapter) and registered to the
caller's tenant by the operator path's own admin operation, so the catalog, ledger, metrics and suspension cascade
apply unchanged. Any refusal removes what was written and registers nothing. Another tenant's adapter, a global one
and a name nobody registered are the same 404 on DELETE (no oracle); names are one namespace, so a taken name is a
409 whoever holds it.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import shutil
from pathlib import Path
from typing import IO, Any

import trio
from hypercorn.typing import ASGISendCallable
from quart import Blueprint, Response, request
from quart.wrappers import Request
from quart_trio import QuartTrio
from werkzeug.exceptions import RequestEntityTooLarge
from werkzeug.http import parse_options_header
from werkzeug.sansio.multipart import Data, Epilogue, Field, File, MultipartDecoder, NeedData

from common.peft_config import NAME_RE as DIR_NAME_RE
from gateway.api.admin import op_error
from gateway.api.context import app_state, authorize
from gateway.api.files_routes import UploadConnection, read_in_handler
from gateway.api.http_json import body_read, json_response
from gateway.base.errors import APIError, bad_request
from gateway.base.principal import Principal
from tenancy.adapter_files import read_marker, write_marker
from tenancy.admin_ops import AdminOpError, LocalAdmin
from tenancy.adapters_store import NAME_RE, AdapterStore
from tenancy.lora_check import CONFIG_FILE, WEIGHTS_FILE, LoraContext, check_adapter
from tenancy.models import LoraAdapterRecord

log = logging.getLogger("kvgate.gateway.adapters")

ADAPTERS_PATH = "/v1/adapters"
MAX_UPLOAD_BYTES = 256 << 20  # the whole body; a rank-64 adapter of every projection of an 8B model is ~170 MiB
FILE_PARTS = (CONFIG_FILE, WEIGHTS_FILE)  # the form's file parts are named as PEFT names the files
MAX_NAME_BYTES = 1024  # the name field's bytes: far past any valid name, so a bad one is refused by the rule
CHUNK = 1 << 20  # the body is fed to the multipart decoder this much at a time, and written to disk as it decodes
TEMP_PREFIX = ".upload-"  # not a valid adapter directory name: nothing can name a half-written upload
_PARAMS = {"lora_name": "name", "lora_path": "name", "tenant": None}  # the admin op's params, in this API's words


class AdapterUploadConnection(UploadConnection):
    """Gives an adapter upload its own body limit when its request is built (as UploadConnection does for /v1/files):
    past MAX_UPLOAD_BYTES by Content-Length, Quart refuses it (413) before a byte of the body is buffered, and a
    chunked body is cut off there."""

    def _create_request_from_scope(self, send: ASGISendCallable) -> Request:
        req = super()._create_request_from_scope(send)
        if req.method == "POST" and req.path == ADAPTERS_PATH:
            req.body = req.body_class(req.content_length, MAX_UPLOAD_BYTES)  # nothing has been read into it yet
            req.max_content_length = MAX_UPLOAD_BYTES
        return req


def install_upload_limit(app: object) -> None:
    # Keeps the Files API's own limit: this class extends UploadConnection, which files_routes installs first.
    if isinstance(app, QuartTrio) and issubclass(AdapterUploadConnection, app.asgi_http_class):
        app.asgi_http_class = AdapterUploadConnection
        read_in_handler(app, ADAPTERS_PATH)
    else:
        raise RuntimeError("the adapter upload limit must be installed after files_routes.register")


def add_upload_routes(bp: Blueprint) -> None:
    bp.record_once(lambda setup: install_upload_limit(setup.app))
    bp.add_url_rule(ADAPTERS_PATH, "upload_adapter", upload_adapter, methods=["POST"])
    bp.add_url_rule(ADAPTERS_PATH, "list_tenant_adapters", list_tenant_adapters, methods=["GET"])
    bp.add_url_rule(f"{ADAPTERS_PATH}/<path:name>", "delete_tenant_adapter", delete_tenant_adapter,
                    methods=["DELETE"])


def _lora() -> LoraContext:
    lora = app_state().lora
    if lora is None:  # a 4xx, not a 5xx: OpenAI's SDKs retry 5xx, and no retry turns this deployment's adapters on
        raise APIError(400, "LoRA adapters are not enabled on this server (the operator starts it with --lora-dir)",
                       code="lora_disabled")
    return lora


def check_upload_name(name: str) -> str:
    """Stricter than an operator's names (adapters_store.NAME_RE also takes ':' and '/'): an uploaded name is one
    path component, never '..', so it can never read as a path wherever it travels."""
    if DIR_NAME_RE.fullmatch(name) is None or ".." in name:
        raise bad_request(f"'name' must be 1-128 letters, digits or . _ - starting with a letter or digit, without "
                          f"'..'; got {name[:160]!r}", param="name")
    return name


def _not_found(name: str) -> APIError:
    return APIError(404, f"The adapter `{name[:160]}` does not exist.", code="adapter_not_found", param="name")


def _item(a: LoraAdapterRecord, principal: Principal, base: str) -> dict[str, Any]:
    """As /v1/models lists adapters (owned_by, parent), plus whether it is global (the operator's, every tenant's)."""
    return {"id": a.name, "object": "lora_adapter", "created": int(a.created_at), "parent": base,
            "owned_by": "kvgate" if a.tenant_id is None else principal.tenant_name, "global": a.tenant_id is None}


class FormError(ValueError):
    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.param, self.code = param, code


def _boundary() -> bytes:
    mimetype, options = parse_options_header(request.headers.get("Content-Type", ""))
    boundary = options.get("boundary", "")
    if mimetype != "multipart/form-data" or not boundary or not boundary.isascii():
        raise bad_request(f"the body must be multipart/form-data with 'name', '{CONFIG_FILE}' and '{WEIGHTS_FILE}'")
    return boundary.encode("ascii")


def _open_part(part: str, seen: set[str], tmp: Path) -> IO[bytes] | None:
    """The file a part's bytes go to (None: the name field, kept in memory)."""
    if part in seen:
        raise FormError(f"'{part}' is given twice", part)
    seen.add(part)
    if part == "name":
        return None
    if part in FILE_PARTS:
        return (tmp / part).open("xb")
    shown = part[:64]
    raise FormError(f"Unrecognized request argument supplied: {shown}", shown, "unrecognized_argument")


def write_form(raw: bytes, boundary: bytes, tmp: Path) -> str:
    """Decodes the form into ``tmp`` (each file straight to disk, a chunk at a time); the adapter's name. FormError
    for a broken form, an unknown or repeated part, or a missing one."""
    decoder = MultipartDecoder(boundary, max_form_memory_size=2 * CHUNK, max_parts=8)
    seen: set[str] = set()
    sink: IO[bytes] | None = None
    name = bytearray()
    pos = 0
    try:
        while not isinstance(event := decoder.next_event(), Epilogue):
            if isinstance(event, NeedData):
                decoder.receive_data(raw[pos:pos + CHUNK] if pos < len(raw) else None)
                pos += CHUNK
            elif isinstance(event, (Field, File)):
                if sink is not None:
                    sink.close()
                sink = _open_part(event.name, seen, tmp)
            elif isinstance(event, Data) and sink is not None:
                sink.write(event.data)
            elif isinstance(event, Data):
                name.extend(event.data)
                if len(name) > MAX_NAME_BYTES:
                    raise FormError("'name' is too long", "name")
    except FormError:
        raise
    except (ValueError, RequestEntityTooLarge):
        raise FormError("the body is not a well-formed multipart/form-data form") from None
    finally:
        if sink is not None:
            sink.close()
    for part in ("name", *FILE_PARTS):
        if part not in seen:
            raise FormError(f"'{part}' is required", part)
    try:
        return name.decode("utf-8")
    except UnicodeDecodeError:
        raise FormError("'name' is not valid UTF-8", "name") from None


def publish(tmp: Path, root: Path, name: str, tenant_id: str) -> str:
    """Marks ``tmp`` as the tenant's upload and renames it into place; its directory's name. The random suffix:
    never an existing directory (an operator's, or an upload of a name since freed), and a valid worker name."""
    write_marker(tmp, name, tenant_id)  # which tenant's upload it is (DELETE and sweeps remove only those)
    final = f"{name[:100]}.{secrets.token_hex(8)}"
    os.rename(tmp, root / final)  # the same filesystem: atomic
    return final


def remove_upload(root: Path, record: LoraAdapterRecord, adapters: AdapterStore) -> None:
    """Deletes an unregistered adapter's files when they are this tenant's upload of this name and nothing else is
    registered over them; an operator's directory registered to the tenant is the operator's to remove."""
    directory = root / record.path
    if read_marker(directory) != {"name": record.name, "tenant_id": record.tenant_id}:
        return
    if any(a.path == record.path for a in adapters.list()):
        return
    shutil.rmtree(directory, ignore_errors=True)


def _check(tmp: Path, lora: LoraContext) -> dict[str, Any]:
    try:
        summary = check_adapter(tmp, lora.base)
    except ValueError as e:
        param = WEIGHTS_FILE if str(e).startswith(WEIGHTS_FILE) else CONFIG_FILE
        raise APIError(400, f"LoRA adapter refused: {e}", code="invalid_lora_adapter", param=param) from None
    return {"rank": summary.rank, "target_modules": list(summary.targets)}


async def _stage(raw: bytes, lora: LoraContext, principal: Principal) -> tuple[str, str, dict[str, Any]]:
    """(name, directory under --lora-dir, check summary) of a checked upload now in place; nothing is left of a
    refused one."""
    tmp = lora.directory / f"{TEMP_PREFIX}{secrets.token_hex(8)}"
    await trio.to_thread.run_sync(tmp.mkdir)
    try:
        try:
            name = await trio.to_thread.run_sync(write_form, raw, _boundary(), tmp)
        except FormError as e:
            raise bad_request(str(e), param=e.param, code=e.code) from None
        check_upload_name(name)
        summary = await trio.to_thread.run_sync(_check, tmp, lora)
        directory = await trio.to_thread.run_sync(publish, tmp, lora.directory, name, principal.tenant_id)
    finally:
        await trio.to_thread.run_sync(functools.partial(shutil.rmtree, tmp, ignore_errors=True))  # gone if renamed
    return name, directory, summary


async def upload_adapter() -> Response:
    principal = await authorize()
    state = app_state()
    lora = _lora()
    # Read here, after the key (at most MAX_UPLOAD_BYTES; http_json.read_body_first leaves uploads to their
    # handlers); the decode writes it out, no 2nd copy.
    raw = await request.get_data(cache=False, as_text=False, parse_form_data=False)
    body_read()
    name, directory, summary = await _stage(raw, lora, principal)
    del raw
    ops = LocalAdmin(state.tenancy.store, lora=lora)
    try:  # the operator path's own op: the same check again (cheap), then the insert that decides a taken name
        added = await trio.to_thread.run_sync(ops.load_adapter, name, directory, principal.tenant_id)
    except AdminOpError as e:
        await trio.to_thread.run_sync(functools.partial(shutil.rmtree, lora.directory / directory,
                                                        ignore_errors=True))
        raise APIError(e.status, e.message, code=e.code, param=_PARAMS.get(e.param or "", e.param)) from None
    state.tenancy.adapters.invalidate()  # this gateway's requests see it at once
    record = LoraAdapterRecord(name, directory, principal.tenant_id, float(added["created_at"]))
    log.info("adapter uploaded", extra={"fields": {"event": "adapter_uploaded", "adapter": name,
                                                   "tenant_id": principal.tenant_id, "key_id": principal.key_id}})
    return json_response({**_item(record, principal, state.config.model_name), **summary})


async def list_tenant_adapters() -> Response:
    principal = await authorize()
    state = app_state()
    if request.args:
        raise bad_request(f"Unrecognized query parameter: {next(iter(request.args))[:64]}",
                          code="unrecognized_argument")
    records = await state.tenancy.adapters.visible(principal.tenant_id)  # the catalog: what /v1/models lists
    return json_response({"object": "list", "data": [_item(a, principal, state.config.model_name)
                                                     for a in records]})


async def delete_tenant_adapter(name: str) -> Response:
    principal = await authorize()
    state = app_state()
    lora = _lora()
    adapters = AdapterStore(state.tenancy.store.backend)
    # A name nobody can register is not looked up (a NUL byte would be a PostgreSQL error, not a 404). Any adapter
    # the tenant owns may be unregistered (only the owner could use it); only its own uploads' files are deleted.
    record = await trio.to_thread.run_sync(adapters.get, name) if NAME_RE.fullmatch(name) else None
    if record is None or record.tenant_id != principal.tenant_id:
        raise _not_found(name)  # another tenant's and a global adapter read as a name nobody registered
    try:
        await trio.to_thread.run_sync(LocalAdmin(state.tenancy.store, lora=lora).unload_adapter, name)
    except AdminOpError as e:
        if e.status == 404:  # unregistered meanwhile (an operator, a suspension): gone all the same
            raise _not_found(name) from None
        raise op_error(e) from None
    state.tenancy.adapters.invalidate()
    await trio.to_thread.run_sync(remove_upload, lora.directory, record, adapters)
    log.info("adapter deleted", extra={"fields": {"event": "adapter_deleted", "adapter": name,
                                                  "tenant_id": principal.tenant_id, "key_id": principal.key_id}})
    return json_response({"id": name, "object": "lora_adapter", "deleted": True})
