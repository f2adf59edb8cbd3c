"""ToolParserTests and ReasoningParserTests fail broken parsers: each deliberately broken
variant of engine-llama's hermes tool parser and qwen3 reasoning parser below is caught by
the kit check named next to it, and the real parsers pass them all."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
from plugin_helpers import assert_broken_caught_and_good_passes, run_kit_in_subprocess  # noqa: E402

pytest.importorskip("engine_llama")

pytest_plugins = ["pytester"]

PLUGIN = '''
import re

import engine
from engine.interfaces.reasoning_parser import ReasoningSplit, ReasoningStream
from engine.interfaces.tool_parser import ParsedToolCalls, ToolCall, ToolCallDelta, ToolCallStream, ToolStreamDelta
from engine_llama.parsers import HermesToolParser, Qwen3ReasoningParser


# tool parsers


class Good(HermesToolParser):
    name = "good"


class NameAgainStream(ToolCallStream):
    def _diff(self, parsed):
        delta = super()._diff(parsed)
        calls = tuple(
            d if d.name is not None else ToolCallDelta(d.index, self._calls[d.index][0], None, d.arguments)
            for d in delta.tool_calls
        )
        return ToolStreamDelta(delta.content, calls)


class NameAgain(HermesToolParser):
    """every delta of a call's arguments carries its name again"""
    name = "name_again"

    def streamer(self):
        return NameAgainStream(self)


class SpeculativeClose(HermesToolParser):
    """a partial call's arguments are sent closed ("}") before the model closed them"""
    name = "speculative_close"

    def parse_partial(self, text):
        parsed = super().parse_partial(text)
        calls = list(parsed.tool_calls)
        if calls and calls[-1].name and not calls[-1].arguments.endswith("}"):
            calls[-1] = ToolCall(calls[-1].name, calls[-1].arguments + "}", calls[-1].id)
        return ParsedToolCalls(parsed.content, tuple(calls))


class MalformedIsCall(HermesToolParser):
    """a block with a name but no well-formed arguments is a call with no arguments"""
    name = "malformed_is_call"

    def parse(self, text):
        parsed = super().parse(text)
        named = re.search(r'"name": "(\\w+)"', text)
        if parsed.tool_calls or "<tool_call>" not in text or not named:
            return parsed
        return ParsedToolCalls(text[: text.index("<tool_call>")], (ToolCall(named.group(1), "{}"),))


class LosesHeldBackStream(ToolCallStream):
    def feed(self, delta):
        out = super().feed(delta)
        if not self._inside:
            self._content = len(self.text)  # the tail held back as a possible marker counts as sent
        return out


class LosesHeldBack(HermesToolParser):
    """text held back because it could begin a call ("<") is dropped when it does not"""
    name = "loses_held_back"

    def streamer(self):
        return LosesHeldBackStream(self)


class UnclosedTag(HermesToolParser):
    """structural_tag forces calls without their closing </tool_call>"""
    name = "unclosed_tag"

    def structural_tag(self, tools, *, parallel):
        tag = super().structural_tag(tools, parallel=parallel)
        structures = [{**s, "end": s["end"].replace("</tool_call>", "")} for s in tag["structures"]]
        return {**tag, "structures": structures}


# reasoning parsers


class GoodReasoning(Qwen3ReasoningParser):
    name = "good_reasoning"


class EndLeaks(Qwen3ReasoningParser):
    """the end marker stays at the start of the content"""
    name = "end_leaks"

    def split(self, text):
        split = super().split(text)
        if split.reasoning is None or self.end not in text:
            return split
        return ReasoningSplit(split.reasoning, self.end + split.content)


class LateReasoningStream(ReasoningStream):
    def feed(self, delta):
        self.text += delta
        split = self._certain()
        if split.reasoning:
            split = ReasoningSplit(split.reasoning[:-1], split.content)
        return self._diff(split)


class LateReasoning(Qwen3ReasoningParser):
    """the stream sends the reasoning's last character only at the end, after the answer"""
    name = "late_reasoning"

    def streamer(self):
        return LateReasoningStream(self)


class NoHoldStream(ReasoningStream):
    def _certain(self):
        parser, text = self.parser, self.text
        if not parser.starts_in_reasoning() and parser.start.startswith(text.lstrip()):
            return ReasoningSplit(None, "")
        return parser.split(text)


class NoHold(Qwen3ReasoningParser):
    """the stream sends the start of a possible end marker ("</thi") as reasoning"""
    name = "no_hold"

    def streamer(self):
        return NoHoldStream(self)


class IgnoresPrompt(Qwen3ReasoningParser):
    """ignores a prompt that leaves the reasoning open"""
    name = "ignores_prompt"

    def starts_in_reasoning(self):
        return False


class ShortEndTokens(Qwen3ReasoningParser):
    """the end marker's token ids lack the last token"""
    name = "short_end_tokens"

    def marker_token_ids(self):
        start, end, forced = super().marker_token_ids()
        return start, end[:-1], forced


@engine.hookimpl
def register_tool_parsers(register):
    for cls in (Good, NameAgain, SpeculativeClose, MalformedIsCall, LosesHeldBack, UnclosedTag):
        register(cls)


@engine.hookimpl
def register_reasoning_parsers(register):
    for cls in (GoodReasoning, EndLeaks, LateReasoning, NoHold, IgnoresPrompt, ShortEndTokens):
        register(cls)
'''

KIT = """
from engine.interfaces.tool_parser import Tool
from engine.testing.checkpoints import make_tiny_tokenizer
from engine.testing.kit import ReasoningCase, ReasoningParserTests, ToolCase, ToolParserTests

WEATHER = Tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
TIME = Tool("get_time", {"type": "object", "properties": {"timezone": {"type": "string"}}})


def marker_tokenizer():
    tokenizer = make_tiny_tokenizer(300)
    tokenizer.add_tokens(["<think>", "</think>"])
    return tokenizer


class ToolKit(ToolParserTests):
    plugin = "broken_parsers"
    tools = (WEATHER, TIME)
    cases = (
        ToolCase(
            '<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>',
            "",
            (("get_weather", {"city": "Paris"}),),
        ),
        ToolCase(
            "Both cities.\\n"
            '<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\\n</tool_call>\\n'
            '<tool_call>\\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\\n</tool_call>',
            "Both cities.\\n",
            (("get_weather", {"city": "Oslo"}), ("get_time", {"timezone": "UTC"})),
        ),
        ToolCase(
            '<tool_call>{"name":"get_time","arguments":{}}</tool_call>\\nDone.',
            "\\nDone.",
            (("get_time", {}),),
        ),
    )
    malformed = (
        'Checking.\\n<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Par',
        '<tool_call>\\n{"name": "get_weather", "arguments": ["Paris"]}\\n</tool_call>',
    )


class ReasoningKit(ReasoningParserTests):
    plugin = "broken_parsers"
    tokenizer = staticmethod(marker_tokenizer)
    cases = (
        ReasoningCase("<think>\\nThe user greets me.\\n</think>\\n\\nHello!", "\\nThe user greets me.\\n", "Hello!"),
        ReasoningCase("Short.\\n</think>\\n\\nHi!", "Short.\\n", "Hi!", prompt="<|im_start|>assistant\\n<think>\\n"),
        ReasoningCase("Hello!", None, "Hello!"),
    )
"""

# broken variant -> the kit checks that must fail for it
TOOL_CAUGHT_BY = {
    "name_again": ("test_streaming_adds_up_to_the_whole_text_at_every_cut",),
    "speculative_close": ("test_streaming_adds_up_to_the_whole_text_at_every_cut",),
    "malformed_is_call": ("test_malformed_calls_are_content",),
    "loses_held_back": ("test_text_without_calls_streams_through",),
    "unclosed_tag": ("test_structural_tag_forces_calls_the_parser_reads",),
}
REASONING_CAUGHT_BY = {
    "end_leaks": ("test_whole_text_splits_as_expected",),
    "late_reasoning": ("test_streaming_adds_up_to_the_whole_text_at_every_cut",),
    "no_hold": ("test_streaming_adds_up_to_the_whole_text_at_every_cut",),
    "ignores_prompt": ("test_whole_text_splits_as_expected",),
    "short_end_tokens": ("test_markers_are_tokens_of_the_tokenizer",),
}


def kit_classes(base: str, names: list[str]) -> str:
    return "".join(f"\nclass Test_{name}({base}):\n    parser_name = {name!r}\n" for name in names)


@pytest.mark.parametrize(
    ("base", "good", "caught_by", "good_checks"),
    [
        pytest.param("ToolKit", "good", TOOL_CAUGHT_BY, 6, id="tool"),
        pytest.param("ReasoningKit", "good_reasoning", REASONING_CAUGHT_BY, 4, id="reasoning"),
    ],
)
def test_every_broken_parser_is_caught_by_its_check(pytester, monkeypatch, base, good, caught_by, good_checks):
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    tests = KIT + kit_classes(base, [good, *caught_by])
    outcomes = run_kit_in_subprocess(pytester, broken_parsers=PLUGIN, test_parser_kit=tests)
    # assert_broken_caught_and_good_passes names the correct variant "good"
    outcomes = {(cls.replace(f"Test_{good}", "Test_good"), check): out for (cls, check), out in outcomes.items()}
    assert_broken_caught_and_good_passes(outcomes, caught_by, good_checks=good_checks)
