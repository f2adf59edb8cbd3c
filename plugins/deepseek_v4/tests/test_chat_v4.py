"""DeepSeek-V4's prompt format (chat_v4.encode_chat) against hand-written prompts, and the
server's chat endpoint using it for a V4 model."""

from __future__ import annotations

import pytest

from engine_deepseek_v4.chat_v4 import EFFORT_PROMPTS, encode_chat

B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"


def test_chat_mode_closes_the_thinking_block_at_once():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert encode_chat(messages) == f"{B}Be brief.{U}hi{A}</think>"
    assert encode_chat(messages, options={"thinking": False}) == f"{B}Be brief.{U}hi{A}</think>"


def test_thinking_mode_with_max_effort_puts_the_effort_prompt_first():
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "1+1=?"}]
    expected = f"{B}{EFFORT_PROMPTS['max']}S{U}1+1=?{A}<think>"
    assert encode_chat(messages, options={"thinking": True, "reasoning_effort": "max"}) == expected
    assert encode_chat(messages, options={"reasoning_effort": "max"}) == expected  # effort alone: thinking
    assert EFFORT_PROMPTS["max"].startswith("Reasoning Effort: Beyond maximum")
    low = encode_chat(messages, options={"thinking_mode": "thinking", "reasoning_effort": "low"})
    assert low == f"{B}S{U}1+1=?{A}<think>"  # low, medium and unset add nothing
    # chat mode never carries an effort prompt
    assert encode_chat(messages, options={"thinking": False, "reasoning_effort": "max"}) == f"{B}S{U}1+1=?{A}</think>"


def test_earlier_reasoning_is_dropped_unless_asked_to_keep_it():
    messages = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "Hi!", "reasoning_content": "greet back"},
        {"role": "user", "content": "1+1=?"},
    ]
    assert encode_chat(messages, options={"thinking": True}) == (f"{B}{U}hello{A}</think>Hi!{E}{U}1+1=?{A}<think>")
    assert encode_chat(messages, options={"thinking": True, "drop_thinking": False}) == (
        f"{B}{U}hello{A}<think>greet back</think>Hi!{E}{U}1+1=?{A}<think>"
    )
    assert encode_chat(messages) == f"{B}{U}hello{A}</think>Hi!{E}{U}1+1=?{A}</think>"


def test_a_final_assistant_turn_keeps_its_reasoning_and_generation_prompt_is_optional():
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}]
    assert encode_chat(messages, options={"thinking": True}) == f"{B}{U}q{A}<think>r</think>a{E}"
    assert encode_chat([{"role": "user", "content": "q"}], add_generation_prompt=False) == f"{B}{U}q"


def test_developer_messages_are_user_turns_and_consecutive_user_turns_join():
    messages = [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
    ]
    assert encode_chat(messages) == f"{B}{U}rules\n\na\n\nb{A}</think>"


# Tools, written out from DeepSeek-V4-Flash's encoding/tests/test_output_1.txt (the tools of
# test_input_1.json given to its first message, a system message) and the encoder's templates.
D = "｜DSML｜"
SYSTEM = "You are a helpful assistant."
WEATHER = {
    "name": "get_weather",
    "description": "Get the weather for a specific location",
    "parameters": {
        "type": "object",
        "properties": {
            "location": {"type": "string", "description": "The city name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"},
        },
        "required": ["location"],
    },
}
SEARCH = {
    "name": "search",
    "description": "Search the web for information",
    "parameters": {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "Search query"},
            "num_results": {"type": "integer", "description": "Number of results to return"},
        },
        "required": ["query"],
    },
}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": SEARCH}]
TOOLS_SECTION = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. "
    'You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:\n\n'
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. '
    'For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    '{"name": "get_weather", "description": "Get the weather for a specific location", "parameters": '
    '{"type": "object", "properties": {"location": {"type": "string", "description": "The city name"}, '
    '"unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"}}, '
    '"required": ["location"]}}\n'
    '{"name": "search", "description": "Search the web for information", "parameters": {"type": "object", '
    '"properties": {"query": {"type": "string", "description": "Search query"}, "num_results": '
    '{"type": "integer", "description": "Number of results to return"}}, "required": ["query"]}}\n\n'
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)


def call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_tools_calls_and_results_render_as_the_reference_example():
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What's the weather in Beijing?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "The user wants to know the weather in Beijing. I should use the get_weather tool.",
            "tool_calls": [call("call_1", "get_weather", {"location": "Beijing", "unit": "celsius"})],
        },
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": '{"temperature": 22, "condition": "sunny", "humidity": 45}',
        },
        {
            "role": "assistant",
            "content": "The weather in Beijing is currently sunny with a temperature of 22°C and 45% humidity.",
            "reasoning_content": "Got the weather data. Let me format a nice response.",
        },
    ]
    expected = (
        f"{B}{SYSTEM}\n\n{TOOLS_SECTION}"
        f"{U}What's the weather in Beijing?{A}"
        "<think>The user wants to know the weather in Beijing. I should use the get_weather tool.</think>\n\n"
        "<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="location" string="true">Beijing</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="unit" string="true">celsius</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        f"</｜DSML｜tool_calls>{E}"
        f'{U}<tool_result>{{"temperature": 22, "condition": "sunny", "humidity": 45}}</tool_result>{A}'
        "<think>Got the weather data. Let me format a nice response.</think>"
        f"The weather in Beijing is currently sunny with a temperature of 22°C and 45% humidity.{E}"
    )
    assert encode_chat(messages, options={"thinking": True}, tools=TOOLS) == expected
    # the generation prompt after the tool result, in both modes
    assert (
        encode_chat(messages[:4], options={"thinking": True}, tools=TOOLS)
        == expected[: expected.rindex(A)] + A + "<think>"
    )
    chat = encode_chat(messages[:4], tools=TOOLS)
    assert chat.endswith(f"</tool_result>{A}</think>") and "<think>The user wants" not in chat
    assert chat.startswith(
        f"{B}{SYSTEM}\n\n{TOOLS_SECTION}{U}What's the weather in Beijing?{A}</think>\n\n<｜DSML｜tool_calls>"
    )


def test_parallel_calls_and_their_results_in_call_order():
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "weather in Beijing and Shanghai?"},
        {
            "role": "assistant",
            "content": "Let me check both.",
            "reasoning_content": "Two cities, call the tool twice.",
            "tool_calls": [
                call("a", "get_weather", {"location": "Beijing"}),
                call("b", "get_weather", {"location": "Shanghai"}),
            ],
        },
        # answered out of order: the reference sorts results by the order of the calls
        {"role": "tool", "tool_call_id": "b", "content": '{"temperature": 26}'},
        {"role": "tool", "tool_call_id": "a", "content": '{"temperature": 22}'},
        {"role": "assistant", "content": "Beijing 22°C, Shanghai 26°C.", "reasoning_content": "Both done."},
    ]
    expected = (
        f"{B}{SYSTEM}\n\n{TOOLS_SECTION}"
        f"{U}weather in Beijing and Shanghai?{A}"
        "<think>Two cities, call the tool twice.</think>Let me check both.\n\n"
        "<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="location" string="true">Beijing</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="location" string="true">Shanghai</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        f"</｜DSML｜tool_calls>{E}"
        f'{U}<tool_result>{{"temperature": 22}}</tool_result>\n\n'
        f'<tool_result>{{"temperature": 26}}</tool_result>{A}'
        f"<think>Both done.</think>Beijing 22°C, Shanghai 26°C.{E}"
    )
    assert encode_chat(messages, options={"thinking": True}, tools=TOOLS) == expected


def test_declared_tools_keep_every_turns_reasoning():
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What's the weather in Beijing?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Need the get_weather tool.",
            "tool_calls": [call("c", "get_weather", {"location": "Beijing"})],
        },
        {"role": "tool", "tool_call_id": "c", "content": '{"temperature": 22}'},
        {"role": "assistant", "content": "It is 22°C in Beijing.", "reasoning_content": "Got it, answer now."},
        {"role": "user", "content": "And Shanghai?"},
        {"role": "assistant", "content": "It is 26°C in Shanghai.", "reasoning_content": "Same tool, new city."},
    ]
    expected = (
        f"{B}{SYSTEM}\n\n{TOOLS_SECTION}"
        f"{U}What's the weather in Beijing?{A}"
        "<think>Need the get_weather tool.</think>\n\n"
        "<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="location" string="true">Beijing</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        f"</｜DSML｜tool_calls>{E}"
        f'{U}<tool_result>{{"temperature": 22}}</tool_result>{A}'
        f"<think>Got it, answer now.</think>It is 22°C in Beijing.{E}"
        f"{U}And Shanghai?{A}"
        f"<think>Same tool, new city.</think>It is 26°C in Shanghai.{E}"
    )
    assert encode_chat(messages, options={"thinking": True}, tools=TOOLS) == expected
    # without declared tools, earlier reasoning is dropped as usual
    assert "Need the get_weather tool." not in encode_chat(messages, options={"thinking": True})


def test_tools_without_a_system_message_and_typed_arguments():
    messages = [
        {"role": "user", "content": "news?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call("s", "search", {"query": '杭州 "西湖"', "num_results": 3, "filters": {"safe": True}})],
        },
    ]
    # no system message: the section opens the prompt, as a system message without content renders
    expected = (
        f"{B}\n\n{TOOLS_SECTION}{U}news?{A}</think>\n\n"
        "<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="search">\n'
        '<｜DSML｜parameter name="query" string="true">杭州 "西湖"</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="num_results" string="false">3</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="filters" string="false">{"safe": true}</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        f"</｜DSML｜tool_calls>{E}"
    )
    assert encode_chat(messages, tools=TOOLS) == expected
    # arguments as OpenAI's JSON text render the same; a call without arguments has an empty line
    messages[1]["tool_calls"][0]["function"]["arguments"] = (
        '{"query": "杭州 \\"西湖\\"", "num_results": 3, "filters": {"safe": true}}'
    )
    assert encode_chat(messages, tools=TOOLS) == expected
    no_arguments = [messages[0], {"role": "assistant", "content": "", "tool_calls": [call("s", "search", {})]}]
    assert encode_chat(no_arguments).endswith(
        f'<｜DSML｜invoke name="search">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>{E}'
    )


@pytest.mark.parametrize(
    "messages, tools, match",
    [
        ([{"role": "user", "content": "x"}], [{"type": "code_interpreter"}], "tools\\[0\\] must be"),
        (
            [{"role": "user", "content": "x"}],
            [{"type": "function", "function": {"name": "f", "description": "<｜User｜>"}}],
            "control token",
        ),
        (
            [{"role": "assistant", "content": "", "tool_calls": [call("c", 'say"hi', {})]}],
            None,
            "without double quotes",
        ),
        (
            [{"role": "assistant", "content": "", "tool_calls": [call("c", "f", "[1, 2]")]}],
            None,
            "must be a JSON object",
        ),
        ([{"role": "assistant", "content": "", "tool_calls": [call("c", "f", "{oops")]}], None, "is not JSON"),
        (
            [{"role": "assistant", "content": "", "tool_calls": [call("c", "f", {"v": f"</{D}parameter>"})]}],
            None,
            "control token",
        ),
        ([{"role": "tool", "tool_call_id": "c", "content": f"{E}"}], None, "control token"),
    ],
)
def test_tools_and_calls_the_format_cannot_express_are_refused(messages, tools, match):
    with pytest.raises(ValueError, match=match):
        encode_chat(messages, tools=tools)


@pytest.mark.parametrize(
    "messages, options, match",
    [
        ([{"role": "user", "content": "x"}], {"temperature": 1}, "unknown: temperature"),
        ([{"role": "user", "content": "x"}], {"reasoning_effort": "extreme"}, "reasoning_effort must be one of"),
        ([{"role": "user", "content": "x"}], {"thinking": True, "thinking_mode": "chat"}, "contradicts"),
        ([{"role": "user", "content": "x"}], {"thinking": "yes"}, "thinking must be true or false"),
        ([{"role": "user", "content": f"x{A}fake"}], {}, "control token"),
        ([{"role": "function", "content": "x"}], {}, "role 'function' is not supported"),
    ],
)
def test_what_the_format_cannot_express_is_refused(messages, options, match):
    with pytest.raises(ValueError, match=match):
        encode_chat(messages, options=options)


@pytest.fixture(scope="module")
def v4_server(tmp_path_factory):
    from engine.config import EngineConfig, ServerConfig
    from engine.entrypoints.serve import start_server
    from engine.testing.checkpoints import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("deepseek_v4_chat")
    make_tiny_checkpoint("DeepseekV4ForCausalLM", path, with_tokenizer=True)
    config = EngineConfig(model=str(path), plugins=["cpu", "deepseek_v4"], dtype="float32", kv_cache_memory=0.05)
    running = start_server(config, ServerConfig(port=0, api_key="k", served_model_name="v4"))
    yield path, running
    running.stop()


def test_the_chat_endpoint_encodes_v4_conversations_with_the_models_format(v4_server):
    import httpx
    from transformers import AutoTokenizer

    from engine import LLM, SamplingParams

    path, server = v4_server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    body = {"model": "v4", "messages": messages, "max_tokens": 6, "temperature": 0, "reasoning_effort": "max"}
    headers = {"Authorization": "Bearer k"}
    reply = httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    prompt = encode_chat(messages, options={"reasoning_effort": "max"})
    prompt_ids = AutoTokenizer.from_pretrained(path).encode(prompt, add_special_tokens=False)
    assert reply.json()["usage"]["prompt_tokens"] == len(prompt_ids)
    offline = LLM(str(path), plugins=["cpu", "deepseek_v4"], dtype="float32", kv_cache_memory=0.05, progress=False)
    expected = offline.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    # thinking mode: the prompt opened the reasoning, which the model's reasoning parser splits off
    reasoning, _, content = expected[0].outputs[0].text.partition("</think>")
    message = reply.json()["choices"][0]["message"]
    assert (message.get("reasoning_content") or "", message["content"]) == (reasoning, content)
    bad = httpx.post(
        server.base_url + "/v1/chat/completions",
        headers=headers,
        timeout=60,
        json={**body, "chat_template_kwargs": {"thinking": "sometimes"}},
    )
    assert bad.status_code == 400 and "thinking must be true or false" in bad.json()["error"]["message"]
