"""The core's ToolCallStream: successive partial parses turned into OpenAI-shaped deltas, text
held back while it may begin a call, and a call that turns out malformed left behind."""

from __future__ import annotations

from engine.interfaces.tool_parser import ParsedToolCalls, ToolCall, ToolParser, held_back, scan_json


class Scripted(ToolParser):
    """Answers with the parse given for each text (the whole text's under ``final``)."""

    name = "scripted"
    markers = ("<call>",)

    def __init__(self, partial: dict[str, ParsedToolCalls], final: ParsedToolCalls) -> None:
        super().__init__()
        self.partial, self.final = partial, final

    def parse(self, text):
        return self.final

    def parse_partial(self, text):
        return self.partial[text]


def stream(parser: ToolParser, pieces: list[str]) -> list:
    s = parser.streamer()
    return [s.feed(piece) for piece in pieces] + [s.finish()]


def test_text_before_a_marker_streams_and_a_possible_marker_is_held_back():
    parser = Scripted({}, ParsedToolCalls("Hi <ca and more"))
    deltas = stream(parser, ["Hi ", "<ca", " and more"])
    assert [d.content for d in deltas] == ["Hi ", "", "<ca and more", ""]
    assert held_back("x <cal", ("<call>",)) == 4 and held_back("x <call", ("<c>", "<call>")) == 5


def test_a_call_opens_with_its_name_then_grows_its_arguments():
    a = "x<call>f"
    partial = {
        a: ParsedToolCalls("x"),
        a + "{": ParsedToolCalls("x", (ToolCall("f", "{", "id1"),)),
        a + '{"a"': ParsedToolCalls("x", (ToolCall("f", '{"a"', "id1"),)),
    }
    parser = Scripted(partial, ParsedToolCalls("x", (ToolCall("f", '{"a": 1}', "id1"),)))
    deltas = stream(parser, [a, "{", '"a"'])
    calls = [c for d in deltas for c in d.tool_calls]
    assert [(c.index, c.name, c.id, c.arguments) for c in calls] == [
        (0, "f", "id1", "{"),
        (0, None, None, '"a"'),
        (0, None, None, ": 1}"),
    ]
    assert "".join(d.content for d in deltas) == "x"


def test_a_call_that_turns_out_malformed_is_left_and_the_next_gets_its_own_index():
    text = "<call>bad{<call>good{}"
    partial = {
        "<call>bad{": ParsedToolCalls("", (ToolCall("bad", "{"),)),
        text: ParsedToolCalls("<call>bad{", (ToolCall("good", "{}"),)),
    }
    parser = Scripted(partial, ParsedToolCalls("<call>bad{", (ToolCall("good", "{}"),)))
    deltas = stream(parser, ["<call>bad{", "<call>good{}"])
    calls = [c for d in deltas for c in d.tool_calls]
    assert [(c.index, c.name, c.arguments) for c in calls] == [(0, "bad", "{"), (1, "good", "{}")]
    assert "".join(d.content for d in deltas) == "<call>bad{"


def test_scan_json_finds_where_a_value_ends():
    text = '  {"a": "}", "b": [1, {"c": "\\""}]} tail'
    assert scan_json(text, 0) == text.index(" tail")
    assert scan_json('{"a": [1, 2', 0) is None
    assert scan_json('"x\\"y" z', 0) == 6
    assert scan_json("123, 4", 0) == 3
    assert scan_json("123", 0) is None  # a number may go on
    assert scan_json("   ", 0) is None
