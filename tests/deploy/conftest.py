"""Make the shared manifest checks importable whatever pytest's import mode is."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
