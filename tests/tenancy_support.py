"""Helpers for tenancy tests over real HTTP: tenants and keys made in a running gateway's own store, and a
bounded concurrent load generator (Trio + httpx) that records what each response said."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tenancy.models import Quota
from tenancy.server_secret import ServerSecret
from tenancy.store import TenancyStore
from tests.test_gateway_support import REPO, Server


@contextmanager
def store_of(server: Server) -> Iterator[TenancyStore]:
    """The gateway's own SQLite store, opened beside it (WAL: both may read and write)."""
    store = TenancyStore(server.db_path, ServerSecret(server.secret.encode()).key_pepper)
    try:
        yield store
    finally:
        store.close()


def make_tenant(server: Server, name: str, weight: float = 1.0, quota: Quota | None = None) -> tuple[str, str]:
    """Creates a tenant with one key; returns (tenant_id, plaintext key)."""
    with store_of(server) as store:
        tenant = store.create_tenant(name, weight)
        if quota is not None:
            store.set_quota(name, quota)
        _, key = store.create_key(name, "test")
    return tenant.id, key


def kvgatectl(server: Server, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "console.kvgatectl", "--db", str(server.db_path), *args], cwd=REPO,
                          env=server.env, capture_output=True, text=True, timeout=60)


def ids_prompt(n: int, seed: int) -> list[int]:
    """A prompt of ``n`` token ids that no other seed shares (so no prefix-cache hits between requests)."""
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


@dataclass
class Outcome:
    status: int
    headers: httpx.Headers
    body: dict[str, Any]
    sent_at: float
    done_at: float
    token_times: list[float] = field(default_factory=list)  # streaming: arrival of each token (logprobs)


async def _one(client: httpx.AsyncClient, url: str, key: str, body: dict[str, Any]) -> Outcome:
    sent = time.monotonic()
    headers = {"Authorization": f"Bearer {key}"}
    if not body.get("stream"):
        r = await client.post(url, json=body, headers=headers)
        return Outcome(r.status_code, r.headers, r.json(), sent, time.monotonic())
    times: list[float] = []
    final: dict[str, Any] = {}
    async with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return Outcome(r.status_code, r.headers, r.json(), sent, time.monotonic())
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                # One entry per token when the request asked for logprobs (a chunk may carry several).
                lp = chunk["choices"][0].get("logprobs") or {"tokens": [None]}
                times.extend([time.monotonic()] * len(lp["tokens"]))
            if chunk.get("usage"):
                final = chunk
        return Outcome(200, r.headers, final, sent, time.monotonic(), times)


def run_concurrently(calls: list[tuple[str, str, dict[str, Any]]], timeout: float = 120.0) -> list[Outcome]:
    """Sends every (url, key, body) at once (one connection each) and returns the outcomes in order."""
    results: list[Outcome | None] = [None] * len(calls)

    async def go(i: int, url: str, key: str, body: dict[str, Any], client: httpx.AsyncClient) -> None:
        results[i] = await _one(client, url, key, body)

    async def main() -> None:
        limits = httpx.Limits(max_connections=len(calls), max_keepalive_connections=0)
        with trio.fail_after(timeout):
            async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
                async with trio.open_nursery() as nursery:
                    for i, (url, key, body) in enumerate(calls):
                        nursery.start_soon(go, i, url, key, body, client)

    trio.run(main)
    return [r for r in results if r is not None]


PEPPER = b"test-pepper"


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Both store backends: a fresh SQLite file, or the session's PostgreSQL (tests/postgres_support.py)."""
    if request.param == "sqlite":
        return str(tmp_path / "kvgate.db")
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture
def tenancy(db: str) -> Iterator[TenancyStore]:
    store = TenancyStore(db, PEPPER)
    yield store
    store.close()
