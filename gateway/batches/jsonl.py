"""A batch input file: JSONL, one request a line, each ``{"custom_id", "method", "url", "body"}``.

Checked whole when it is uploaded, as OpenAI checks an input file: the first bad line is a 400 that names it (line
numbers count every line of the file, blank ones included, as an editor shows them). Only the envelope is checked
here: a body's own fields are checked when its line runs (``parse_chat``/``parse_completion``), and a body they
refuse becomes that line's entry in the batch's error file, again as OpenAI does. Messages name lines, fields and
sizes, never a line's content.

A file names one model, as OpenAI's does: every line's ``body.model`` is the same name, the served model or
(vLLM's convention) a LoRA adapter's. Whether an adapter name is one the batch's tenant may use is the runner's
check when the batch starts (the registry is asked outside this thread; an adapter may come and go after upload).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.base.errors import APIError
from tenancy.adapters_store import NAME_RE

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MAX_CUSTOM_ID_CHARS = 512  # a key, not a payload: it is repeated in the output file and held per line
_FIELDS = ("custom_id", "method", "url", "body")


class BatchFileError(APIError):
    """A 400 naming the file's first bad line (``line``; None when the file as a whole is wrong)."""

    def __init__(self, message: str, line: int | None, code: str = "invalid_file_format") -> None:
        where = f"line {line}: " if line is not None else ""
        super().__init__(400, f"Invalid batch input file, {where}{message}", code=code, param="file")
        self.line = line
        self.reason = message

    def as_batch_error(self) -> dict[str, Any]:
        """The entry of a failed batch's ``errors.data`` (OpenAI's BatchError)."""
        return {"code": self.code, "message": self.reason, "param": None, "line": self.line}


@dataclass(frozen=True)
class InputLine:
    line: int
    custom_id: str
    body: dict[str, Any]


@dataclass(frozen=True)
class BatchFile:
    endpoint: str  # every line's url: a batch runs one endpoint
    lines: list[InputLine]
    model: str  # every line's body.model: a batch runs one model (the served one or an adapter)


def parse_batch_file(data: bytes, served: str, max_lines: int) -> BatchFile:
    """The file's requests, or a ``BatchFileError`` for its first bad line. ``served``: the served model's name
    (any other name must at least be one an adapter could be registered as). Runs in a thread (a large file takes
    seconds)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BatchFileError("not valid UTF-8", data[:e.start].count(b"\n") + 1) from None
    lines: list[InputLine] = []
    first_of: dict[str, int] = {}  # custom_id -> the line that used it first
    endpoint: str | None = None
    model = ""
    for number, raw in enumerate(text.split("\n"), 1):  # not splitlines(): U+2028 inside a JSON string is no break
        if not raw.strip():
            continue
        if len(lines) == max_lines:
            raise BatchFileError(f"a batch file holds at most {max_lines} requests", number, "too_many_requests")
        entry = _envelope(raw, number, served)
        url, named = entry["url"], entry["body"]["model"]
        if endpoint is None:
            endpoint, model = url, named
        elif url != endpoint:
            raise BatchFileError(f"'url' is {url} but line {lines[0].line} is {endpoint}: one batch file holds "
                                 "requests to one endpoint", number, "mismatched_url")
        elif named != model:
            raise BatchFileError(f"'body.model' differs from line {lines[0].line}'s: one batch file holds requests "
                                 "to one model", number, "mismatched_model")
        custom_id = entry["custom_id"]
        if custom_id in first_of:
            raise BatchFileError(f"'custom_id' repeats the custom_id of line {first_of[custom_id]}; each must be "
                                 "unique within the file", number, "duplicate_custom_id")
        first_of[custom_id] = number
        lines.append(InputLine(number, custom_id, entry["body"]))
    if endpoint is None:
        raise BatchFileError("the file holds no requests", None, "empty_file")
    return BatchFile(endpoint, lines, model)


def _envelope(raw: str, number: int, served: str) -> dict[str, Any]:
    try:
        entry = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise BatchFileError("nests too deeply", number) from None
    except ValueError as e:
        raise BatchFileError(f"not valid JSON ({type(e).__name__})", number) from None
    if not isinstance(entry, dict):
        raise BatchFileError("each line must be a JSON object", number)
    unknown = sorted(set(entry) - set(_FIELDS))
    if unknown:
        raise BatchFileError(f"unrecognized field '{unknown[0][:64]}'", number)
    custom_id = entry.get("custom_id")
    if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= MAX_CUSTOM_ID_CHARS:
        raise BatchFileError(f"'custom_id' must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters", number)
    if not _storable(custom_id):
        raise BatchFileError("'custom_id' must not hold NUL or unpaired surrogate characters", number)
    if entry.get("method") != "POST":
        raise BatchFileError("'method' must be \"POST\"", number)
    if entry.get("url") not in ENDPOINTS:
        raise BatchFileError(f"'url' must be one of {', '.join(ENDPOINTS)}", number, "invalid_url")
    body = entry.get("body")
    if not isinstance(body, dict):
        raise BatchFileError("'body' must be a JSON object", number)
    model = body.get("model")
    # A name no adapter can be registered as can never run: refused now, as the route would refuse it. Any other
    # name may be an adapter; the runner resolves it for the batch's tenant.
    if not isinstance(model, str) or (model != served and NAME_RE.fullmatch(model) is None):
        raise BatchFileError(f"'body.model' must be the served model, {served!r}, or a LoRA adapter's name", number,
                             "model_not_found")
    return entry


def _storable(text: str) -> bool:
    """Whether a database column can hold it as it is (PostgreSQL refuses NUL; neither store takes a lone
    surrogate, which JSON's \\u escapes can spell)."""
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
