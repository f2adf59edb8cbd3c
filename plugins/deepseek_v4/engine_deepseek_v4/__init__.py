"""engine-deepseek-v4: the DeepSeek family for engine: DeepSeek-V3 and Kimi-K2, V3.2 (sparse
attention) and V4, with their multi-token-prediction blocks for the ``mtp`` speculative proposer.

- ``deepseek_v3``: ``DeepseekV3ForCausalLM`` (V3, Kimi-K2) and ``DeepseekV32ForCausalLM``;
- ``deepseek_v4``: the package of ``DeepseekV4ForCausalLM``, one part of the network per module;
- ``chat_v4``: V4's chat encoder (its prompt format, which its checkpoints ship as code);
- ``parsers``: the family's tool-call formats (V3, V3.1, V3.2 and V4) and its ``<think>`` reasoning;
- ``mtp``: V3 / V3.2's multi-token-prediction layer and V4's block, as the engine's ``mtp`` proposer takes them;
- ``plugin``: the hooks that register all of these with the engine.
"""
