"""DeepSeek's reasoning (``deepseek_r1``): ``<think>`` … ``</think>``, then the answer.

DeepSeek-R1 writes its reasoning between the two markers. R1-0528's template, and V3.1's,
V3.2's and V4's in thinking mode, write ``<think>`` at the end of the prompt, so the output
starts inside the reasoning; in chat mode V3.1, V3.2 and V4 write ``</think>`` there, and the
output is all answer. The prompt says which (:meth:`~ReasoningParser.starts_in_reasoning`), so
one parser serves every mode. The markers are plain added tokens, not special ones.
"""

from __future__ import annotations

from engine.interfaces.reasoning_parser import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
