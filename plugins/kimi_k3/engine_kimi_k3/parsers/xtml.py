"""Kimi K3's XTML markers: channels opened by ``<|open|>NAME<|sep|>`` and closed by
``<|close|>NAME<|sep|>``, each of ``<|open|>``, ``<|close|>`` and ``<|sep|>`` a special token."""

OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"

THINK_OPEN = f"{OPEN}think{SEP}"
THINK_CLOSE = f"{CLOSE}think{SEP}"
RESPONSE_OPEN = f"{OPEN}response{SEP}"
RESPONSE_CLOSE = f"{CLOSE}response{SEP}"
TOOLS_OPEN = f"{OPEN}tools{SEP}"
TOOLS_CLOSE = f"{CLOSE}tools{SEP}"
MESSAGE_CLOSE = f"{CLOSE}message{SEP}"
CALL_OPEN = f"{OPEN}call"  # followed by its attributes, then SEP
CALL_CLOSE = f"{CLOSE}call{SEP}"
ARGUMENT_OPEN = f"{OPEN}argument"
ARGUMENT_CLOSE = f"{CLOSE}argument{SEP}"

# the markers that wrap the answer: the answer is what they hold
ANSWER_MARKERS = (RESPONSE_OPEN, RESPONSE_CLOSE, MESSAGE_CLOSE)
