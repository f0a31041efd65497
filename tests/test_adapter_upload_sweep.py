"""A running gateway removes tenants' uploaded adapter directories that nothing registers any more
(gateway/server.py, _sweep_uploads): a tenant suspended through ``kvgatectl --db`` loses its registrations in the
database, and its files go at the next sweep past the grace period instead of at the next gateway start. An
unregistered upload younger than the grace period (one between its rename and its registration) stays."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tenancy.adapter_files import GRACE_S, MARKER, read_marker, write_marker
from tests.lora_support import ATTN, make_adapter
from tests.tenancy_support import kvgatectl, make_tenant
from tests.test_gateway_support import Server, start_server

pytestmark = pytest.mark.timeout(300)
SWEEP_S = 0.3


@pytest.fixture(scope="module")
def source(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    d = tmp_path_factory.mktemp("sweep-sources") / "good"
    make_adapter(hf, d, ATTN, seed=6)
    return d


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("sweep-lora") / "adapters"
    d.mkdir()
    return d


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, lora_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("sweep") / "gateway.log", "--lora-dir", str(lora_dir),
                     "--quantization", "none", env={"KVGATE_UPLOAD_SWEEP_S": str(SWEEP_S)})
    yield s
    s.stop()
    assert "Traceback" not in s.log()


def _upload_dir(lora_dir: Path, name: str) -> Path | None:
    found = [d for d in lora_dir.iterdir() if d.is_dir() and (read_marker(d) or {}).get("name") == name]
    return found[0] if found else None


def _age(directory: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(directory / MARKER, (then, then))


def test_a_tenant_suspended_through_the_database_loses_its_upload_files(srv: Server, source: Path,
                                                                          lora_dir: Path) -> None:
    _, key = make_tenant(srv, "sweep-a")
    files = {f: (f, (source / f).read_bytes()) for f in ("adapter_config.json", "adapter_model.safetensors")}
    r = httpx.post(f"{srv.url}/v1/adapters", headers={"Authorization": f"Bearer {key}"}, data={"name": "sweep-one"},
                   files=files, timeout=60)
    assert r.status_code == 200, r.text
    uploaded = _upload_dir(lora_dir, "sweep-one")
    assert uploaded is not None
    young = lora_dir / "young.abc123"  # unregistered and within the grace period: must stay
    young.mkdir()
    write_marker(young, "young", "ten_nobody")
    assert kvgatectl(srv, "tenant", "suspend", "sweep-a").returncode == 0  # straight to the database
    time.sleep(10 * SWEEP_S)
    assert uploaded.exists()  # unregistered now, but younger than the grace period: a sweep spares it
    _age(uploaded, GRACE_S + 60)
    deadline = time.monotonic() + 30
    while uploaded.exists():
        assert time.monotonic() < deadline, "the gateway did not sweep the suspended tenant's upload"
        time.sleep(SWEEP_S)
    assert young.exists() and (lora_dir / "young.abc123" / MARKER).exists()
