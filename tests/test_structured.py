"""Structured outputs on the engine: a tiny random-weight model over smollm2's real tokenizer (vocab 49152),
sampled at temperature 1.0 with many seeds; every finished output parses and validates against its schema."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from ipc.codec import decode, encode
from ipc.messages import Generate
from tests.tiny import hf_model, run_all, tiny_engine
from workers import structured
from workers.core.outputs import StepOutput
from workers.core.sampling_params import SamplingParams
from workers.engine import LLMEngine
from workers.structured import StructuredError

EOS = 2  # smollm2's <|im_end|>: what the grammar engine allows once the grammar may end
# Bounded everywhere: a random model picks among allowed tokens uniformly-ish, so an unbounded string would
# only end when it happens to draw the closing quote among ~49k tokens.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                                  "zip": {"type": "integer", "maximum": 99999}},
                 "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "active", "tags", "home"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from workers.model_files import resolve

    return AutoTokenizer.from_pretrained(resolve("smollm2").directory)


@pytest.fixture(scope="module")
def engine(tokenizer: Any) -> LLMEngine:
    eng = tiny_engine(hf_model(vocab_size=49152, eos_token_id=EOS, bos_token_id=1), max_num_batched_tokens=256)
    structured.enable(eng, tokenizer)
    return eng


def _spec(kind: str, **fields: Any) -> str:
    return json.dumps({"type": kind} | fields)


def _generate(engine: LLMEngine, spec: str, n: int, max_tokens: int = 200, **kw: Any) -> list[list[int]]:
    ids = [f"s{i}-{hash(spec) & 0xffff}" for i in range(n)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, [1, 100 + i, 200 + i], SamplingParams(
            max_tokens=max_tokens, temperature=1.0, seed=1000 + i, structured=spec, **kw))
    out = run_all(engine)
    return [out[rid] for rid in ids]


def _outputs_until_idle(engine: LLMEngine) -> list[StepOutput]:
    outs: list[StepOutput] = []
    for _ in range(100_000):
        if not engine.has_unfinished():
            return outs
        outs += engine.step()
    raise RuntimeError("engine did not finish")


def _text(tokenizer: Any, ids: list[int]) -> str:
    assert ids and ids[-1] == EOS, "the grammar ended and only then was EOS allowed"
    return str(tokenizer.decode(ids[:-1]))


def test_json_schema_outputs_always_validate(engine: LLMEngine, tokenizer: Any) -> None:
    outs = _generate(engine, _spec("json_schema", schema=SCHEMA), 24)
    for ids in outs:
        value = json.loads(_text(tokenizer, ids))
        jsonschema.validate(value, SCHEMA)
    assert len({tuple(o) for o in outs}) > 20  # seeds differ, outputs differ: masking, not a fixed answer


def test_choice_and_regex(engine: LLMEngine, tokenizer: Any) -> None:
    choices = ["red", "green", "blue violet"]
    for ids in _generate(engine, _spec("choice", choices=choices), 8):
        assert _text(tokenizer, ids) in choices
    for ids in _generate(engine, _spec("regex", pattern=r"[0-9]{3}-[a-z]{2}"), 8):
        text = _text(tokenizer, ids)
        assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha()


def test_unstructured_requests_in_the_same_batch_are_untouched(engine: LLMEngine) -> None:
    engine.add_request("free", [1, 5, 6], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    engine.add_request("shaped", [1, 5, 6], SamplingParams(max_tokens=50, temperature=1.0, seed=3,
                                                           structured=_spec("choice", choices=["yes", "no"])))
    mixed = run_all(engine)["free"]
    engine.add_request("alone", [1, 5, 6], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert run_all(engine)["alone"] == mixed


@pytest.mark.parametrize("spec, message", [
    ('{"type": "choice", "choices": []}', "choice"),
    ('{"type": "regex", "pattern": 7}', "pattern"),
    ('{"type": "json_schema", "schema": "object"}', "schema"),
    ('{"type": "grammar"}', "type must be"),
    ("not json", "not JSON"),
])
def test_malformed_specs_are_refused_at_add_request(engine: LLMEngine, spec: str, message: str) -> None:
    with pytest.raises(StructuredError, match=message):
        engine.add_request("bad", [1, 2, 3], SamplingParams(structured=spec))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("spec", [
    '{"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}',
    '{"type": "json_schema", "schema": {"type": "strnig"}}',
    '{"type": "regex", "pattern": "(unclosed"}',
])
def test_unsupported_grammars_finish_with_an_error(engine: LLMEngine, spec: str) -> None:
    """Found by the compile, off the engine thread: the request finishes with the reason as its error (the
    gateway's 4xx path for a request that can never run), twice: the second time from the cache."""
    for rid in ("bad1", "bad2"):
        engine.add_request(rid, [1, 2, 3], SamplingParams(structured=spec))
        outs = _outputs_until_idle(engine)
        assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [(rid, [], "length")]
        assert outs[0].error is not None and "unsupported" in outs[0].error
        assert outs[0].error_code == "invalid_request"  # the schema's fault: a 400, not a context-length one


def test_compile_cache_is_keyed_by_canonical_json(engine: LLMEngine) -> None:
    outputs = engine.structured
    assert outputs is not None
    a = outputs.compiled(json.dumps({"type": "json_schema", "schema": {"type": "object", "required": []}}))
    b = outputs.compiled('{"schema":{"type":"object","required":[]},  "type":"json_schema"}')
    assert a is b
    # nested order is meaning (properties are generated in schema order), so it is part of the key
    assert outputs.compiled('{"type":"json_schema","schema":{"required":[],"type":"object"}}') is not a


def test_properties_come_in_schema_order(engine: LLMEngine, tokenizer: Any) -> None:
    schema = {"type": "object", "properties": {"z": {"type": "boolean"}, "a": {"type": "boolean"}},
              "required": ["z", "a"], "additionalProperties": False}
    for ids in _generate(engine, _spec("json_schema", schema=schema), 4):
        assert list(json.loads(_text(tokenizer, ids))) == ["z", "a"]


def test_an_engine_without_a_tokenizer_refuses_structured_requests() -> None:
    eng = tiny_engine(hf_model(vocab_size=512))
    with pytest.raises(StructuredError, match="no structured-output support"):
        eng.add_request("r", [1, 2], SamplingParams(structured=_spec("json_object")))


def test_sampling_params_round_trip_the_spec() -> None:
    p = SamplingParams(structured=_spec("json_object"))
    msg = decode(encode(Generate("r", [1], p, None, 1.0, None, None)))  # the spec crosses the wire intact
    assert isinstance(msg, Generate) and msg.sampling == p
    with pytest.raises(ValueError):
        SamplingParams(structured={"type": "json_object"})  # type: ignore[arg-type]
