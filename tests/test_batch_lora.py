"""Issue 25, the Batch API with LoRA adapters (``kvgate serve --lora-dir``, a CPU worker on the tiny model): a batch
whose lines name a tenant's adapter answers each line as the same request sent interactively with that adapter
(greedy), names the adapter in its responses and its ledger rows; a batch naming another tenant's adapter fails
validation exactly as one naming no model at all; a file naming two models is refused at upload; an adapter
unregistered mid-batch fails the lines that run after (404 in the error file) and the batch completes. The file
check alone: the first test. The Batch API on the base model: tests/test_batch_api.py."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import httpx
import openai
import pytest

from gateway.batches.jsonl import BatchFileError, parse_batch_file
from tenancy.models import Quota
from tests.lora_support import ATTN, make_adapter
from tests.tenancy_support import make_tenant, store_of
from tests.test_gateway_support import MODEL, Server, start_server, wait_batch

pytestmark = pytest.mark.timeout(300)
COMPLETIONS: Final = "/v1/completions"
PROMPTS = [[5, 17, 230, 41, 7, 99, 1200, 3], [11, 12, 13, 14], [300, 2, 301, 4, 302, 6]]
N = 8


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One line at a time, each step held 5 ms: an adapter unregistered mid-batch still has lines after it."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(tiny_model_dir)).eval()  # type: ignore[no-untyped-call]
    loras = tmp_path_factory.mktemp("batch-loras") / "adapters"
    make_adapter(hf, loras / "alpha", ATTN, seed=6)
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("batch-lora") / "gateway.log", "--lora-dir",
                     str(loras), "--quantization", "none", "--max-loras", "2", "--batch-lines-in-flight", "1",
                     env={"KVGATE_DEBUG_STEP_DELAY": "0.005"})
    yield s
    s.stop()
    assert "Traceback" not in s.log()


@pytest.fixture(scope="module")
def tenants(srv: Server) -> dict[str, tuple[str, str]]:
    """Two tenants; "alpha-a" is ten-a's adapter."""
    found = {name: make_tenant(srv, name) for name in ("ten-a", "ten-b")}
    assert _load(srv, "alpha-a", tenant="ten-a").status_code == 200
    return found


def _load(srv: Server, name: str, tenant: str | None = None) -> httpx.Response:
    body = {"lora_name": name, "lora_path": "alpha", **({"tenant": tenant} if tenant else {})}
    return httpx.post(f"{srv.url}/v1/load_lora_adapter", json=body, headers=srv.admin_headers, timeout=30)


def _client(srv: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=60)


def _body(model: str, prompt: list[int], max_tokens: int = N) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def _jsonl(bodies: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps({"custom_id": f"r-{i}", "method": "POST", "url": COMPLETIONS, "body": b}) + "\n"
                   for i, b in enumerate(bodies)).encode()


def _run(client: openai.OpenAI, bodies: list[dict[str, Any]]) -> str:
    uploaded = client.files.create(file=("in.jsonl", _jsonl(bodies)), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint=COMPLETIONS, completion_window="24h").id


def _lines(client: openai.OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    assert file_id is not None
    return {line["custom_id"]: line for line in map(json.loads, client.files.content(file_id).text.splitlines())}


def test_a_file_names_one_model_any_adapter_s_name_included() -> None:
    parsed = parse_batch_file(_jsonl([_body("org/alpha-a", p) for p in PROMPTS]), MODEL, 10)
    assert parsed.model == "org/alpha-a" and len(parsed.lines) == 3
    assert parse_batch_file(_jsonl([_body(MODEL, p) for p in PROMPTS]), MODEL, 10).model == MODEL
    for models, line, code in (([MODEL, "alpha-a"], 2, "mismatched_model"), (["a", "a", "b"], 3, "mismatched_model"),
                               (["alpha a"], 1, "model_not_found"),  # no adapter can be named so
                               ([7], 1, "model_not_found")):
        with pytest.raises(BatchFileError) as e:
            parse_batch_file(_jsonl([_body(m, PROMPTS[0]) for m in models]), MODEL, 10)  # type: ignore[arg-type]
        assert (e.value.line, e.value.code) == (line, code)


def test_a_batch_on_an_adapter_answers_as_its_requests_and_bills_the_adapter(
        srv: Server, tenants: dict[str, tuple[str, str]]) -> None:
    a_id, a_key = tenants["ten-a"]
    with _client(srv, a_key) as client:
        done = wait_batch(client, _run(client, [_body("alpha-a", p) for p in PROMPTS]))
        assert done.status == "completed" and done.request_counts is not None
        assert done.request_counts.model_dump() == {"total": 3, "completed": 3, "failed": 0}
        lines = _lines(client, done.output_file_id)
    base_differs = False
    for i, prompt in enumerate(PROMPTS):
        body = lines[f"r-{i}"]["response"]["body"]
        tuned = httpx.post(f"{srv.url}/v1/completions", json=_body("alpha-a", prompt), timeout=60,
                           headers={"Authorization": f"Bearer {a_key}"}).json()
        base = httpx.post(f"{srv.url}/v1/completions", json=_body(MODEL, prompt), timeout=60,
                          headers={"Authorization": f"Bearer {a_key}"}).json()
        assert body["model"] == tuned["model"] == "alpha-a"
        assert body["choices"][0]["text"] == tuned["choices"][0]["text"] and body["usage"] == tuned["usage"]
        base_differs |= base["choices"][0]["text"] != tuned["choices"][0]["text"]
    assert base_differs  # the adapter changes the answers, or the equality above proves nothing
    with store_of(srv) as store:  # the ledger names the adapter for every line, the base model as the model
        rows = {r.request_id: r for r in store.usage_rows(a_id)}
    assert {(rows[line["id"]].adapter, rows[line["id"]].model) for line in lines.values()} == {("alpha-a", MODEL)}


def test_another_tenant_s_adapter_fails_validation_as_a_name_nobody_registered(
        srv: Server, tenants: dict[str, tuple[str, str]]) -> None:
    with _client(srv, tenants["ten-b"][1]) as client:
        errors = {}
        for name in ("alpha-a", "alpha-nobody"):  # uploaded fine: the name is only resolved when the batch starts
            done = wait_batch(client, _run(client, [_body(name, p) for p in PROMPTS]))
            assert done.status == "failed" and done.errors is not None and done.errors.data is not None
            [error] = done.errors.data
            errors[name] = (error.code, error.line, error.message and error.message.replace(name, "NAME"))
    assert errors["alpha-a"] == errors["alpha-nobody"] == ("model_not_found", 1, "The model `NAME` does not exist.")


def test_a_key_allowed_only_an_adapter_runs_a_batch_for_it(srv: Server, tenants: dict[str, tuple[str, str]]) -> None:
    # The key's model allowlist is checked against the model the file names, not the served one: a key allowed
    # only its tenant's adapter uploads and runs a file for that adapter, is refused one for the base model, and
    # the batch object names the adapter (before: 403 at upload, and "model" the served model).
    with store_of(srv) as store:
        key_id, key = store.create_key("ten-a", "adapter-only")
        store.set_quota("ten-a", Quota(allowed_models=("alpha-a",)), key_id=key_id)
    with _client(srv, key) as client:
        done = wait_batch(client, _run(client, [_body("alpha-a", PROMPTS[0])]))
        assert done.status == "completed" and done.model == "alpha-a"
        assert client.batches.retrieve(done.id).model == "alpha-a"
        assert [b.model for b in client.batches.list() if b.id == done.id] == ["alpha-a"]
        with pytest.raises(openai.PermissionDeniedError) as e:
            client.files.create(file=("base.jsonl", _jsonl([_body(MODEL, PROMPTS[0])])), purpose="batch")
    assert e.value.code == "model_not_allowed" and e.value.param == "file" and MODEL in e.value.message


def test_a_file_naming_two_models_is_refused_at_upload(srv: Server, tenants: dict[str, tuple[str, str]]) -> None:
    with _client(srv, tenants["ten-a"][1]) as client, pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("mixed.jsonl", _jsonl([_body("alpha-a", PROMPTS[0]), _body(MODEL, PROMPTS[1])])),
                            purpose="batch")
    assert e.value.code == "mismatched_model" and e.value.param == "file" and "line 2:" in e.value.message


def test_an_adapter_unregistered_mid_batch_fails_the_lines_after(srv: Server,
                                                                  tenants: dict[str, tuple[str, str]]) -> None:
    assert _load(srv, "alpha-tmp", tenant="ten-a").status_code == 200
    n = 10
    with _client(srv, tenants["ten-a"][1]) as client:
        batch_id = _run(client, [_body("alpha-tmp", PROMPTS[i % 3], max_tokens=64) for i in range(n)])
        deadline = time.monotonic() + 60
        while (counts := client.batches.retrieve(batch_id).request_counts) is None or counts.completed < 1:
            assert time.monotonic() < deadline, counts
            time.sleep(0.02)
        r = httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "alpha-tmp"},
                       headers=srv.admin_headers, timeout=30)
        assert r.status_code == 200, r.text
        done = wait_batch(client, batch_id)
        assert done.status == "completed" and done.request_counts is not None
        completed, failed = done.request_counts.completed, done.request_counts.failed
        assert completed >= 1 and failed >= 1 and completed + failed == n  # lines in flight at the unload finish
        for line in _lines(client, done.error_file_id).values():
            assert line["response"]["status_code"] == 404 and line["error"]["code"] == "model_not_found"
