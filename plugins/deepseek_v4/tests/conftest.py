"""The DeepSeek tests import their shared helpers (deepseek_helpers.py) from this folder."""

import sys
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
