"""Tools that work on checkpoints rather than serve them (``engine quantize``)."""
