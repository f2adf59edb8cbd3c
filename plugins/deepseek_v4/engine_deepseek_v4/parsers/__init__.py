"""DeepSeek's tool-call and reasoning formats (no torch):

- ``deepseek_v3``: the tool parser of DeepSeek-V3 and R1 (``blocks.py`` reads, ``deepseek_v3.py`` decodes);
- ``deepseek_v31``: V3.1's (``deepseek_v3.py``);
- ``deepseek_v32`` and ``deepseek_v4``: the DSML of V3.2 and V4 (``dsml.py``);
- ``deepseek_r1``: the ``<think>`` reasoning parser of R1, V3.1, V3.2 and V4 (``reasoning.py``).

The plugin registers each by its module path, so importing this package imports none of them.
"""
