"""DeepSeek-V4's prompt format, which its checkpoints ship as code rather than a chat template.

A conversation renders as::

    <｜begin▁of▁sentence｜>[effort prompt]{system}<｜User｜>{user}<｜Assistant｜>{transition}
        [{reasoning}</think>]{answer}<｜end▁of▁sentence｜><｜User｜>...<｜Assistant｜>{transition}

- **Modes.** In ``chat`` mode the transition after a user turn is ``</think>``: the model
  answers without reasoning. In ``thinking`` mode, the transition after the last user turn is
  ``<think>``, and the model reasons first. Earlier turns keep ``</think>`` and lose their
  ``reasoning_content``, unless ``drop_thinking`` is false.
- **Reasoning effort.** In thinking mode, ``reasoning_effort`` ``high`` or ``max`` puts an
  instruction to reason harder before everything else. ``low``, ``medium`` and unset add
  nothing.
- **Roles.** A system message is its bare text. A developer message is sent as a user turn.
  Consecutive user messages join with a blank line. Assistant turns end with the
  end-of-sentence token.
- **Tools.** The declared functions follow the first message after a blank line when it is a
  system message (else they open the prompt, after a blank line): a ``## Tools``
  section with the DSML call format and one JSON schema a line. Declaring tools keeps every
  turn's reasoning, as if ``drop_thinking`` were false. An assistant's calls follow its answer
  after a blank line, in a ``<｜DSML｜tool_calls>`` block, each argument a parameter: a string
  as is (``string="true"``), any other value as JSON (``string="false"``). Tool results join
  the user turn around them, each as ``<tool_result>...</tool_result>``, in the order of the
  last assistant's calls (by ``tool_call_id``).

This is the rendering of DeepSeek's ``encoding/encoding_dsv4.py``, with the tools of the
request given to its first message (as ``encode_messages`` reads them there).

Options come from the chat request: ``thinking`` (bool) or ``thinking_mode`` (``chat`` /
``thinking``), ``reasoning_effort``, and ``drop_thinking``. A ``reasoning_effort`` alone
selects thinking mode. Text holding the format's own control tokens is refused, so that
user input cannot fake a turn.
"""

from __future__ import annotations

import json
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"
RESERVED = (BOS, EOS, USER, ASSISTANT, THINK, END_THINK, DSML, "<｜latest_reminder｜>")

EFFORT_PROMPTS = {
    "high": (
        "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
        "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the "
        "root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
        "adversarial scenarios.\n"
        "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
        "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
    ),
    "max": (
        "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
        "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
        "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
        "resolve the underlying cause rather than any surface symptom.\n"
        "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
        "certain that no assumption remains unchecked and no error remains undiscovered.\n\n"
    ),
}
TOOLS_PREAMBLE = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside {THINK}...{END_THINK} BEFORE any tool calls or final response.

Otherwise, output directly after {END_THINK} with tool calls or final response.

### Available Tool Schemas

"""
TOOLS_CLOSING = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"

EFFORTS = ("minimal", "low", "medium", "high", "max")
OPTIONS = ("thinking", "thinking_mode", "reasoning_effort", "drop_thinking")


def encode_chat(
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    options: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text of ``messages`` (``role``, ``content`` and, for assistant turns,
    optional ``reasoning_content`` and ``tool_calls``; ``tool`` turns with ``tool_call_id``)
    and of the declared ``tools`` (OpenAI's list, or None). Raises ``ValueError`` for options,
    messages or tools the format cannot express."""
    mode, effort, drop_thinking = _options(options or {})
    turns = _turns(messages)
    if tools:
        section = _tools_section(tools)
        if turns and turns[0]["role"] == "system":
            turns[0] = {**turns[0], "content": turns[0]["content"] + "\n\n" + section}
        else:
            turns.insert(0, {"role": "system", "content": "\n\n" + section})
        drop_thinking = False  # the reference keeps all reasoning once tools are declared
    last_user = max((i for i, m in enumerate(turns) if m["role"] == "user"), default=-1)
    prompt = BOS
    if mode == "thinking":
        prompt += EFFORT_PROMPTS.get(effort, "")
    for index, message in enumerate(turns):
        role, content = message["role"], message["content"]
        if role == "system":
            prompt += content
        elif role == "user":
            prompt += USER + content
            following = turns[index + 1]["role"] if index + 1 < len(turns) else None
            if following == "assistant" or (following is None and add_generation_prompt):
                thinks = mode == "thinking" and (index == last_user or not drop_thinking)
                prompt += ASSISTANT + (THINK if thinks else END_THINK)
        else:  # assistant
            if mode == "thinking" and (index > last_user or not drop_thinking):
                prompt += message.get("reasoning_content", "") + END_THINK
            prompt += content + message.get("calls", "") + EOS
    return prompt


def _options(options: dict[str, Any]) -> tuple[str, str | None, bool]:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"DeepSeek-V4 chat options are {', '.join(OPTIONS)}; unknown: {', '.join(unknown)}.")
    effort = options.get("reasoning_effort")
    if effort is not None and effort not in EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {', '.join(EFFORTS)}, not {effort!r}.")
    mode = options.get("thinking_mode")
    if "thinking" in options:
        if not isinstance(options["thinking"], bool):
            raise ValueError("thinking must be true or false.")
        flag_mode = "thinking" if options["thinking"] else "chat"
        if mode is not None and mode != flag_mode:
            raise ValueError(f"thinking={options['thinking']} contradicts thinking_mode={mode!r}.")
        mode = flag_mode
    if mode is None:
        mode = "thinking" if effort is not None else "chat"
    if mode not in ("chat", "thinking"):
        raise ValueError(f"thinking_mode must be 'chat' or 'thinking', not {mode!r}.")
    drop_thinking = options.get("drop_thinking", True)
    if not isinstance(drop_thinking, bool):
        raise ValueError("drop_thinking must be true or false.")
    return mode, effort, drop_thinking


def _turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Developer messages as user turns, consecutive user turns (tool results among them)
    joined with a blank line, each turn's tool results in the order of the last assistant's
    calls; assistant calls rendered; every text checked for the format's control tokens."""
    turns: list[dict[str, Any]] = []
    parts: list[tuple[int, str] | str] = []  # the open user turn: texts, and tool results with their order
    call_order: dict[str, int] = {}  # tool_call_id -> position among the last assistant's calls

    def close_user_turn() -> None:
        if parts:
            results = iter(sorted((p for p in parts if isinstance(p, tuple)), key=lambda p: p[0]))
            texts = [next(results)[1] if isinstance(p, tuple) else p for p in parts]
            turns.append({"role": "user", "content": "\n\n".join(texts)})
            parts.clear()

    for index, message in enumerate(messages):
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise ValueError(
                f"messages[{index}]: role {role!r} is not supported (system, developer, user, assistant, tool)."
            )
        content = message.get("content") or ""
        _check(content, f"messages[{index}].content")
        if role == "tool":
            order = call_order.get(message.get("tool_call_id") or "", 0)
            parts.append((order, f"<tool_result>{content}</tool_result>"))
            continue
        if role in ("user", "developer"):
            parts.append(content)
            continue
        close_user_turn()
        turn = {"role": role, "content": content}
        if role == "assistant" and message.get("reasoning_content"):
            _check(message["reasoning_content"], f"messages[{index}].reasoning_content")
            turn["reasoning_content"] = message["reasoning_content"]
        if role == "assistant" and message.get("tool_calls"):
            turn["calls"] = _tool_calls(message["tool_calls"], f"messages[{index}].tool_calls")
            call_order = {call.get("id"): n for n, call in enumerate(message["tool_calls"]) if call.get("id")}
        turns.append(turn)
    close_user_turn()
    return turns


def _tools_section(tools: list[dict[str, Any]]) -> str:
    """The ``## Tools`` section: the call format, then each function's JSON, a line each."""
    if not isinstance(tools, list):
        raise ValueError("tools must be a list.")
    schemas = []
    for n, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ValueError(f'tools[{n}] must be {{"type": "function", "function": {{...}}}}.')
        schemas.append(_json(tool["function"], f"tools[{n}].function"))
    return TOOLS_PREAMBLE + "\n".join(schemas) + TOOLS_CLOSING


def _tool_calls(calls: Any, where: str) -> str:
    """An assistant's calls: a blank line, then the ``tool_calls`` block of one invoke each."""
    if not isinstance(calls, list):
        raise ValueError(f"{where} must be a list.")
    invokes = []
    for n, call in enumerate(calls):
        at = f"{where}[{n}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise ValueError(f'{at} must be {{"type": "function", "function": {{"name", "arguments"}}}}.')
        name, arguments = function.get("name"), function.get("arguments")
        _check_name(name, f"{at}.function.name")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise ValueError(f"{at}.function.arguments is not JSON.") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"{at}.function.arguments must be a JSON object.")
        parameters = []
        for key, value in arguments.items():
            _check_name(key, f"{at}.function.arguments key {key!r}")
            text = value if isinstance(value, str) else _json(value, f"{at}.function.arguments[{key!r}]")
            _check(text, f"{at}.function.arguments[{key!r}]")
            string = "true" if isinstance(value, str) else "false"
            parameters.append(f'<{DSML}parameter name="{key}" string="{string}">{text}</{DSML}parameter>')
        invokes.append(f'<{DSML}invoke name="{name}">\n' + "\n".join(parameters) + f"\n</{DSML}invoke>")
    return f"\n\n<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


def _json(value: Any, where: str) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        raise ValueError(f"{where} cannot be written as JSON.") from None
    _check(text, where)
    return text


def _check_name(name: Any, where: str) -> None:
    """A function or parameter name, which the format writes between double quotes."""
    if not isinstance(name, str) or not name or '"' in name:
        raise ValueError(f"{where} must be a non-empty text without double quotes.")
    _check(name, where)


def _check(text: str, where: str) -> None:
    if not isinstance(text, str):
        raise ValueError(f"{where} must be text.")
    for token in RESERVED:
        if token in text:
            raise ValueError(f"{where} holds the control token {token!r}, which the prompt format reserves.")
