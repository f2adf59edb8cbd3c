"""Kimi's tool-call and reasoning formats (no torch): ``kimi_k2`` and ``kimi_k3`` tool
parsers, ``kimi`` and ``kimi_k3`` reasoning parsers. The plugin registers each by its module
path, so importing this package imports none of them."""
