"""Shared setup for functional tests: make ``tests/_dist.py`` importable as ``_dist``."""

import sys
from pathlib import Path

_TESTS_DIR = str(Path(__file__).resolve().parents[1])
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)
