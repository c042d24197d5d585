"""An agent framework's tool loop against `qllama serve` (slow suite): the OpenAI Agents SDK over
chat completions drives the demo model with a function tool. The first turn must call the tool
(tool_choice required: decoding is constrained to a valid call), the SDK runs it and sends the
result back (a `role: "tool"` message), and the run ends with the model's final answer.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import pytest

pydantic = pytest.importorskip("pydantic")
Field = pydantic.Field

pytestmark = pytest.mark.slow


def test_agents_sdk_tool_loop():
    agents = pytest.importorskip("agents")
    pytest.importorskip("llguidance")
    pytest.importorskip("starlette")
    from openai import AsyncOpenAI

    sys.path.insert(0, os.path.dirname(__file__))
    from _serve_cli import ServedCLI

    calls = []

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=20)]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny, 21 C in {city}"

    agents.set_tracing_disabled(True)
    server = ServedCLI("demo", "--chat-template", "chatml", "-np", "2", "-c", "2048")
    try:
        client = AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        model = agents.OpenAIChatCompletionsModel(model="demo", openai_client=client)
        agent = agents.Agent(
            name="weather", instructions="Answer with the weather tool.", tools=[get_weather], model=model,
            model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=60,
                                                parallel_tool_calls=False))
        result = agents.Runner.run_sync(agent, "What is the weather in Verona?", max_turns=8)
        assert calls and all(isinstance(c, str) for c in calls)  # the model called the tool, with valid arguments
        kinds = [item.type for item in result.new_items]
        assert "tool_call_item" in kinds and "tool_call_output_item" in kinds
        assert kinds.index("tool_call_output_item") < len(kinds) - 1  # the model spoke again after the result
        assert isinstance(result.final_output, str) and result.final_output
    finally:
        server.stop()
