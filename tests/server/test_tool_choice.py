"""``tool_choice`` ``required`` and a named function force a call even from models that know
nothing of tools: the built-in demo model and a random-weight Llama. Each of 100 sampled
requests must come back as a call of a declared function whose arguments validate with
``jsonschema`` against that function's parameters."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from server_helpers import API_KEY, engine_config, make_chat_checkpoint

from engine.builtin_models import DEMO_MODEL_DIR

REQUESTS = 100
CONCURRENT = 25
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "minLength": 1, "maxLength": 10},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "set_alarm",
            "parameters": {
                "type": "object",
                "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}, "loud": {"type": "boolean"}},
                "required": ["hour"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module", params=["demo", "random-llama"])
def server(request, tmp_path_factory):
    from engine.config import ServerConfig
    from engine.entrypoints.serve import start_server

    path = DEMO_MODEL_DIR if request.param == "demo" else make_chat_checkpoint(tmp_path_factory.mktemp("llama"))
    config = engine_config(path, plugins=["cpu", "llama", "xgrammar"], structured_output_disable_any_whitespace=True)
    running = start_server(config, ServerConfig(port=0, api_key=API_KEY, served_model_name="m"))
    yield running
    running.stop()


def _run(server, choice, parallel: bool) -> list:
    import openai

    async def main():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0) as client:
            gate = asyncio.Semaphore(CONCURRENT)

            async def one(seed: int):
                async with gate:
                    return await client.chat.completions.create(
                        model="m",
                        messages=[{"role": "user", "content": f"Request {seed}: do something."}],
                        tools=TOOLS,
                        tool_choice=choice,
                        parallel_tool_calls=parallel,
                        max_tokens=120,
                        temperature=1.0,
                        seed=seed,
                    )

            return await asyncio.gather(*(one(seed) for seed in range(REQUESTS)))

    return asyncio.run(main())


@pytest.mark.parametrize(
    "choice, parallel",
    [
        ("required", False),
        ("required", True),
        ({"type": "function", "function": {"name": "set_alarm"}}, True),
    ],
    ids=["required", "required-parallel", "named"],
)
def test_every_forced_request_is_a_valid_call(server, choice, parallel):
    responses = _run(server, choice, parallel)
    for response in responses:
        message = response.choices[0].message
        assert message.tool_calls, (message.content, response.choices[0].finish_reason)
        if not parallel:
            assert len(message.tool_calls) == 1
            assert response.choices[0].finish_reason == "tool_calls"
        for call in message.tool_calls:
            if isinstance(choice, dict):
                assert call.function.name == choice["function"]["name"]
            arguments = json.loads(call.function.arguments)
            jsonschema.validate(arguments, SCHEMAS[call.function.name])
