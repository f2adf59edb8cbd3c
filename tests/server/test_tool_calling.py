"""Tool loops end to end: a scripted model (tests/server/scripted_model.py) that answers in a
model family's own tool-call format, served by ``engine serve`` with that family's parsers,
driven by the official ``openai`` and ``anthropic`` clients: a call (after a thinking
block), the tool's result sent back, the final answer; whole and streamed."""

from __future__ import annotations

import json

import pytest

from engine.builtin_models import DEMO_MODEL_DIR

API_KEY = "tools-key"
# renders declared tools, earlier calls (arguments as objects) and tool results, as families' templates do
TEMPLATE = (
    "{%- if tools %}<|system|>\nTools: {{ tools | tojson }}<|end|>\n{% endif %}"
    "{%- for m in messages %}<|{{ 'user' if m.role == 'tool' else m.role }}|>\n"
    "{%- if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>{% else %}{{ m.content }}{% endif %}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
THINKING = "The user wants the weather, so I call the tool."
ANSWER = "It is 22 degrees in Paris."
ARGS = {"city": "Paris", "unit": "c"}
RESULT = "22 degrees"
# the second turn's prompt holds the first call, its arguments rendered as an object, then its result
SECOND_TURN = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}</tool_call><|end|>\n<|user|><tool_response>22 degrees</tool_response>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    }
]
ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]

# each family's call of get_weather(ARGS) after a thinking block, and its final answer, as its chat
# template / model card writes them: (plugin, tool parser, reasoning parser, first reply, final reply)
CALL = json.dumps(ARGS)
THINK = f"<think>{THINKING}</think>"
K3_ARGS = "".join(
    f'<|open|>argument key="{k}" type="string"<|sep|>{v}<|close|>argument<|sep|>' for k, v in ARGS.items()
)
FAMILIES = {
    "hermes": (
        "llama",
        "qwen3",
        f'{THINK}<tool_call>\n{{"name": "get_weather", "arguments": {CALL}}}\n</tool_call>',
        ANSWER,
    ),
    "llama3_json": ("llama", "qwen3", f'{THINK}{{"name": "get_weather", "parameters": {CALL}}}', ANSWER),
    "mistral": ("llama", "qwen3", f'{THINK}[TOOL_CALLS][{{"name": "get_weather", "arguments": {CALL}}}]', ANSWER),
    "deepseek_v3": (
        "deepseek_v4",
        "deepseek_r1",
        f"{THINK}<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{CALL}\n```"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        ANSWER,
    ),
    "deepseek_v31": (
        "deepseek_v4",
        "deepseek_r1",
        f"{THINK}<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{CALL}<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜>",
        ANSWER,
    ),
    "deepseek_v4": (
        "deepseek_v4",
        "deepseek_r1",
        f'{THINK}\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        + "\n".join(f'<｜DSML｜parameter name="{k}" string="true">{v}</｜DSML｜parameter>' for k, v in ARGS.items())
        + "\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
        ANSWER,
    ),
    "kimi_k2": (
        "kimi_k3",
        "kimi",
        f"{THINK}<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        f"{CALL}<|tool_call_end|><|tool_calls_section_end|>",
        ANSWER,
    ),
    "kimi_k3": (
        "kimi_k3",
        "kimi_k3",
        f"<|open|>think<|sep|>{THINKING}<|close|>think<|sep|><|open|>tools<|sep|>"
        f'<|open|>call tool="get_weather" index="1"<|sep|>{K3_ARGS}<|close|>call<|sep|><|close|>tools<|sep|>'
        "<|close|>message<|sep|>",
        f"<|open|>response<|sep|>{ANSWER}<|close|>response<|sep|><|close|>message<|sep|>",
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    from scripted_model import make_scripted_checkpoint

    from engine.config import EngineConfig, ServerConfig
    from engine.entrypoints.serve import start_server

    tool_parser = request.param
    plugin, reasoning_parser, first, final = FAMILIES[tool_parser]
    script = [("", first), (SECOND_TURN, final)]
    path = make_scripted_checkpoint(
        tmp_path_factory.mktemp(f"scripted-{tool_parser}"),
        script,
        tokenizer_from=DEMO_MODEL_DIR,
        chat_template=TEMPLATE,
    )
    config = EngineConfig(
        model=str(path),
        plugins=["cpu", plugin, "scripted_model"],
        dtype="float32",
        kv_cache_memory=0.02,
        tool_call_parser=tool_parser,
        reasoning_parser=reasoning_parser,
    )
    running = start_server(config, ServerConfig(port=0, api_key=API_KEY, enable_auto_tool_choice=True))
    running.tool_parser = tool_parser
    yield running
    running.stop()


@pytest.fixture(scope="module")
def openai_client(family):
    import openai

    with openai.OpenAI(base_url=family.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def anthropic_client(family):
    import anthropic

    with anthropic.Anthropic(base_url=family.base_url, api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


def _model(client) -> str:
    return client.models.list().data[0].id


def _first_turn():
    return [{"role": "user", "content": "What is the weather in Paris?"}]


def check_id(family, call_id: str, prefix: str) -> None:
    """The format's own id where it has one, else one the server made (Mistral's templates
    take back nine letters and digits only)."""
    if family.tool_parser == "kimi_k2":
        assert call_id == "functions.get_weather:0"
    elif family.tool_parser == "mistral":
        assert len(call_id) == 9 and call_id.isalnum()
    else:
        assert call_id.startswith(prefix) and len(call_id) > len(prefix)


def test_openai_tool_loop(family, openai_client):
    model = _model(openai_client)
    messages = _first_turn()
    first = openai_client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=200)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.reasoning_content == THINKING
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    check_id(family, call.id, "call_")
    assert json.loads(call.function.arguments) == ARGS
    assert first.usage.completion_tokens_details.reasoning_tokens > 0

    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": RESULT},
    ]
    final = openai_client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=200)
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.content == ANSWER
    assert final.choices[0].message.tool_calls is None


def test_openai_tool_loop_streaming(openai_client):
    model = _model(openai_client)
    messages = _first_turn()
    with openai_client.chat.completions.stream(
        model=model, messages=messages, tools=TOOLS, max_tokens=200, stream_options={"include_usage": True}
    ) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        first = stream.get_final_completion()
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGS
    # the OpenAI streaming shape: the call's first delta has index, id, type and name; later ones only arguments
    deltas = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
    assert deltas[0].index == 0 and deltas[0].id == call.id and deltas[0].type == "function"
    assert deltas[0].function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    reasoning = "".join(getattr(ch.delta, "reasoning_content", None) or "" for c in chunks for ch in c.choices)
    assert reasoning == THINKING
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens > 0

    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": RESULT},
    ]
    with openai_client.chat.completions.stream(model=model, messages=messages, tools=TOOLS, max_tokens=200) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert final.choices[0].message.content == ANSWER and final.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "stream"])
def test_anthropic_tool_loop_with_thinking(family, anthropic_client, streaming):
    messages = _first_turn()
    kwargs = dict(
        model=_served(anthropic_client),
        max_tokens=300,
        tools=ANTHROPIC_TOOLS,
        thinking={"type": "enabled", "budget_tokens": 100},
    )

    def create(messages):
        if not streaming:
            return anthropic_client.messages.create(messages=messages, **kwargs)
        with anthropic_client.messages.stream(messages=messages, **kwargs) as stream:
            events = [event for event in stream if event.type == "content_block_delta"]
            final = stream.get_final_message()
        kinds = {event.delta.type for event in events}
        if any(block.type == "tool_use" for block in final.content):
            assert {"thinking_delta", "input_json_delta"} <= kinds, kinds
        return final

    first = create(messages)
    assert first.stop_reason == "tool_use"
    kinds = [block.type for block in first.content]
    assert kinds == ["thinking", "tool_use"], kinds
    assert first.content[0].thinking == THINKING
    use = first.content[1]
    assert use.name == "get_weather" and use.input == ARGS
    check_id(family, use.id, "toolu_")

    messages += [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]},
    ]
    final = create(messages)
    assert final.stop_reason == "end_turn"
    assert [block.type for block in final.content] == ["text"] and final.content[0].text == ANSWER


def _served(anthropic_client) -> str:
    import httpx

    base = str(anthropic_client.base_url).rstrip("/")
    return httpx.get(f"{base}/v1/models", headers={"x-api-key": API_KEY}).json()["data"][0]["id"]


def test_anthropic_count_tokens(anthropic_client):
    served = _served(anthropic_client)
    counted = anthropic_client.messages.count_tokens(model=served, messages=_first_turn(), tools=ANTHROPIC_TOOLS)
    bare = anthropic_client.messages.count_tokens(model=served, messages=_first_turn())
    assert counted.input_tokens > bare.input_tokens > 0  # the declared tools are part of the prompt
