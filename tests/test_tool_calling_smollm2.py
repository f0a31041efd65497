"""Agents unchanged, on the default model: ``kvgate serve --model smollm2`` (a template without tool syntax, so the
generic format) runs an agent framework's two-step tool loop (call, tool result, final answer; openai-agents from
PyPI, plain and streamed), the openai SDK's ``chat.completions.parse`` with a pydantic function tool, and the
README's tool-calling and Responses API examples as written."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import openai
import pydantic
import pytest

from tests.async_support import run_async
from tests.test_gateway_support import REPO, Server

pytestmark = pytest.mark.timeout(600)

ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(smollm2_server: Server) -> Server:
    """The session's smollm2 server (tests/test_gateway_support.py): loading the model is the slow part."""
    return smollm2_server


def weather_agent(model: Any) -> tuple[Any, list[str]]:
    """An openai-agents agent with one tool on ``model``, and the cities its tool was called with."""
    from agents import Agent, ModelSettings, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # its default exporter would post traces to api.openai.com
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return json.dumps({"city": city, "sky": "sunny", "temp_c": 18})

    # tool_choice "required" for the first turn; the framework resets it to auto once a tool ran (its default)
    return Agent(name="weather", instructions="You are a helpful assistant.", tools=[get_weather], model=model,
                 model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=64)), calls


def test_agent_framework_tool_loop(server: Server) -> None:
    from agents import OpenAIChatCompletionsModel, Runner

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key)
    agent, calls = weather_agent(OpenAIChatCompletionsModel(model="smollm2", openai_client=client))

    async def run() -> tuple[Any, Any]:
        plain = await Runner.run(agent, ASK, max_turns=4)
        streamed = Runner.run_streamed(agent, ASK, max_turns=4)
        async for _ in streamed.stream_events():
            pass
        return plain.final_output, streamed.final_output

    plain, streamed = run_async(run)
    assert calls == ["Paris", "Paris"]  # one call a run, with the argument the question gives
    assert "sunny" in plain.lower() and plain == streamed  # the answer uses the tool's result; greedy: the same


def test_sdk_parse_with_a_pydantic_function_tool(server: Server) -> None:
    class GetWeather(pydantic.BaseModel):
        city: str

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key)
    r = client.chat.completions.parse(model="smollm2", messages=[{"role": "user", "content": ASK}],
                                      tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required",
                                      temperature=0, max_tokens=64)
    call = (r.choices[0].message.tool_calls or [])[0]
    assert r.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "GetWeather" and call.function.parsed_arguments == GetWeather(city="Paris")


def _run_readme_example(server: Server, heading: str) -> None:
    readme = (REPO / "README.md").read_text()
    section = readme.split(heading, 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    os.environ["KVGATE_API_KEY"] = server.api_key
    try:
        exec(code.group(1).replace("http://127.0.0.1:8000", server.url), {})  # noqa: S102 - our own README
    finally:
        del os.environ["KVGATE_API_KEY"]


def test_readme_tool_calling_example_runs(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    _run_readme_example(server, "## Tool calling")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == 'get_weather {"city":"Paris"}'
    assert "sunny" in lines[1].lower()


def test_readme_responses_example_runs(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    _run_readme_example(server, "## Responses API")
    first, second, counted, items = capsys.readouterr().out.splitlines()
    assert "Paris" in first and "Rome" in second  # the second turn continued the first (previous_response_id)
    assert counted.strip() and items == "['And of Italy?']"
