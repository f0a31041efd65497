"""The default deployment for real: ``kvgate serve --model smollm2`` answers a factual question sensibly.

It runs ``--quantization auto``, which on a SIMD CPU keeps the GGUF's own Q4_1 blocks (as llama.cpp runs
them). The question is one whose answer the 135M model keeps under that arithmetic: "What is the capital of
France?" answers "Paris" in fp32 but starts "L'Étoile, ..." with the Q4_1 weights, in llama.cpp (llama-cpp-python,
same GGUF, greedy) and in kvgate alike, token for token (measured 2026-11-23, bench/RESULTS.md)."""

from __future__ import annotations

import openai
import pytest

from tests.test_gateway_support import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_smollm2_chat_through_gateway(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from gateway.pipeline.tokenizer import resolve_model_dir

    srv = start_server(resolve_model_dir("smollm2"), tmp_path / "gateway.log", served_name="smollm2")
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=srv.api_key, max_retries=0, timeout=120)
        question = [{"role": "user", "content": "What is 2+2?"}]
        r = client.chat.completions.create(model="smollm2", messages=question, max_tokens=32, temperature=0)
        text = r.choices[0].message.content or ""
        assert "4" in text, text
        stream = client.chat.completions.create(
            model="smollm2", messages=question,
            max_tokens=32, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
        client.close()  # an idle keep-alive connection would hold the graceful shutdown for its full timeout
        # The gateway hands the worker the converted directory; the worker must still find the GGUF behind it
        # and run its blocks (not int8 of de-quantized weights, which it did before the directory said where
        # it came from).
        assert "quantization int4" in srv.log() and "linear layers: int4" in srv.log(), srv.log()[-3000:]
    finally:
        srv.stop()
