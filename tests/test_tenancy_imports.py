"""tenancy/ import boundary (docs/ARCHITECTURE.md package map): kvgatectl and the planner never load workers/,
torch, CuPy or transformers. Checked in a fresh interpreter, where sys.modules is honest, after running
``kvgatectl plan`` on smollm2's real GGUF, since the model half resolves the file through a lazy import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TENANCY_FORBIDDEN = ("workers", "gateway", "torch", "cupy", "transformers")

_CODE = f"""
import json, sys
import console.kvgatectl, console.plan, console.plan_model, console.plan_cli, tenancy.store, console.top
from typer.testing import CliRunner
result = CliRunner().invoke(console.kvgatectl.app, ["plan", "--model", "smollm2", "--device", "l4", "--json"])
bad = sorted(m for m in sys.modules if m.split('.')[0] in {TENANCY_FORBIDDEN!r})
print(json.dumps({{"exit": result.exit_code, "output": result.output, "bad": bad}}))
"""


def test_kvgatectl_and_plan_never_import_workers_gateway_or_torch() -> None:
    run = subprocess.run([sys.executable, "-c", _CODE], cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=True)
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["exit"] == 0, seen["output"]
    assert json.loads(seen["output"])["model"]["name"] == "smollm2"  # the GGUF was really read
    assert seen["bad"] == []
