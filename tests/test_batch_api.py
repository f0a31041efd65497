"""OpenAI's Batch API over HTTP (``kvgate serve`` on the tiny model) with the official ``openai`` SDK: upload, create,
poll, read the output file (every custom_id answered once, counts and usage right, the ledger billed per line);
bad input files refused naming the line; an oversized file; a body its route refuses landing in the error file;
tenant isolation; cancel; and a gateway SIGKILLed mid-batch whose successor, on the same store, finishes it with
every custom_id exactly once. The store and the runner alone: tests/test_batch_store.py."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types import FileObject

from tests.tenancy_support import make_tenant, store_of
from tests.test_gateway_support import MODEL, Server, start_server, wait_batch

pytestmark = pytest.mark.timeout(300)
MAX_FILE_BYTES = 20_000
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Steps held 2 ms, so a cancelled batch still has lines left when its cancel is seen."""
    srv = start_server(tiny_model_dir, tmp_path_factory.mktemp("batches") / "gateway.log",
                       "--max-file-bytes", str(MAX_FILE_BYTES), env={"KVGATE_DEBUG_STEP_DELAY": "0.002"})
    yield srv
    srv.stop()
    assert "Traceback" not in srv.log()


def _client(server: Server, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key or server.api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with _client(server) as c:
        yield c  # closed after: an idle keep-alive connection holds a gateway's graceful shutdown for 5 s


def _line(i: int, url: str = CHAT, prefix: str = "req", max_tokens: int = 3, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, **extra}
    if url == CHAT:
        body["messages"] = [{"role": "user", "content": f"question {i}"}]
    else:
        body["prompt"] = f"prompt {i}"
    return {"custom_id": f"{prefix}-{i}", "method": "POST", "url": url, "body": body}


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _output(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_a_chat_batch_end_to_end(client: openai.OpenAI, server: Server) -> None:
    data = _jsonl([_line(i) for i in range(6)])
    uploaded = client.files.create(file=("questions.jsonl", data), purpose="batch")
    assert isinstance(uploaded, FileObject) and uploaded.id.startswith("file-") and uploaded.object == "file"
    assert (uploaded.bytes, uploaded.filename, uploaded.purpose, uploaded.status) == (len(data), "questions.jsonl",
                                                                                      "batch", "processed")
    assert client.files.retrieve(uploaded.id) == uploaded and client.files.content(uploaded.id).content == data
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h",
                                  metadata={"run": "e2e"})
    assert batch.id.startswith("batch_") and batch.status == "validating" and batch.metadata == {"run": "e2e"}
    assert batch.expires_at == batch.created_at + 86400
    done = wait_batch(client, batch.id)
    assert done.status == "completed" and done.error_file_id is None and done.errors is None
    assert done.request_counts is not None and done.request_counts.model_dump() == {"total": 6, "completed": 6,
                                                                                    "failed": 0}
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.model == MODEL
    lines = _output(client, done.output_file_id)
    assert sorted(line["custom_id"] for line in lines) == [f"req-{i}" for i in range(6)]
    for line in lines:
        assert line["error"] is None and line["id"].startswith("batch_req_")
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"] == line["id"]
        body = response["body"]
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        assert body["usage"]["completion_tokens"] == 3 and body["choices"][0]["finish_reason"] == "length"
    assert done.usage is not None and done.usage.output_tokens == 18
    assert done.usage.input_tokens == sum(line["response"]["body"]["usage"]["prompt_tokens"] for line in lines)
    output = client.files.retrieve(done.output_file_id or "")
    assert output.purpose == "batch_output" and output.filename == f"{batch.id}_output.jsonl"
    with store_of(server) as store:  # one ledger row per line, under the line's id
        rows = {r.request_id: r for r in store.usage_rows("demo") if r.request_id.startswith("batch_req_")}
    for line in lines:
        row = rows[line["id"]]
        usage = line["response"]["body"]["usage"]
        assert (row.prompt_tokens, row.completion_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert batch.id in [b.id for b in client.batches.list()]
    assert {uploaded.id, output.id} <= {f.id for f in client.files.list()}


def test_a_completions_batch_with_a_refused_body(client: openai.OpenAI) -> None:
    lines = [_line(0, COMPLETIONS, "c"), _line(1, COMPLETIONS, "c", temperature="hot"), _line(2, COMPLETIONS, "c")]
    uploaded = client.files.create(file=("c.jsonl", _jsonl(lines)), purpose="batch")
    done = wait_batch(client, client.batches.create(input_file_id=uploaded.id, endpoint=COMPLETIONS,
                                               completion_window="24h").id)
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    assert {line["custom_id"] for line in _output(client, done.output_file_id)} == {"c-0", "c-2"}
    assert all(line["response"]["body"]["object"] == "text_completion"
               for line in _output(client, done.output_file_id))
    [error] = _output(client, done.error_file_id)
    assert error["custom_id"] == "c-1" and error["error"]["code"] == "invalid_request"
    assert error["response"]["status_code"] == 400 and error["response"]["body"]["error"]["param"] == "temperature"


def _bad(lines: list[dict[str, Any]], index: int, **change: Any) -> bytes:
    changed = [dict(line) for line in lines]
    changed[index] = {**changed[index], **change}
    return _jsonl(changed)


GOOD = [_line(i) for i in range(4)]


@pytest.mark.parametrize("data,line,code", [
    (_jsonl(GOOD[:1]) + b'{"custom_id": "x",\n' + _jsonl(GOOD[1:]), 2, "invalid_file_format"),
    (_bad(GOOD, 2, body={**GOOD[2]["body"], "model": "gpt-4o"}), 3, "mismatched_model"),  # line 3 names another model
    (_bad(GOOD, 1, url="/v1/embeddings"), 2, "invalid_url"),
    (_bad(GOOD, 3, url=COMPLETIONS), 4, "mismatched_url"),
    (_bad(GOOD, 3, custom_id="req-1"), 4, "duplicate_custom_id"),
    (_bad(GOOD, 0, method="GET"), 1, "invalid_file_format"),
])
def test_a_bad_file_is_refused_naming_its_line(client: openai.OpenAI, data: bytes, line: int, code: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("bad.jsonl", data), purpose="batch")
    assert e.value.code == code and e.value.param == "file" and f"line {line}:" in e.value.message


def test_upload_refusals(client: openai.OpenAI, server: Server) -> None:
    with pytest.raises(openai.APIStatusError) as e:  # past --max-file-bytes
        client.files.create(file=("big.jsonl", _jsonl([_line(i) for i in range(200)])), purpose="batch")
    assert e.value.status_code == 413 and e.value.code == "file_too_large"
    with pytest.raises(openai.APIStatusError) as e:  # past the upload's whole body limit: refused before parsing
        client.files.create(file=("huge.jsonl", b"x" * (MAX_FILE_BYTES + 70_000)), purpose="batch")
    assert e.value.status_code == 413
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("a.jsonl", _jsonl(GOOD)), purpose="fine-tune")
    assert e.value.param == "purpose"
    r = httpx.post(f"{server.url}/v1/files", headers=server.headers, json={"purpose": "batch"}, timeout=30)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    uploaded = client.files.create(file=("a.jsonl", _jsonl(GOOD)), purpose="batch")
    for kwargs, param in (({"endpoint": COMPLETIONS}, "endpoint"), ({"completion_window": "1h"}, "completion_window"),
                          ({"input_file_id": "file-nope"}, "input_file_id")):
        args: dict[str, Any] = {"input_file_id": uploaded.id, "endpoint": CHAT, "completion_window": "24h", **kwargs}
        with pytest.raises(openai.APIStatusError) as e:
            client.batches.create(**args)
        assert e.value.status_code in (400, 404) and e.value.body["param"] == param  # type: ignore[index]
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_another_tenant_sees_nothing(client: openai.OpenAI, server: Server) -> None:
    uploaded = client.files.create(file=("mine.jsonl", _jsonl(GOOD[:2])), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    _, key = make_tenant(server, "batches-other")
    other = _client(server, key)
    for call in (lambda: other.files.retrieve(uploaded.id), lambda: other.files.content(uploaded.id),
                 lambda: other.files.delete(uploaded.id), lambda: other.batches.retrieve(batch.id),
                 lambda: other.batches.cancel(batch.id),
                 lambda: other.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert other.files.list().data == [] and other.batches.list().data == []
    assert wait_batch(client, batch.id).status == "completed"  # the owner's batch ran regardless


def test_cancel(client: openai.OpenAI) -> None:
    data = _jsonl([_line(i, max_tokens=200) for i in range(40)])
    batch = client.batches.create(input_file_id=client.files.create(file=("long.jsonl", data), purpose="batch").id,
                                  endpoint=CHAT, completion_window="24h")
    wait_batch(client, batch.id, until=("in_progress",), within=30)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    done = wait_batch(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None and done.request_counts is not None
    assert done.request_counts.total == 40 and done.request_counts.completed < 40
    if done.request_counts.completed:  # the lines that were in flight finished and are in the output
        assert len(_output(client, done.output_file_id)) == done.request_counts.completed
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(wait_batch(client, client.batches.create(
            input_file_id=client.files.create(file=("one.jsonl", _jsonl(GOOD[:1])), purpose="batch").id,
            endpoint=CHAT, completion_window="24h").id).id)


def test_workers_under_fcfs_get_no_priority(fcfs_server: Server) -> None:
    """fcfs workers refuse any priority but 0: a gateway that starts them so sends its batch lines without one."""
    client = _client(fcfs_server)
    with pytest.raises(openai.BadRequestError):  # what a batch line at priority 100 would get
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                       extra_body={"priority": 100})
    uploaded = client.files.create(file=("f.jsonl", _jsonl(GOOD[:2])), purpose="batch")
    done = wait_batch(client, client.batches.create(input_file_id=uploaded.id, endpoint=CHAT,
                                               completion_window="24h").id)
    assert done.request_counts is not None and done.request_counts.model_dump() == {"total": 2, "completed": 2,
                                                                                    "failed": 0}


@pytest.mark.timeout(420)
def test_a_killed_gateway_s_batch_is_finished_by_the_next(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SIGKILL mid-batch (lines in flight, their results unstored); a new gateway on the same store takes the lease
    once it expires and runs what has no result: every custom_id exactly once, every line billed once."""
    env = {"KVGATE_DEBUG_STEP_DELAY": "0.02"}
    first = start_server(tiny_model_dir, tmp_path / "a.log", "--batch-lines-in-flight", "2", env=env)
    n = 12
    try:
        client = _client(first)
        uploaded = client.files.create(file=("r.jsonl", _jsonl([_line(i, max_tokens=12) for i in range(n)])),
                                       purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
        deadline = time.monotonic() + 120
        with store_of(first) as store:
            while True:  # some lines stored, one started within the last 0.1 s (>= 0.24 s of its 12 steps left)
                counts = client.batches.retrieve(batch.id).request_counts
                # The lines run in lockstep pairs: right after a pair's results are stored, none may be in flight
                # until the next pair is marked, so a kill timed by the counts alone could find nothing cut.
                fresh = store.backend.read("SELECT COUNT(*) FROM batch_lines WHERE batch_id = ? AND attempts > 0 AND "
                                           "result IS NULL AND attempted_at > ?", (batch.id, time.time() - 0.1))[0][0]
                if counts is not None and counts.completed >= 3 and fresh >= 1:
                    break
                assert time.monotonic() < deadline, counts
                time.sleep(0.02)
    finally:
        first.proc.kill()
        first.proc.wait(10)
    assert counts.completed < n  # the kill came mid-batch
    with store_of(first) as store:  # lines it had submitted and not stored: attempted, no result
        cut = store.backend.read("SELECT COUNT(*) FROM batch_lines WHERE batch_id = ? AND attempts > 0 AND "
                                 "result IS NULL", (batch.id,))[0][0]
    assert cut >= 1
    second = start_server(tiny_model_dir, tmp_path / "b.log", "--batch-lines-in-flight", "2", env=env,
                          db_path=first.db_path, secret=first.secret)
    try:
        client = _client(second, first.api_key)
        done = wait_batch(client, batch.id, within=180)
        assert done.status == "completed" and done.request_counts is not None
        assert done.request_counts.model_dump() == {"total": n, "completed": n, "failed": 0}
        lines = _output(client, done.output_file_id)
        assert sorted(line["custom_id"] for line in lines) == sorted(f"req-{i}" for i in range(n))
        with store_of(second) as store:
            billed = [r for r in store.usage_rows("demo") if r.request_id.startswith("batch_req_")]
        assert sorted(r.request_id for r in billed) == sorted(line["id"] for line in lines)
        assert done.usage is not None and sum(r.completion_tokens for r in billed) == done.usage.output_tokens == 12 * n
    finally:
        second.stop()
    assert "Traceback" not in second.log()


@pytest.mark.timeout(420)
def test_two_gateways_on_one_postgresql_run_each_batch_once(tiny_model_dir: Path, tmp_path: Path,
                                                            postgres_url: str) -> None:
    """One of them leads (it alone runs lines); a batch created on either completes; once the leader is killed
    the other takes the lease over and runs the next batch."""
    a = start_server(tiny_model_dir, tmp_path / "a.log", db_path=postgres_url)  # type: ignore[arg-type]
    b = start_server(tiny_model_dir, tmp_path / "b.log", "--no-demo-tenant",
                     db_path=postgres_url, secret=a.secret)  # type: ignore[arg-type]
    servers = {"a": a, "b": b}
    try:
        data = _jsonl([_line(i) for i in range(4)])
        client_b = _client(b, a.api_key)
        batch = client_b.batches.create(input_file_id=client_b.files.create(file=("x.jsonl", data),
                                                                            purpose="batch").id,
                                        endpoint=CHAT, completion_window="24h")
        done = wait_batch(_client(a), batch.id)  # either gateway answers for it
        assert done.status == "completed" and done.request_counts is not None and done.request_counts.completed == 4
        ran = {name: s.log().count('"request_id":"batch_req_') for name, s in servers.items()}
        leaders = [name for name, s in servers.items() if "batch_runner_leading" in s.log()]
        assert len(leaders) == 1 and ran[leaders[0]] == 4 and sum(ran.values()) == 4, (leaders, ran)
        leader, other = servers[leaders[0]], servers["b" if leaders[0] == "a" else "a"]
        leader.proc.kill()
        leader.proc.wait(10)
        client = _client(other, a.api_key)
        again = client.batches.create(input_file_id=client.files.create(file=("y.jsonl", data), purpose="batch").id,
                                      endpoint=CHAT, completion_window="24h")
        assert wait_batch(client, again.id, within=60).status == "completed"
        assert "batch_runner_leading" in other.log()
    finally:
        for s in servers.values():
            s.stop()
    assert "Traceback" not in a.log() + b.log()


def test_an_upload_over_64_kib_of_jsonl_is_read_whole() -> None:
    """werkzeug's multipart decoder bounds its buffer (a 64 KiB read plus the tail it keeps back at a line break)
    by max_form_memory_size; at 64 KiB a JSONL file was refused ("too large a field") whenever a read ended just
    after a line break: 1.1 MB of batch lines failed every time. Unit-level: the gateway's own form reader."""
    from gateway.api.files_routes import _read_form

    data = _jsonl([_line(i, max_tokens=48, prefix="long-custom-id-to-vary-the-offsets") for i in range(12_000)])
    request = httpx.Request("POST", "http://gateway/v1/files", data={"purpose": "batch"},
                            files={"file": ("big.jsonl", data, "application/jsonl")})
    purpose, upload = _read_form(request.read(), request.headers["content-type"])
    assert purpose == "batch" and upload is not None and upload[1] == data
