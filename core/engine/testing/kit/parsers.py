"""``ToolParserTests`` and ``ReasoningParserTests``: a model family's output formats, read
back against what its chat template and model card say they hold.

The plugin gives cases: output texts written by hand in the family's format (from its
published chat template or model card, never produced by the parser's own code) and what a
reader of that format finds in them. The kit checks the parser's whole-text answer against
each case, then streams every case in every way it can be cut (at each single boundary, a
character at a time, and in random pieces) and checks that the stream's pieces add up to
the whole-text answer exactly: same content, same calls, same ids, same argument text,
each call's name and id sent once, in its first piece, and calls opened in order.

For tool parsers that can force calls (``structural_tag``), the kit fills each structure
with an instance of its function's parameters and checks the parser reads the call back.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Sequence

from engine.testing.kit.base import KitTests, capability_skip

RANDOM_SPLITS = 20  # random cuttings per case, besides every single cut and one character at a time


@dataclass(frozen=True)
class ToolCase:
    """An output and what it holds: ``content`` (the text outside calls) and ``calls``,
    ``(name, arguments)`` with the arguments as a dict; ``ids`` when the format names its
    calls."""

    text: str
    content: str
    calls: tuple[tuple[str, dict], ...] = ()
    ids: tuple[str, ...] | None = None


@dataclass(frozen=True)
class ReasoningCase:
    """An output, the prompt it followed (None: a prompt that leaves no reasoning open), and
    its reasoning (None: it has none) and content."""

    text: str
    reasoning: str | None
    content: str
    prompt: str | None = None


def cuttings(text: str, seed: int = 0) -> Iterator[list[str]]:
    """``text`` as lists of pieces: whole, cut once at every boundary, a character at a
    time, and cut at random places."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(RANDOM_SPLITS):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _resolved(kit: KitTests) -> type:
    """The parser class under test, resolved through the plugin manager once per kit class."""
    cls = type(kit)
    if cls.__dict__.get("_parser_cls") is None:
        cls._parser_cls = kit.resolve(kit.required("parser_name"))
    return cls._parser_cls


def streamed_calls(parser: Any, text: str) -> list[dict]:
    """Stream ``text`` through a fresh stream of ``parser`` a character at a time: per call,
    its ``name`` and ``id``, where it ``opened`` (the length of the text fed then) and its
    argument ``fragments``, each ``(where it came, text)``. For plugins' own tests of how
    incrementally their calls stream."""
    stream, calls = parser.streamer(), []
    deltas = [(i + 1, stream.feed(ch)) for i, ch in enumerate(text)] + [(len(text), stream.finish())]
    for at, delta in deltas:
        for d in delta.tool_calls:
            if d.name is not None:
                assert d.index == len(calls)
                calls.append({"name": d.name, "id": d.id, "opened": at, "fragments": []})
            if d.arguments:
                calls[d.index]["fragments"].append((at, d.arguments))
    return calls


def arguments_so_far(call: dict, at: int) -> str:
    """A call from :func:`streamed_calls`: its arguments once ``text[:at]`` was fed."""
    return "".join(fragment for when, fragment in call["fragments"] if when <= at)


# tool parsers


def _stream_tools(parser: Any, pieces: Sequence[str]) -> tuple[str, list[dict]]:
    """Feed ``pieces`` to a fresh stream; the content and the calls its deltas add up to,
    checking the rules of the deltas on the way."""
    stream = parser.streamer()
    content, calls = "", []
    for delta in [*(stream.feed(piece) for piece in pieces), stream.finish()]:
        content += delta.content
        for call in delta.tool_calls:
            if call.index == len(calls):
                assert call.name, f"call {call.index} opened without its name: {call}"
                calls.append({"name": call.name, "id": call.id, "arguments": call.arguments})
            else:
                assert call.index < len(calls), f"call {call.index} opened before call {len(calls)}: {call}"
                assert call.name is None and call.id is None, f"call {call.index} got its name or id again: {call}"
                calls[call.index]["arguments"] += call.arguments
    return content, calls


def _whole(parsed: Any) -> tuple[str, list[dict]]:
    return parsed.content, [{"name": c.name, "id": c.id, "arguments": c.arguments} for c in parsed.tool_calls]


class ToolParserTests(KitTests):
    """Subclass with ``plugin``, ``parser_name``, ``tools`` (the
    :class:`~engine.interfaces.tool_parser.Tool` list the cases call), ``cases``
    (:class:`ToolCase`) and optionally ``malformed``: outputs holding no well-formed call,
    which the parser must give back whole as content."""

    registry_name = "tool_parsers"
    parser_name: ClassVar[str | None] = None
    tools: ClassVar[Sequence[Any]] = ()
    cases: ClassVar[Sequence[ToolCase]] = ()
    malformed: ClassVar[Sequence[str]] = ()

    def parser(self) -> Any:
        from engine.interfaces.tool_parser import ToolParser

        cls = _resolved(self)
        assert isinstance(cls, type) and issubclass(cls, ToolParser)
        return cls(self.tools)

    def test_cases_are_given(self):
        assert self.required("cases"), "give at least one ToolCase"
        assert any(case.calls for case in self.cases), "give at least one case with a call"
        assert any(len(case.calls) > 1 for case in self.cases), "give at least one case with parallel calls"

    def test_whole_text_holds_the_expected_calls(self):
        for case in self.cases:
            parsed = self.parser().parse(case.text)
            assert parsed.content == case.content, case.text
            got = [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]
            assert got == [(name, args) for name, args in case.calls], case.text
            for call in parsed.tool_calls:
                assert isinstance(json.loads(call.arguments), dict)
            if case.ids is not None:
                assert tuple(call.id for call in parsed.tool_calls) == case.ids, case.text

    def test_streaming_adds_up_to_the_whole_text_at_every_cut(self):
        for n, case in enumerate(self.cases):
            expected = _whole(self.parser().parse(case.text))
            for pieces in cuttings(case.text, seed=n):
                assert _stream_tools(self.parser(), pieces) == expected, (case.text, pieces)

    def test_malformed_calls_are_content(self):
        """A malformed call is content, as written. A stream learns that only at the end, and
        cannot take back a call it opened before; its content still adds up to the text."""
        for n, text in enumerate(self.malformed):
            parsed = self.parser().parse(text)
            assert (parsed.content, parsed.tool_calls) == (text, ()), text
            for pieces in cuttings(text, seed=n):
                content, _ = _stream_tools(self.parser(), pieces)
                assert content == text, (text, pieces)

    def test_text_without_calls_streams_through(self):
        text = 'Plain answer: 3 < 4 and {"a": 1} is JSON.\n'
        parsed = self.parser().parse(text)
        assert parsed.tool_calls == () and parsed.content == text, f"parse({text!r}) gave {parsed}"
        streamed = _stream_tools(self.parser(), list(text))
        assert streamed == (text, []), f"{text!r} streamed a character at a time gave (content, calls) {streamed}"

    def test_structural_tag_forces_calls_the_parser_reads(self):
        parser = self.parser()
        examples = {name: args for case in self.cases for name, args in case.calls}
        for parallel in (False, True):
            tag = parser.structural_tag(self.tools, parallel=parallel)
            if tag is None:
                capability_skip("structural_tag")
            assert set(tag) <= {"structures", "triggers", "at_least_one", "stop_after_first"}, sorted(tag)
            # one call and nothing after it when parallel calls are not wanted (a format may force one anyway)
            assert tag.get("at_least_one") is True and (parallel or tag.get("stop_after_first") is True)
            structures = tag["structures"]
            assert {s["begin"] for s in structures}, "no structures"
            for tool in self.tools:
                mine = [s for s in structures if s.get("schema") == tool.parameters and tool.name in s["begin"]]
                assert mine, f"no structure for {tool.name}"
                structure = mine[0]
                assert any(structure["begin"].startswith(t) for t in tag["triggers"])
                args = examples.get(tool.name, {})
                text = structure["begin"] + json.dumps(args) + structure["end"]
                parsed = self.parser().parse(text)
                assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [(tool.name, args)], text
                assert parsed.content.strip() == "", text


# reasoning parsers


def _stream_reasoning(parser: Any, pieces: Sequence[str]) -> tuple[str, str]:
    stream = parser.streamer()
    reasoning = content = ""
    for r, c in [*(stream.feed(piece) for piece in pieces), stream.finish()]:
        assert not (reasoning and content and r), "reasoning after the content began"
        reasoning += r
        content += c
    return reasoning, content


class ReasoningParserTests(KitTests):
    """Subclass with ``plugin``, ``parser_name`` and ``cases`` (:class:`ReasoningCase`);
    ``tokenizer`` (a callable returning a Hugging Face tokenizer with the family's marker
    tokens) to check the markers' token ids."""

    registry_name = "reasoning_parsers"
    parser_name: ClassVar[str | None] = None
    cases: ClassVar[Sequence[ReasoningCase]] = ()
    tokenizer: ClassVar[Any] = None

    def parser(self, prompt: str | None = None) -> Any:
        from engine.interfaces.reasoning_parser import ReasoningParser

        cls = _resolved(self)
        assert isinstance(cls, type) and issubclass(cls, ReasoningParser)
        tokenizer = type(self).tokenizer() if type(self).tokenizer is not None else None
        return cls(tokenizer, prompt)

    def test_cases_are_given(self):
        cases = self.required("cases")
        assert any(c.reasoning is not None and c.content for c in cases), "give a case with reasoning and an answer"
        assert any(c.reasoning is None for c in cases), "give a case without reasoning"

    def test_whole_text_splits_as_expected(self):
        for case in self.cases:
            split = self.parser(case.prompt).split(case.text)
            assert (split.reasoning, split.content) == (case.reasoning, case.content), case.text

    def test_streaming_adds_up_to_the_whole_text_at_every_cut(self):
        for n, case in enumerate(self.cases):
            split = self.parser(case.prompt).split(case.text)
            expected = (split.reasoning or "", split.content)
            for pieces in cuttings(case.text, seed=n):
                assert _stream_reasoning(self.parser(case.prompt), pieces) == expected, (case.text, pieces)

    def test_markers_are_tokens_of_the_tokenizer(self):
        if type(self).tokenizer is None:
            capability_skip("tokenizer")
        parser = self.parser()
        tokenizer = parser.tokenizer
        start, end, forced = parser.marker_token_ids()
        assert end and forced and start, f"marker_token_ids() gave (start, end, forced_end) {(start, end, forced)}"
        assert tokenizer.decode(list(end)) == parser.end
        assert tokenizer.decode(list(forced)) == (parser.forced_end or parser.end)
        assert tokenizer.decode(list(start)) == parser.start
