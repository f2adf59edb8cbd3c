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

Options come from the chat request: ``thinking`` (bool) or ``thinking_mode`` (``chat`` /
``thinking``), ``reasoning_effort``, and ``drop_thinking``. A ``reasoning_effort`` alone
selects thinking mode. Text holding the format's own control tokens is refused, so that
user input cannot fake a turn.
"""

from __future__ import annotations

from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
RESERVED = (BOS, EOS, USER, ASSISTANT, THINK, END_THINK, "｜DSML｜", "<｜latest_reminder｜>")

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
EFFORTS = ("minimal", "low", "medium", "high", "max")
OPTIONS = ("thinking", "thinking_mode", "reasoning_effort", "drop_thinking")


def encode_chat(
    messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, options: dict[str, Any] | None = None
) -> str:
    """The prompt text of ``messages`` (``role``, ``content`` and, for assistant turns,
    optional ``reasoning_content``). Raises ``ValueError`` for options or messages the format
    cannot express."""
    mode, effort, drop_thinking = _options(options or {})
    turns = _merge_users(messages)
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
            prompt += content + EOS
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


def _merge_users(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Developer messages as user turns, consecutive user turns joined with a blank line; every
    text checked for the format's control tokens."""
    turns: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise ValueError(f"messages[{index}]: role {role!r} is not supported (system, developer, user, assistant).")
        content = message.get("content") or ""
        _check(content, f"messages[{index}].content")
        if role == "developer":
            role = "user"
        if role == "user" and turns and turns[-1]["role"] == "user":
            turns[-1] = {"role": "user", "content": turns[-1]["content"] + "\n\n" + content}
            continue
        turn = {"role": role, "content": content}
        if role == "assistant" and message.get("reasoning_content"):
            _check(message["reasoning_content"], f"messages[{index}].reasoning_content")
            turn["reasoning_content"] = message["reasoning_content"]
        turns.append(turn)
    return turns


def _check(text: str, where: str) -> None:
    if not isinstance(text, str):
        raise ValueError(f"{where} must be text.")
    for token in RESERVED:
        if token in text:
            raise ValueError(f"{where} holds the control token {token!r}, which the prompt format reserves.")
