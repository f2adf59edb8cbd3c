"""Mistral tool calls, in the forms mistral_common's instruct tokenizers write them.

Every form opens with the control token ``[TOOL_CALLS]``:

- tokenizers before v11 (``InstructTokenizerV2``/``V3``/``V7``: Mistral 7B v0.3, Nemo,
  Small 2409 and 2501, Large 2407): ``[TOOL_CALLS]`` and one JSON list of the calls,
  ``[{"name": "...", "arguments": {...}}]``, each with an ``"id"`` from v3 on when the
  call has one (SentencePiece tokenizers decode a space before the list);
- v11: one group per call, ``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}``, the id optional;
- v13: ``[TOOL_CALLS]name[ARGS]{...}``.

From v7 on, text may come before the calls; that is the content. A group (from one
``[TOOL_CALLS]`` to the next, or to the end) holds calls and whitespace only; any other
group is content, as written. The format has no closing token, so a group is certain only
once the next ``[TOOL_CALLS]`` begins, and the last one when the output ends.

A stream does not wait for that: it opens a call once its name and id are known and sends
its arguments object as it is written. In the ``name[CALL_ID]id[ARGS]{...}`` forms that is
when the object begins after ``[ARGS]`` (arguments that do not begin as an object open no
call). In the list form a call's id is a member of its object, and must come with its
name: a call opens once both its name and its id are complete, or once its object closes
without an id. As mistral_common writes the id after the arguments (or none), a call of
the list form arrives whole as its object closes, before the list does. A group that turns
out malformed is still content in the end; the stream cannot take back the calls it
opened for it.
"""

from __future__ import annotations

import re
import secrets
import string

from engine.interfaces.tool_parser import ParsedToolCalls, ToolCall, held_back, scan_json
from engine_llama.parsers.json_text import (
    WHITESPACE,
    MarkedJsonToolParser,
    call_from_object,
    call_so_far,
    object_members,
    skip_whitespace,
)

TOOL_CALLS, CALL_ID, ARGS = "[TOOL_CALLS]", "[CALL_ID]", "[ARGS]"
ARGUMENTS = ("arguments",)  # the key of a call object's arguments
ID_ALPHABET = string.ascii_letters + string.digits
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")  # OpenAI's function names (with dots)


class MistralToolParser(MarkedJsonToolParser):
    name = "mistral"
    markers = (TOOL_CALLS,)
    special_tokens = True
    # Calls are forced in the list form: what the pre-v11 tokenizers of most
    # MistralForCausalLM checkpoints write. Parallel calls repeat the group, which the
    # parser reads as one sequence.
    call_before, call_after = f"{TOOL_CALLS}[", "]"

    def new_call_id(self, prefix: str) -> str:
        """Nine letters and digits, the only ids Mistral's chat templates accept back."""
        return "".join(secrets.choice(ID_ALPHABET) for _ in range(9))

    def read(self, text: str, final: bool) -> ParsedToolCalls:
        first = text.find(TOOL_CALLS)
        if first < 0:
            end = len(text) if final else len(text) - held_back(text, (TOOL_CALLS,))
            return ParsedToolCalls(text[:end])
        content, calls = [text[:first]], []
        start = first
        while start < len(text):
            read, end = _group(text, start, final)
            if end is None:  # only what follows can tell where the group ends
                calls += read or []
                break
            if read is None:
                content.append(text[start:end])
            else:
                calls += read
            start = end
        return ParsedToolCalls("".join(content), tuple(calls))


def _group(text: str, start: int, final: bool) -> tuple[list[ToolCall] | None, int | None]:
    """The group that opens with the ``[TOOL_CALLS]`` at ``text[start]``: its calls (None:
    it is malformed) and where it ends. The end is None when only a continuation can tell
    (never when ``final``); the calls are then those the group has begun, as far as they
    are written."""
    i = skip_whitespace(text, start + len(TOOL_CALLS))
    if text[i : i + 1] == "[":  # the list form
        opener, end = "[", scan_json(text, i)
        calls = _call_list(text[i:end]) if end is not None else None
    else:  # name[CALL_ID]id[ARGS]{...}
        args, next_group = text.find(ARGS, i), text.find(TOOL_CALLS, i)
        if args < 0 and next_group < 0:
            return None, (len(text) if final else None)
        if args < 0 or 0 <= next_group < args:
            return None, next_group
        name, _, call_id = text[i:args].partition(CALL_ID)
        name, call_id = name.strip(WHITESPACE), call_id.strip(WHITESPACE)
        if not _NAME.fullmatch(name) or (CALL_ID in text[i:args] and not call_id):
            return _malformed(text, start, final)
        i = skip_whitespace(text, args + len(ARGS))
        if i == len(text) and not final:
            return None, None
        opener, end = "{", scan_json(text, i) if text[i : i + 1] == "{" else None
        is_object = end is not None and object_members(text[i:end]) is not None
        calls = [ToolCall(name, text[i:end], call_id or None)] if is_object else None
    if end is None:  # the JSON has not closed (yet), or it does not open
        if text[i : i + 1] == opener and not final:
            begun = _list_so_far(text, i) if opener == "[" else [ToolCall(name, text[i:], call_id or None)]
            return begun, None
        return _malformed(text, start, final)
    if calls is None:
        return _malformed(text, start, final)
    k = skip_whitespace(text, end)
    if text.startswith(TOOL_CALLS, k) or (k == len(text) and final):
        return calls, k
    if not final and TOOL_CALLS.startswith(text[k:]):
        return calls, None
    return _malformed(text, start, final)


def _malformed(text: str, start: int, final: bool) -> tuple[None, int | None]:
    """A malformed group runs to the next ``[TOOL_CALLS]`` or the end of the output."""
    next_group = text.find(TOOL_CALLS, start + len(TOOL_CALLS))
    if next_group >= 0:
        return None, next_group
    return None, (len(text) if final else None)


def _call_list(text: str) -> list[ToolCall] | None:
    """The calls of the JSON list ``text``; None when it is anything else."""
    calls: list[ToolCall] = []
    i = skip_whitespace(text, 1)
    while i < len(text) and text[i] == "{":
        end = scan_json(text, i)
        call = call_from_object(text[i:end], ARGUMENTS, id_key="id") if end is not None else None
        if call is None:
            return None
        calls.append(call)
        i = skip_whitespace(text, end)
        if text[i : i + 1] != ",":
            break
        i = skip_whitespace(text, i + 1)
    return calls if calls and text[i:] == "]" else None


def _list_so_far(text: str, start: int) -> list[ToolCall] | None:
    """The calls begun by the list that opens at ``text[start]`` and has not closed: its
    whole calls, and the last one as far as it is written once its name and id are known;
    None when it can no longer be a list of calls."""
    calls: list[ToolCall] = []
    i = skip_whitespace(text, start + 1)
    while i < len(text):
        if text[i] != "{":
            return None
        end = scan_json(text, i)
        if end is None:
            call = call_so_far(text[i:], ARGUMENTS, "id", wait_for_id=True)
            return calls + [call] if call is not None else calls
        call = call_from_object(text[i:end], ARGUMENTS, id_key="id")
        if call is None:
            return None
        calls.append(call)
        i = skip_whitespace(text, end)
        if text[i : i + 1] == ",":
            i = skip_whitespace(text, i + 1)
        elif i < len(text):
            return None
    return calls
