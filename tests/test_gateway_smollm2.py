"""The default deployment for real: ``kvgate serve --model smollm2`` answers the README's first question correctly.

It runs ``--quantization auto``, which on a SIMD CPU keeps the GGUF's own Q4_1 blocks (as llama.cpp runs
them) with 12-bit activations, so it answers as fp32 of those weights does: "What is the capital of France?" ->
"... Paris." (llama.cpp's 8-bit activations, and this engine's ``int4-a8``, answer "L'Étoile, ..."; bench/RESULTS.md).
The streamed answer must equal the non-streamed one although the second request hits the prefix cache."""

from __future__ import annotations

import openai
import pytest

from tests.test_gateway_support import Server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_smollm2_chat_through_gateway(smollm2_server: Server) -> None:
    srv = smollm2_server
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=srv.api_key, max_retries=0, timeout=120)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model="smollm2", messages=question, max_tokens=32, temperature=0)
    text = r.choices[0].message.content or ""
    assert "Paris" in text, text
    stream = client.chat.completions.create(
        model="smollm2", messages=question,
        max_tokens=32, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    client.close()  # an idle keep-alive connection would hold the graceful shutdown for its full timeout
    # The gateway hands the worker the converted directory; the worker must still find the GGUF behind it
    # and run its blocks (not int8 of de-quantized weights, which it did before the directory said where
    # it came from).
    assert "quantization int4" in srv.log() and "linear layers: int4" in srv.log(), srv.log()[-3000:]
