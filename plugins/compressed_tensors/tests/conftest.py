"""The compressed-tensors tests import the format's plain reference (pack_quantized_reference.py)
from this folder."""

import sys
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
