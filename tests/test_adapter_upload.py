"""Issue 25: tenants upload their own LoRA adapters with their API keys (``POST /v1/adapters``, multipart), list them
(``GET``) and delete them (``DELETE /v1/adapters/{name}``). One ``kvgate serve --lora-dir`` with a CPU worker on the
tiny random base model for the whole module. An upload answers its tenant's requests only; every refused upload
(shapes of another base, a bad rank, a truncated file, a path-like name, a broken form, an oversize body, a taken
name) is a 4xx that leaves nothing registered and nothing in the adapter directory; another tenant's adapter and a
global one are the same 404 on DELETE as a name nobody registered."""

from __future__ import annotations

import json
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.lora_support import ATTN, broken_copies, make_adapter
from tests.tenancy_support import make_tenant
from tests.test_gateway_support import MODEL, Server, start_server

pytestmark = pytest.mark.timeout(300)

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


@pytest.fixture(scope="module")
def sources(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Adapters to upload, outside the gateway's adapter directory: a good one and broken copies of it."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    d = tmp_path_factory.mktemp("sources")
    make_adapter(hf, d / "good", ATTN, seed=6)
    broken_copies(d / "good", d)
    return d


@pytest.fixture(scope="module")
def lora_dir(sources: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("lora") / "adapters"
    shutil.copytree(sources / "good", d / "operator-good")  # an operator's directory, registered globally below
    return d


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, lora_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("upload") / "gateway.log", "--lora-dir", str(lora_dir),
                     "--quantization", "none")
    r = httpx.post(f"{s.url}/v1/load_lora_adapter", headers=s.admin_headers, timeout=30,
                   json={"lora_name": "shared", "lora_path": "operator-good"})
    assert r.status_code == 200, r.text
    yield s
    s.stop()


@pytest.fixture(scope="module")
def keys(srv: Server) -> dict[str, str]:
    return {name: make_tenant(srv, name)[1] for name in ("up-a", "up-b")}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _upload(srv: Server, key: str, name: str | None, source: Path | None, **extra: Any) -> httpx.Response:
    files = {} if source is None else {f: (f, (source / f).read_bytes()) for f in (CONFIG, WEIGHTS)}
    data = {**({} if name is None else {"name": name}), **extra}
    return httpx.post(f"{srv.url}/v1/adapters", headers=_auth(key), data=data, files=files, timeout=60)


def _chat(srv: Server, key: str, model: str) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/chat/completions", headers=_auth(key), timeout=60,
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})


def _registered(srv: Server) -> set[str]:
    r = httpx.get(f"{srv.url}/admin/adapters", headers=srv.admin_headers, timeout=30)
    assert r.status_code == 200, r.text
    return {a["name"] for a in r.json()["data"]}


def _listed(srv: Server, key: str) -> dict[str, dict[str, Any]]:
    r = httpx.get(f"{srv.url}/v1/adapters", headers=_auth(key), timeout=30)
    assert r.status_code == 200, r.text
    return {a["id"]: a for a in r.json()["data"]}


def _assert_error(r: httpx.Response, status: int, code: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    if code is not None:
        assert err["code"] == code, err


def test_an_upload_answers_only_its_tenant(srv: Server, keys: dict[str, str], sources: Path,
                                           lora_dir: Path) -> None:
    r = _upload(srv, keys["up-a"], "mine", sources / "good")
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["id"], body["object"], body["owned_by"], body["global"]) == ("mine", "lora_adapter", "up-a", False)
    assert (body["rank"], body["target_modules"], body["parent"]) == (8, ATTN, MODEL)
    placed = [p for p in lora_dir.iterdir() if p.name.startswith("mine.")]
    assert len(placed) == 1 and {p.name for p in placed[0].iterdir()} >= {CONFIG, WEIGHTS}
    assert (placed[0] / WEIGHTS).read_bytes() == (sources / "good" / WEIGHTS).read_bytes()
    assert not [p for p in lora_dir.iterdir() if p.name.startswith(".")]  # no temporary directory left
    ok = _chat(srv, keys["up-a"], "mine")
    assert ok.status_code == 200 and ok.json()["model"] == "mine", ok.text
    _assert_error(_chat(srv, keys["up-b"], "mine"), 404, "model_not_found")
    seen_a, seen_b = _listed(srv, keys["up-a"]), _listed(srv, keys["up-b"])
    assert set(seen_a) == {"mine", "shared"} and set(seen_b) == {"shared"}
    assert seen_a["shared"]["global"] is True and seen_a["shared"]["owned_by"] == "kvgate"
    assert seen_a["mine"]["global"] is False


def _form(boundary: str, parts: list[tuple[str, bytes]]) -> bytes:
    out = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{n}"\r\n\r\n'.encode() + v + b"\r\n"
                   for n, v in parts)
    return out + f"--{boundary}--\r\n".encode()


def test_refused_uploads_leave_nothing(srv: Server, keys: dict[str, str], sources: Path, lora_dir: Path) -> None:
    key = keys["up-b"]
    before_disk, before_names = sorted(p.name for p in lora_dir.iterdir()), _registered(srv)
    good = sources / "good"
    cases: list[tuple[httpx.Response, int, str | None, str | None]] = [
        (_upload(srv, key, "shapes", sources / "shapes"), 400, "invalid_lora_adapter", WEIGHTS),
        (_upload(srv, key, "rank", sources / "rank"), 400, "invalid_lora_adapter", CONFIG),
        (_upload(srv, key, "trunc", sources / "truncated"), 400, "invalid_lora_adapter", WEIGHTS),
        (_upload(srv, key, "a..b", good), 400, None, "name"),
        (_upload(srv, key, "x/y", good), 400, None, "name"),
        (_upload(srv, key, "../escape", good), 400, None, "name"),
        (_upload(srv, key, None, good), 400, None, "name"),
        (httpx.post(f"{srv.url}/v1/adapters", headers={**_auth(key), "Content-Type": "multipart/form-data; "
                    "boundary=zz"}, content=_form("zz", [("name", b"nofile")]), timeout=30), 400, None, CONFIG),
        (_upload(srv, key, "extra", good, extra="1"), 400, "unrecognized_argument", "extra"),
        (_upload(srv, key, "shared", good), 409, "adapter_exists", "name"),  # an operator's global name
        (httpx.post(f"{srv.url}/v1/adapters", headers=_auth(key), json={"name": "j"}, timeout=30), 400, None, None),
        (httpx.post(f"{srv.url}/v1/adapters", headers={**_auth(key), "Content-Type": "multipart/form-data; "
                    "boundary=zz"}, content=_form("zz", [("name", b"cut")])[:-6], timeout=30), 400, None, None),
    ]
    if "mine" in _registered(srv):  # another tenant's name: taken all the same (one namespace)
        cases.append((_upload(srv, key, "mine", good), 409, "adapter_exists", "name"))
    for r, status, code, param in cases:
        _assert_error(r, status, code)
        assert param is None or r.json()["error"]["param"] == param, r.text
    unauthenticated = httpx.post(f"{srv.url}/v1/adapters", data={"name": "anon"}, timeout=30)
    _assert_error(unauthenticated, 401)
    assert sorted(p.name for p in lora_dir.iterdir()) == before_disk
    assert _registered(srv) == before_names


def test_an_oversize_body_is_refused_before_it_is_read(srv: Server, keys: dict[str, str], lora_dir: Path) -> None:
    from gateway.api.adapter_upload import MAX_UPLOAD_BYTES

    before = sorted(p.name for p in lora_dir.iterdir())
    url = urlsplit(srv.url)
    head = (f"POST /v1/adapters HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {keys['up-a']}\r\n"
            f"Content-Type: multipart/form-data; boundary=zz\r\nContent-Length: {MAX_UPLOAD_BYTES + 1}\r\n\r\n")
    with socket.create_connection((url.hostname or "127.0.0.1", url.port or 80), timeout=30) as s:
        s.sendall(head.encode() + b"--zz\r\n")  # a sliver of the promised body: the answer must not wait for it
        reply = b""
        while b"}}" not in reply and (chunk := s.recv(65536)):  # the head and the JSON error may come apart
            reply += chunk
    status_line, _, rest = reply.decode("latin-1").partition("\r\n")
    assert " 413 " in status_line, reply[:300]
    assert json.loads(rest.split("\r\n\r\n", 1)[1])["error"]["code"] == "request_too_large"
    assert sorted(p.name for p in lora_dir.iterdir()) == before


def test_delete_own_only(srv: Server, keys: dict[str, str], sources: Path, lora_dir: Path) -> None:
    a, b = keys["up-a"], keys["up-b"]
    assert _upload(srv, a, "gone-soon", sources / "good").status_code == 200
    assert [p for p in lora_dir.iterdir() if p.name.startswith("gone-soon.")]
    nobody = httpx.delete(f"{srv.url}/v1/adapters/nobody-has-this", headers=_auth(b), timeout=30)
    _assert_error(nobody, 404, "adapter_not_found")
    for name in ("gone-soon", "shared"):  # another tenant's, a global one: the same answer as a guess
        r = httpx.delete(f"{srv.url}/v1/adapters/{name}", headers=_auth(b), timeout=30)
        _assert_error(r, 404, "adapter_not_found")
        assert r.json()["error"]["message"] == nobody.json()["error"]["message"].replace("nobody-has-this", name)
    _assert_error(httpx.delete(f"{srv.url}/v1/adapters/shared", headers=_auth(a), timeout=30), 404)
    assert {"gone-soon", "shared"} <= _registered(srv)
    r = httpx.delete(f"{srv.url}/v1/adapters/gone-soon", headers=_auth(a), timeout=30)
    assert r.status_code == 200 and r.json() == {"id": "gone-soon", "object": "lora_adapter", "deleted": True}
    assert "gone-soon" not in _registered(srv) and "shared" in _registered(srv)
    assert not [p for p in lora_dir.iterdir() if p.name.startswith("gone-soon.")]  # its files went with it
    assert (lora_dir / "operator-good").is_dir()
    _assert_error(_chat(srv, a, "gone-soon"), 404, "model_not_found")
    _assert_error(httpx.delete(f"{srv.url}/v1/adapters/gone-soon", headers=_auth(a), timeout=30), 404)
    assert _upload(srv, b, "gone-soon", sources / "good").status_code == 200  # the name is free again


def test_a_suspended_tenants_uploads_are_removed(srv: Server, sources: Path, lora_dir: Path) -> None:
    _, key = make_tenant(srv, "up-gone")
    assert _upload(srv, key, "of-a-gone-tenant", sources / "good").status_code == 200
    assert [p for p in lora_dir.iterdir() if p.name.startswith("of-a-gone-tenant.")]
    r = httpx.post(f"{srv.url}/admin/tenants/up-gone/suspend", headers=srv.admin_headers, timeout=30)
    assert r.status_code == 200, r.text
    assert "of-a-gone-tenant" not in _registered(srv)
    assert not [p for p in lora_dir.iterdir() if p.name.startswith("of-a-gone-tenant.")]  # its files went too
    assert (lora_dir / "operator-good").is_dir()  # an operator's directory is never the sweep's
