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

Calls cannot be forced with the engine's structural tags: a structure holds one JSON instance,
and DSML's arguments are a sequence of tagged parameters (:meth:`structural_tag` is None).
"""

from __future__ import annotations

import json
import re

from engine.interfaces.tool_parser import ToolCall
from engine_deepseek_v4.parsers.blocks import BlockToolParser, json_value

DSML = "｜DSML｜"
INVOKE_BEGIN = f"<{DSML}invoke"
INVOKE_END = f"</{DSML}invoke>"
CONTENT_BREAK = "\n\n"

_INVOKE_HEAD = re.compile(r' name="(?P<name>[^"\n<]+)">')
_PARAMETER = re.compile(
    rf'\s*<{DSML}parameter name="(?P<key>[^"\n<]*)" string="(?P<string>true|false)">(?P<value>.*?)</{DSML}parameter>',
    re.DOTALL,
)


class DsmlToolParser(BlockToolParser):
    call_begin, call_end, content_break = INVOKE_BEGIN, INVOKE_END, CONTENT_BREAK

    def read_call(self, body: str) -> ToolCall | None:
        head = _INVOKE_HEAD.match(body)
        if head is None:
            return None
        pos, fields, keys = head.end(), [], set()
        while (parameter := _PARAMETER.match(body, pos)) is not None:
            key, value = parameter["key"], parameter["value"]
            if key in keys or (parameter["string"] == "false" and not json_value(value)):
                return None
            keys.add(key)
            text = json.dumps(value, ensure_ascii=False) if parameter["string"] == "true" else value
            fields.append(f"{json.dumps(key, ensure_ascii=False)}: {text}")
            pos = parameter.end()
        if body[pos:].strip():
            return None
        return ToolCall(head["name"], "{" + ", ".join(fields) + "}")


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
