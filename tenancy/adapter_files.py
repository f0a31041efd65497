"""The files of tenants' uploaded LoRA adapters under ``--lora-dir`` (gateway/api/adapter_upload.py writes them).

An upload's directory holds a marker naming its adapter and tenant, so its files can be told from an operator's
(which are the operator's to remove). Registrations go with their tenant (suspension and deletion cascade in the
store), and ``sweep_uploads`` then removes the uploads nothing is registered over any more. A grace period spares
an upload between its rename into place and its registration (a second or so), which would otherwise look
unregistered.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MARKER = ".kvgate-upload.json"  # in an uploaded directory: {"name": ..., "tenant_id": ...}
GRACE_S = 600.0  # an unregistered upload younger than this may be mid-registration: left alone


def write_marker(directory: Path, name: str, tenant_id: str) -> None:
    (directory / MARKER).write_text(json.dumps({"name": name, "tenant_id": tenant_id}))


def read_marker(directory: Path) -> dict[str, Any] | None:
    """The upload's marker, or None (not an upload, or an unreadable marker: treated as the operator's)."""
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def sweep_uploads(root: Path, registered: set[str], now: float | None = None, tenant_id: str | None = None) -> list[str]:
    """Removes the uploaded adapter directories under ``root`` that no registration names (``registered``: the
    registered paths) and that are older than GRACE_S, or of ``tenant_id`` whatever their age (a tenant just
    suspended or deleted: its registrations went with it); returns the names removed. Operators' directories and
    temporary ones (dot names) are never touched."""
    now = time.time() if now is None else now
    removed: list[str] = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    for d in entries:
        if d.name.startswith(".") or d.name in registered or not d.is_dir() or d.is_symlink():
            continue
        marker = read_marker(d)
        if marker is None:
            continue
        try:
            if marker.get("tenant_id") != tenant_id and now - (d / MARKER).stat().st_mtime < GRACE_S:
                continue
        except OSError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d.name)
    if removed:
        log.info("removed %d unregistered uploaded adapter director%s", len(removed),
                 "y" if len(removed) == 1 else "ies")
    return removed
