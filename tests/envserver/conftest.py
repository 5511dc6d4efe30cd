"""Fixtures shared with the other toolgym SDK/server test folders (see tests/envserver/toolgym_fixtures.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "envserver"))

from toolgym_fixtures import *  # noqa: E402,F401,F403
