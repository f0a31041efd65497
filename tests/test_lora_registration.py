"""Issue 25, the gateway's and the store's side of LoRA adapters, without a server: the torch-free check an adapter
passes before it is registered (every refusal of the worker's loader but finiteness, on the same broken adapters),
where ``lora_path`` may point, the registry table (migration 7 on SQLite and PostgreSQL, old ledger rows kept),
suspension and deletion unregistering a tenant's adapters, the gateway's catalog (another tenant's adapter resolves
exactly as an unknown name), the metrics, and ``kvgatectl adapters`` in local mode."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import trio

from gateway.base.errors import APIError
from gateway.base.handle import RequestFailed, RequestHandle
from gateway.pipeline.adapters import AdapterCatalog
from gateway.pipeline.streaming import failure_to_api_error
from gateway.telemetry import metrics
from gateway.telemetry.gateway_metrics import GatewayMetrics
from tenancy import schema
from tenancy.adapter_ops import AdapterAdmin, AdapterOpError
from tenancy.adapters_store import AdapterExists, AdapterStore
from tenancy.lora_check import BaseShapes, LoraContext, check_adapter, resolve_adapter_dir
from tenancy.models import UsageRow
from tenancy.store import TenancyStore
from tests.lora_support import ATTN, make_adapter
from tests.postgres_support import database_at_version
from tests.test_kvgatectl import Cli, clean_env, db, local  # noqa: F401  (fixtures)
from tests.test_lora_adapter import CASES
from tests.tiny import hf_model

PEPPER = b"test-pepper"


@pytest.fixture(scope="module")
def hf() -> Any:
    return hf_model(seed=0)


@pytest.fixture(scope="module")
def base(hf: Any) -> BaseShapes:
    return BaseShapes.from_config(hf.config.to_dict())


@pytest.fixture(scope="module")
def good(hf: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(hf, tmp_path_factory.mktemp("good") / "a", ATTN, r=8, seed=1)


# --- the check before registration ----------------------------------------------------------------------------

def test_a_good_adapter_passes_with_its_rank_and_targets(good: Path, base: BaseShapes) -> None:
    summary = check_adapter(good, base)
    assert summary.rank == 8 and summary.targets == tuple(ATTN)


@pytest.mark.parametrize("case", [c for c in CASES if c != "not finite"])  # finiteness needs the data: the worker's
def test_every_loader_refusal_is_refused_before_registration(good: Path, base: BaseShapes, tmp_path: Path,
                                                             case: str) -> None:
    breaks, message = CASES[case]
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    breaks(bad)
    with pytest.raises(ValueError, match=message):
        check_adapter(bad, base)


def test_an_adapter_for_another_base_model_is_refused(good: Path) -> None:
    other = BaseShapes.from_config(hf_model(seed=0, hidden_size=96).config.to_dict())
    with pytest.raises(ValueError, match="the base model needs"):
        check_adapter(good, other)


def test_padding_after_the_data_is_refused_like_truncation(good: Path, base: BaseShapes, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    with (bad / "adapter_model.safetensors").open("ab") as f:
        f.write(b"\0" * 16)
    with pytest.raises(ValueError, match="cannot be read"):
        check_adapter(bad, base)


def test_lora_path_must_be_a_directory_directly_inside_the_adapter_directory(good: Path, tmp_path: Path) -> None:
    root = tmp_path / "loras"
    root.mkdir()
    shutil.copytree(good, root / "mine")
    shutil.copytree(good, tmp_path / "outside")
    (root / "nested").mkdir()
    shutil.copytree(good, root / "nested" / "deep")
    (root / "escape").symlink_to(tmp_path / "outside")
    (root / "alias").symlink_to(root / "mine")  # a link that stays inside names its target
    assert resolve_adapter_dir(root, "mine") == "mine"
    assert resolve_adapter_dir(root, str(root / "mine")) == "mine"
    assert resolve_adapter_dir(root, "./mine/") == "mine"
    assert resolve_adapter_dir(root, "alias") == "mine"
    refusals = {"../outside": "'..'", "mine/../mine": "'..'", str(tmp_path / "outside"): "outside",
                "escape": "outside", "nested/deep": "directly inside", "absent": "no such directory",
                ".": "directly inside", "": "non-empty", "a\0b": "non-empty", "/": "outside"}
    for path, message in refusals.items():
        with pytest.raises(ValueError, match=message):
            resolve_adapter_dir(root, path)
    with pytest.raises(ValueError, match="non-empty"):
        resolve_adapter_dir(root, 7)


# --- the registry in the store ---------------------------------------------------------------------------------

def _schema_6_with_a_usage_row(where: str) -> None:
    """A database as kvgate left it before LoRA (migrations 1-6): one tenant and one ledger row."""
    database_at_version(where, 6, [
        "INSERT INTO tenants (id, name, status, weight, created_at) VALUES ('ten_0', 'old', 'active', 1, 0)",
        "INSERT INTO usage (request_id, tenant_id, key_id, model, prompt_tokens, cached_tokens, completion_tokens, "
        "status, started_at, finished_at) VALUES ('r0', 'ten_0', NULL, 'tiny', 5, 0, 3, 'stop', 10, 11)"])


def test_migration_7_keeps_old_ledger_rows_and_records_adapters(any_db: str) -> None:
    _schema_6_with_a_usage_row(any_db)
    with TenancyStore(any_db, PEPPER) as s:
        # 7 and every migration after it (8: batch files' models)
        assert s.applied_migrations == list(range(7, schema.LATEST_VERSION + 1)) and s.schema_version == 8
        [old] = s.usage_rows("old")
        assert (old.request_id, old.adapter, old.completion_tokens) == ("r0", None, 3)
        s.record_usage([UsageRow("r1", "ten_0", None, "tiny", 4, 0, 2, "length", 20, 21, adapter="mine")])
        assert [r.adapter for r in s.usage_rows("old")] == [None, "mine"]
        by = {g.group: (g.requests, g.completion_tokens) for g in s.usage_summary("old", by="adapter")}
        assert by == {"": (1, 3), "mine": (1, 2)}  # '' is the base model
        adapters = AdapterStore(s.backend)
        adapters.add("mine", "mine-dir", "ten_0")
        adapters.add("org/shared:v1", "shared", None)
        assert [(a.name, a.tenant_id) for a in adapters.list()] == [("mine", "ten_0"), ("org/shared:v1", None)]
        assert [a.name for a in adapters.list("ten_0")] == ["mine"]
        with pytest.raises(AdapterExists):
            adapters.add("mine", "other", None)
        with pytest.raises(KeyError):
            adapters.add("orphan", "x", "ten_nobody")
        with pytest.raises(ValueError, match="lora_name"):
            adapters.add("../etc", "x", None)
        assert adapters.get("orphan") is None and adapters.remove("orphan") is None


def test_suspension_and_deletion_unregister_a_tenants_adapters(any_db: str) -> None:
    with TenancyStore(any_db, PEPPER) as s:
        a, b = s.create_tenant("a"), s.create_tenant("b")
        adapters = AdapterStore(s.backend)
        for name, owner in (("a1", a.id), ("a2", a.id), ("b1", b.id), ("global", None)):
            adapters.add(name, "dir", owner)
        assert s.suspend_tenant("a").status == "suspended"
        assert [x.name for x in adapters.list()] == ["b1", "global"]
        s.resume_tenant("a")
        assert adapters.list("a") == []  # registered again by an operator, not by a resume
        s.delete_tenant("b")
        assert [x.name for x in adapters.list()] == ["global"]


def test_admin_ops_refuse_before_touching_the_store(tmp_path: Path, good: Path, base: BaseShapes) -> None:
    root = tmp_path / "loras"
    root.mkdir()
    shutil.copytree(good, root / "ok")
    shutil.copytree(good, root / "broken")
    (root / "broken" / "adapter_config.json").write_text(json.dumps({"r": 128, "target_modules": ATTN}))
    with TenancyStore(tmp_path / "kvgate.db", PEPPER) as s:
        s.create_tenant("acme")
        ops = AdapterAdmin(s, LoraContext(root, base))
        for name, path, tenant, status in (("x", "broken", None, 400), ("x", "../ok", None, 400),
                                           ("x", "ok", "nobody", 404), ("bad name", "ok", None, 400),
                                           ("x", None, None, 400), (None, "ok", None, 400)):
            with pytest.raises(AdapterOpError) as e:
                ops.load(name, path, tenant)
            assert e.value.status == status, (name, path, tenant)
        assert ops.list()["data"] == []
        added = ops.load("x", "ok", "acme")
        assert (added["path"], added["tenant"], added["rank"]) == ("ok", "acme", 8)
        with pytest.raises(AdapterOpError) as e:
            ops.load("x", "ok", None)
        assert e.value.status == 409
        assert [a["name"] for a in ops.list("acme")["data"]] == ["x"]
        assert ops.unload("x")["deleted"] is True
        for call in (lambda: ops.unload("x"), lambda: ops.unload("a\0b"), lambda: ops.list("a\0b")):
            with pytest.raises(AdapterOpError) as e:
                call()
            assert e.value.status == 404  # a NUL byte is never sent to the database (PostgreSQL would fail: a 500)
        with pytest.raises(AdapterOpError) as e:
            AdapterAdmin(s, None).load("y", "ok", None)  # no --lora-dir: registration is off
        assert e.value.code == "lora_disabled"


# --- the gateway's catalog -------------------------------------------------------------------------------------

def test_another_tenants_adapter_resolves_as_an_unknown_name(tmp_path: Path) -> None:
    now = [0.0]
    with TenancyStore(tmp_path / "kvgate.db", PEPPER) as s:
        a, b = s.create_tenant("a"), s.create_tenant("b")
        store = AdapterStore(s.backend)
        store.add("mine", "d", a.id)
        store.add("shared", "d", None)
        catalog = AdapterCatalog(store, ttl=1.0, clock=lambda: now[0])

        async def main() -> None:
            assert (await catalog.resolve("mine", a.id)) is not None
            assert await catalog.resolve("mine", b.id) is None  # exactly what an unknown name gives
            assert await catalog.resolve("never-registered", b.id) is None
            assert [r.name for r in await catalog.visible(b.id)] == ["shared"]
            assert [r.name for r in await catalog.visible(a.id)] == ["mine", "shared"]
            store.add("late", "d", None)
            assert await catalog.resolve("late", b.id) is None  # within the snapshot's second
            now[0] = 1.5
            assert await catalog.resolve("late", b.id) is not None
            store.remove("late")
            catalog.invalidate()  # this gateway's own change: at once
            assert await catalog.resolve("late", b.id) is None
            assert await AdapterCatalog(None).resolve("mine", a.id) is None  # adapters off: nothing read

        trio.run(main)


def test_a_read_that_raced_a_write_is_not_kept() -> None:
    """A registry read under way when an admin write commits (and invalidates) may return the old table: it is
    not kept as the snapshot, so the next request sees the write at once, not a second later (the lora-churn drill
    saw a just-registered adapter answer 404)."""
    import threading

    from tenancy.models import LoraAdapterRecord

    class Racing:
        def __init__(self) -> None:
            self.rows: list[LoraAdapterRecord] = []
            self.reading, self.release = threading.Event(), threading.Event()
            self.slow = True

        def list(self) -> list[LoraAdapterRecord]:
            old = list(self.rows)  # what the read sees: the table before the write
            if self.slow:
                self.reading.set()
                self.release.wait(5)
            return old

    store = Racing()
    catalog = AdapterCatalog(store, ttl=60.0)  # type: ignore[arg-type]
    added = LoraAdapterRecord("new", "d", None, 0.0)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            async def early() -> None:
                assert await catalog.resolve("new", "ten_x") is None  # began before the write: may miss it
            nursery.start_soon(early)
            await trio.to_thread.run_sync(store.reading.wait)
            store.rows.append(added)  # the write commits ...
            catalog.invalidate()  # ... and the admin route invalidates, while the read is still under way
            store.slow = False
            store.release.set()
        assert await catalog.resolve("new", "ten_x") == added  # not the raced read's table, for a minute

    trio.run(main)


def test_a_failing_or_hung_registry_is_a_503_not_a_stalled_request() -> None:
    class Broken:
        def list(self) -> list[Any]:
            raise OSError("disk gone")

    class Hung:
        def list(self) -> list[Any]:
            import time

            time.sleep(0.5)  # a read past the deadline (its thread is abandoned)
            return []

    async def main() -> None:
        for store in (Broken(), Hung()):
            catalog = AdapterCatalog(store, timeout_s=0.1)  # type: ignore[arg-type]
            with pytest.raises(APIError) as e:
                await catalog.resolve("mine", "ten_x")
            assert (e.value.status, e.value.code) == (503, "store_unavailable")

    trio.run(main)


# --- errors and metrics ----------------------------------------------------------------------------------------

def test_a_workers_unknown_adapter_is_a_404_not_a_500() -> None:
    e = failure_to_api_error(RequestFailed("model_not_found", "unknown LoRA adapter 'x'"))
    assert (e.status, e.code, e.param) == (404, "model_not_found", "model")
    assert failure_to_api_error(RequestFailed("invalid_request", "cannot be loaded")).status == 400


def test_per_adapter_counters_and_the_lora_requests_info_gauge() -> None:
    gm = GatewayMetrics("tiny")
    gm.request_finished(UsageRow("r1", "t", "k", "tiny", 10, 4, 3, "stop", 0, 1, adapter="mine"), "acme", "w0")
    gm.request_finished(UsageRow("r2", "t", "k", "tiny", 5, 0, 2, "stop", 0, 1), "acme", "w0")
    text = gm.render()
    assert 'kvgate:lora_requests_total{adapter="mine",status="stop"} 1.0' in text
    assert 'kvgate:lora_tokens_total{adapter="mine",kind="prompt"} 10.0' in text
    assert 'kvgate:lora_tokens_total{adapter="mine",kind="completion"} 3.0' in text
    assert text.count("kvgate:lora_requests_total{") == 1  # the base model's request is not an adapter's

    class Pool:
        def __init__(self) -> None:
            self.handles = [RequestHandle("a", "w0", 3, adapter="mine"), RequestHandle("b", "w0", 3, adapter="x"),
                            RequestHandle("c", "w0", 3)]
            self.handles[0].generated_tokens = 2

        def inflight(self) -> list[RequestHandle]:
            return self.handles

    async def main() -> str:
        return metrics.lora_requests_info(Pool(), 8)  # type: ignore[arg-type]

    info = trio.run(main)
    assert 'vllm:lora_requests_info{running_lora_adapters="mine",max_lora="8",waiting_lora_adapters="x"}' in info


# --- kvgatectl, local mode ---------------------------------------------------------------------------------------

def test_kvgatectl_adapters_local_mode(local: Cli, db: Path) -> None:  # noqa: F811
    assert local.json("adapters", "list") == {"object": "list", "data": []}
    with TenancyStore(db, _pepper_of(db)) as s:
        AdapterStore(s.backend).add("mine", "dir", s.create_tenant("acme").id)
    [row] = local.json("adapters", "list")["data"]
    assert (row["name"], row["tenant"], row["path"]) == ("mine", "acme", "dir")
    assert "mine" in local.ok("adapters", "list").stdout
    added = local("adapters", "add", "x", "dir")
    assert added.exit_code == 2 and "--url" in added.output  # only a gateway can check it against its model
    assert local.json("adapters", "rm", "mine")["deleted"] is True
    assert local("adapters", "rm", "mine").exit_code == 1
    assert local.json("adapters", "list")["data"] == []


def _pepper_of(path: Path) -> bytes:
    from tenancy.server_secret import load_secret

    return load_secret(str(path)).key_pepper
