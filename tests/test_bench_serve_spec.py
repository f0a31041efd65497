"""bench/serve_spec.py's pure parts: per-token ITL from multi-token chunks, the /metrics counters and their
deltas, greedy mismatch reporting. No server."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from tests.async_support import run_async

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import serve_spec  # noqa: E402

METRICS_BEFORE = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{model_name="smollm2",worker="w0"} 10
vllm:spec_decode_num_drafts_total{model_name="smollm2",worker="w1"} 2
vllm:spec_decode_num_draft_tokens_total{model_name="smollm2",worker="w0"} 40
vllm:spec_decode_num_accepted_tokens_total{model_name="smollm2",worker="w0"} 30
vllm:generation_tokens_total{model_name="smollm2",worker="w0"} 100.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="smollm2",worker="w0",position="0"} 9
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="smollm2",worker="w0",position="1"} 8
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="smollm2",worker="w1",position="1"} 1
kvgate:workers_ready{model_name="smollm2"} 2
"""


def test_per_token_gaps_split_a_chunk_evenly_over_its_tokens() -> None:
    # first chunk at 1.0 (TTFT, no gap); then 1 token after 0.1 s; then 4 tokens after 0.4 s; then 2 after 0.1 s
    gaps = serve_spec.per_token_gaps([(1.0, 1), (1.1, 1), (1.5, 4), (1.6, 2)])
    assert gaps == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05])
    assert serve_spec.per_token_gaps([(1.0, 3)]) == []  # one chunk: no inter-token gap measured


def test_parse_counters_sums_workers_and_positions() -> None:
    c = serve_spec.parse_counters(METRICS_BEFORE)
    assert c["vllm:spec_decode_num_drafts_total"] == 12
    assert c["vllm:spec_decode_num_draft_tokens_total"] == 40
    assert c["vllm:generation_tokens_total"] == 100
    assert c["pos0"] == 9 and c["pos1"] == 9
    assert "kvgate:workers_ready" not in c


def test_acceptance_is_a_delta_between_scrapes() -> None:
    before = serve_spec.parse_counters(METRICS_BEFORE)
    after_text = (METRICS_BEFORE.replace("} 10\n", "} 14\n").replace("} 40\n", "} 56\n")
                  .replace("} 30\n", "} 42\n").replace("} 100.0\n", "} 130\n"))
    after_text += 'vllm:spec_decode_num_accepted_tokens_per_pos_total{worker="w0",position="2"} 3\n'
    r = serve_spec.acceptance(before, serve_spec.parse_counters(after_text))
    assert (r["drafts"], r["draft_tokens"], r["accepted"], r["generation_tokens"]) == (4, 16, 12, 30)
    assert r["acceptance"] == pytest.approx(0.75)
    assert r["accepted_per_draft"] == pytest.approx(3.0)
    assert r["accepted_rate_per_pos"] == pytest.approx([0.0, 0.0, 0.75])  # pos2 is new: 3 of 4 drafts


def test_acceptance_without_drafts_is_none() -> None:
    c = serve_spec.parse_counters(METRICS_BEFORE)
    r = serve_spec.acceptance(c, c)
    assert r["acceptance"] is None and r["accepted_per_draft"] is None and r["drafts"] == 0


def test_mismatches_name_the_first_differing_token() -> None:
    same = serve_spec.Result(ok=True, tokens=["a", "b", "c"])
    off = [same, serve_spec.Result(ok=True, tokens=["a", "b", "c"]), serve_spec.Result(ok=True, tokens=["a", "b"])]
    on = [same, serve_spec.Result(ok=True, tokens=["a", "x", "c"]), serve_spec.Result(ok=True, tokens=["a", "b", "d"])]
    assert serve_spec.mismatches(off, on) == ["#1: token 1 (3 vs 3 tokens)", "#2: token 2 (2 vs 3 tokens)"]


def test_sse_chunks_stop_at_done_and_raise_on_an_error_event() -> None:
    async def chunks(body: bytes) -> list[dict[str, object]]:
        return [c async for c in serve_spec.sse_chunks(httpx.Response(200, content=body))]

    ok = b': ping\n\ndata: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\ndata: {"late":1}\n\n'
    assert run_async(lambda: chunks(ok)) == [{"choices": [{"text": "a"}]}]
    with pytest.raises(RuntimeError, match="overloaded"):
        run_async(lambda: chunks(b'data: {"choices":[]}\n\ndata: {"error":{"code":"overloaded"}}\n\n'))
