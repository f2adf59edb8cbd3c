"""Qwen3's reasoning: ``<think>`` … ``</think>``, then the answer.

Qwen3's chat template writes an assistant turn as ``<think>\\n`` + reasoning +
``\\n</think>\\n\\n`` + answer (and puts an answer back with ``content.lstrip('\\n')``);
the model card strips the newlines from the answer it decodes. So the newlines right
after ``</think>`` are the format's, not the answer's: the content starts after them.
The reasoning is kept as written between the markers, as vLLM's ``qwen3`` parser keeps it.

Where the reasoning starts depends on the prompt, which the base class reads: the
original Qwen3 template leaves the output to open ``<think>`` itself; with
``enable_thinking=False`` it writes ``<think>\\n\\n</think>\\n\\n`` into the prompt (no
reasoning follows); the thinking-2507 templates end the prompt with ``<think>\\n`` (the
output begins inside the reasoning). ``<think>`` and ``</think>`` are added tokens of the
Qwen3 tokenizer that are not special, so they survive ``skip_special_tokens``.
"""

from __future__ import annotations

from engine.interfaces.reasoning_parser import ReasoningParser, ReasoningSplit


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    start = "<think>"
    end = "</think>"
    forced_end = "</think>\n\n"  # what the template writes after the reasoning

    def split(self, text: str) -> ReasoningSplit:
        split = super().split(text)
        if split.reasoning is None:
            return split
        return ReasoningSplit(split.reasoning, split.content.lstrip("\n"))
