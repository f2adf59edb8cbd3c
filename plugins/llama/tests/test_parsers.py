"""engine-llama's tool-call and reasoning parsers through the parser kit, on outputs written
by hand in each family's published format."""

from __future__ import annotations

import functools
import json
from typing import Any, ClassVar

from engine.cli import main
from engine.interfaces.tool_parser import Tool, ToolCall, ToolCallDelta
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


def test_hermes_reports_a_call_before_its_closing_tag_and_content_only_once_certain():
    from engine_llama.parsers import HermesToolParser

    parser = HermesToolParser(TOOLS)
    text = 'Hi.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call'
    assert parser.parse_partial(text).content == "Hi.\n"
    assert parser.parse_partial(text).tool_calls == (ToolCall("get_time", "{}"),)
    assert parser.parse_partial('<tool_call>\n{"name": "get_ti').tool_calls == ()  # the name is not complete
    # the arguments so far, never the wrapper's closing brace
    assert parser.parse_partial('<tool_call>{"name": "get_time", "arguments": {"timezone": "UT').tool_calls == (
        ToolCall("get_time", '{"timezone": "UT'),
    )
    assert parser.parse_partial('<tool_call>{"name": "get_time", "arguments": {}}').tool_calls == (
        ToolCall("get_time", "{}"),
    )
    # arguments first: the call waits for its name, then comes with all the arguments written
    assert parser.parse_partial('<tool_call>{"arguments": {"timezone": "UTC"}, "name": "get_t').tool_calls == ()
    assert parser.parse_partial('<tool_call>{"arguments": {"timezone": "UTC"}, "name": "get_time"').tool_calls == (
        ToolCall("get_time", '{"timezone": "UTC"}'),
    )
    # what can no longer be a call is no call, even before the block ends
    assert parser.parse_partial('<tool_call>{"name": "get_time", "arguments": "UT').tool_calls == ()
    assert parser.parse_partial('<tool_call>{"name": 3, "arguments": {').tool_calls == ()


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


# -------------------------------------------------------------------------
# incremental streaming
# -------------------------------------------------------------------------
# A stream opens a call (name, and id where the format gives one) as soon as the name is
# complete, then sends the arguments in fragments as the model writes them.


def fed_a_character_at_a_time(parser: Any, text: str) -> list[tuple[int, Any]]:
    """``(characters fed so far, the delta)`` for every delta with a call in it."""
    stream, got = parser.streamer(), []
    for n, ch in enumerate(text, 1):
        got.append((n, stream.feed(ch)))
    got.append((len(text), stream.finish()))
    return [(n, delta) for n, delta in got if delta.tool_calls]


def assert_streams_incrementally(parser: Any, text: str, call_ids: tuple[str | None, ...] | None = None) -> None:
    """Each call of ``text`` opens before its arguments are complete, with its name (and
    id), and its arguments come in more than one fragment, adding up to the whole-text
    parse's arguments."""
    whole = parser.parse(text).tool_calls
    assert whole
    deltas = fed_a_character_at_a_time(parser, text)
    for index, call in enumerate(whole):
        mine = [(n, d) for n, delta in deltas for d in delta.tool_calls if d.index == index]
        (opened_at, opening), rest = mine[0], mine[1:]
        assert (opening.name, opening.id) == (call.name, call.id)
        assert all(d.name is None and d.id is None for _, d in rest)
        args_end = text.index(call.arguments, text.index(call.name)) + len(call.arguments)
        assert opened_at < args_end, f"call {index} opened only once its arguments were complete"
        fragments = [d.arguments for _, d in mine if d.arguments]
        assert len(fragments) > 1 and "".join(fragments) == call.arguments, fragments
    if call_ids is not None:
        assert tuple(call.id for call in whole) == call_ids


def test_hermes_streams_a_call_incrementally():
    from engine_llama.parsers import HermesToolParser

    text = (
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "search", "arguments": ' + TRICKY_JSON + "}\n</tool_call>"
    )
    assert_streams_incrementally(HermesToolParser(TOOLS), text)
    # the name once complete, and not a character of the wrapper's "}" or of </tool_call> in the arguments
    deltas = fed_a_character_at_a_time(HermesToolParser(TOOLS), text)
    first_open = deltas[0][0]
    assert text[:first_open].endswith('"get_weather"')


def test_hermes_streams_arguments_written_before_the_name_once_the_name_is_complete():
    from engine_llama.parsers import HermesToolParser

    text = '<tool_call>\n{"arguments": {"timezone": "Asia/Tokyo"}, "name": "get_time"}\n</tool_call>'
    deltas = fed_a_character_at_a_time(HermesToolParser(TOOLS), text)
    (n, first), *_ = deltas
    assert text[:n].endswith('"get_time"')
    assert first.tool_calls == (ToolCallDelta(0, "get_time", None, '{"timezone": "Asia/Tokyo"}'),)


def test_mistral_streams_calls_incrementally_with_their_ids():
    from engine_llama.parsers import MistralToolParser

    v11 = (
        '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris", "unit": "celsius"}'
        "[TOOL_CALLS]search[CALL_ID]Z9y8X7w6v[ARGS]" + TRICKY_JSON
    )
    assert_streams_incrementally(MistralToolParser(TOOLS), v11, ("a1B2c3D4e", "Z9y8X7w6v"))
    v13 = 'I will check.[TOOL_CALLS]get_weather[ARGS]{"city": "Tokyo", "unit": "fahrenheit"}'
    assert_streams_incrementally(MistralToolParser(TOOLS), v13, (None,))
    # the list form, when the id comes before the arguments (or is not given, see below)
    listed = (
        '[TOOL_CALLS] [{"name": "get_weather", "id": "a1B2c3D4e", "arguments": {"city": "Paris"}},'
        ' {"id": "Z9y8X7w6v", "name": "search", "arguments": ' + TRICKY_JSON + "}]"
    )
    assert_streams_incrementally(MistralToolParser(TOOLS), listed, ("a1B2c3D4e", "Z9y8X7w6v"))


def test_mistral_list_calls_open_with_their_ids():
    """In the list form the id must come with the name: a call whose id follows its
    arguments (as mistral_common writes them), or that has none, opens as its object
    closes, whole, before the list closes."""
    from engine_llama.parsers import MistralToolParser

    text = (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"},'
        ' {"name": "get_time", "arguments": {"timezone": "UTC"}}]'
    )
    deltas = fed_a_character_at_a_time(MistralToolParser(TOOLS), text)
    assert [d.tool_calls for _, d in deltas] == [
        (ToolCallDelta(0, "get_weather", "a1B2c3D4e", '{"city": "Paris"}'),),
        (ToolCallDelta(1, "get_time", None, '{"timezone": "UTC"}'),),
    ]
    assert text[: deltas[0][0]].endswith('"id": "a1B2c3D4e"')  # before the object's "}"
    assert text[: deltas[1][0]].endswith('"arguments": {"timezone": "UTC"}}')  # before the list's "]"


def test_mistral_opens_a_call_once_its_arguments_object_begins():
    from engine_llama.parsers import MistralToolParser

    parser = MistralToolParser(TOOLS)
    assert parser.parse_partial("[TOOL_CALLS]get_weather[CALL_ID]a1B2").tool_calls == ()
    assert parser.parse_partial("[TOOL_CALLS]get_weather[CALL_ID]a1B2[ARGS]").tool_calls == ()
    assert parser.parse_partial('[TOOL_CALLS]get_weather[CALL_ID]a1B2[ARGS]{"ci').tool_calls == (
        ToolCall("get_weather", '{"ci', "a1B2"),
    )
    assert parser.parse_partial('[TOOL_CALLS]get_weather[ARGS]"Paris"').tool_calls == ()  # no object: no call


def test_llama3_streams_calls_incrementally():
    from engine_llama.parsers import Llama3JsonToolParser

    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "search", "parameters": ' + TRICKY_JSON + "}"
    )
    assert_streams_incrementally(Llama3JsonToolParser(TOOLS), text)
    assert_streams_incrementally(
        Llama3JsonToolParser(TOOLS), '\n{"name": "get_time", "arguments": {"timezone": "UTC"}}'
    )


def test_llama3_prose_after_a_call_it_opened_is_content_too():
    from engine_llama.parsers import Llama3JsonToolParser

    text = '{"name": "get_time", "parameters": {"timezone": "UTC"}}\nThat should do it.'
    stream = Llama3JsonToolParser(TOOLS).streamer()
    deltas = [*(stream.feed(ch) for ch in text), stream.finish()]
    assert [d.name for delta in deltas for d in delta.tool_calls if d.name] == ["get_time"]  # opened, not taken back
    assert "".join(delta.content for delta in deltas) == text
    assert Llama3JsonToolParser(TOOLS).parse(text).tool_calls == ()
    assert Llama3JsonToolParser(TOOLS).parse_partial('Sure! {"name": "get_time"').tool_calls == ()  # prose first


def test_mistral_makes_the_nine_character_ids_its_templates_accept_back():
    from engine_llama.parsers import MistralToolParser

    ids = {MistralToolParser(TOOLS).new_call_id("call_") for _ in range(50)}
    assert len(ids) == 50
    assert all(len(i) == 9 and i.isalnum() and i.isascii() for i in ids)
