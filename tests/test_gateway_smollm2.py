"""The default deployment for real: ``kvgate serve --model smollm2`` answers a factual question sensibly."""

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
        r = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=32, temperature=0)
        text = r.choices[0].message.content or ""
        assert "Paris" in text, text
        stream = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=32, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
        client.close()  # an idle keep-alive connection would hold the graceful shutdown for its full timeout
    finally:
        srv.stop()
