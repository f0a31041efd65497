"""Many long prompts with prompt logprobs at once through a real ``kvgate serve`` and worker process (the defect's
shape at a small size: 50 requests of 1,000-token prompts made the worker build one huge message per request at its
first token and miss its heartbeats). Now every step sends only the chunk it computed: the worker is never given up
on, and every response holds complete prompt logprobs, bit for bit those of the same prompt served alone."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.test_gateway_support import MODEL, Server, metric_sum, start_server
from tests.tiny import VOCAB

pytestmark = pytest.mark.timeout(300)

PROMPTS = 8  # distinct prompts, each sent COPIES times at once
COPIES = 4
PROMPT_LEN = 400
STEP_TOKENS = 64  # a small step budget: each prompt goes out in 7 chunks, mixed with the others'


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tiny_model_dir, tmp_path_factory.mktemp("plp-fleet") / "gateway.log",
                     "--max-num-batched-tokens", str(STEP_TOKENS), "--heartbeat-timeout", "2")
    yield s
    s.stop()


def _prompt(i: int, n: int = PROMPT_LEN) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(4, VOCAB) for _ in range(n)]


def _post(srv: Server, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "temperature": 0.0, "ignore_eos": True,
                                                         **body}, headers=srv.headers, timeout=180)


def _stream_prompt_lps(srv: Server, body: dict[str, Any]) -> list[Any]:
    import json

    with httpx.stream("POST", f"{srv.url}/v1/completions", headers=srv.headers, timeout=180,
                      json={"model": MODEL, "temperature": 0.0, "ignore_eos": True, "stream": True, **body}) as r:
        assert r.status_code == 200
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    found = [c["choices"][0]["prompt_logprobs"] for c in chunks if "prompt_logprobs" in c["choices"][0]]
    assert len(found) == 1  # once, whole, with the first token
    return found[0]  # type: ignore[no-any-return]


def test_many_long_prompts_with_prompt_logprobs_at_once(srv: Server) -> None:
    pids = srv.worker_pids()
    body = {"max_tokens": 3, "prompt_logprobs": 5}
    alone = {i: _post(srv, {**body, "prompt": _prompt(i)}).json()["choices"][0]["prompt_logprobs"]
             for i in range(PROMPTS)}
    results: dict[tuple[int, int], Any] = {}

    def one(i: int, copy: int) -> None:
        try:
            if copy == 0:  # one of each streamed: the same list, in one chunk
                results[i, copy] = _stream_prompt_lps(srv, {**body, "prompt": _prompt(i)})
                return
            r = _post(srv, {**body, "prompt": _prompt(i)})
            results[i, copy] = r.json()["choices"][0]["prompt_logprobs"] if r.status_code == 200 else r.text
        except Exception as e:  # noqa: BLE001 - recorded, the assertion below names it
            results[i, copy] = repr(e)

    threads = [threading.Thread(target=one, args=(i, c)) for i in range(PROMPTS) for c in range(COPIES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(200)
    for (i, copy), got in sorted(results.items()):
        assert isinstance(got, list), f"prompt {i} copy {copy}: {got}"
        assert len(got) == PROMPT_LEN and got[0] is None
        assert got == alone[i], f"prompt {i} copy {copy}: other values than served alone"
    assert len(results) == PROMPTS * COPIES
    metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
    assert metric_sum(metrics, "kvgate:workers_lost_total") == 0
    assert srv.worker_pids() == pids  # the same process throughout: never given up on, never restarted


def test_a_long_prompt_with_twenty_alternatives_is_not_cut_as_a_slow_client(srv: Server) -> None:
    """1,000 positions x 20 alternatives weigh ~2.5 MB at the gateway, past a stream's 1 MiB bound: sent at once
    with the first token they cut the request (408 client_too_slow) though its client read everything."""
    r = _post(srv, {"prompt": _prompt(99, 1000), "max_tokens": 4, "prompt_logprobs": 20})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == 1000 and all(20 <= len(e) <= 21 for e in plp[1:])
