"""Stored responses (``tenancy.responses_store``, ``gateway.responses.stored``): on SQLite and PostgreSQL, rows keyed
by tenant (another tenant's id reads like an unknown one), retention that holds on read and prunes on schedule, a
deleted tenant's responses going with it, the gateway's async face (threads, deadlines, 503s, the prune task), the
retention setting, and two gateways on one PostgreSQL: what gateway A stored, gateway B serves after A is gone."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx
import openai
import pytest
import trio

from gateway.base.errors import APIError
from gateway.cli import add_serve_parser, config_from_args
from gateway.config import TenancyConfig
from gateway.responses.stored import StoredResponses
from tenancy.responses_store import ResponseStore, StoredResponse
from tenancy.store import TenancyStore
from tests.test_gateway_support import MODEL, Server, start_server
from tests.tenancy_support import PEPPER, db, tenancy  # noqa: F401  (fixtures)

DAY = 86400.0


class FakeClock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t



def _record(rid: str, tenant_id: str, created_at: float, text: str = "out") -> StoredResponse:
    return StoredResponse(rid, tenant_id, created_at, {"id": rid, "object": "response", "output_text": text},
                          [{"id": f"msg_{rid}", "type": "message", "role": "user", "content": []}],
                          [{"role": "user", "content": "in"}, {"role": "assistant", "content": text}])


def test_rows_are_per_tenant(tenancy: TenancyStore) -> None:
    clock = FakeClock()
    store = ResponseStore(tenancy.backend, 30 * DAY, clock=clock)
    a, b = tenancy.create_tenant("a").id, tenancy.create_tenant("b").id
    store.put(_record("resp_1", a, clock.t))
    assert store.read(a, "resp_1", "body") == {"id": "resp_1", "object": "response", "output_text": "out"}
    assert store.read(a, "resp_1", "context")[-1] == {"role": "assistant", "content": "out"}
    assert store.read(a, "resp_1", "input_items")[0]["id"] == "msg_resp_1"
    full = store.get(a, "resp_1")
    assert full is not None and full.created_at == clock.t and full.tenant_id == a
    assert store.read(b, "resp_1", "body") is None and store.get(b, "resp_1") is None  # another tenant's
    assert not store.delete(b, "resp_1") and store.read(a, "resp_1", "body") is not None
    assert store.read(a, "resp_2", "body") is None
    for odd in ("resp_" + "x" * 200, "resp_\x00", "resp 1", ""):  # no query: PostgreSQL refuses a NUL byte
        assert store.read(a, odd, "body") is None and not store.delete(a, odd)
    assert store.delete(a, "resp_1") and not store.delete(a, "resp_1")
    assert store.read(a, "resp_1", "body") is None and store.count() == 0
    with pytest.raises(ValueError):
        store.read(a, "resp_1", "tenant_id")  # type: ignore[arg-type]  # only the three parts


def test_retention_holds_on_read_and_prune_deletes(tenancy: TenancyStore) -> None:
    clock = FakeClock()
    store = ResponseStore(tenancy.backend, 1 * DAY, clock=clock)
    t = tenancy.create_tenant("t").id
    store.put(_record("resp_old", t, clock.t - DAY - 1))
    store.put(_record("resp_new", t, clock.t))
    assert store.read(t, "resp_old", "body") is None and not store.delete(t, "resp_old")  # expired: gone at once
    assert store.read(t, "resp_new", "body") is not None and store.count(t) == 2  # not pruned yet
    assert store.prune() == 1 and store.count(t) == 1
    clock.t += DAY + 1
    assert store.read(t, "resp_new", "body") is None and store.prune() == 1 and store.count() == 0
    with pytest.raises(ValueError):
        ResponseStore(tenancy.backend, 0)


def test_a_deleted_tenant_takes_its_responses(tenancy: TenancyStore) -> None:
    store = ResponseStore(tenancy.backend, DAY)
    t, keep = tenancy.create_tenant("gone").id, tenancy.create_tenant("kept").id
    store.put(_record("resp_a", t, time.time()))
    store.put(_record("resp_b", keep, time.time()))
    tenancy.delete_tenant("gone")
    assert store.count(t) == 0 and store.count(keep) == 1


@pytest.mark.trio
async def test_the_gateway_face_prunes_and_answers_503(tmp_path: Path) -> None:
    tenancy = TenancyStore(tmp_path / "kvgate.db", PEPPER)
    t = tenancy.create_tenant("t").id
    store = ResponseStore(tenancy.backend, 4.0)  # a prune every second
    stored = StoredResponses(store)
    assert stored.prune_interval_s == 1.0
    await stored.put(_record("resp_old", t, 0.0))
    await stored.put(_record("resp_new", t, 1e12))
    assert await stored.read(t, "resp_old", "body") is None
    async with trio.open_nursery() as nursery:
        await nursery.start(stored.run)
        with trio.fail_after(10):
            while stored.pruned < 1:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert store.count() == 1 and (await stored.read(t, "resp_new", "body"))["id"] == "resp_new"
    tenancy.close()  # the database is gone: every call is a 503 in OpenAI's shape, not a crash
    with pytest.raises(APIError) as e:
        await stored.read(t, "resp_new", "body")
    assert e.value.status == 503 and e.value.code == "store_unavailable"


def test_retention_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    def parsed(*argv: str) -> float:
        parser = argparse.ArgumentParser()
        add_serve_parser(parser.add_subparsers())
        return config_from_args(parser.parse_args(["serve", *argv])).tenancy.responses_retention_days

    monkeypatch.delenv("KVGATE_RESPONSES_RETENTION_DAYS", raising=False)
    assert parsed() == 30.0 and parsed("--responses-retention-days", "0.5") == 0.5
    monkeypatch.setenv("KVGATE_RESPONSES_RETENTION_DAYS", "7")
    assert parsed() == 7.0
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="--responses-retention-days"):
            TenancyConfig(responses_retention_days=bad)


# ---- two gateways, one PostgreSQL ------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_a_second_gateway_serves_what_the_first_stored(tiny_model_dir: Path, tmp_path: Path,
                                                       postgres_url: str) -> None:
    a = start_server(tiny_model_dir, tmp_path / "a.log", db_path=postgres_url)  # type: ignore[arg-type]
    try:
        client = openai.OpenAI(base_url=f"{a.url}/v1", api_key=a.api_key, max_retries=0, timeout=120)
        first = client.responses.create(model=MODEL, input="remember this", max_output_tokens=3)
        unkept = client.responses.create(model=MODEL, input="not this", max_output_tokens=2, store=False)
    finally:
        a.stop()
    assert a.proc.returncode is not None
    b: Server = start_server(tiny_model_dir, tmp_path / "b.log", "--no-demo-tenant", db_path=postgres_url,  # type: ignore[arg-type]
                             secret=a.secret)
    try:
        client = openai.OpenAI(base_url=f"{b.url}/v1", api_key=a.api_key, max_retries=0, timeout=120)
        again = client.responses.retrieve(first.id)
        assert again.model_dump() == first.model_dump()
        [item] = client.responses.input_items.list(first.id).data
        assert item.content[0].text == "remember this"  # type: ignore[union-attr]
        second = client.responses.create(model=MODEL, input="and now", previous_response_id=first.id,
                                         max_output_tokens=2)
        turns = [{"role": "user", "content": "remember this"}, {"role": "assistant", "content": first.output_text},
                 {"role": "user", "content": "and now"}]
        count = httpx.post(f"{b.url}/tokenize", json={"messages": turns}, timeout=30,
                           headers={"Authorization": f"Bearer {a.api_key}"}).json()["count"]
        assert second.previous_response_id == first.id and second.usage is not None
        assert second.usage.input_tokens == count  # b continued a's conversation
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(unkept.id)
    finally:
        b.stop()
    assert "Traceback" not in a.log() + b.log()
