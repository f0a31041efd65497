"""ipc/ import boundaries (DESIGN.md package map): checked in a fresh interpreter, where sys.modules is honest."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN_EVERYWHERE = ("gateway", "workers", "torch")


def _imported_top_level(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            timeout=60, check=True)
    return set(result.stdout.split())


@pytest.mark.parametrize("module", ["ipc", "ipc.messages", "ipc.sampling", "ipc.codec", "ipc.sync_transport",
                                    "ipc.transport"])
def test_ipc_never_imports_gateway_workers_or_torch(module: str) -> None:
    assert not _imported_top_level(module) & set(FORBIDDEN_EVERYWHERE)


@pytest.mark.parametrize("module", ["ipc.messages", "ipc.codec", "ipc.sync_transport"])
def test_worker_side_modules_do_not_import_trio(module: str) -> None:
    # workers/ may not import trio, and it imports these three
    assert "trio" not in _imported_top_level(module)
