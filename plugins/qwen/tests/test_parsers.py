"""engine-qwen's qwen3_coder tool parser through the kit's ToolParserTests (every cutting of
each output streamed, against the whole parse and the expected calls), and its values read by
the tools' schemas."""

from __future__ import annotations

import json

from engine.interfaces.tool_parser import Tool
from engine.testing.kit import ToolCase, ToolParserTests

TOOLS = (
    Tool(
        "get_weather",
        {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
        },
    ),
    Tool("search", {"type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"}}}),
    Tool("get_time", {"type": "object", "properties": {}}),
)


def block(name: str, **params: str) -> str:
    inner = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{inner}</function>\n</tool_call>"


class TestQwen3CoderKit(ToolParserTests):
    plugin = "qwen"
    parser_name = "qwen3_coder"
    tools = TOOLS
    cases = (
        ToolCase(block("get_weather", city="Paris", days="3"), "", (("get_weather", {"city": "Paris", "days": 3}),)),
        ToolCase(  # text before parallel calls; a boolean; a string that looks like a number stays a string
            "Checking both.\n"
            + block("get_weather", city="Tokyo", metric="true")
            + "\n"
            + block("get_weather", city="42"),
            "Checking both.\n",
            (("get_weather", {"city": "Tokyo", "metric": True}), ("get_weather", {"city": "42"})),
        ),
        ToolCase(  # a multi-line string with tags in it, and a JSON object
            block("search", query='a "quoted" <b>line</b>\nand another', filters='{"year": 2024, "tags": ["x"]}'),
            "",
            (("search", {"query": 'a "quoted" <b>line</b>\nand another', "filters": {"year": 2024, "tags": ["x"]}}),),
        ),
        ToolCase(  # no parameters, then a closing remark
            "<tool_call>\n<function=get_time>\n</function>\n</tool_call>\nThat is all.",
            "\nThat is all.",
            (("get_time", {}),),
        ),
        ToolCase(  # a malformed block (text between parameters) among calls is content
            block("get_time")
            + "\n<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>\n"
            + block("get_weather", city="Lima"),
            "\n<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>\n",
            (("get_time", {}), ("get_weather", {"city": "Lima"})),
        ),
        ToolCase(
            "A plain answer mentioning <tool_ and </tool_call> in passing.",
            "A plain answer mentioning <tool_ and </tool_call> in passing.",
        ),
    )
    malformed = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n",  # cut short
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',  # Hermes JSON, not this format
    )


def test_values_follow_the_schema_and_unknown_tools_read_json_where_they_can():
    from engine_qwen.parsers.qwen3_coder import Qwen3CoderToolParser

    parsed = Qwen3CoderToolParser(TOOLS).parse(
        block("get_weather", city="null", days="x7") + block("other", n="1.5", s="plain text")
    )
    args = [json.loads(c.arguments) for c in parsed.tool_calls]
    assert args == [{"city": "null", "days": "x7"}, {"n": 1.5, "s": "plain text"}]
