"""Issue 25 end to end: ``kvgate serve --lora-dir`` with a CPU worker on a tiny random base model and random PEFT
adapters. Registration at vLLM's paths (bad paths and broken adapters refused with a 4xx, nothing registered), an
adapter answering only its tenant's keys (another tenant gets the same 404 for it as for a guessed name), its
greedy answer differing from the base model's and equal to the offline engine's, ``/v1/models``, the ledger and
metrics, suspension and deletion unregistering, a worker that cannot find an adapter (404, not 500), and
``kvgatectl adapters`` through the gateway."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.lora_support import ALL, ATTN, broken_copies, make_adapter
from tests.tenancy_support import make_tenant, store_of
from tests.test_gateway_support import ADMIN_TOKEN, MODEL, REPO, Server, start_server

pytestmark = pytest.mark.timeout(300)

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
PROMPT = [5, 17, 230, 41, 7, 99, 1200, 3]
N = 8


@pytest.fixture(scope="module")
def loras(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The adapter directory: good adapters, broken ones, and a link out of it."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    root = tmp_path_factory.mktemp("loras")
    d = root / "adapters"
    make_adapter(hf, d / "alpha", ATTN, seed=6)
    make_adapter(hf, d / "beta", ALL, r=4, seed=7)
    make_adapter(hf, root / "outside", ATTN, seed=8)
    (d / "escape").symlink_to(root / "outside")
    broken_copies(d / "alpha", d)
    return d


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, loras: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("lora") / "gateway.log", "--lora-dir", str(loras),
                     "--quantization", "none", "--max-loras", "2")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tenants(srv: Server) -> dict[str, tuple[str, str]]:
    return {name: make_tenant(srv, name) for name in ("ten-a", "ten-b")}


def _admin(srv: Server, path: str, body: dict[str, Any] | None = None, **kw: Any) -> httpx.Response:
    if body is None:
        return httpx.get(f"{srv.url}{path}", headers=srv.admin_headers, timeout=30, **kw)
    return httpx.post(f"{srv.url}{path}", json=body, headers=kw.pop("headers", srv.admin_headers), timeout=30)


def _load(srv: Server, name: str, path: str, tenant: str | None = None) -> httpx.Response:
    body = {"lora_name": name, "lora_path": path, **({"tenant": tenant} if tenant else {})}
    return _admin(srv, "/v1/load_lora_adapter", body)


def _complete(srv: Server, key: str, model: str, **kw: Any) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True, **kw}
    return httpx.post(f"{srv.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=60)


def _registered(srv: Server) -> set[str]:
    r = _admin(srv, "/admin/adapters")
    assert r.status_code == 200, r.text
    return {a["name"] for a in r.json()["data"]}


def test_registration_refuses_bad_paths_and_broken_adapters(srv: Server, loras: Path,
                                                            tenants: dict[str, tuple[str, str]]) -> None:
    refused = {"up": "../outside", "abs": str(loras.parent / "outside"), "link": "escape", "trunc": "truncated",
               "rank": "rank", "shape": "shapes", "none": "absent"}
    for name, path in refused.items():
        r = _load(srv, f"bad-{name}", path)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_lora_adapter" and err["param"] == "lora_path" and err["type"]
    r = _load(srv, "bad-owner", "alpha", tenant="no-such-tenant")
    assert r.status_code == 404 and r.json()["error"]["code"] == "tenant_not_found"
    assert _admin(srv, "/v1/load_lora_adapter", {"lora_name": "x"}).status_code == 400  # no lora_path
    assert _admin(srv, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "alpha", "extra": 1}
                  ).status_code == 400
    tenant_key = {"Authorization": f"Bearer {tenants['ten-a'][1]}"}
    r = _admin(srv, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "alpha"}, headers=tenant_key)
    assert r.status_code == 401  # an operator's job: tenant keys never register adapters
    assert not {n for n in _registered(srv) if n.startswith("bad-") or n == "x"}  # nothing was registered


def test_an_adapter_answers_only_its_tenant_and_a_guess_reads_the_same(
        srv: Server, tenants: dict[str, tuple[str, str]]) -> None:
    (a_id, a_key), (_, b_key) = tenants["ten-a"], tenants["ten-b"]
    r = _load(srv, "alpha-a", "alpha", tenant="ten-a")
    assert r.status_code == 200, r.text
    assert (r.json()["tenant_id"], r.json()["rank"]) == (a_id, 8)
    assert _load(srv, "beta", "beta").status_code == 200  # global
    assert _load(srv, "beta", "alpha").status_code == 409
    assert _complete(srv, a_key, "alpha-a").status_code == 200
    assert _complete(srv, b_key, "beta").status_code == 200
    for name in ("alpha-a", "alpha-b-guess"):
        r = _complete(srv, b_key, name)
        assert r.status_code == 404
        assert r.json() == {"error": {"message": f"The model `{name}` does not exist.", "type":
                                      "invalid_request_error", "param": "model", "code": "model_not_found"}}
    chat = httpx.post(f"{srv.url}/v1/chat/completions", headers={"Authorization": f"Bearer {b_key}"}, timeout=30,
                      json={"model": "alpha-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 404 and chat.json()["error"]["code"] == "model_not_found"
    resp = httpx.post(f"{srv.url}/v1/responses", headers={"Authorization": f"Bearer {b_key}"}, timeout=30,
                      json={"model": "beta", "input": "hi", "max_output_tokens": 2, "store": False})
    assert resp.status_code == 200 and resp.json()["model"] == "beta"  # the Responses API takes adapters too

    def models(key: str) -> dict[str, Any]:
        r = httpx.get(f"{srv.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert r.status_code == 200
        return {m["id"]: m for m in r.json()["data"]}

    seen_a, seen_b = models(a_key), models(b_key)
    assert set(seen_a) == {MODEL, "alpha-a", "beta"} and set(seen_b) == {MODEL, "beta"}
    assert seen_a["alpha-a"]["parent"] == seen_a["beta"]["parent"] == MODEL and seen_a[MODEL]["parent"] is None

    def retrieve(key: str, name: str) -> httpx.Response:
        return httpx.get(f"{srv.url}/v1/models/{name}", headers={"Authorization": f"Bearer {key}"}, timeout=10)

    assert retrieve(a_key, "alpha-a").json() == seen_a["alpha-a"]  # OpenAI's retrieve: the list's entry
    assert retrieve(b_key, MODEL).json() == seen_b[MODEL]
    for name in ("alpha-a", "alpha-b-guess"):  # another tenant's adapter is a name nobody registered
        r = retrieve(b_key, name)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_the_adapters_greedy_answer_is_the_offline_engines(srv: Server, tiny_model_dir: Path, loras: Path,
                                                           tenants: dict[str, tuple[str, str]]) -> None:
    from workers import LLM, SamplingParams

    a_key = tenants["ten-a"][1]
    if "alpha-a" not in _registered(srv):
        assert _load(srv, "alpha-a", "alpha", tenant="ten-a").status_code == 200
    base = _complete(srv, a_key, MODEL, logprobs=0)
    tuned = _complete(srv, a_key, "alpha-a", logprobs=0)
    assert base.status_code == tuned.status_code == 200, tuned.text
    assert tuned.json()["model"] == "alpha-a" and base.json()["model"] == MODEL
    offline = LLM(str(tiny_model_dir), quantization="none", lora_dir=str(loras), kv_cache_tokens=2048)
    params = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    ref_base, ref_tuned = offline.generate([PROMPT, PROMPT], params, lora=[None, "alpha"])
    assert ref_tuned.token_ids != ref_base.token_ids  # the adapter changes the answer, or this proves nothing
    for got, ref in ((base, ref_base), (tuned, ref_tuned)):
        choice = got.json()["choices"][0]
        assert choice["text"] == ref.text
        assert choice["logprobs"]["tokens"] == [offline.tokenizer.decode([t]) for t in ref.token_ids]


def test_the_ledger_and_metrics_name_the_adapter(srv: Server, tenants: dict[str, tuple[str, str]]) -> None:
    a_id, a_key = tenants["ten-a"]
    if "alpha-a" not in _registered(srv):
        assert _load(srv, "alpha-a", "alpha", tenant="ten-a").status_code == 200
    r = _complete(srv, a_key, "alpha-a")
    assert r.status_code == 200
    with store_of(srv) as store:
        rows = {row.request_id: row for row in store.usage_rows(a_id)}
    assert rows[r.json()["id"]].adapter == "alpha-a" and rows[r.json()["id"]].model == MODEL
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    assert 'kvgate:lora_requests_total{adapter="alpha-a",status="length"}' in text
    assert 'kvgate:lora_tokens_total{adapter="alpha-a",kind="completion"}' in text
    assert 'vllm:lora_requests_info{running_lora_adapters="",max_lora="2",waiting_lora_adapters=""}' in text


def test_suspension_and_deletion_unregister_and_unload_stops_requests(srv: Server) -> None:
    c_id, c_key = make_tenant(srv, "ten-c")
    make_tenant(srv, "ten-d")
    assert _load(srv, "gamma", "alpha", tenant="ten-c").status_code == 200
    assert _load(srv, "delta", "alpha", tenant="ten-d").status_code == 200
    assert _complete(srv, c_key, "gamma").status_code == 200
    assert _admin(srv, "/admin/tenants/ten-c/suspend", {}).status_code == 200
    assert _admin(srv, "/admin/tenants/ten-c/resume", {}).status_code == 200
    assert _complete(srv, c_key, "gamma").status_code == 404  # unregistered with the suspension
    assert httpx.delete(f"{srv.url}/admin/tenants/ten-d", headers=srv.admin_headers, timeout=10).status_code == 200
    assert not {"gamma", "delta"} & _registered(srv)
    assert _load(srv, "eps", "beta").status_code == 200
    assert _complete(srv, c_key, "eps").status_code == 200
    r = _admin(srv, "/v1/unload_lora_adapter", {"lora_name": "eps"})
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert _complete(srv, c_key, "eps").status_code == 404
    r = _admin(srv, "/v1/unload_lora_adapter", {"lora_name": "eps"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "adapter_not_found"


def test_an_adapter_the_worker_cannot_find_is_a_404(srv: Server, loras: Path,
                                                    tenants: dict[str, tuple[str, str]]) -> None:
    shutil.copytree(loras / "alpha", loras / "ghost")
    assert _load(srv, "ghost", "ghost").status_code == 200
    shutil.rmtree(loras / "ghost")  # gone from disk after its check: the worker refuses it
    r = _complete(srv, tenants["ten-a"][1], "ghost")
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "model_not_found"


def test_kvgatectl_adapters_through_the_gateway(srv: Server, tenants: dict[str, tuple[str, str]]) -> None:
    def ctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "console.kvgatectl", "--url", srv.url, "--admin-token", ADMIN_TOKEN,
                               *args], cwd=REPO, env=srv.env, capture_output=True, text=True, timeout=60)

    added = ctl("--json", "adapters", "add", "cli-alpha", "alpha", "--tenant", "ten-a")
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["target_modules"] == ATTN
    listed = ctl("--json", "adapters", "list", "--tenant", "ten-a")
    assert "cli-alpha" in {a["name"] for a in json.loads(listed.stdout)["data"]}
    refused = ctl("adapters", "add", "cli-bad", "truncated")
    assert refused.returncode == 1 and "cannot be read" in refused.stderr
    assert ctl("adapters", "rm", "cli-alpha").returncode == 0
    assert "cli-alpha" not in _registered(srv)
