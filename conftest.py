import os

# Tests never download anything: checkpoints are made locally from random weights.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# engine-cpu's kernel choice by timing would make a test's kernels depend on the machine's load;
# tests get its fixed rule, and plugins/cpu/tests/test_tuning.py measures with a store of its own.
os.environ.setdefault("ENGINE_CPU_TUNING", "0")
