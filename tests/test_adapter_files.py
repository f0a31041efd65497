"""tenancy/adapter_files.py's sweep: uploads nothing is registered over go (past the grace period, or at once for
the tenant named); registered uploads, operators' directories and temporary ones stay."""

from __future__ import annotations

import os
from pathlib import Path

from tenancy.adapter_files import GRACE_S, MARKER, read_marker, sweep_uploads, write_marker


def _upload(root: Path, name: str, tenant: str, age: float) -> Path:
    d = root / f"{name}.0123456789abcdef"
    d.mkdir()
    write_marker(d, name, tenant)
    t = os.stat(d / MARKER).st_mtime - age
    os.utime(d / MARKER, (t, t))
    return d


def test_the_sweep_removes_only_unregistered_uploads(tmp_path: Path) -> None:
    old = _upload(tmp_path, "old", "t1", GRACE_S + 60)
    young = _upload(tmp_path, "young", "t1", 5)
    kept = _upload(tmp_path, "kept", "t2", GRACE_S + 60)
    of_t3 = _upload(tmp_path, "fresh", "t3", 5)
    operator = tmp_path / "operator"
    operator.mkdir()
    (tmp_path / ".upload-0123").mkdir()
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / MARKER).write_text("{not json")
    assert read_marker(kept) == {"name": "kept", "tenant_id": "t2"} and read_marker(operator) is None
    assert sweep_uploads(tmp_path, {kept.name}) == [old.name]
    assert young.is_dir() and kept.is_dir() and operator.is_dir() and (tmp_path / ".upload-0123").is_dir()
    assert (tmp_path / "junk").is_dir()  # an unreadable marker: not known to be an upload
    assert sweep_uploads(tmp_path, {kept.name}, tenant_id="t3") == [of_t3.name]  # the tenant's, whatever its age
    assert young.is_dir()
    assert sweep_uploads(tmp_path / "missing", set()) == []
