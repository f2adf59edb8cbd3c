"""Kimi's tool-call and reasoning parsers through the kit's parser tests.

Every case is written by hand from the published formats:
- K2: MoonshotAI/Kimi-K2 docs/tool_call_guidance.md (markers, ``functions.NAME:IDX`` ids, the
  reader's whitespace) and Kimi-K2-Instruct's chat_template.jinja (how a turn's calls are
  written: no whitespace, arguments as given); the singular section markers and ids without
  ``functions.`` as vLLM's kimi_k2 parser accepts them.
- K3: the XTML channels as vLLM's and SGLang's kimi_k3 parsers document them (response
  channel, ``tools`` channel, typed ``argument`` tags, ``&amp;``/``&quot;`` in attributes).
- Reasoning: Kimi-K2-Thinking's template (the model opens ``<think>``), K2.5's (the prompt
  ends in ``<think>`` or, without thinking, ``<think></think>``), and K3's think channel.
"""

from __future__ import annotations

import json

from engine.interfaces.tool_parser import Tool
from engine.testing.kit.parsers import (
    ReasoningCase,
    ReasoningParserTests,
    ToolCase,
    ToolParserTests,
    arguments_so_far,
    streamed_calls,
)


class OneManagerPerTest:
    """The kit resolves the parser through a new plugin manager for each parser it builds
    (each cutting of each case); one manager per test finds the same class, much faster."""

    def components(self):
        if "_components" not in vars(self):
            self._components = super().components()
        return self._components


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
QUERY = {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}}

# Kimi K2

S, E = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
B, A, C = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
WEATHER_0 = f'{B}functions.get_weather:0{A}{{"city": "Beijing"}}{C}'

K2_CASES = (
    ToolCase(f"{S}{WEATHER_0}{E}", "", (("get_weather", {"city": "Beijing"}),), ("functions.get_weather:0",)),
    ToolCase(
        f'Let me check both cities.{S}{WEATHER_0}{B}functions.get_weather:1{A}{{"city": "Shanghai"}}{C}{E}',
        "Let me check both cities.",
        (("get_weather", {"city": "Beijing"}), ("get_weather", {"city": "Shanghai"})),
        ("functions.get_weather:0", "functions.get_weather:1"),
    ),
    # escapes, unicode, markup-like characters inside strings, nested values; the counter
    # continues across the conversation
    ToolCase(
        f'{S}{B}functions.search:7{A}{{"query": "say \\"hi\\" \\\\ caf\\u00e9 北京 😀 }} <|x|>", "limit": 3, '
        f'"filters": {{"tags": ["a", "b"], "exact": true, "near": null}}}}{C}{E}',
        "",
        (
            (
                "search",
                {
                    "query": 'say "hi" \\ café 北京 😀 } <|x|>',
                    "limit": 3,
                    "filters": {"tags": ["a", "b"], "exact": True, "near": None},
                },
            ),
        ),
        ("functions.search:7",),
    ),
    # whitespace the guide's reader allows around ids and arguments, and between calls
    ToolCase(
        f'Searching.\n{S}\n{B} functions.search:2 {A} {{"query": "kimi"}} {C}\n{B}functions.get_weather:3{A}\n{{"city": "Oslo"}}\n{C}\n{E}',
        "Searching.\n",
        (("search", {"query": "kimi"}), ("get_weather", {"city": "Oslo"})),
        ("functions.search:2", "functions.get_weather:3"),
    ),
    # the singular section markers, and an id without ``functions.``
    ToolCase(
        f'<|tool_call_section_begin|>{B}get_weather:0{A}{{"city": "Rome"}}{C}<|tool_call_section_end|>',
        "",
        (("get_weather", {"city": "Rome"}),),
        ("get_weather:0",),
    ),
    # the output stopped after its last call, before the section's end
    ToolCase(f"{S}{WEATHER_0}", "", (("get_weather", {"city": "Beijing"}),), ("functions.get_weather:0",)),
    # text after a section, then another section
    ToolCase(
        f'{S}{WEATHER_0}{E}Then the search: {S}{B}functions.search:1{A}{{"query": "kimi"}}{C}{E}',
        "Then the search: ",
        (("get_weather", {"city": "Beijing"}), ("search", {"query": "kimi"})),
        ("functions.get_weather:0", "functions.search:1"),
    ),
    # empty arguments
    ToolCase(f"{S}{B}functions.search:0{A}{{}}{C}{E}", "", (("search", {}),), ("functions.search:0",)),
)

K2_MALFORMED = (
    f'Let me look.{S}{B}functions.get_weather:0{A}{{"city": "Bei',  # cut short in the arguments
    f"{S}{B}functions.get_wea",  # cut short in the id
    f'{S}{B}functions.get_weather:0{A}{{"city": Beijing}}{C}{E}',  # not JSON
    f'{S}{B}functions.get_weather:0{A}["Beijing"]{C}{E}',  # not an object
    f'{S}{B}functions.get_weather{A}{{"city": "Beijing"}}{C}{E}',  # an id without its counter
    f'{S}{B}functions.get_weather:0{A}{{"city": "Paris"}}{B}functions.get_weather:1{A}{{"city"',  # both cut short
    f"{S}",
    f"A section with no call: {S} {E} and text after it.",
)


class TestKimiK2ToolParser(OneManagerPerTest, ToolParserTests):
    plugin = "kimi_k3"
    parser_name = "kimi_k2"
    tools = (Tool("get_weather", CITY), Tool("search", QUERY))
    cases = K2_CASES
    malformed = K2_MALFORMED


def streamed(calls: list[dict]) -> list[tuple[str, str | None, str]]:
    return [(c["name"], c["id"], "".join(fragment for _, fragment in c["fragments"])) for c in calls]


def streamed_content(parser, text: str) -> str:
    stream = parser.streamer()
    return "".join(stream.feed(ch).content for ch in text) + stream.finish().content


def k2_parser():
    from engine_kimi_k3.parsers.kimi_k2 import KimiK2ToolParser

    return KimiK2ToolParser(TestKimiK2ToolParser.tools)


def test_k2_streams_a_call_from_its_id_on():
    first, second = '{"city": "Beijing", "days": [1, 2]}', '{"query": "kimi"}'
    text = f"Checking.{S}{B}functions.get_weather:0{A} {first}\n{C}{B}functions.search:1{A}{second}{C}{E}"
    calls = streamed_calls(k2_parser(), text)
    assert streamed(calls) == [
        ("get_weather", "functions.get_weather:0", first),
        ("search", "functions.search:1", second),
    ]
    # name and id at the argument marker, before any argument
    opened = text.index(A) + len(A)
    assert calls[0]["opened"] == opened and arguments_so_far(calls[0], opened) == ""
    assert arguments_so_far(calls[0], text.index("Beijing") + 3) == '{"city": "Bei'
    assert len(calls[0]["fragments"]) > 3
    # nothing of the end marker (nor the whitespace before it): all of the object once it closes
    for at in range(text.index(first) + len(first), text.index(C) + len(C)):
        assert arguments_so_far(calls[0], at) == first
    assert calls[1]["opened"] == text.index(A, opened) + len(A)
    assert len(calls[1]["fragments"]) > 1


def test_k2_a_malformed_call_beside_a_good_one():
    """The malformed call is content, as written, and the good one is a call. A stream has
    opened the malformed one (its name and id came before its arguments went wrong) and
    cannot take it back; what it sends as content still adds up to the whole text's."""
    bad = f'{B}functions.get_weather:0{A}{{"city": Beijing}}{C}'
    text = f'Checking.{S}{bad}{B}functions.get_weather:1{A}{{"city": "Beijing"}}{C}{E}'
    parsed = k2_parser().parse(text)
    assert parsed.content == f"Checking.{bad}"
    assert [(c.name, c.arguments, c.id) for c in parsed.tool_calls] == [
        ("get_weather", '{"city": "Beijing"}', "functions.get_weather:1")
    ]
    assert streamed_calls(k2_parser(), text)[0]["id"] == "functions.get_weather:0"
    assert streamed_content(k2_parser(), text) == parsed.content


# Kimi K3 (XTML)

RO, RC, MC = "<|open|>response<|sep|>", "<|close|>response<|sep|>", "<|close|>message<|sep|>"
TO, TC, CC = "<|open|>tools<|sep|>", "<|close|>tools<|sep|>", "<|close|>call<|sep|>"


def arg(key: str, kind: str, value: str) -> str:
    return f'<|open|>argument key="{key}" type="{kind}"<|sep|>{value}<|close|>argument<|sep|>'


def call(tool: str, index: int, *args: str) -> str:
    return f'<|open|>call tool="{tool}" index="{index}"<|sep|>{"".join(args)}{CC}'


RAW_CODE = ' print("a\\\\b")\n{x} 北京 '  # raw text, as the model writes it
RAW_CALL = call(
    "run&amp;log",
    1,
    arg("code", "string", RAW_CODE),
    arg("opts", "object", '{"deep": [1, 2.5, {"k": null}]}'),
    arg("dry", "boolean", "true"),
    arg("say &quot;hi&quot;", "null", "null"),
    arg("ids", "array", "[3, 4]"),
)

K3_CASES = (
    ToolCase(
        f"{RO}On it.{RC}{TO}{call('get_weather', 1, arg('city', 'string', 'Beijing'), arg('days', 'number', '2'))}{TC}{MC}",
        "On it.",
        (("get_weather", {"city": "Beijing", "days": 2}),),
        (None,),
    ),
    # the prompt opened the response channel; two calls
    ToolCase(
        f"Checking both.{RC}{TO}{call('get_weather', 1, arg('city', 'string', 'Paris'))}"
        f"{call('search', 2, arg('query', 'string', 'louvre hours'), arg('limit', 'integer', '5'))}{TC}{MC}",
        "Checking both.",
        (("get_weather", {"city": "Paris"}), ("search", {"query": "louvre hours", "limit": 5})),
        (None, None),
    ),
    # a string is raw text (quotes, backslashes, newlines, braces, unicode, its whitespace);
    # other types are JSON; attributes escape & and "
    ToolCase(
        TO + RAW_CALL + TC,
        "",
        (
            (
                "run&log",
                {
                    "code": RAW_CODE,
                    "opts": {"deep": [1, 2.5, {"k": None}]},
                    "dry": True,
                    'say "hi"': None,
                    "ids": [3, 4],
                },
            ),
        ),
    ),
    # indentation between the tags, a call without arguments
    ToolCase(
        f'{RO}Time first.{RC}\n{TO}\n  {call("now", 1)}\n  <|open|>call tool="search" index="2"<|sep|>\n    {arg("query", "string", "x")}\n  {CC}\n{TC}',
        "Time first.\n",
        (("now", {}), ("search", {"query": "x"})),
    ),
    # an answer without calls
    ToolCase(f"{RO}Hello there.{RC}{MC}", "Hello there."),
    ToolCase(f"Hello there.{RC}{MC}", "Hello there."),
    # a malformed call beside a good one (a stream opens the malformed call, with "{", and the
    # good one then comes under its index: its name and arguments extend what was sent)
    ToolCase(
        f"{TO}{call('get_weather', 1, arg('days', 'number', 'two'))}{call('get_weather', 2, arg('city', 'string', 'Oslo'))}{TC}",
        call("get_weather", 1, arg("days", "number", "two")),
        (("get_weather", {"city": "Oslo"}),),
    ),
)

K3_MALFORMED = (
    f"{TO}{call('get_weather', 1)[: -len(CC)]}{arg('city', 'string', 'Bei')[:-10]}",  # cut short in an argument
    f"{TO}{call('get_weather', 1, arg('days', 'number', 'two'))}{TC}",  # not JSON
    f'{TO}<|open|>call index="1"<|sep|>{CC}{TC}',  # no tool
    f'{TO}<|open|>call tool="get_weather" index="1"<|sep|>Beijing{CC}{TC}',  # no argument tag
    f"{TO}",
)


class TestKimiK3ToolParser(OneManagerPerTest, ToolParserTests):
    plugin = "kimi_k3"
    parser_name = "kimi_k3"
    tools = (Tool("get_weather", CITY), Tool("search", QUERY), Tool("now"), Tool("run&log"))
    cases = K3_CASES
    malformed = K3_MALFORMED


def k3_parser():
    from engine_kimi_k3.parsers.kimi_k3 import KimiK3ToolParser

    return KimiK3ToolParser(TestKimiK3ToolParser.tools)


def test_k3_streams_string_arguments_as_written_and_the_others_whole():
    raw = 'Bei "jing"\\\n北京'
    text = (
        f"{RO}On it.{RC}{TO}"
        + call("get_weather", 1, arg("city", "string", raw), arg("days", "array", "[1,2]"), arg("note", "string", "x"))
        + call("search", 2, arg("query", "string", "louvre"))
        + f"{TC}{MC}"
    )
    whole = k3_parser().parse(text).tool_calls
    assert whole[0].arguments == '{"city": "Bei \\"jing\\"\\\\\\n北京", "days": [1, 2], "note": "x"}'
    calls = streamed_calls(k3_parser(), text)
    assert streamed(calls) == [(c.name, None, c.arguments) for c in whole]
    # the call opens with its tag, before any argument
    opened = text.index('index="1"<|sep|>') + len('index="1"<|sep|>')
    assert calls[0]["opened"] == opened and arguments_so_far(calls[0], opened) == "{"
    # a string argument as it grows, escaped as in the whole arguments
    assert arguments_so_far(calls[0], text.index("Bei") + 3) == '{"city": "Bei'
    assert arguments_so_far(calls[0], text.index('"jing') + 1) == '{"city": "Bei \\"'
    assert arguments_so_far(calls[0], text.index("北京")) == '{"city": "Bei \\"jing\\"\\\\\\n'
    city_end = text.index("<|close|>argument<|sep|>") + len("<|close|>argument<|sep|>")
    assert arguments_so_far(calls[0], city_end - 1) == '{"city": "Bei \\"jing\\"\\\\\\n北京'
    assert arguments_so_far(calls[0], city_end) == '{"city": "Bei \\"jing\\"\\\\\\n北京"'
    # a typed argument whole, once it closes: its value re-encoded
    days_end = text.index("<|close|>argument<|sep|>", city_end) + len("<|close|>argument<|sep|>")
    assert arguments_so_far(calls[0], days_end - 1) == arguments_so_far(calls[0], city_end)
    assert arguments_so_far(calls[0], days_end) == arguments_so_far(calls[0], city_end) + ', "days": [1, 2]'
    assert len(calls[0]["fragments"]) > 10
    assert calls[1]["opened"] < text.index("louvre")
    assert arguments_so_far(calls[1], text.index("louvre") + 3) == '{"query": "lou'


def test_k3_a_repeated_key_is_written_again():
    text = (
        TO
        + call("search", 1, arg("query", "string", "a"), arg("limit", "integer", "1"), arg("query", "string", "b"))
        + TC
    )
    (whole,) = k3_parser().parse(text).tool_calls
    assert whole.arguments == '{"query": "a", "limit": 1, "query": "b"}'
    assert json.loads(whole.arguments) == {"query": "b", "limit": 1}
    assert streamed(streamed_calls(k3_parser(), text)) == [("search", None, whole.arguments)]


# reasoning

K2_TURN = "<|im_user|>user<|im_middle|>2+2?<|im_end|><|im_assistant|>assistant<|im_middle|>"


class TestKimiReasoningParser(OneManagerPerTest, ReasoningParserTests):
    plugin = "kimi_k3"
    parser_name = "kimi"
    cases = (
        # K2.5 thinking: the prompt opens <think>
        ReasoningCase("The user adds.</think>4.", "The user adds.", "4.", K2_TURN + "<think>"),
        # K2.5 instant: the prompt closes it
        ReasoningCase("4.", None, "4.", K2_TURN + "<think></think>"),
        # K2-Thinking: the model opens it
        ReasoningCase("<think>Add them.</think>\n\nIt is 4.", "Add them.", "\n\nIt is 4.", K2_TURN),
        ReasoningCase("No thinking here < think >.", None, "No thinking here < think >."),
        # cut short while reasoning
        ReasoningCase("Still adding", "Still adding", "", K2_TURN + "<think>"),
        # an earlier turn's reasoning in the prompt does not leave one open
        ReasoningCase("4.", None, "4.", f"<think>old</think>3.<|im_end|>{K2_TURN}"),
        ReasoningCase("New.</think>4.", "New.", "4.", f"<think>old</think>3.<|im_end|>{K2_TURN}<think>"),
        # a tool-call section ends the reasoning and stays for the tool parser
        ReasoningCase(f"Call it.{S}{WEATHER_0}{E}", "Call it.", f"{S}{WEATHER_0}{E}", K2_TURN + "<think>"),
        ReasoningCase(f"<think>Look up.</think>{S}{WEATHER_0}{E}", "Look up.", f"{S}{WEATHER_0}{E}", K2_TURN),
    )


TO_THINK, TC_THINK = "<|open|>think<|sep|>", "<|close|>think<|sep|>"
K3_TURN = '<|open|>message role="assistant"<|sep|>'


class TestKimiK3ReasoningParser(OneManagerPerTest, ReasoningParserTests):
    plugin = "kimi_k3"
    parser_name = "kimi_k3"
    tool_call = f"{TO}{call('get_weather', 1, arg('city', 'string', 'Beijing'))}{TC}"
    cases = (
        ReasoningCase(f"Say hi.{TC_THINK}{RO}Hi.{RC}{MC}", "Say hi.", "Hi.", K3_TURN + TO_THINK),
        ReasoningCase(f"{TO_THINK}Say hi.{TC_THINK}{RO}Hi.{RC}", "Say hi.", "Hi.", K3_TURN),
        # the tools channel stays in the content, for the tool parser
        ReasoningCase(
            f"Need weather.{TC_THINK}{RO}On it.{RC}{tool_call}{MC}",
            "Need weather.",
            f"On it.{tool_call}",
            K3_TURN + TO_THINK,
        ),
        # without thinking: the answer, unwrapped
        ReasoningCase(f"{RO}Hi.{RC}{MC}", None, "Hi."),
        ReasoningCase(f"Hi.{RC}{MC}", None, "Hi.", K3_TURN + RO),
        ReasoningCase("Still thinking <|close|>th", "Still thinking <|close|>th", "", K3_TURN + TO_THINK),
    )
