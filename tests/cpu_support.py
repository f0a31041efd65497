"""What the CPU kernel tests share: a built kernel module, or the reason there is none."""

from __future__ import annotations

import os
from typing import Any

import pytest


def built(mod: Any | None, what: str) -> Any:
    """``mod`` (a kernel loader's result); a skip where the kernels were switched off with KVGATE_CPU_KERNEL=0,
    a failure where it did not build (gcc and ninja are part of the dev setup)."""
    if mod is None:
        if os.environ.get("KVGATE_CPU_KERNEL") == "0":
            pytest.skip("CPU kernels switched off with KVGATE_CPU_KERNEL=0")
        pytest.fail(f"{what} failed to build on a machine that has the toolchain")
    return mod


def results_per_isa(script: str, env_var: str, isas: tuple[str, ...], tmp_path: Any,
                    timeout_s: float = 600) -> dict[str, Any]:
    """Run ``script`` (which saves a tensor to argv[1] and prints the path it ran) once per ``env_var=isa``, each
    in its own process (a kernel picks its path once per process); returns {printed path: tensor}."""
    import subprocess
    import sys

    import torch

    results = {}
    for isa in isas:
        out = tmp_path / f"{isa}.pt"
        env = dict(os.environ, **{env_var: isa})
        p = subprocess.run([sys.executable, "-c", script, str(out)], env=env, capture_output=True, text=True,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=timeout_s)
        assert p.returncode == 0, p.stderr[-2000:]
        results[p.stdout.strip()] = torch.load(out)
    assert "scalar" in results, results.keys()
    return results
