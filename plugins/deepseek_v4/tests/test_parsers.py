"""DeepSeek's tool-call and reasoning parsers through the kit, with outputs written by hand in
each family's published format:

- V3 / R1: the chat templates of DeepSeek-V3-0324 and R1-0528 (tokenizer_config.json), which
  write a call as ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>``,
  the calls after the first on a new line, the answer right before the block;
- V3.1: DeepSeek-V3.1's chat template and model card (``NAME<｜tool▁sep｜>ARGS``, calls chained);
- V3.2: DeepSeek's ``encoding/encoding_dsv32.py`` (the ``function_calls`` block);
- V4: DeepSeek-V4-Flash's ``encoding/encoding_dsv4.py`` and its ``encoding/tests`` examples
  (``test_output_1.txt``: the ``get_weather`` call; the two-city parallel call);
- ``<think>``: R1's model card (the output opens with ``<think>``), R1-0528's and V3.1's
  templates and V4's encoder (the prompt ends with ``<think>`` or ``</think>``).
"""

from __future__ import annotations

import json

from engine.interfaces.tool_parser import Tool
from engine.testing.kit import ReasoningCase, ReasoningParserTests, ToolCase, ToolParserTests
from engine.testing.kit.parsers import arguments_so_far, streamed_calls

TOOLS = (
    Tool(
        "get_weather",
        {
            "type": "object",
            "properties": {
                "location": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location"],
        },
    ),
    Tool(
        "search",
        {
            "type": "object",
            "properties": {"query": {"type": "string"}, "num_results": {"type": "integer"}},
            "required": ["query"],
        },
    ),
)

# V3 / R1 / V3.1 special tokens, spelled as in their tokenizer.json
CALLS, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def v3_call(name: str, arguments: str) -> str:
    return f"{CALL}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


class TestDeepSeekV3ToolParser(ToolParserTests):
    plugin = "deepseek_v4"
    parser_name = "deepseek_v3"
    tools = TOOLS
    cases = (
        ToolCase(
            "Let me check." + CALLS + v3_call("get_weather", '{"location": "Paris"}') + CALLS_END,
            "Let me check.",
            (("get_weather", {"location": "Paris"}),),
        ),
        # parallel calls: the template writes each after the first on a new line
        ToolCase(
            CALLS
            + v3_call("get_weather", '{"location": "Beijing", "unit": "celsius"}')
            + "\n"
            + v3_call("search", '{"query": "Beijing news", "num_results": 3}')
            + CALLS_END,
            "",
            (
                ("get_weather", {"location": "Beijing", "unit": "celsius"}),
                ("search", {"query": "Beijing news", "num_results": 3}),
            ),
        ),
        # escapes, braces and fences inside strings, unicode as is and escaped, pretty-printed JSON
        ToolCase(
            CALLS
            + v3_call(
                "search", '{\n  "query": "say \\"hi\\" {not a brace} ```",\n  "note": "K\\u00f8benhavn \\\\ 東京"\n}'
            )
            + CALLS_END,
            "",
            (("search", {"query": 'say "hi" {not a brace} ```', "note": "København \\ 東京"}),),
        ),
        # text after the block is content too
        ToolCase(
            "A" + CALLS + v3_call("search", '{"query": "x"}') + CALLS_END + " done",
            "A done",
            (("search", {"query": "x"}),),
        ),
    )
    malformed = (
        # cut short in the arguments, and before the block's first call ends
        CALLS + f'{CALL}function{SEP}get_weather\n```json\n{{"location": "Par',
        "Sure: " + CALLS + f"{CALL}function{SEP}get_weather\n```json\n" + '{"location": "Paris"}\n```',
        # arguments that are not JSON, not an object, or no fence
        CALLS + v3_call("get_weather", "{location: Paris}") + CALLS_END,
        CALLS + v3_call("get_weather", '["Paris"]') + CALLS_END,
        CALLS + f'{CALL}function{SEP}get_weather\n{{"location": "Paris"}}{CALL_END}' + CALLS_END,
        # V3.1's call in V3's block
        CALLS + f'{CALL}get_weather{SEP}{{"location": "Paris"}}{CALL_END}' + CALLS_END,
        # a block with no call
        "x" + CALLS + CALLS_END + "y",
    )


def test_v3_keeps_the_calls_before_a_break_and_the_rest_is_content():
    from engine_deepseek_v4.parsers.deepseek_v3 import DeepSeekV3ToolParser

    good = v3_call("search", '{"query": "x"}')
    bad = v3_call("get_weather", "{oops}")
    parsed = DeepSeekV3ToolParser(TOOLS).parse(CALLS + good + "\n" + bad + CALLS_END)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("search", '{"query": "x"}')]
    assert parsed.content == bad + CALLS_END
    # the block's end marker may be missing: the output stopped after its last call
    parsed = DeepSeekV3ToolParser(TOOLS).parse("hi" + CALLS + good)
    assert (parsed.content, len(parsed.tool_calls)) == ("hi", 1)


def streamed_arguments(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["name"], "".join(fragment for _, fragment in c["fragments"])) for c in calls]


def test_v3_streams_a_call_from_its_name_on():
    from engine_deepseek_v4.parsers.deepseek_v3 import DeepSeekV3ToolParser

    first, second = '{"query": "a ``` b", "num_results": 3}', '{"location": "Paris"}'
    text = "Hi" + CALLS + v3_call("search", first) + "\n" + v3_call("get_weather", second) + CALLS_END
    calls = streamed_calls(DeepSeekV3ToolParser(TOOLS), text)
    assert streamed_arguments(calls) == [("search", first), ("get_weather", second)]
    # the name at the json fence, before any argument
    fence = text.index("```json") + len("```json")
    assert calls[0]["opened"] == fence and arguments_so_far(calls[0], fence) == ""
    # the arguments as the model writes them, a fence inside a string held only until it is not the closing one
    assert arguments_so_far(calls[0], text.index("```", fence)) == '{"query": "a'
    assert arguments_so_far(calls[0], text.index("```", fence) + 3) == '{"query": "a'
    assert arguments_so_far(calls[0], text.index(" b") + 2) == '{"query": "a ``` b'
    assert len(calls[0]["fragments"]) > 3
    # nothing of the closing fence or the end marker: all of the object once it closes
    closing = text.index("\n```" + CALL_END)
    for at in range(closing, text.index(CALL_END) + len(CALL_END)):
        assert arguments_so_far(calls[0], at) == first
    assert calls[1]["opened"] == text.index("```json", closing) + len("```json")
    assert calls[1]["opened"] < text.index(second) + len(second)


def test_v3_a_call_it_opened_that_turns_out_malformed_is_content_in_the_end():
    from engine_deepseek_v4.parsers.deepseek_v3 import DeepSeekV3ToolParser

    text = "Hi" + CALLS + v3_call("search", '{"query": x}') + CALLS_END
    calls = streamed_calls(DeepSeekV3ToolParser(TOOLS), text)
    assert streamed_arguments(calls) == [("search", '{"query": x}')]  # opened, and it cannot be taken back
    stream = DeepSeekV3ToolParser(TOOLS).streamer()
    content = "".join(stream.feed(ch).content for ch in text) + stream.finish().content
    assert content == text == DeepSeekV3ToolParser(TOOLS).parse(text).content


class TestDeepSeekV31ToolParser(ToolParserTests):
    plugin = "deepseek_v4"
    parser_name = "deepseek_v31"
    tools = TOOLS
    cases = (
        ToolCase(
            f'I will look it up.{CALLS}{CALL}get_weather{SEP}{{"location": "Tokyo"}}{CALL_END}{CALLS_END}',
            "I will look it up.",
            (("get_weather", {"location": "Tokyo"}),),
        ),
        # parallel calls, chained without separators (the template's tool prompt says so)
        ToolCase(
            f'{CALLS}{CALL}get_weather{SEP}{{"location": "Tokyo", "unit": "celsius"}}{CALL_END}'
            f'{CALL}search{SEP}{{"query": "Tokyo \\"weekend\\" events", "num_results": 5}}{CALL_END}{CALLS_END}',
            "",
            (
                ("get_weather", {"location": "Tokyo", "unit": "celsius"}),
                ("search", {"query": 'Tokyo "weekend" events', "num_results": 5}),
            ),
        ),
        ToolCase(
            f'{CALLS}{CALL}search{SEP}{{"query": "\\u6771\\u4eac {{x}} \\\\n", "filters": {{"lang": ["ja", "en"]}}}}{CALL_END}{CALLS_END}',
            "",
            (("search", {"query": "東京 {x} \\n", "filters": {"lang": ["ja", "en"]}}),),
        ),
    )
    malformed = (
        f'{CALLS}{CALL}get_weather{SEP}{{"location": "Tok',
        f"{CALLS}{CALL}get_weather{SEP}{{'location': 'Tokyo'}}{CALL_END}{CALLS_END}",
        f"{CALLS}{CALL}get_weather{SEP}42{CALL_END}{CALLS_END}",
        f'{CALLS}{CALL}get_weather{{"location": "Tokyo"}}{CALL_END}{CALLS_END}',
        # V3's call in V3.1's block: the name would be "function"
        CALLS + v3_call("get_weather", '{"location": "Tokyo"}') + CALLS_END,
        # another call begins before this one ends
        f'{CALLS}{CALL}get_weather{SEP}{{"location": "Tokyo"}}{CALL}search{SEP}{{"query": "x"}}{CALL_END}{CALLS_END}',
    )


def test_v31_streams_a_call_from_its_name_on():
    from engine_deepseek_v4.parsers.deepseek_v3 import DeepSeekV31ToolParser

    first, second = '{"location": "Tokyo", "unit": "celsius"}', '{"query": "x"}'
    text = f"{CALLS}{CALL}get_weather{SEP} {first} {CALL_END}{CALL}search{SEP}{second}{CALL_END}{CALLS_END}"
    calls = streamed_calls(DeepSeekV31ToolParser(TOOLS), text)
    assert streamed_arguments(calls) == [("get_weather", first), ("search", second)]
    opened = text.index(SEP) + len(SEP)
    assert calls[0]["opened"] == opened and arguments_so_far(calls[0], opened) == ""
    assert arguments_so_far(calls[0], text.index("Tokyo") + 3) == '{"location": "Tok'
    assert len(calls[0]["fragments"]) > 3
    assert calls[1]["opened"] == text.index(SEP, opened) + len(SEP)
    assert len(calls[1]["fragments"]) > 1


def test_structural_tags_of_v3_and_v31_begin_at_the_arguments():
    from engine_deepseek_v4.parsers.deepseek_v3 import DeepSeekV3ToolParser, DeepSeekV31ToolParser

    tag = DeepSeekV3ToolParser(TOOLS).structural_tag(TOOLS[:1], parallel=False)
    assert tag == {
        "structures": [
            {
                "begin": f"{CALLS}{CALL}function{SEP}get_weather\n```json\n",
                "schema": TOOLS[0].parameters,
                "end": f"\n```{CALL_END}{CALLS_END}",
            }
        ],
        "triggers": [CALLS],
        "at_least_one": True,
        "stop_after_first": True,
    }
    tag = DeepSeekV31ToolParser(TOOLS).structural_tag(TOOLS, parallel=True)
    assert [(s["begin"], s["end"]) for s in tag["structures"]] == [
        (f"{CALLS}{CALL}get_weather{SEP}", CALL_END + CALLS_END),
        (f"{CALLS}{CALL}search{SEP}", CALL_END + CALLS_END),
    ]
    assert tag["stop_after_first"] is False


# DSML, as encoding_dsv32.py / encoding_dsv4.py write it
D = "｜DSML｜"


def invoke(name: str, *parameters: tuple[str, str, str]) -> str:
    lines = [
        f'<{D}parameter name="{key}" string="{string}">{value}</{D}parameter>' for key, string, value in parameters
    ]
    return f'<{D}invoke name="{name}">\n' + "\n".join(lines) + f"\n</{D}invoke>"


def dsml_block(block: str, *invokes: str) -> str:
    return f"\n\n<{D}{block}>\n" + "\n".join(invokes) + f"\n</{D}{block}>"


def dsml_cases(block: str) -> tuple[ToolCase, ...]:
    return (
        # test_output_1.txt: the first turn's call, after the reasoning (which the reasoning parser takes)
        ToolCase(
            dsml_block(block, invoke("get_weather", ("location", "true", "Beijing"), ("unit", "true", "celsius"))),
            "",
            (("get_weather", {"location": "Beijing", "unit": "celsius"}),),
        ),
        # the two-city example: an answer, then two calls of one tool
        ToolCase(
            "Let me check both."
            + dsml_block(
                block,
                invoke("get_weather", ("location", "true", "Beijing")),
                invoke("get_weather", ("location", "true", "Shanghai")),
            ),
            "Let me check both.",
            (("get_weather", {"location": "Beijing"}), ("get_weather", {"location": "Shanghai"})),
        ),
        # string="false" values are JSON; string values are raw text, quotes, newlines, unicode and all
        ToolCase(
            "Searching."
            + dsml_block(
                block,
                invoke(
                    "search",
                    ("query", "true", '杭州 "西湖" \\ {天气}\nline 2'),
                    ("num_results", "false", "3"),
                    ("filters", "false", '{"lang": ["zh", "en"], "safe": true, "since": null}'),
                ),
                invoke("get_weather", ("location", "true", "北京"), ("days", "false", "[1, 2.5]")),
            ),
            "Searching.",
            (
                (
                    "search",
                    {
                        "query": '杭州 "西湖" \\ {天气}\nline 2',
                        "num_results": 3,
                        "filters": {"lang": ["zh", "en"], "safe": True, "since": None},
                    },
                ),
                ("get_weather", {"location": "北京", "days": [1, 2.5]}),
            ),
        ),
        # a call without parameters (the encoder writes an empty line), and a blank line that stays content
        ToolCase(
            "Line one.\n\nLine two.\n" + dsml_block(block, f'<{D}invoke name="search">\n\n</{D}invoke>'),
            "Line one.\n\nLine two.\n",
            (("search", {}),),
        ),
    )


def dsml_malformed(block: str, other: str) -> tuple[str, ...]:
    return (
        # cut short in a parameter, and before the block's first call ends
        f'\n\n<{D}{block}>\n<{D}invoke name="get_weather">\n<{D}parameter name="location" string="true">Bei',
        "On it."
        + f'\n\n<{D}{block}>\n<{D}invoke name="get_weather">\n<{D}parameter name="location" string="true">Beijing</{D}parameter>\n',
        # a string="false" value that is not JSON, a repeated parameter, a parameter without its string attribute
        dsml_block(block, invoke("search", ("query", "true", "x"), ("num_results", "false", "three"))),
        dsml_block(block, invoke("search", ("query", "true", "x"), ("query", "true", "y"))),
        dsml_block(block, f'<{D}invoke name="search">\n<{D}parameter name="query">x</{D}parameter>\n</{D}invoke>'),
        # stray text in the invoke
        dsml_block(block, f'<{D}invoke name="search">\nquery=x\n</{D}invoke>'),
        # the other model's block: no call of this format
        dsml_block(other, invoke("search", ("query", "true", "x"))),
    )


class TestDeepSeekV4ToolParser(ToolParserTests):
    plugin = "deepseek_v4"
    parser_name = "deepseek_v4"
    tools = TOOLS
    cases = dsml_cases("tool_calls")
    malformed = dsml_malformed("tool_calls", "function_calls")


class TestDeepSeekV32ToolParser(ToolParserTests):
    plugin = "deepseek_v4"
    parser_name = "deepseek_v32"
    tools = TOOLS
    cases = dsml_cases("function_calls")
    malformed = dsml_malformed("function_calls", "tool_calls")


def test_dsml_arguments_are_written_as_the_reference_decoder_writes_them():
    from engine_deepseek_v4.parsers.dsml import DeepSeekV4ToolParser

    text = dsml_block(
        "tool_calls",
        invoke("search", ("query", "true", 'a "b" 杭州'), ("num_results", "false", "3"), ("x", "false", "[1,2]")),
    )
    (call,) = DeepSeekV4ToolParser(TOOLS).parse(text).tool_calls
    # decode_dsml_to_arguments: '{' + ', '.join(f'{to_json(k)}: {v}') + '}', strings to_json'd (ensure_ascii=False)
    assert call.arguments == '{"query": "a \\"b\\" 杭州", "num_results": 3, "x": [1,2]}'
    assert json.loads(call.arguments) == {"query": 'a "b" 杭州', "num_results": 3, "x": [1, 2]}


def test_the_v4_encoder_writes_calls_the_v4_parser_reads():
    from engine_deepseek_v4.chat_v4 import encode_chat
    from engine_deepseek_v4.parsers.dsml import DeepSeekV4ToolParser

    arguments = {"query": "杭州 weather", "num_results": 3, "filters": {"lang": ["zh"]}}
    calls = [{"id": "c1", "type": "function", "function": {"name": "search", "arguments": arguments}}]
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Sure.", "tool_calls": calls}]
    prompt = encode_chat(messages)
    answer = prompt[prompt.index("</think>") + len("</think>") : -len("<｜end▁of▁sentence｜>")]
    parsed = DeepSeekV4ToolParser(TOOLS).parse(answer)
    assert parsed.content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("search", arguments)]


def test_dsml_streams_the_arguments_as_the_parameters_are_written():
    from engine_deepseek_v4.parsers.dsml import DeepSeekV4ToolParser, DeepSeekV32ToolParser

    for cls, block in ((DeepSeekV4ToolParser, "tool_calls"), (DeepSeekV32ToolParser, "function_calls")):
        text = "On it." + dsml_block(
            block,
            invoke("search", ("query", "true", 'Bei "jing"\\\n北京'), ("filters", "false", '{"lang": ["zh"]}')),
            invoke("get_weather", ("location", "true", "Shanghai")),
        )
        whole = cls(TOOLS).parse(text).tool_calls
        calls = streamed_calls(cls(TOOLS), text)
        assert streamed_arguments(calls) == [(c.name, c.arguments) for c in whole]
        assert whole[0].arguments == '{"query": "Bei \\"jing\\"\\\\\\n北京", "filters": {"lang": ["zh"]}}'
        # the call opens with its invoke tag, before any parameter
        opened = text.index('name="search">') + len('name="search">')
        assert calls[0]["opened"] == opened and arguments_so_far(calls[0], opened) == "{"
        # a string value as it grows, escaped as in the whole arguments
        assert arguments_so_far(calls[0], text.index("Bei") + 3) == '{"query": "Bei'
        assert arguments_so_far(calls[0], text.index('"jing') + 1) == '{"query": "Bei \\"'
        assert arguments_so_far(calls[0], text.index("北京")) == '{"query": "Bei \\"jing\\"\\\\\\n'
        # a string="false" value as the raw JSON text it is
        assert (
            arguments_so_far(calls[0], text.index('["zh"]') + 3)
            == '{"query": "Bei \\"jing\\"\\\\\\n北京", "filters": {"lang": ["z'
        )
        # nothing of a closing tag; the closing brace with the invoke's end
        end = text.index(f"</{D}invoke>")
        assert arguments_so_far(calls[0], end + len(f"</{D}invoke>") - 1) == whole[0].arguments[:-1]
        assert arguments_so_far(calls[0], end + len(f"</{D}invoke>")) == whole[0].arguments
        assert len(calls[0]["fragments"]) > 10
        assert calls[1]["opened"] < text.index("Shanghai")
        assert arguments_so_far(calls[1], text.index("Shanghai") + 5) == '{"location": "Shang'


def test_dsml_has_no_structural_tag():
    from engine_deepseek_v4.parsers.dsml import DeepSeekV4ToolParser, DeepSeekV32ToolParser

    assert DeepSeekV4ToolParser(TOOLS).structural_tag(TOOLS, parallel=False) is None
    assert DeepSeekV32ToolParser(TOOLS).structural_tag(TOOLS, parallel=True) is None


def test_the_models_name_their_parsers():
    from engine_deepseek_v4.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV32ForCausalLM
    from engine_deepseek_v4.deepseek_v4 import DeepseekV4ForCausalLM

    named = [
        (m.tool_parser, m.reasoning_parser)
        for m in (DeepseekV3ForCausalLM, DeepseekV32ForCausalLM, DeepseekV4ForCausalLM)
    ]
    assert named == [("deepseek_v3", "deepseek_r1"), ("deepseek_v32", "deepseek_r1"), ("deepseek_v4", "deepseek_r1")]


# reasoning

R1_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>1+1=?<｜Assistant｜>"  # R1 (January): the output opens with <think>
R1_0528_PROMPT = R1_PROMPT + "<think>\n"  # R1-0528's template opens the block itself
V4_THINKING_PROMPT = R1_PROMPT + "<think>"  # V3.1 and V4 in thinking mode
V4_CHAT_PROMPT = R1_PROMPT + "</think>"  # V3.1 and V4 in chat mode
V4_KEPT_PROMPT = (
    "<｜User｜>hi<｜Assistant｜><think>greet</think>Hi!<｜end▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜></think>"
)


def tiny_tokenizer_with_think_tokens():
    from engine.testing.checkpoints import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer(300)
    tokenizer.add_tokens(["<think>", "</think>"])  # added, not special, as in DeepSeek's tokenizers
    return tokenizer


class TestDeepSeekR1ReasoningParser(ReasoningParserTests):
    plugin = "deepseek_v4"
    parser_name = "deepseek_r1"
    tokenizer = staticmethod(tiny_tokenizer_with_think_tokens)
    cases = (
        ReasoningCase(
            "<think>\n1 and 1 make 2.\n</think>\n\nThe answer is 2.",
            "\n1 and 1 make 2.\n",
            "\n\nThe answer is 2.",
            R1_PROMPT,
        ),
        ReasoningCase("1 and 1 make 2.\n</think>\n\n**2**", "1 and 1 make 2.\n", "\n\n**2**", R1_0528_PROMPT),
        ReasoningCase("Add them: 2.</think>2", "Add them: 2.", "2", V4_THINKING_PROMPT),
        ReasoningCase("4. I think <think> is a tag.", None, "4. I think <think> is a tag.", V4_CHAT_PROMPT),
        ReasoningCase("4.", None, "4.", V4_KEPT_PROMPT),
        # cut short while reasoning: all of it is reasoning
        ReasoningCase("Still adding <thi", "Still adding <thi", "", V4_THINKING_PROMPT),
        # a V4 tool call after the reasoning goes to the tool parser as content
        ReasoningCase(
            f'Use the tool.</think>\n\n<{D}tool_calls>\n<{D}invoke name="search">\n\n</{D}invoke>\n</{D}tool_calls>',
            "Use the tool.",
            f'\n\n<{D}tool_calls>\n<{D}invoke name="search">\n\n</{D}invoke>\n</{D}tool_calls>',
            V4_THINKING_PROMPT,
        ),
        ReasoningCase("Plain answer.", None, "Plain answer."),
    )
