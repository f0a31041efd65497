"""The grammar engine's tokenizer built from tokenizer.json alone (workers.grammar_tokenizer) is the one
llguidance builds through transformers: same vocabulary bytes, special flags, EOS, tokenization and masks. Where
tokenizer_config.json declares what tokenizer.json lacks, transformers builds it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import llguidance
import llguidance.hf
import pytest
import torch
from transformers import AutoTokenizer

from workers import grammar_tokenizer
from workers.model_files import resolve
from workers.structured import fill_bitmask, new_bitmask

VOCAB = 49152  # smollm2's
TEXTS = ["Hello world", ' {"a": 1, "b": [true, null]}', "<|im_start|>user\nhi<|im_end|>\n",
         "ünïcödé  tabs\t\nand   spaces", "1234567890", "```python\nprint('x')\n```"]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def directory() -> Path:
    return resolve("smollm2").directory


@pytest.fixture(scope="module")
def pair(directory: Path) -> tuple[Any, Any]:
    direct = grammar_tokenizer.direct(directory, VOCAB)
    assert direct is not None
    hf: Any = AutoTokenizer.from_pretrained(directory)
    return direct, llguidance.hf.from_tokenizer(hf, n_vocab=VOCAB)


def _mask(tok: Any, grammar: str, prefix: str) -> torch.Tensor:
    matcher = llguidance.LLMatcher(tok, grammar)
    assert matcher.consume_tokens(tok.tokenize_str(prefix)), matcher.get_error()
    mask = new_bitmask(1, VOCAB)
    fill_bitmask(matcher, mask, 0)
    return mask


def test_same_vocabulary_and_eos(pair: tuple[Any, Any]) -> None:
    direct, via_hf = pair
    assert (direct.vocab_size, direct.eos_token, direct.eos_tokens) == (via_hf.vocab_size, via_hf.eos_token,
                                                                         via_hf.eos_tokens)
    assert direct.eos_token == 2  # <|im_end|>, tokenizer_config's eos_token
    for i in range(VOCAB):
        assert direct.decode_bytes([i]) == via_hf.decode_bytes([i]), i
        assert direct.is_special_token(i) == via_hf.is_special_token(i), i
    assert direct.is_special_token(2) and not direct.is_special_token(100)


def test_same_tokens_and_masks(pair: tuple[Any, Any]) -> None:
    direct, via_hf = pair
    for text in TEXTS:
        assert direct.tokenize_str(text) == via_hf.tokenize_str(text), text
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    for prefix in ("", '{"city": "Pa', '{"city": "Paris", "n": 1'):
        a, b = _mask(direct, grammar, prefix), _mask(via_hf, grammar, prefix)
        assert torch.equal(a, b), prefix
        assert int(a.ne(0).sum()) > 0  # the mask allows something: the comparison is not of two empty masks


def _copy(directory: Path, tmp_path: Path) -> Path:
    out = tmp_path / "tok"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(directory / name, out / name)
    return out


def test_what_tokenizer_json_lacks_is_left_to_transformers(directory: Path, tmp_path: Path) -> None:
    out = _copy(directory, tmp_path)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["added_tokens_decoder"] = {str(VOCAB): {"content": "<|tool_sep|>", "special": True, "lstrip": False,
                                                   "rstrip": False, "normalized": False, "single_word": False}}
    config_path.write_text(json.dumps(config))
    assert grammar_tokenizer.direct(out, VOCAB + 1) is None
    loaded = grammar_tokenizer.load(out, VOCAB + 1)
    assert loaded.decode_bytes([VOCAB]) == b"<|tool_sep|>" and loaded.is_special_token(VOCAB)

    original = json.loads((directory / "tokenizer_config.json").read_text())
    config_path.write_text(json.dumps({**original, "eos_token": "<|no_such|>"}))
    assert grammar_tokenizer.direct(out, VOCAB) is None
    # tokenizer.json has <|endoftext|> as a special token: declared otherwise, the merge is left to transformers
    plain = {"0": {"content": "<|endoftext|>", "special": False}}
    config_path.write_text(json.dumps({**original, "added_tokens_decoder": plain}))
    assert grammar_tokenizer.direct(out, VOCAB) is None
    config_path.write_text(json.dumps({**original, "added_tokens_decoder": {"0": {**plain["0"], "special": True}}}))
    assert grammar_tokenizer.direct(out, VOCAB) is not None  # declared as tokenizer.json has it


def test_a_directory_or_a_tokenizer_object_loads(directory: Path) -> None:
    from_dir = grammar_tokenizer.load(directory, VOCAB)
    from_object = grammar_tokenizer.load(AutoTokenizer.from_pretrained(directory), VOCAB)
    assert from_dir.tokenize_str(TEXTS[1]) == from_object.tokenize_str(TEXTS[1])
    assert grammar_tokenizer.direct(directory.parent / "no-such-model", VOCAB) is None


def test_the_direct_route_does_not_import_transformers(directory: Path) -> None:
    """transformers' import is what made a worker's first grammar request slow (seconds): a fresh process loads
    the tokenizer from a directory without it."""
    code = ("import sys; from workers import grammar_tokenizer as g; "
            f"t = g.load({str(directory)!r}, {VOCAB}); print(t.eos_token, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["2", "False"], out.stdout
