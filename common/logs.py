"""Logging set-up for the gateway and its workers (torch-free, so the gateway can import it): JSON lines by
default (one object per line, for log shippers), readable text on request.

Fields passed as ``extra={"fields": {...}}`` become top-level keys of the JSON object (or ``key=value`` pairs in
text, where a string value with spaces, quotes or line breaks is JSON-quoted, so one record stays one line and
no value can forge another record). Callers log ids, counts and timings; prompt and completion text only for a
tenant that opted in (``kvgatectl tenant set-log-text``).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

FORMATS = ("json", "text")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"), default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        return line + "".join(f" {k}={_text_value(v)}" for k, v in fields.items()) if fields else line


def _text_value(v: Any) -> str:
    s = str(v)
    if isinstance(v, str) and (not s or any(c.isspace() or c in '"=' for c in s)):
        return json.dumps(s, ensure_ascii=False)  # quoted, newlines escaped
    return s


def setup_logging(level: str, fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"--log-format must be one of {FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logging.basicConfig(level=getattr(logging, level), handlers=[handler], force=True)
