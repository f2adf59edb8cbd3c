"""The llama tests import their tiny MoE and Phi-3 checkpoints (llama_checkpoints.py) from this folder."""

import sys
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
