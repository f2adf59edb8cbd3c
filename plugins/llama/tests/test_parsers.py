"""engine-llama's tool-call and reasoning parsers through the parser kit, on outputs written
by hand in each family's published format."""

from __future__ import annotations

import functools
import json
from typing import Any, ClassVar

from engine.cli import main
from engine.interfaces.tool_parser import Tool
from engine.testing.kit import ReasoningParserTests, ToolParserTests
from engine.testing.kit.parsers import ReasoningCase, ToolCase

WEATHER = Tool(
    "get_weather",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"],
    },
)
TIME = Tool("get_time", {"type": "object", "properties": {"timezone": {"type": "string"}}})
SEARCH = Tool(
    "search",
    {
        "type": "object",
        "properties": {"query": {"type": "string"}, "filters": {"type": "object"}},
        "required": ["query"],
    },
)
TOOLS = (WEATHER, TIME, SEARCH)


@functools.cache
def llama_components() -> Any:
    from engine.plugins.manager import get_plugin_manager

    return get_plugin_manager(["llama"]).components()


class LlamaPlugin:
    """The kit loads the plugin again for every parser it builds (once per cutting of every
    case); the plugin's components are loaded once here instead."""

    plugin = "llama"

    def components(self) -> Any:
        return llama_components()


# Arguments whose strings hold what a careless reader trips on: braces, quotes, backslashes,
# the format's own markers, and text outside ASCII (escaped and as is).
TRICKY_JSON = (
    r'{"query": "say \"}\" then {\"a\": [1]} and </tool_call> [TOOL_CALLS] ; done\\",'
    r' "filters": {"lang": "日本語", "note": "caf\u00e9 \ud83c\udf75", "tags": ["x", {"deep": [1, 2.5, null, true]}]}}'
)
TRICKY = {
    "query": 'say "}" then {"a": [1]} and </tool_call> [TOOL_CALLS] ; done\\',
    "filters": {"lang": "日本語", "note": "café 🍵", "tags": ["x", {"deep": [1, 2.5, None, True]}]},
}


# -------------------------------------------------------------------------
# hermes: the Qwen2.5 / Qwen3 chat templates
# -------------------------------------------------------------------------
# Their system prompt: "For each function call, return a json object with function name and
# arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>,
# "arguments": <args-json-object>}\n</tool_call>"; earlier calls are written back as
# '<tool_call>\n{"name": "' + name + '", "arguments": ' + arguments + '}\n</tool_call>', a
# newline before each call that follows content or another call.


class TestHermesKit(LlamaPlugin, ToolParserTests):
    parser_name = "hermes"
    tools = TOOLS
    cases = (
        ToolCase(
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
            "",
            (("get_weather", {"city": "Paris", "unit": "celsius"}),),
        ),
        ToolCase(  # text before parallel calls
            "Let me check both cities.\n"
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "fahrenheit"}}\n</tool_call>',
            "Let me check both cities.\n",
            (("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tokyo", "unit": "fahrenheit"})),
        ),
        ToolCase(
            '<tool_call>\n{"name": "search", "arguments": ' + TRICKY_JSON + "}\n</tool_call>",
            "",
            (("search", TRICKY),),
        ),
        ToolCase(  # compact, no newlines; empty arguments; then a closing remark
            '<tool_call>{"name":"get_time","arguments":{}}</tool_call>\nThat is all.',
            "\nThat is all.",
            (("get_time", {}),),
        ),
        ToolCase(  # a malformed block among calls is content; the calls around it still count
            '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>\n',
            '\n<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>\n',
            (("get_time", {"timezone": "UTC"}), ("get_weather", {"city": "Lima"})),
        ),
        ToolCase(  # key order as the model chose it; extra whitespace inside the tags
            '<tool_call>  \n{\n  "arguments": {"timezone": "Asia/Tokyo"},\n  "name": "get_time"\n}\n  </tool_call>',
            "",
            (("get_time", {"timezone": "Asia/Tokyo"}),),
        ),
        ToolCase(
            "A plain answer mentioning <tool_ and </tool_call> in passing.",
            "A plain answer mentioning <tool_ and </tool_call> in passing.",
        ),
    )
    malformed = (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut short
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',  # cut short before the closing tag
        '<tool_call>\n{"name": "get_weather", "arguments": ["Paris"]}\n</tool_call>',  # arguments not an object
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_cal>',  # unknown closing
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</function>\nmore',  # unknown closing
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',  # a brace missing
        '<tool_call>\n{"name": "get_weather", "arguments": {\'city\': \'Paris\'}}\n</tool_call>',  # not JSON
        '<tool_call>\nget_weather(city="Paris")\n</tool_call>',  # not an object at all
    )


def test_hermes_keeps_the_arguments_text_as_written():
    from engine_llama.parsers import HermesToolParser

    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Z\\u00fcrich" ,  "unit": "celsius"}}\n</tool_call>'
    )
    (call,) = HermesToolParser(TOOLS).parse(text).tool_calls
    assert call.arguments == '{"city":"Z\\u00fcrich" ,  "unit": "celsius"}'


def test_hermes_calls_become_certain_at_their_closing_tag():
    from engine_llama.parsers import HermesToolParser

    parser = HermesToolParser(TOOLS)
    text = 'Hi.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call'
    assert parser.parse_partial(text).tool_calls == ()
    assert parser.parse_partial(text).content == "Hi.\n"
    assert [c.name for c in parser.parse_partial(text + ">").tool_calls] == ["get_time"]


# -------------------------------------------------------------------------
# llama3_json: the Llama 3.1 / 3.2 / 3.3 chat templates
# -------------------------------------------------------------------------
# Their prompt: "Respond in the format {"name": function name, "parameters": dictionary of
# argument name and its value}. Do not use variables."; an earlier call is written back as
# '{"name": "' + name + '", "parameters": ' + arguments | tojson + '}' and a built-in tool's
# call after <|python_tag|>. Several calls joined by "; " are what vLLM's llama3_json reads.


class TestLlama3JsonKit(LlamaPlugin, ToolParserTests):
    parser_name = "llama3_json"
    tools = TOOLS
    cases = (
        ToolCase(
            '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
            "",
            (("get_weather", {"city": "Paris", "unit": "celsius"}),),
        ),
        ToolCase(
            '<|python_tag|>{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}',
            "",
            (("get_time", {"timezone": "Europe/Paris"}),),
        ),
        ToolCase(  # parallel calls
            '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "get_time", "parameters": {"timezone": "Asia/Tokyo"}}',
            "",
            (("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Asia/Tokyo"})),
        ),
        ToolCase('\n\n{"name": "search", "parameters": ' + TRICKY_JSON + "}\n", "", (("search", TRICKY),)),
        ToolCase('{"name": "get_time", "arguments": {}}', "", (("get_time", {}),)),  # vLLM's other key
        ToolCase(  # prose first: JSON inside prose is no call
            'Sure! {"name": "get_weather", "parameters": {"city": "Paris"}}',
            'Sure! {"name": "get_weather", "parameters": {"city": "Paris"}}',
        ),
        ToolCase("The weather in Paris is sunny.", "The weather in Paris is sunny."),
    )
    malformed = (
        '{"name": "get_weather", "parameters": {"city": "Par',  # cut short
        '{"name": "get_weather", "parameters": "Paris"}',  # parameters not an object
        '{"name": "get_weather", "parameters": {"city": "Paris"}}\nThat should do it.',  # prose after the call
        '{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}',  # comma
        '{"name": "get_weather", "parameters": {"city": "Paris"}};',  # a separator and no call after it
        '{"name": "get_time", "parameters": {}, "arguments": {}}',  # both keys
        '{"name": ["get_time"], "parameters": {}}',  # name not a string
        '{"city": "Paris"}',  # no name
        '<|python_tag|>brave_search.call(query="weather in Paris")',  # a built-in tool's Python call
    )


# -------------------------------------------------------------------------
# mistral: mistral_common's instruct tokenizers
# -------------------------------------------------------------------------
# V2/V3/V7 write [TOOL_CALLS] + json.dumps([{"name", "arguments"(, "id" from V3)}]);
# V11 writes, per call, [TOOL_CALLS] name [CALL_ID] id [ARGS] json.dumps(arguments);
# V13 the same without the id. Text before the calls is allowed from V7 on.


class TestMistralKit(LlamaPlugin, ToolParserTests):
    parser_name = "mistral"
    tools = TOOLS
    cases = (
        ToolCase(
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
            "",
            (("get_weather", {"city": "Paris", "unit": "celsius"}),),
            ids=(None,),
        ),
        ToolCase(  # SentencePiece's space after the control token; ids; parallel calls in one list
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"},'
            ' {"name": "get_time", "arguments": {"timezone": "UTC"}, "id": "Z9y8X7w6v"}]',
            "",
            (("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "UTC"})),
            ids=("a1B2c3D4e", "Z9y8X7w6v"),
        ),
        ToolCase(  # text before the calls (V7)
            'Let me look that up.[TOOL_CALLS][{"name": "search", "arguments": ' + TRICKY_JSON + "}]",
            "Let me look that up.",
            (("search", TRICKY),),
        ),
        ToolCase(  # V11
            '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}'
            "[TOOL_CALLS]get_time[CALL_ID]Z9y8X7w6v[ARGS]{}",
            "",
            (("get_weather", {"city": "Paris"}), ("get_time", {})),
            ids=("a1B2c3D4e", "Z9y8X7w6v"),
        ),
        ToolCase(  # V13, after text
            'I will check.[TOOL_CALLS]get_weather[ARGS]{"city": "Tokyo", "unit": "fahrenheit"}'
            "[TOOL_CALLS]search[ARGS]" + TRICKY_JSON,
            "I will check.",
            (("get_weather", {"city": "Tokyo", "unit": "fahrenheit"}), ("search", TRICKY)),
            ids=(None, None),
        ),
        ToolCase(  # a malformed group among calls is content
            '[TOOL_CALLS]get_weather[ARGS]"Paris"[TOOL_CALLS]get_time[ARGS]{"timezone": "UTC"}',
            '[TOOL_CALLS]get_weather[ARGS]"Paris"',
            (("get_time", {"timezone": "UTC"}),),
        ),
    )
    malformed = (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',  # cut short
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}',  # cut short: the list not closed
        '[TOOL_CALLS]get_weather[ARGS]["Paris"]',  # arguments not an object
        '[TOOL_CALLS][{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}]',  # arguments a string
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"} and more text',  # unknown closing
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]</s>',  # unknown closing
        '[TOOL_CALLS]get_weather{"city": "Paris"}',  # no [ARGS]
        '[TOOL_CALLS][{"arguments": {}}]',  # no name
        "Sure.[TOOL_CALLS]",  # nothing after the marker
        "[TOOL_CALLS][]",  # no call in the list
    )


# -------------------------------------------------------------------------
# qwen3 reasoning
# -------------------------------------------------------------------------
# Qwen3's template: an assistant turn is '<think>\n' + reasoning + '\n</think>\n\n' + answer;
# with enable_thinking=False the generation prompt is '<|im_start|>assistant\n<think>\n\n</think>\n\n';
# the thinking-2507 templates end it with '<|im_start|>assistant\n<think>\n'.

PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
PROMPT_NO_THINKING = PROMPT + "<think>\n\n</think>\n\n"
PROMPT_2507 = PROMPT + "<think>\n"


@functools.cache
def marker_tokenizer() -> Any:
    """A small byte-level tokenizer with Qwen3's markers as added tokens that are not special
    (as in Qwen3's tokenizer, ids 151667 and 151668)."""
    from engine.testing.checkpoints import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer(300)
    tokenizer.add_tokens(["<think>", "</think>"])
    return tokenizer


class TestQwen3ReasoningKit(LlamaPlugin, ReasoningParserTests):
    parser_name = "qwen3"
    tokenizer: ClassVar[Any] = staticmethod(marker_tokenizer)
    cases = (
        ReasoningCase(
            "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?",
            "\nThe user greets me.\n",
            "Hello! How can I help?",
            prompt=PROMPT,
        ),
        ReasoningCase("The user greets me.\n</think>\n\nHello!", "The user greets me.\n", "Hello!", prompt=PROMPT_2507),
        ReasoningCase("Hello!\n\nHow can I help?", None, "Hello!\n\nHow can I help?", prompt=PROMPT_NO_THINKING),
        ReasoningCase("Hello!", None, "Hello!"),
        ReasoningCase(
            "Let me think about 2 < 3 and </thi", "Let me think about 2 < 3 and </thi", "", prompt=PROMPT_2507
        ),
        ReasoningCase(  # the answer keeps its own newlines, and a later </think> is the answer's
            "<think>\n\n</think>\n\n\nLine one.\n\nSay </think> twice.\n",
            "\n\n",
            "Line one.\n\nSay </think> twice.\n",
        ),
        ReasoningCase(
            "Need the weather.\n</think>\n\n<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            "Need the weather.\n",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            prompt=PROMPT_2507,
        ),
        ReasoningCase("  <think>Short.</think>  Spaces stay.", "Short.", "  Spaces stay."),
    )


# -------------------------------------------------------------------------
# what the plugin declares
# -------------------------------------------------------------------------


def test_engine_plugins_lists_the_parsers(capsys):
    assert main(["plugins", "--plugins", "llama", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (llama,) = [p for p in report["plugins"] if p["name"] == "llama"]
    assert llama["components"]["tool_parsers"] == ["hermes", "llama3_json", "mistral"]
    assert llama["components"]["reasoning_parsers"] == ["qwen3"]
    targets = {(e["name"], e["target"]) for e in report["components"]["tool_parsers"]}
    assert ("hermes", "engine_llama.parsers:HermesToolParser") in targets


def test_each_family_names_its_parsers():
    from engine_llama import model

    assert model.LlamaForCausalLM.tool_parser == "llama3_json"
    assert model.MistralForCausalLM.tool_parser == "mistral"
    assert model.Qwen2ForCausalLM.tool_parser == model.Qwen3ForCausalLM.tool_parser == "hermes"
    assert (model.Qwen3ForCausalLM.reasoning_parser, model.Qwen2ForCausalLM.reasoning_parser) == ("qwen3", None)


def test_mistral_parallel_structures_read_back_as_one_sequence():
    from engine_llama.parsers import MistralToolParser

    parser = MistralToolParser(TOOLS)
    by_name = {s["begin"]: s for s in parser.structural_tag(TOOLS, parallel=True)["structures"]}
    weather, time = (next(s for b, s in by_name.items() if name in b) for name in ("get_weather", "get_time"))
    text = weather["begin"] + '{"city": "Oslo"}' + weather["end"] + time["begin"] + "{}" + time["end"]
    parsed = parser.parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert parsed.content == ""


def test_llama3_prose_streams_as_soon_as_it_cannot_be_a_call():
    from engine_llama.parsers import Llama3JsonToolParser

    parser = Llama3JsonToolParser(TOOLS)
    assert parser.parse_partial("\n").content == ""  # a call may follow
    assert parser.parse_partial('{"name": "get_time", "parameters": {}}').content == ""  # prose may follow
    assert parser.parse_partial("The answer {").content == "The answer {"
    assert parser.parse_partial('{"name": "get_time", "parameters": {}} and').content.endswith(" and")
