"""DeepSeek's DSML tool calls: ``deepseek_v32`` (DeepSeek-V3.2) and ``deepseek_v4`` (V4).

As DeepSeek's encoding code writes them (``encoding_dsv32.py``, ``encoding_dsv4.py``) after
the answer and a blank line::

    On it.

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Beijing</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

V3.2 names the block ``function_calls``, V4 ``tool_calls``; the rest is the same. The blank
line before the block belongs to it (the reference reader splits the answer at
``"\\n\\n<｜DSML｜"``). A parameter with ``string="true"`` is its raw text; with
``string="false"`` it is the JSON text of its value (a number, a boolean, an array, an object),
which must be JSON for the call to be well formed. A parameter name may not repeat.

The arguments are no JSON text of the model's own, so the parser writes them as the reference
decoder does: ``{"city": "Beijing", "days": 2}``, each name and string value ``json.dumps``'d
with non-ASCII as is, each ``string="false"`` value as the model wrote it, ``", "`` between
them. A call carries no id, so the server makes one.

A stream opens a call once its ``invoke`` tag is complete, with ``{``, and then sends its
arguments text as the parameters are written, each partial answer a prefix of that final text:
a parameter's ``"name": `` once its tag is complete (after ``", "`` when it is not the first),
then its value as it grows, less a tail that could begin ``</｜DSML｜parameter>``. A
``string="true"`` value goes out as ``json.dumps`` writes it, without its closing quote until the
parameter closes: ``json.dumps`` escapes each character on its own, so the escaped text of a
value's beginning is the beginning of the escaped whole (``{"location": "Bei`` grows into
``{"location": "Beijing"``). A ``string="false"`` value goes out as the raw JSON text it is, as
written, which is how the whole arguments hold it too (a value that turns out not to be JSON
makes the call malformed, and the stream has sent its beginning). The closing ``}`` comes with
the invoke's end. Nothing is sent of a parameter that breaks the call (a repeated name, stray
text), nor after it.

Calls cannot be forced with the engine's structural tags: a structure holds one JSON instance,
and DSML's arguments are a sequence of tagged parameters (:meth:`structural_tag` is None).
"""

from __future__ import annotations

import json
import re

from engine.interfaces.tool_parser import ToolCall, held_back
from engine_deepseek_v4.parsers.blocks import BlockToolParser, json_value

DSML = "｜DSML｜"
INVOKE_BEGIN = f"<{DSML}invoke"
INVOKE_END = f"</{DSML}invoke>"
PARAMETER_END = f"</{DSML}parameter>"
CONTENT_BREAK = "\n\n"

_INVOKE_HEAD = re.compile(r' name="(?P<name>[^"\n<]+)">')
_PARAMETER_HEAD = rf'\s*<{DSML}parameter name="(?P<key>[^"\n<]*)" string="(?P<string>true|false)">'
_PARAMETER = re.compile(_PARAMETER_HEAD + rf"(?P<value>.*?){PARAMETER_END}", re.DOTALL)
_PARAMETER_OPENING = re.compile(_PARAMETER_HEAD)


def _dumps(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)


def _parameters(body: str, pos: int) -> tuple[list[str], int | None, set[str]]:
    """The arguments' fields (``"name": value``) of the complete parameters from ``pos``,
    where they stop (None: at one that makes the call malformed) and their names."""
    fields: list[str] = []
    keys: set[str] = set()
    while (parameter := _PARAMETER.match(body, pos)) is not None:
        key, value = parameter["key"], parameter["value"]
        if key in keys or (parameter["string"] == "false" and not json_value(value)):
            return fields, None, keys
        keys.add(key)
        fields.append(f"{_dumps(key)}: {_dumps(value) if parameter['string'] == 'true' else value}")
        pos = parameter.end()
    return fields, pos, keys


class DsmlToolParser(BlockToolParser):
    call_begin, call_end, content_break = INVOKE_BEGIN, INVOKE_END, CONTENT_BREAK

    def read_call(self, body: str) -> ToolCall | None:
        head = _INVOKE_HEAD.match(body)
        if head is None:
            return None
        fields, pos, keys = _parameters(body, head.end())
        if pos is None or body[pos:].strip():
            return None
        return ToolCall(head["name"], "{" + ", ".join(fields) + "}")

    def read_partial_call(self, body: str) -> ToolCall | None:
        head = _INVOKE_HEAD.match(body)
        if head is None:
            return None
        fields, pos, keys = _parameters(body, head.end())
        opening = _PARAMETER_OPENING.match(body, pos) if pos is not None else None
        if opening is not None and opening["key"] not in keys:  # a parameter in progress
            value = body[opening.end() :]
            value = value[: len(value) - held_back(value, (PARAMETER_END, *self.stops))]
            value = _dumps(value)[:-1] if opening["string"] == "true" else value
            fields.append(f"{_dumps(opening['key'])}: {value}")
        return ToolCall(head["name"], "{" + ", ".join(fields))


class DeepSeekV32ToolParser(DsmlToolParser):
    name = "deepseek_v32"
    block_begin = f"<{DSML}function_calls>"
    block_end = f"</{DSML}function_calls>"
    markers = (CONTENT_BREAK + block_begin, block_begin)


class DeepSeekV4ToolParser(DsmlToolParser):
    name = "deepseek_v4"
    block_begin = f"<{DSML}tool_calls>"
    block_end = f"</{DSML}tool_calls>"
    markers = (CONTENT_BREAK + block_begin, block_begin)
