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
