"""The Batch API's store and runner without a model: files, batches, lines and results (``tenancy.files_store``,
``tenancy.batch_store``) on SQLite and PostgreSQL; the runner lease (one holder, taken over once expired); the input
file check (``gateway.batches.jsonl``: the first bad line named); and ``gateway.batches.runner`` driving batches to
their end with a stand-in for the line pipeline (round robin, results stored once and billed once, resume after a
runner dies, cancel, expiry, a second runner taking over)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from gateway.base.errors import APIError
from gateway.batches import runner as runner_mod
from gateway.batches.jsonl import BatchFileError, parse_batch_file
from gateway.batches.line import BATCH_PRIORITY, Line, Outcome, batch_priority, prepared_body
from gateway.batches.objects import failure_line, line_request_id, success_line
from gateway.batches.runner import BatchRunner
from gateway.batches.stored import StoredBatches
from tenancy.batch_lease import BatchLease
from tenancy.batch_store import BatchRecord, BatchStore
from tenancy.files_store import FileRecord, FileStore, Purpose
from tenancy.models import UsageRow
from tenancy.store import TenancyStore
from tests.tenancy_support import PEPPER, db, tenancy  # noqa: F401  (fixtures)

MODEL = "tiny"
CHAT = "/v1/chat/completions"



def _jsonl(n: int, url: str = CHAT, prefix: str = "", **body: Any) -> bytes:
    lines = [{"custom_id": f"{prefix}c{i}", "method": "POST", "url": url,
              "body": {"model": MODEL, "messages": [{"role": "user", "content": f"q{i}"}], **body}} for i in range(n)]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _file(fid: str, tenant: str, t: float, purpose: Purpose = "batch") -> FileRecord:
    # an input file keeps its lines' model (an adapter's name here), an output file none
    return FileRecord(fid, tenant, t, f"{fid}.jsonl", purpose, 10, 1, *((CHAT, "org/alpha:v1") if purpose == "batch"
                                                                        else (None, None)))


def _batch(bid: str, tenant: str, t: float, expires_in: float = 86400.0) -> BatchRecord:
    return BatchRecord(bid, tenant, "key_x", t, "validating", CHAT, "file-in", "24h", {"k": "v"}, t + expires_in,
                       model="org/alpha:v1")


def _usage(rid: str, tenant: str, tokens: int = 5) -> UsageRow:
    return UsageRow(rid, tenant, "key_x", MODEL, tokens, 0, tokens, "stop", 1.0, 2.0)


# ---- the input file check ------------------------------------------------------------------------

@pytest.mark.parametrize("data,line,code", [
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "tiny"}}\n{oops\n', 2,
     "invalid_file_format"),
    (_jsonl(2) + b"\n" + _jsonl(1).replace(b'"tiny"', b'"other"'), 4, "mismatched_model"),
    (_jsonl(1) + _jsonl(1, "/v1/completions").replace(b'"c0"', b'"c9"'), 2, "mismatched_url"),
    (_jsonl(1, "/v1/embeddings"), 1, "invalid_url"),
    (_jsonl(2) + _jsonl(1), 3, "duplicate_custom_id"),
    (_jsonl(1).replace(b'"POST"', b'"GET"'), 1, "invalid_file_format"),
    (_jsonl(1).replace(b'"method"', b'"extra": 1, "method"'), 1, "invalid_file_format"),
    (b"[1, 2]\n", 1, "invalid_file_format"),
    (_jsonl(1) + b"\xff\n", 2, "invalid_file_format"),
    (_jsonl(1).replace(b'"body": {', b'"body": {"x": NaN, '), 1, "invalid_file_format"),
    (_jsonl(2).replace(b'"c1"', b'"c\\u0000"'), 2, "invalid_file_format"),  # a NUL: PostgreSQL cannot store it
    (_jsonl(1).replace(b'"c0"', b'"c\\ud800"'), 1, "invalid_file_format"),  # a lone surrogate: no store can
    (b"\n  \n", None, "empty_file"),
    (_jsonl(4), 4, "too_many_requests"),
])
def test_a_bad_file_names_its_first_bad_line(data: bytes, line: int | None, code: str) -> None:
    with pytest.raises(BatchFileError) as e:
        parse_batch_file(data, MODEL, max_lines=3)
    assert (e.value.status, e.value.line, e.value.code, e.value.param) == (400, line, code, "file")
    assert (f"line {line}:" in e.value.message) == (line is not None)
    assert "q0" not in e.value.message  # never the content


def test_a_good_file() -> None:
    parsed = parse_batch_file(b"\n" + _jsonl(2, "/v1/completions") + b"\r\n", MODEL, max_lines=2)
    assert parsed.endpoint == "/v1/completions" and [(x.line, x.custom_id) for x in parsed.lines] == [(2, "c0"),
                                                                                                      (3, "c1")]


def test_a_line_body_is_never_streamed_and_runs_after_interactive_requests() -> None:
    raw = json.dumps({"model": MODEL, "stream": True, "stream_options": {"include_usage": True}, "prompt": "x"})
    assert prepared_body(raw, 100) == {"model": MODEL, "stream": False, "prompt": "x", "priority": 100}
    assert prepared_body(raw, None) == {"model": MODEL, "stream": False, "prompt": "x"}
    for given, sent in ((5, 100), (-3, 100), (250, 250), (None, 100), ("soon", "soon"), (True, True)):
        assert prepared_body(json.dumps({"priority": given}), 100)["priority"] == sent
    assert batch_priority("fcfs") is None and batch_priority("priority") == batch_priority(None) == BATCH_PRIORITY


# ---- files and batches ---------------------------------------------------------------------------

def test_files_are_per_tenant_and_paged(tenancy: TenancyStore) -> None:
    files = FileStore(tenancy.backend)
    a, b = tenancy.create_tenant("a").id, tenancy.create_tenant("b").id
    for i in range(5):
        files.put(_file(f"file-{i}", a, 100.0 + i), b"\x00bytes\xff" * (i + 1))
    files.put(_file("file-out", a, 200.0, "batch_output"), b"out")
    assert files.content(a, "file-3") == b"\x00bytes\xff" * 4 and files.get(a, "file-3") == _file("file-3", a, 103.0)
    assert files.get(b, "file-3") is None and files.content(b, "file-3") is None and not files.delete(b, "file-3")
    page, more = files.page(a, limit=2) or ([], False)
    assert [f.id for f in page] == ["file-out", "file-4"] and more
    page, more = files.page(a, limit=10, after="file-4") or ([], False)
    assert [f.id for f in page] == ["file-3", "file-2", "file-1", "file-0"] and not more
    page, _ = files.page(a, limit=10, order="asc", purpose="batch", after="file-1") or ([], False)
    assert [f.id for f in page] == ["file-2", "file-3", "file-4"]
    assert files.page(a, limit=1, after="file-nope") is None and files.page(b, limit=1, after="file-1") is None
    for odd in ("file-\x00", "x" * 200, ""):
        assert files.get(a, odd) is None and not files.delete(a, odd)
    assert files.delete(a, "file-0") and not files.delete(a, "file-0") and files.count(a) == 5
    tenancy.delete_tenant("a")
    assert files.count() == 0


def test_a_batch_from_start_to_finish(tenancy: TenancyStore) -> None:
    store = BatchStore(tenancy.backend)
    t = tenancy.create_tenant("t").id
    store.create(_batch("batch_1", t, 10.0))
    assert store.get(t, "batch_1") == _batch("batch_1", t, 10.0) and store.get("other", "batch_1") is None
    assert [b.id for b in store.active()] == ["batch_1"]
    assert store.start("batch_1", [(1, "a", "{}"), (3, "b", "{}"), (4, "c", "{}")], 11.0)
    assert not store.start("batch_1", [(1, "a", "{}")], 11.0)  # no longer validating: nothing written
    assert [p.line for p in store.pending("batch_1", 0, 10)] == [1, 3, 4]
    assert [p.line for p in store.pending("batch_1", 1, 1)] == [3]
    assert store.mark_attempt("batch_1", 3, 12.0) and store.pending("batch_1", 1, 1)[0].attempts == 1
    store.unmark_attempt("batch_1", 3)
    assert store.pending("batch_1", 1, 1)[0].attempts == 0
    assert store.put_result("batch_1", 3, "r3", True, _usage(line_request_id("batch_1", 3), t))
    assert not store.put_result("batch_1", 3, "again", True, _usage(line_request_id("batch_1", 3), t, 50))
    assert not store.mark_attempt("batch_1", 3, 13.0)  # a line with a result is never run again
    assert store.put_result("batch_1", 1, "r1", False, None)
    b = store.get(t, "batch_1")
    assert b is not None and (b.status, b.total, b.completed, b.failed, b.prompt_tokens) == ("in_progress", 3, 1, 1, 5)
    assert [u.request_id for u in tenancy.usage_rows("t")] == ["batch_req_1_3"]  # billed once
    assert store.count_pending("batch_1") == 1
    assert [(r.line, r.result, r.ok) for r in store.results("batch_1")] == [(1, "r1", False), (3, "r3", True),
                                                                            (4, None, None)]
    assert store.set_finalizing("batch_1", 14.0) and not store.set_finalizing("batch_1", 14.0)
    out = (_file("file-out", t, 15.0, "batch_output"), b"r3\n")
    assert not store.finish("batch_1", "in_progress", "completed", 15.0, out, None)  # stale: nothing written
    assert store.finish("batch_1", "finalizing", "completed", 15.0, out, None)
    b = store.get(t, "batch_1")
    assert b is not None and (b.status, b.completed_at, b.output_file_id, b.error_file_id) == (
        "completed", 15.0, "file-out", None)
    assert FileStore(tenancy.backend).content(t, "file-out") == b"r3\n"
    assert store.results("batch_1") == [] and store.active() == []
    assert not store.put_result("batch_1", 4, "late", True, _usage("late", t))  # its lines are gone
    assert [u.request_id for u in tenancy.usage_rows("t")] == ["batch_req_1_3"]


def test_cancel_fail_and_paging(tenancy: TenancyStore) -> None:
    store = BatchStore(tenancy.backend)
    t = tenancy.create_tenant("t").id
    for i in range(4):
        store.create(_batch(f"batch_{i}", t, 10.0 + i))
    assert store.fail("batch_0", [{"code": "x", "message": "m", "line": 3, "param": None}], 20.0)
    failed = store.get(t, "batch_0")
    assert failed is not None and failed.status == "failed" and failed.errors == [
        {"code": "x", "message": "m", "line": 3, "param": None}]
    cancelled = store.cancel(t, "batch_1", 21.0)
    assert cancelled is not None and (cancelled.status, cancelled.cancelling_at) == ("cancelling", 21.0)
    assert store.cancel(t, "batch_0", 22.0).status == "failed"  # type: ignore[union-attr]  # not cancellable
    assert store.cancel("other", "batch_2", 22.0) is None and store.cancel(t, "batch_\x00", 22.0) is None
    page, more = store.page(t, limit=3) or ([], False)
    assert [b.id for b in page] == ["batch_3", "batch_2", "batch_1"] and more
    assert [b.id for b in (store.page(t, limit=3, after="batch_1") or ([], False))[0]] == ["batch_0"]
    assert store.page("other", limit=3, after="batch_1") is None


def test_the_lease_has_one_holder(tenancy: TenancyStore) -> None:
    now = [1000.0]
    a = BatchLease(tenancy.backend, "a", 10.0, clock=lambda: now[0])
    b = BatchLease(tenancy.backend, "b", 10.0, clock=lambda: now[0])
    assert a.current() is None and a.acquire() and not b.acquire() and a.acquire()
    now[0] += 9.0
    assert not b.acquire() and a.current() == ("a", 1010.0)  # renewed at 1000
    now[0] += 2.0  # a did not renew in time
    assert b.acquire() and not a.acquire() and b.current() == ("b", 1021.0)
    b.release()
    assert a.acquire()
    with pytest.raises(ValueError):
        BatchLease(tenancy.backend, "c", 0.0)


def test_a_renewal_never_revives_a_released_lease(tenancy: TenancyStore) -> None:
    now = [1000.0]
    a = BatchLease(tenancy.backend, "a", 10.0, clock=lambda: now[0])
    b = BatchLease(tenancy.backend, "b", 10.0, clock=lambda: now[0])
    assert not a.renew()  # nothing to renew before it was taken
    assert a.acquire() and a.renew() and a.current() == ("a", 1010.0)
    now[0] += 15.0  # past its expiry, but nobody took it: still a's to extend
    assert a.renew() and a.current() == ("a", 1025.0) and not b.acquire()
    a.release()
    assert not a.renew() and a.current() == ("a", 0.0)  # a renewal landing after the release (it was abandoned)
    assert b.acquire() and not a.renew() and b.current() == ("b", 1025.0)  # and never one taken over


# ---- the runner, with a stand-in for the line pipeline -------------------------------------------

class FakeLines:
    """Answers each line after ``delay`` (chat completions of its custom_id), or fails the ones in ``bad``."""

    def __init__(self, tenant_id: str, delay: float = 0.0, bad: frozenset[str] = frozenset()) -> None:
        self.tenant_id, self.delay, self.bad = tenant_id, delay, bad
        self.ran: list[str] = []
        self.concurrent = self.peak = 0

    async def run(self, principal: Any, endpoint: str, line: Line, marks: Any) -> Outcome | None:
        if not await marks.mark():
            return None
        self.ran.append(line.custom_id)
        self.concurrent += 1
        self.peak = max(self.peak, self.concurrent)
        try:
            await trio.sleep(self.delay)
        finally:
            self.concurrent -= 1
        if line.custom_id in self.bad:
            err = APIError(400, "bad body", code="invalid_request")
            return Outcome(failure_line(line.request_id, line.custom_id, err), False, None, 400)
        usage = UsageRow(line.request_id, self.tenant_id, "key_x", MODEL, 3, 0, 2, "stop", 1.0, 2.0)
        return Outcome(success_line(line.request_id, line.custom_id, {"answer": line.custom_id}), True, usage, 200)


async def _principal(tenant_id: str, key_id: str) -> Any:
    return object()


def _runner(stored: StoredBatches, lines: FakeLines, in_flight: int = 4,
            draining: list[bool] | None = None) -> BatchRunner:
    flag = draining or [False]
    return BatchRunner(stored, lines, _principal, model=MODEL, max_file_lines=100,  # type: ignore[arg-type]
                       in_flight=in_flight, draining=lambda: flag[0])


def _setup(tenancy: TenancyStore, holder: str, batches: dict[str, int]) -> tuple[StoredBatches, str]:
    t = tenancy.create_tenant("t").id if tenancy.find_tenant("t") is None else tenancy.get_tenant("t").id
    stored = StoredBatches(tenancy.backend, holder, 2.0)
    for i, (bid, n) in enumerate(batches.items()):
        fid = f"file-{bid}"
        stored.files.put(FileRecord(fid, t, 1.0 + i, "in.jsonl", "batch", 1, n, CHAT), _jsonl(n, prefix=f"{bid}-"))
        stored.batches.create(BatchRecord(bid, t, "key_x", 1.0 + i, "validating", CHAT, fid, "24h", None,
                                          time.time() + 3600))
    return stored, t


async def _until(stored: StoredBatches, t: str, bid: str, status: str, within: float = 20.0) -> BatchRecord:
    with trio.fail_after(within):
        while True:
            b = stored.batches.get(t, bid)
            if b is not None and b.status == status:
                return b
            await trio.sleep(0.05)


@pytest.fixture
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner_mod, "POLL_S", 0.05)
    monkeypatch.setattr(runner_mod, "LEASE_RENEW_S", 0.2)
    monkeypatch.setattr(runner_mod, "LEASE_TTL_S", 2.0)


@pytest.mark.trio
@pytest.mark.usefixtures("fast")
async def test_the_runner_completes_batches_round_robin(tmp_path: Path) -> None:
    tenancy = TenancyStore(tmp_path / "kvgate.db", PEPPER)
    stored, t = _setup(tenancy, "one", {"batch_big": 12, "batch_small": 2})
    lines = FakeLines(t, delay=0.02, bad=frozenset({"batch_big-c3"}))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_runner(stored, lines).run)
        big = await _until(stored, t, "batch_big", "completed")
        small = await _until(stored, t, "batch_small", "completed")
        nursery.cancel_scope.cancel()
    assert lines.peak <= 4 and lines.ran.index("batch_small-c1") < 8  # the small batch did not wait for the big one
    assert (big.total, big.completed, big.failed, big.prompt_tokens) == (12, 11, 1, 33)
    out = stored.files.content(t, big.output_file_id or "")
    errors = stored.files.content(t, big.error_file_id or "")
    assert out is not None and errors is not None
    ids = [json.loads(x)["custom_id"] for x in out.decode().splitlines()]
    assert sorted(ids) == sorted(f"batch_big-c{i}" for i in range(12) if i != 3) and len(set(ids)) == 11
    assert [json.loads(x)["custom_id"] for x in errors.decode().splitlines()] == ["batch_big-c3"]
    assert small.error_file_id is None and stored.lease.current()[0] == "one"  # type: ignore[index]
    assert len(tenancy.usage_rows("t")) == 13  # the failed line ran nothing on a worker: not billed
    tenancy.close()


@pytest.mark.trio
@pytest.mark.usefixtures("fast")
async def test_a_second_runner_resumes_after_the_first_dies(tmp_path: Path) -> None:
    tenancy = TenancyStore(tmp_path / "kvgate.db", PEPPER)
    stored, t = _setup(tenancy, "first", {"batch_r": 10})
    slow = FakeLines(t, delay=0.3)
    async with trio.open_nursery() as nursery:  # the first runner "dies" (is cancelled) mid-batch
        nursery.start_soon(_runner(stored, slow, in_flight=2).run)
        with trio.fail_after(20):
            while stored.batches.get(t, "batch_r").completed < 3:  # type: ignore[union-attr]
                await trio.sleep(0.02)
        nursery.cancel_scope.cancel()
    # The first gave its lease up on the way out (a killed one's expires after the ttl instead).
    second = StoredBatches(tenancy.backend, "second", 2.0)
    quick = FakeLines(t)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_runner(second, quick).run)
        done = await _until(second, t, "batch_r", "completed")
        nursery.cancel_scope.cancel()
    out = second.files.content(t, done.output_file_id or "") or b""
    ids = [json.loads(x)["custom_id"] for x in out.decode().splitlines()]
    assert sorted(ids) == sorted(f"batch_r-c{i}" for i in range(10))  # every line exactly once
    assert set(slow.ran) | set(quick.ran) == set(ids) and len(quick.ran) < 10  # the second did not start over
    assert len(tenancy.usage_rows("t")) == 10  # lines cut off in the first runner were billed only once
    tenancy.close()


@pytest.mark.trio
@pytest.mark.usefixtures("fast")
async def test_cancel_lets_lines_in_flight_finish_and_expiry_fails_the_rest(tmp_path: Path) -> None:
    tenancy = TenancyStore(tmp_path / "kvgate.db", PEPPER)
    stored, t = _setup(tenancy, "one", {"batch_c": 6, "batch_e": 3})
    lines = FakeLines(t, delay=0.4)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_runner(stored, lines, in_flight=2).run)
        await _until(stored, t, "batch_c", "in_progress")
        with trio.fail_after(10):
            while not lines.ran:
                await trio.sleep(0.01)
        stored.batches.cancel(t, "batch_c", time.time())
        cancelled = await _until(stored, t, "batch_c", "cancelled")
        with tenancy.backend.write() as tx:  # batch_e's window closes now
            tx.execute("UPDATE batches SET expires_at = ? WHERE id = 'batch_e'", (time.time(),))
        expired = await _until(stored, t, "batch_e", "expired")
        nursery.cancel_scope.cancel()
    assert cancelled.completed >= 1 and cancelled.completed + cancelled.failed < 6 and cancelled.total == 6
    assert cancelled.cancelled_at is not None and cancelled.error_file_id is None
    errors = (stored.files.content(t, expired.error_file_id or "") or b"").decode().splitlines()
    assert expired.completed + expired.failed == 3 and len(errors) == expired.failed >= 1
    assert all(json.loads(e)["error"]["code"] == "batch_expired" for e in errors)
    tenancy.close()


@pytest.mark.trio
@pytest.mark.usefixtures("fast")
async def test_a_draining_runner_finishes_its_lines_and_hands_over(tmp_path: Path) -> None:
    tenancy = TenancyStore(tmp_path / "kvgate.db", PEPPER)
    stored, t = _setup(tenancy, "one", {"batch_d": 8})
    draining = [False]
    lines = FakeLines(t, delay=0.2)
    first = _runner(stored, lines, in_flight=2, draining=draining)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(first.run)
        with trio.fail_after(10):
            while first.in_flight < 2:
                await trio.sleep(0.01)
        draining[0] = True
        with trio.fail_after(10):
            while first.leading:
                await trio.sleep(0.01)
        b = stored.batches.get(t, "batch_d")
        assert b is not None and b.completed >= 2 and first.in_flight == 0  # what it started, it finished
        other = StoredBatches(tenancy.backend, "two", 2.0)
        assert await other.acquire_lease()  # released: taken over at once, not after the ttl
        nursery.cancel_scope.cancel()
    tenancy.close()


@pytest.mark.trio
@pytest.mark.usefixtures("fast")
async def test_a_runner_stops_leading_only_once_its_lease_is_released(tmp_path: Path) -> None:
    tenancy = TenancyStore(tmp_path / "kvgate.db", PEPPER)
    stored, t = _setup(tenancy, "one", {"batch_s": 2})
    release = stored.lease.release

    def slow_release() -> None:  # a loaded database: the release commits well after the runner asked for it
        time.sleep(0.5)
        release()

    stored.lease.release = slow_release  # type: ignore[method-assign]
    draining = [False]
    first = _runner(stored, FakeLines(t, delay=0.05), draining=draining)
    other = StoredBatches(tenancy.backend, "two", 2.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(first.run)
        await _until(stored, t, "batch_s", "completed")
        draining[0] = True
        with trio.fail_after(10):
            while first.leading:
                await trio.sleep(0.01)
        assert await other.acquire_lease()  # not leading means released: the next gateway takes over at once
        nursery.cancel_scope.cancel()
    tenancy.close()
