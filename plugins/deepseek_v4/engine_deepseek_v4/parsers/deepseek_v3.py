"""DeepSeek-V3's and V3.1's tool calls: a block of calls whose arguments are one JSON object.

``deepseek_v3`` (DeepSeek-V3, V3-0324, R1 and R1-0528), as their chat templates write a
call (``tool['type']`` is ``function``) and the calls after the first on a new line::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

``deepseek_v31`` (DeepSeek-V3.1 and V3.1-Terminus), as its chat template and model card
write them, chained without separators::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The answer comes right before the block. The arguments are the model's own JSON text (the
whitespace around it is not part of it); a call carries no id, so the server makes one.
V3.1 checkpoints share V3's architecture, so they need ``--tool-call-parser deepseek_v31``.

A stream opens a call once its name is complete (V3: at the ```` ```json ```` fence after it; V3.1:
at ``<｜tool▁sep｜>``), then sends its arguments as the model writes them: the JSON text so far,
less a tail that could begin the closing fence or the call's end marker, all of it once the JSON
value has closed. Whole, a call's arguments are exactly what the stream sent of them.

Calls are forced with one structure per tool, a whole block around one call: parallel calls
come as consecutive blocks, which read as one call each.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

from engine.interfaces.tool_parser import Tool, ToolCall
from engine_deepseek_v4.parsers.blocks import BlockToolParser, json_object, json_so_far

BLOCK_BEGIN = "<｜tool▁calls▁begin｜>"
BLOCK_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"

_V3_HEAD = r"function" + SEP + r"(?P<name>[^\n]+)\n```json"
_V3_BODY = re.compile(_V3_HEAD + r"(?P<arguments>.*)```\s*", re.DOTALL)
_V3_OPENING = re.compile(_V3_HEAD)


def _valid_name(name: str) -> bool:
    return bool(name) and "<｜" not in name and "\n" not in name


def _call(name: str, arguments: str) -> ToolCall | None:
    arguments = arguments.strip()
    if not _valid_name(name) or json_object(arguments) is None:
        return None
    return ToolCall(name, arguments)


def _structural_tag(tools: Sequence[Tool], parallel: bool, begin: Callable[[str], str], end: str) -> dict:
    return {
        "structures": [{"begin": begin(tool.name), "schema": tool.parameters, "end": end} for tool in tools],
        "triggers": [BLOCK_BEGIN],
        "at_least_one": True,
        "stop_after_first": not parallel,
    }


class DeepSeekV3ToolParser(BlockToolParser):
    name = "deepseek_v3"
    markers = (BLOCK_BEGIN,)
    block_begin, block_end, call_begin, call_end = BLOCK_BEGIN, BLOCK_END, CALL_BEGIN, CALL_END

    def read_call(self, body: str) -> ToolCall | None:
        match = _V3_BODY.fullmatch(body)
        return _call(match["name"], match["arguments"]) if match else None

    def read_partial_call(self, body: str) -> ToolCall | None:
        opening = _V3_OPENING.match(body)
        if opening is None or not _valid_name(opening["name"]):
            return None
        return ToolCall(opening["name"], json_so_far(body[opening.end() :], self.stops, fence="`"))

    def structural_tag(self, tools: Sequence[Tool], *, parallel: bool) -> dict | None:
        def begin(name: str) -> str:
            return BLOCK_BEGIN + CALL_BEGIN + "function" + SEP + name + "\n```json\n"

        return _structural_tag(tools, parallel, begin, "\n```" + CALL_END + BLOCK_END)


class DeepSeekV31ToolParser(BlockToolParser):
    name = "deepseek_v31"
    markers = (BLOCK_BEGIN,)
    block_begin, block_end, call_begin, call_end = BLOCK_BEGIN, BLOCK_END, CALL_BEGIN, CALL_END

    def read_call(self, body: str) -> ToolCall | None:
        name, found, arguments = body.partition(SEP)
        return _call(name, arguments) if found else None

    def read_partial_call(self, body: str) -> ToolCall | None:
        name, found, arguments = body.partition(SEP)
        if not found or not _valid_name(name):
            return None
        return ToolCall(name, json_so_far(arguments, self.stops))

    def structural_tag(self, tools: Sequence[Tool], *, parallel: bool) -> dict | None:
        def begin(name: str) -> str:
            return BLOCK_BEGIN + CALL_BEGIN + name + SEP

        return _structural_tag(tools, parallel, begin, CALL_END + BLOCK_END)
