"""Test support shipped with engine: tiny random checkpoints made with HF
transformers, so plugins can be checked against the reference implementation."""
