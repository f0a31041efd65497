"""Incremental detokenization reproduces the full decode, chunk by chunk, including multi-byte text."""

from __future__ import annotations

import pytest

from common.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.slow

TEXTS = ["Hello world, ça va? 日本語のテキスト 🎉🎉 done.\n  indented  text",
         "a  b   c\t\td", "def f(x):\n    return x ** 2  # squared", "Ünïcödé ümläüts and emoji 👩‍👩‍👧"]


@pytest.fixture(scope="module")
def tok():  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    from workers.model_files import resolve

    return AutoTokenizer.from_pretrained(resolve("smollm2").directory)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_concatenate_to_full_decode(tok, text: str, chunk: int) -> None:  # type: ignore[no-untyped-def]
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    deltas = [d.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in x for x in deltas)
