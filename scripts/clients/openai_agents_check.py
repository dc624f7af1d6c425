"""openai-agents (the OpenAI Agents SDK, whose default model speaks the Responses API) against a
running `ddtree serve`: a plain run, a forced function tool, a pydantic output type and a streamed
run. Not in CI (a heavy client); tests/test_openai_conformance.py covers the SDK's own helpers.

    pip install openai-agents            # in a virtual environment
    ddtree serve --reasoning-parser qwen3 --tool-call-parser hermes &
    python scripts/clients/openai_agents_check.py --base-url http://localhost:30000/v1

The embedded pair writes code, not chat, so the runs are bounded by grammars (a regex, the tool's
enum, the output type's schema): an answer cut by max_output_tokens is `status: "incomplete"`,
which openai-agents raises on (as it does against OpenAI).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Literal

from agents import (
    Agent,
    ModelSettings,
    Runner,
    function_tool,
    set_default_openai_client,
    set_tracing_disabled,
)
from openai import AsyncOpenAI
from pydantic import BaseModel

WORD = {"regex": "[a-z]{2,6}"}  # a short answer the code model finishes


@function_tool
def get_weather(city: Literal["paris", "rome"]) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


class Verdict(BaseModel):
    ok: bool


async def main(base_url: str) -> None:
    set_default_openai_client(AsyncOpenAI(base_url=base_url, api_key="-"), use_for_tracing=False)
    set_tracing_disabled(True)
    settings = ModelSettings(max_tokens=16, temperature=0, extra_body=WORD)
    r = await Runner.run(Agent(name="plain", instructions="Answer.", model_settings=settings), "hi")
    print("plain:", repr(r.final_output))
    agent = Agent(
        name="tools",
        instructions="Use the tool.",
        tools=[get_weather],
        model_settings=ModelSettings(max_tokens=40, temperature=0, tool_choice="get_weather"),
        tool_use_behavior="stop_on_first_tool",
    )
    r = await Runner.run(agent, "Weather in Paris?", max_turns=3)
    print("tools:", [type(i).__name__ for i in r.new_items], repr(r.final_output))
    agent = Agent(
        name="typed",
        instructions="Reply as JSON.",
        output_type=Verdict,
        model_settings=ModelSettings(max_tokens=20, temperature=0),
    )
    print("output_type:", (await Runner.run(agent, "ok?")).final_output)
    agent = Agent(name="streamed", instructions="Answer.", model_settings=settings)
    run = Runner.run_streamed(agent, "hi")
    kinds = [event.type async for event in run.stream_events()]
    print("streamed:", len(kinds), "events,", repr(run.final_output))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--base-url", default="http://localhost:30000/v1")
    asyncio.run(main(ap.parse_args().base_url))
