"""Tool calling, units (no server): the request's ``tools`` / ``tool_choice`` / messages checked into 400s in
OpenAI's shape, the prompt each template family gets, the grammar that holds the answer (run against smollm2's
vocabulary with llguidance), and the parser that turns the answer into ``tool_calls``, streamed and not."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import llguidance
import llguidance.hf
import pytest

from gateway.base.errors import APIError
from gateway.pipeline.protocol import parse_chat
from gateway.pipeline.tokenizer import GatewayTokenizer, resolve_model_dir
from gateway.pipeline.tool_stream import JsonScanner, ToolCallParser

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city":"Paris","unit":"c"}'}}
LOOP = ASK + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "content": '{"temp":18}'}]
HERMES_TEMPLATE = (Path(__file__).parent / "data" / "hermes_template.jinja").read_text()


@pytest.fixture(scope="module")
def tok() -> GatewayTokenizer:
    return GatewayTokenizer(resolve_model_dir("smollm2"))


def _with_template(tmp_path_factory: pytest.TempPathFactory, tok: GatewayTokenizer, name: str,
                   template: str) -> GatewayTokenizer:
    """smollm2's tokenizer under another model family's chat template."""
    d = tmp_path_factory.mktemp(name)
    (d / "tokenizer.json").write_bytes((tok.directory / "tokenizer.json").read_bytes())
    (d / "chat_template.jinja").write_text(template)
    return GatewayTokenizer(d)


@pytest.fixture(scope="module")
def hermes_tok(tmp_path_factory: pytest.TempPathFactory, tok: GatewayTokenizer) -> GatewayTokenizer:
    return _with_template(tmp_path_factory, tok, "hermes", HERMES_TEMPLATE)


def _chat(tok: GatewayTokenizer, **fields: Any) -> Any:
    return parse_chat({"model": "m", "messages": ASK, **fields}, tok, 4096)


# ---- refusals ----------------------------------------------------------------------------------

def _fn(**over: Any) -> dict[str, Any]:
    return {"type": "function", "function": {**WEATHER["function"], **over}}


@pytest.mark.parametrize("fields, param, code", [
    ({"tools": [_fn(parameters={"type": "object", "properties": {"a": {"type": "strnig"}}})]},
     "tools[0].function.parameters", "invalid_function_parameters"),
    ({"tools": [_fn(parameters={"type": "string"})]}, "tools[0].function.parameters",
     "invalid_function_parameters"),
    ({"tools": [_fn(name="bad name")]}, "tools[0].function.name", "invalid_value"),
    ({"tools": [WEATHER, WEATHER]}, "tools", None),
    ({"tools": []}, "tools", None),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type", None),
    ({"tools": [_fn(extra=1)]}, "tools[0].function.extra", "unrecognized_argument"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "invalid_value"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    ({"tool_choice": "auto"}, "tool_choice", "invalid_value"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls", "invalid_value"),
    ({"tools": [WEATHER], "guided_regex": "a+"}, "tools", None),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "get_weather",
                                                                                      "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "invalid_value"),
    ({"messages": ASK + [{"role": "tool", "content": "x"}]}, "messages[1].tool_call_id", None),
    ({"messages": ASK + [{"role": "assistant", "content": "x", "refusal": "no"}]}, "messages[1].refusal", None),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls",
     "unrecognized_argument"),
])
def test_bad_tool_input_is_a_400_naming_the_param(tok: GatewayTokenizer, fields: dict[str, Any], param: str,
                                                  code: str | None) -> None:
    with pytest.raises(APIError) as e:
        _chat(tok, **fields)
    assert e.value.status == 400 and e.value.param == param, e.value.message
    if code is not None:
        assert e.value.code == code


def test_what_an_sdk_sends_back_is_accepted(tok: GatewayTokenizer) -> None:
    # The openai SDK's message object of an answer, appended to the conversation as agent loops do
    back = {"role": "assistant", "content": None, "refusal": None, "audio": None, "function_call": None,
            "annotations": [], "tool_calls": [CALL]}
    req = _chat(tok, messages=ASK + [back, LOOP[-1]], tools=[WEATHER])
    assert req.tools is not None and req.tools.mode == "auto"


# ---- prompts -----------------------------------------------------------------------------------

def test_generic_prompt_for_a_template_without_tool_syntax(tok: GatewayTokenizer) -> None:
    assert (tok.tool_format, tok.tool_role) == ("generic", "tool")
    text = tok.decode(_chat(tok, messages=LOOP, tools=[WEATHER, ADD]).prompt_ids, skip_special_tokens=False)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou can call these tools")
    assert json.dumps(WEATHER["function"]["parameters"]) in system and '"name": "add"' in system
    assert '<|im_start|>assistant\n<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}' \
           '\n</tool_call><|im_end|>' in text
    assert '<|im_start|>tool\n<tool_response>\n{"temp":18}\n</tool_response><|im_end|>' in text
    # no tools (or tool_choice none): the prompt is the template's own, as before tools existed
    plain = tok.decode(_chat(tok, tools=[WEATHER], tool_choice="none").prompt_ids, skip_special_tokens=False)
    assert plain == tok.render_chat(ASK)


def test_generic_prompt_does_not_depend_on_tool_choice(tok: GatewayTokenizer) -> None:
    # An agent asks with "required", then "auto": one prompt prefix, so the second turn hits the prefix cache.
    auto = _chat(tok, tools=[WEATHER, ADD]).prompt_ids
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        assert _chat(tok, tools=[WEATHER, ADD], tool_choice=choice).prompt_ids == auto


def test_native_prompt_for_a_hermes_template(hermes_tok: GatewayTokenizer) -> None:
    assert hermes_tok.tool_format == "native"
    text = hermes_tok.decode(_chat(hermes_tok, messages=LOOP, tools=[WEATHER]).prompt_ids, skip_special_tokens=False)
    assert json.dumps(WEATHER) in text  # the template listed the tools it was given
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}' in text  # arguments as an object
    assert "<tool_response>\n{\"temp\":18}\n</tool_response>" in text


# ---- the grammar -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ll_tok(tok: GatewayTokenizer) -> Any:
    from transformers import AutoTokenizer

    return llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(tok.directory))


def _accepts(ll_tok: Any, tok: GatewayTokenizer, spec: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(ll_tok, llguidance.LLMatcher.grammar_from_lark(json.loads(spec)["grammar"]))
    ok = matcher.consume_tokens(tok.encode(text))
    return bool(ok) and not matcher.is_error() and matcher.is_accepting()


def _call_text(name: str, args: dict[str, Any]) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args}, separators=(",", ":"))}\n</tool_call>'


def test_grammar_holds_calls_to_the_tools_and_their_schemas(tok: GatewayTokenizer, ll_tok: Any) -> None:
    good = _call_text("get_weather", {"city": "Paris", "unit": "c"})
    auto = _chat(tok, tools=[WEATHER, ADD]).sampling.structured
    required = _chat(tok, tools=[WEATHER, ADD], tool_choice="required").sampling.structured
    named = _chat(tok, tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}},
                  parallel_tool_calls=False).sampling.structured
    assert _accepts(ll_tok, tok, auto, good) and _accepts(ll_tok, tok, auto, "It is sunny.")
    assert _accepts(ll_tok, tok, auto, good + _call_text("add", {"a": 1, "b": 2}))  # parallel, generic: adjacent
    assert not _accepts(ll_tok, tok, auto, "<b>sunny</b>")  # text cannot start like a call
    assert not _accepts(ll_tok, tok, auto, _call_text("get_weather", {"city": "Paris", "unit": "k"}))
    assert not _accepts(ll_tok, tok, auto, _call_text("get_weather", {"city": "Paris"}))  # required argument
    assert not _accepts(ll_tok, tok, auto, _call_text("nope", {}))
    assert _accepts(ll_tok, tok, required, good) and not _accepts(ll_tok, tok, required, "It is sunny.")
    assert _accepts(ll_tok, tok, named, _call_text("add", {"a": 1, "b": 2}))
    assert not _accepts(ll_tok, tok, named, good)  # another function than the one named
    assert not _accepts(ll_tok, tok, named, _call_text("add", {"a": 1, "b": 2}) * 2)  # parallel_tool_calls false
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object", "properties": {
        "answer": {"type": "string"}}, "required": ["answer"]}}}
    shaped = _chat(tok, tools=[WEATHER], response_format=fmt).sampling.structured
    assert _accepts(ll_tok, tok, shaped, '{"answer":"sunny"}') and _accepts(ll_tok, tok, shaped, good)
    assert not _accepts(ll_tok, tok, shaped, "It is sunny.")


def test_arguments_hold_only_the_declared_properties(tok: GatewayTokenizer, ll_tok: Any) -> None:
    """ADD's schema says nothing of other keys; its calls still hold only ``a`` and ``b`` (vLLM's default too)."""
    required = _chat(tok, tools=[ADD], tool_choice="required").sampling.structured
    assert _accepts(ll_tok, tok, required, _call_text("add", {"a": 1, "b": 2}))
    assert not _accepts(ll_tok, tok, required, _call_text("add", {"a": 1, "b": 2, "c": 3}))
    assert not _accepts(ll_tok, tok, required, '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2,"a":1}}')


# ---- the parser --------------------------------------------------------------------------------

CALLS = (_call_text("get_weather", {"city": 'Pa"ris}{', "unit": "c"}) + "\n"
         + _call_text("add", {"a": 1, "b": [2, {"x": "]"}]}))


def _streamed(text: str, rng: random.Random) -> tuple[str, list[dict[str, Any]]]:
    p, content, deltas, i = ToolCallParser(), "", [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        c, d = p.feed(text[i:i + n], final=i + n >= len(text))
        content, i = content + c, i + n
        deltas += d
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:  # what the openai SDK's accumulation does
        call = calls.setdefault(d["index"], {"id": d.get("id"), "name": d["function"].get("name"), "arguments": ""})
        call["arguments"] += d["function"]["arguments"]
    return content, [calls[k] for k in sorted(calls)]


def test_streamed_fragments_add_up_to_the_whole_answer() -> None:
    rng = random.Random(0)
    whole = ToolCallParser()
    whole.feed(CALLS, final=True)
    expect = [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls()]
    assert expect == [("get_weather", '{"city":"Pa\\"ris}{","unit":"c"}'), ("add", '{"a":1,"b":[2,{"x":"]"}]}')]
    for _ in range(50):
        content, calls = _streamed(CALLS, rng)
        assert content == "" and [(c["name"], c["arguments"]) for c in calls] == expect
        assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in calls)
    assert _streamed("<b>bold</b> text", rng) == ("<b>bold</b> text", [])
    p = ToolCallParser()
    assert p.feed("<tool") == ("", [])  # might be a call: held back
    assert p.feed("s are", final=True) == ("<tools are", [])


def test_a_call_cut_by_max_tokens_keeps_what_was_generated() -> None:
    p = ToolCallParser()
    p.feed('<tool_call>\n{"name":"add","arguments":{"a":1,"b"', final=True)
    assert [c["function"] for c in p.tool_calls()] == [{"name": "add", "arguments": '{"a":1,"b"'}]


def test_json_scanner_finds_the_end_of_a_value() -> None:
    s = JsonScanner()
    assert s.feed('{"a": "}\\"') is None and s.feed('", "b": [1, {}]}, "x"') == 16
    assert JsonScanner().feed('"str\\"ing" ') == 10 and JsonScanner().feed("12}") == 2


def test_bodies_that_build_a_grammar_parse_off_the_event_loop() -> None:
    from gateway.api.generation_routes import parses_a_grammar

    assert parses_a_grammar({"messages": ASK, "tools": [WEATHER]})
    assert parses_a_grammar({"prompt": "x", "guided_regex": "a+"})
    assert parses_a_grammar({"messages": ASK, "response_format": {"type": "json_object"}})
    assert not parses_a_grammar({"messages": ASK, "tools": None}) and not parses_a_grammar({"messages": ASK})
    assert not parses_a_grammar(["not", "an", "object"])


LLAMA_TEMPLATE = (Path(__file__).parent / "data" / "llama3_json_template.jinja").read_text()


@pytest.fixture(scope="module")
def llama_tok(tmp_path_factory: pytest.TempPathFactory, tok: GatewayTokenizer) -> GatewayTokenizer:
    return _with_template(tmp_path_factory, tok, "llama-json", LLAMA_TEMPLATE)


def test_llama_json_format_prompt_grammar_and_parser(llama_tok: GatewayTokenizer, ll_tok: Any) -> None:
    assert llama_tok.tool_format == "llama_json"
    req = _chat(llama_tok, messages=LOOP, tools=[WEATHER, ADD])
    text = llama_tok.decode(req.prompt_ids, skip_special_tokens=False)
    assert '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}' in text  # the template's calls
    assert '<|im_start|>ipython\n{"temp":18}' in text and json.dumps(ADD) in text
    spec = req.sampling.structured
    call = json.dumps({"name": "add", "parameters": {"a": 1, "b": 2}}, separators=(",", ":"))
    assert _accepts(ll_tok, llama_tok, spec, call) and _accepts(ll_tok, llama_tok, spec, "It is sunny.")
    assert not _accepts(ll_tok, llama_tok, spec, call + call)  # Llama's JSON calling: one call an answer
    assert not _accepts(ll_tok, llama_tok, spec, '{"name":"add","arguments":{"a":1,"b":2}}')
    assert not _accepts(ll_tok, llama_tok, spec, "{not json")  # text may not start like a call
    assert req.tools is not None
    whole = ToolCallParser(req.tools.syntax)
    whole.feed(call, final=True)
    assert [c["function"] for c in whole.tool_calls()] == [{"name": "add", "arguments": '{"a":1,"b":2}'}]
    streamed = ToolCallParser(req.tools.syntax)
    got = [d for i in range(len(call)) for d in streamed.feed(call[i], final=i == len(call) - 1)[1]]
    assert got[0]["function"] == {"name": "add", "arguments": ""}
    assert "".join(d["function"]["arguments"] for d in got) == '{"a":1,"b":2}'
    assert ToolCallParser(req.tools.syntax).feed("Sunny {maybe}", final=True) == ("Sunny {maybe}", [])
